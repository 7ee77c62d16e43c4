"""ddplab.bench.results: the one writer of the benchmarks' results files (benchmarks/results/<name>.md).

Checks: the file holds the table and the exact command, the date, the commit, the machine (CPU
model, cores, RAM) and the load average before and after; it is replaced whole; a bad name is
refused before anything is written; the commit is marked when tracked code (not the results
files) differs from it; the command of an ``ansible-playbook`` ancestor is found."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, TRAIN_DIR
from ddplab.bench import results


def test_the_file_holds_the_table_the_command_the_machine_and_the_load(tmp_path):
    table = results.code_block("engine  rec\nper_step  1.2\n")
    path = results.write("demo", table, title="Demo figures", load_before=(1.5, 1.25, 1.0),
                         load_after=(2.0, 1.5, 1.25), command="python benchmarks/demo.py --x 1",
                         notes=["n: runs per engine"], out_dir=tmp_path)
    assert path == tmp_path / "demo.md"
    text = path.read_text()
    assert text.startswith("# Demo figures\n")
    assert "- command: `python benchmarks/demo.py --x 1`" in text
    assert re.search(r"^- date: 20\d\d-\d\d-\d\d \d\d:\d\d:\d\d \S+$", text, re.M)
    head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True,
                          text=True, check=True).stdout.strip()
    assert re.search(rf"^- git commit: {head}( with uncommitted changes)?$", text, re.M)
    m = results.machine()
    assert f"- machine: {m.cpu_model}, {m.logical_cpus} logical CPUs" in text
    assert f"{m.ram_bytes / 2**30:.1f} GiB RAM" in text and f"Python {sys.version.split()[0]}" in text
    assert "- load average (1, 5, 15 min): before 1.50 1.25 1.00; after 2.00 1.50 1.25" in text
    assert "```text\nengine  rec\nper_step  1.2\n```" in text
    assert text.rstrip().endswith("- n: runs per engine")
    assert oct(path.stat().st_mode & 0o777) == "0o644"


def test_load_after_defaults_to_now_and_a_text_load_is_kept_as_given(tmp_path):
    path = results.write("x", "body", title="t", load_before="laptop-a 0.50 0.40 0.30",
                         command="c", out_dir=tmp_path)
    line = next(ln for ln in path.read_text().splitlines() if ln.startswith("- load average"))
    assert re.fullmatch(r"- load average \(1, 5, 15 min\): before laptop-a 0.50 0.40 0.30; "
                        r"after \d+\.\d\d \d+\.\d\d \d+\.\d\d", line), line


def test_the_command_defaults_to_this_process_command_line(tmp_path):
    path = results.write("x", "body", title="t", load_before=None, out_dir=tmp_path)
    assert f"- command: `{results.command_line()}`" in path.read_text()
    assert results.command_line(["python", "a b.py", "--x"]) == "python 'a b.py' --x"
    assert results.command_line() == " ".join(__import__("shlex").quote(a) for a in sys.orig_argv)
    assert "before not measured" in path.read_text()


def test_a_rerun_replaces_the_file_whole_and_leaves_no_temp_file(tmp_path):
    results.write("x", "first body " * 50, title="t", load_before=None, command="c", out_dir=tmp_path)
    results.write("x", "second", title="t", load_before=None, command="c", out_dir=tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == ["x.md"]
    text = (tmp_path / "x.md").read_text()
    assert "second" in text and "first" not in text


@pytest.mark.parametrize("name", ["", "../x", "a/b", "X", "x.md", "-x"])
def test_a_bad_name_is_refused_before_anything_is_written(tmp_path, name):
    with pytest.raises(results.ResultsError, match="use lower-case letters, digits"):
        results.write(name, "b", title="t", load_before=None, command="c", out_dir=tmp_path / "r")
    assert not (tmp_path / "r").exists()


def test_the_folder_is_given_else_the_environment_else_the_checkouts(tmp_path, monkeypatch):
    monkeypatch.setenv(results.RESULTS_ENV, str(tmp_path / "env"))
    assert results.results_dir(tmp_path / "given") == tmp_path / "given"
    assert results.results_dir() == tmp_path / "env"
    monkeypatch.delenv(results.RESULTS_ENV)
    assert results.results_dir() == REPO / "benchmarks" / "results"
    monkeypatch.setattr(results, "CHECKOUT", tmp_path)  # an installed copy: no benchmarks/ beside it
    with pytest.raises(results.ResultsError, match=f"set {results.RESULTS_ENV} or pass --results-dir"):
        results.results_dir()


def test_the_tests_never_write_into_the_checkouts_results():
    """conftest points DDPLAB_RESULTS_DIR at a temporary folder for the whole session."""
    assert results.results_dir() != REPO / "benchmarks" / "results"
    assert os.environ[results.RESULTS_ENV]


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t", *args],
                          capture_output=True, text=True, check=True).stdout.strip()


def test_the_commit_is_marked_when_tracked_code_differs_but_not_for_a_results_file(tmp_path):
    _git(tmp_path, "init", "-q")
    (tmp_path / "code.py").write_text("x = 1\n")
    (tmp_path / "benchmarks/results").mkdir(parents=True)
    (tmp_path / "benchmarks/results/a.md").write_text("old\n")
    _git(tmp_path, "add", ".")
    _git(tmp_path, "commit", "-qm", "c")
    head = _git(tmp_path, "rev-parse", "HEAD")
    assert results.git_commit(tmp_path) == head
    (tmp_path / "benchmarks/results/a.md").write_text("new figures\n")
    (tmp_path / "untracked.py").write_text("")
    assert results.git_commit(tmp_path) == head
    (tmp_path / "code.py").write_text("x = 2\n")
    assert results.git_commit(tmp_path) == f"{head} with uncommitted changes"
    assert results.git_commit(tmp_path / "nowhere").startswith("unknown (")


def test_cpu_model_is_read_from_cpuinfo(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nvendor_id\t: GenuineIntel\nmodel name\t: Intel(R)  Core(TM) i5\n")
    assert results.cpu_model(info) == "Intel(R) Core(TM) i5"
    assert results.cpu_model(tmp_path / "missing")  # platform's, or "unknown CPU"


def test_machine_text_names_cores_ram_system_and_versions():
    m = results.Machine(cpu_model="CPU X", logical_cpus=4, physical_cores=2, ram_bytes=8 * 2**30,
                        system="Linux 6.1 x86_64", python="3.11.2", torch="2.13.0")
    assert m.text() == ("CPU X, 4 logical CPUs (2 physical cores), 8.0 GiB RAM, Linux 6.1 x86_64, "
                        "Python 3.11.2, torch 2.13.0")


def test_markdown_table_escapes_bars():
    assert results.markdown_table(["a", "b"], [[1, "x|y"]]) == "| a | b |\n|---|---|\n| 1 | x\\|y |"


def test_the_command_of_an_ansible_playbook_ancestor_is_found(tmp_path):
    """bench.yml's report runs as a task of ansible-playbook: the command the user typed is that
    ancestor's (here a stand-in script of that name, run by sh, that runs python)."""
    script = tmp_path / "ansible-playbook"
    call = 'from ddplab.bench import results; print(results.ancestor_command("ansible-playbook"))'
    script.write_text(f"{sys.executable} -c '{call}'\n")
    env = dict(os.environ, PYTHONPATH=str(TRAIN_DIR))
    out = subprocess.run(["sh", str(script), "-i", "inventory/lab", "bench.yml"], capture_output=True,
                         text=True, check=True, env=env).stdout.strip()
    assert out == f"sh {script} -i inventory/lab bench.yml"
    assert results.ancestor_command("no-such-program") is None
