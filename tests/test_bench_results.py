"""Every benchmark writes its table to its results file through ddplab.bench.results
(benchmarks/results/<name>.md; here a temporary --results-dir).

train_overhead runs for real on a tiny input; restart_cost, recovery and fault_loss need minutes
of real processes or the lab, so their measuring step is replaced by canned figures (recovery and
fault_loss through the fake playbook runner of tests/test_fault_loss_bench.py); bench.yml's report
reads a synthetic bench folder (tests/test_bench_report.py)."""

from __future__ import annotations

import ast
import importlib
import re
import subprocess

import benchcli
import pytest
from conftest import REPO
from ddplab.bench import results
from ddplab.controller import bench_report
from test_bench_report import make_bench
from test_fault_loss_bench import FakeLab
from test_fault_loss_bench import fl as fault_loss_bench


def load(name: str):
    """The benchmark script ``benchmarks/<name>.py`` (on pytest's pythonpath), by module name."""
    module = importlib.import_module(name)
    return module


def header(text: str) -> dict[str, str]:
    """The ``- key: value`` lines before the body."""
    return dict(re.findall(r"^- (command|date|git commit|machine|load average[^:]*): (.*)$", text, re.M))


def check_header(text: str) -> None:
    """The header's fields; in process, the command is this one's (pytest's)."""
    head = header(text)
    assert head["command"] == f"`{results.command_line()}`", head
    assert re.fullmatch(r"20\d\d-\d\d-\d\d \d\d:\d\d:\d\d \S+", head["date"])
    assert re.match(r"[0-9a-f]{40}", head["git commit"])
    assert "logical CPUs" in head["machine"] and "GiB RAM" in head["machine"]
    assert re.match(r"before .+; after \d+\.\d\d \d+\.\d\d \d+\.\d\d", head["load average (1, 5, 15 min)"])


@pytest.mark.parametrize("name", sorted(n.removesuffix(".py") for n in benchcli.benchmarks()))
def test_every_benchmark_script_writes_its_results_with_the_writer(name):
    """A benchmark added to benchmarks/ must end in ddplab.bench.results.write (the others below
    check that the call happens and what it writes)."""
    tree = ast.parse((REPO / f"benchmarks/{name}.py").read_text())
    imports = {a.asname or a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)
               and n.module == "ddplab.bench" for a in n.names if a.name == "results"}
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
             and n.func.attr == "write" and isinstance(n.func.value, ast.Name) and n.func.value.id in imports]
    assert imports and calls, f"benchmarks/{name}.py does not write its results file (ddplab.bench.results)"
    assert calls[0].args and _page_name(tree, calls[0].args[0]) == name


def _page_name(tree: ast.Module, arg: ast.expr) -> object:
    """The page name a results.write call passes: its constant, or the default of the enclosing
    function's parameter it names (a benchmark whose page name is an option defaults to its own)."""
    if isinstance(arg, ast.Constant):
        return arg.value
    for fn in ast.walk(tree):
        if isinstance(fn, ast.FunctionDef) and any(n is arg for n in ast.walk(fn)):
            params = fn.args.args[len(fn.args.args) - len(fn.args.defaults):]
            defaults = {a.arg: d for a, d in zip(params, fn.args.defaults, strict=True)}
            default = defaults.get(arg.id) if isinstance(arg, ast.Name) else None
            return default.value if isinstance(default, ast.Constant) else None
    return None


def test_train_overhead_writes_its_table_on_a_tiny_run(tmp_path, data_path, capsys):
    to = load("train_overhead")
    argv = ["--preset", "tiny", "--steps", "12", "--skip", "2", "--repeats", "1", "--log-interval", "1",
            "--threads", "1", "--data-path", str(data_path), "--results-dir", str(tmp_path)]
    assert to.main(argv) == 0
    out = capsys.readouterr().out
    text = (tmp_path / "train_overhead.md").read_text()
    assert f"results: {tmp_path / 'train_overhead.md'}" in out
    check_header(text)
    table = out[out.index("loop  "):out.index("overhead of the ddplab loop")].strip()
    assert results_block(text) == table  # the printed table, as printed
    assert re.search(r"^overhead of the ddplab loop \(median of paired repeats\): [+-]\d+\.\d % ", text, re.M)
    assert "preset tiny, world size 1, 1 threads, steps 3..12, 1 paired repeats" in text


def results_block(text: str) -> str:
    return re.search(r"```text\n(.*?)\n```", text, re.S).group(1)


def test_restart_cost_writes_its_markdown_table(tmp_path, data_path, monkeypatch, capsys):
    rc = load("restart_cost")
    canned = {"spawn": 9.5, "fork": 4.25}
    monkeypatch.setattr(rc, "measure", lambda method, data, kills, work: {
        "start_method": method, "first_step_s": canned[method], "first_step_load": 1.5,
        "recoveries": [{"restart_count": 1, "recovered_s": canned[method] / 2, "resumed_at_step": 5,
                        "load": 2.0}]})
    assert rc.main(["--kills", "1", "--data", str(data_path), "--results-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    text = (tmp_path / "restart_cost.md").read_text()
    check_header(text)
    table = rc.table([rc.measure(m, None, 1, None) for m in rc.START_METHODS])
    assert table in out and table in text
    assert "| new interpreter (`-m ddplab.train`, spawn) | 9.50 s | 1.5 |" in text


def test_recovery_writes_the_side_by_side_table(tmp_path, monkeypatch, capsys):
    rb = load("recovery")
    from test_recovery_bench import fault

    def run_engine(a, engine, plan):
        rec = 1.5 if engine == "per_step" else 9.0
        return {"run_id": f"r-{engine}", "engine": engine, "load_start": "1.00 2.00 3.00",
                "load_end": "2.00 2.00 3.00", "faults": [fault("kill-agent", rec, 1)]}

    monkeypatch.setattr(rb, "run_engine", run_engine)
    assert rb.main(["--repeat", "1", "--plan", "kill-agent@rank0", "--out", str(tmp_path / "raw.json"),
                    "--results-dir", str(tmp_path)]) == 0
    capsys.readouterr()
    text = (tmp_path / "recovery.md").read_text()
    check_header(text)
    runs = [run_engine(None, e, None) for e in rb.ENGINES]
    assert results_block(text) == rb.table(runs, list(rb.ENGINES))
    assert "plan `kill-agent@rank0`, 3 nodes" in text
    assert f"- raw figures (JSON, on the machine that ran it): {tmp_path / 'raw.json'}" in text


def test_fault_loss_writes_the_table_and_links_the_plot(tmp_path, monkeypatch, capsys):
    fl = fault_loss_bench
    real_run, lab = subprocess.run, FakeLab(tmp_path / "runs")
    lab.runs.mkdir()
    # the fake playbook runner replaces subprocess.run for everyone: the writer's git calls pass
    monkeypatch.setattr(fl.recovery.subprocess, "run",
                        lambda args, **kw: real_run(args, **kw) if args[0] == "git" else lab(args, **kw))
    monkeypatch.setattr(fl, "plot", lambda runs, path: path.write_bytes(b"png"))
    code = fl.main(["--runs-dir", str(lab.runs), "--out", str(tmp_path / "b.json"), "--plan",
                    "kill-agent@rank0", "--noise-seeds", "1", "--results-dir", str(tmp_path / "res")])
    assert code == 0
    out = capsys.readouterr().out
    text = (tmp_path / "res" / "fault_loss.md").read_text()
    check_header(text)
    block = results_block(text)
    assert block in out and "verdict: faulted - clean" in block
    assert "![validation loss of each run](fault_loss.png)" in text
    assert (tmp_path / "res" / "fault_loss.png").read_bytes() == b"png"


def test_bench_report_writes_the_tables_with_the_nodes_cpus_and_load(tmp_path, capsys):
    bench = make_bench(tmp_path)
    assert bench_report.main([str(bench), "--results-dir", str(tmp_path / "res")]) == 0
    out = capsys.readouterr().out
    text = (tmp_path / "res" / "bench.md").read_text()
    assert f"results: {tmp_path / 'res' / 'bench.md'}" in out
    check_header(text)
    assert results_block(text) == (bench / "tables.txt").read_text().rstrip()
    head = header(text)
    assert head["load average (1, 5, 15 min)"].startswith(
        "before laptop-a 0.30 0.20 0.10; laptop-b 0.30 0.20 0.10; laptop-c 0.30 0.20 0.10 "
        "(nodes, at the bench's start); after ")
    assert head["machine"].endswith("; nodes: laptop-a 2 CPUs, laptop-b 2 CPUs, laptop-c 2 CPUs")
    assert f"- bench folder: {bench} (started 2026-11-29T18:00:00Z)" in text


def test_a_bench_without_results_writes_no_results_file(tmp_path, capsys):
    bench = tmp_path / "bench-empty"
    bench.mkdir()
    (bench / "bench.json").write_text('{"bench_id": "empty", "hosts": []}')
    assert bench_report.main([str(bench), "--results-dir", str(tmp_path / "res")]) == bench_report.EXIT_EMPTY
    assert "(no results file)" in capsys.readouterr().err
    assert not (tmp_path / "res").exists()
