"""status.yml, logs.yml, attach.yml and stop.yml: the table of running / ended / failed /
unreachable laptops, the filters that pick a worker's log, check logs.yml's input and find
stop.yml's event, and the playbooks end to end on local "laptops" (a fake systemctl gives each
one's agent unit) with one unreachable laptop."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from ansible_collections.ddp_lab.cluster.plugins.action import ddp_job_status_table as table
from ansible_collections.ddp_lab.cluster.plugins.filter import ddp_job as filters
from ddplab import status as st

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
PLAYBOOK = shutil.which("ansible-playbook", path=str(BIN)) or shutil.which("ansible-playbook")



NOW = time.time()


def recs(host: str, rank: int, steps: int, end: bool = False, failure: str | None = None) -> list[dict]:
    """A node's metrics records: start, steps 1..steps (one per 2 s up to now), val, end/failure.

    "Now" is the call's time, not the module's import: in the full suite a test runs minutes after
    the import, and the ages the tests assert are measured from the present."""
    base = {"host": host, "local_rank": 0, "rank": rank, "world_size": 3, "restart_count": 1,
            "run_id": "20261130-190000-abcd"}
    t0 = time.time() - 2 * steps - 5
    out = [{**base, "event": "start", "time": t0, "max_steps": 300}]
    out += [{**base, "event": "step", "time": t0 + 2 * s, "step": s, "loss": 3.0 - s / 100,
             "tokens_per_s": 12345.6} for s in range(1, steps + 1)]
    out.append({**base, "event": "val", "time": t0 + 2 * steps + 1, "step": steps, "val_loss": 2.5})
    if end:
        out.append({**base, "event": "end", "time": t0 + 2 * steps + 2, "step": steps})
    if failure:
        out.append({**base, "event": "failure", "time": t0 + 2 * steps + 2, "step": steps, "cause": "error",
                    "error": failure})
    return out


UNITS = {
    "running": {"LoadState": "loaded", "ActiveState": "active", "SubState": "running", "Result": "success",
                "ExecMainStatus": "0", "MainPID": "4242"},
    "ended": {"LoadState": "loaded", "ActiveState": "active", "SubState": "exited", "Result": "success",
              "ExecMainStatus": "0", "MainPID": "0"},
    "failed": {"LoadState": "loaded", "ActiveState": "failed", "SubState": "failed", "Result": "exit-code",
               "ExecMainStatus": "1", "MainPID": "0"},
    "absent": {"LoadState": "not-found", "ActiveState": "inactive", "SubState": "dead"},
}


def watch_result(host: str, unit: dict, records: list[dict]) -> dict:
    """What node_status (mode once) returns for a node: the ddplab.status document's fields."""
    state = st.job_state(unit, records)
    p = st.node_progress(records)
    return {"state": state, "progress": p, "unit": unit, "line": st.format_progress(host, p, state),
            "workers": [], "error": None}


def test_step_age_is_the_time_since_the_newest_step():
    r = recs("laptop-a", 0, 10, end=True)
    p = st.node_progress(r)
    assert p["step_age_s"] == pytest.approx(time.time() - r[10]["time"], abs=1.0)
    assert p["age_s"] < p["step_age_s"]  # val and end came after the last step
    assert st.node_progress([])["step_age_s"] is None


def test_rows_for_running_ended_failed_unreachable_and_no_job():
    nodes = {
        "laptop-a": watch_result("laptop-a", UNITS["running"], recs("laptop-a", 0, 120)),
        "laptop-b": watch_result("laptop-b", UNITS["ended"], recs("laptop-b", 1, 300, end=True)),
        "laptop-c": watch_result("laptop-c", UNITS["failed"], recs(
            "laptop-c", 2, 50, failure="RuntimeError: gloo connection reset\nmore")),
        "laptop-d": {"state": "unreachable", "progress": {},
                     "error": 'Data could not be sent to remote host "10.89.0.14". Make sure this host '
                              "can be reached over ssh: ssh: connect to host 10.89.0.14 port 22: "
                              "No route to host"},
        "laptop-e": watch_result("laptop-e", UNITS["absent"], []),
        "laptop-f": {"skipped": True, "changed": False},
    }
    rows = {r["node"]: r for r in (table.row_of(h, res) for h, res in nodes.items())}
    a = rows["laptop-a"]
    assert (a["agent"], a["run"], a["step"], a["loss"], a["val"], a["ws"], a["rank"], a["tok/s"],
            a["restarts"]) == ("running", "20261130-190000-abcd", "120/300", "1.800", "2.500", "3", "0",
                               "12,346", "1")
    assert a["last step s"] == "5"  # the newest step record is 5 s old (the val and end came after it)
    assert (rows["laptop-b"]["agent"], rows["laptop-b"]["step"]) == ("ended", "300/300")
    assert rows["laptop-c"]["agent"] == "failed"
    assert rows["laptop-c"]["last failure"] == "error: RuntimeError: gloo connection reset"
    killed = table.row_of("laptop-k", watch_result("laptop-k", UNITS["failed"], recs("laptop-k", 0, 5)))
    assert (killed["agent"], killed["last failure"]) == ("failed", "agent unit exit-code, exit status 1")
    assert rows["laptop-d"]["agent"] == "unreachable"
    assert rows["laptop-d"]["last failure"] == "ssh: connect to host 10.89.0.14 port 22: No route to host"
    assert rows["laptop-d"]["step"] == rows["laptop-d"]["run"] == "-"
    assert rows["laptop-e"]["agent"] == rows["laptop-f"]["agent"] == "no job"
    assert table.bad_nodes(list(rows.values())) == ["laptop-c: failed", "laptop-d: unreachable"]


def test_render_is_one_table_with_the_store_line():
    rows = [table.row_of("laptop-a", watch_result("laptop-a", UNITS["running"], recs("laptop-a", 0, 120))),
            table.row_of("laptop-b", {"state": "unreachable", "error": "timed out"})]
    store = {"running": True, "answering": True, "host": "10.89.0.1", "port": 29400, "supervisor_pid": 77,
             "restarts": 0}
    text = table.render(rows, store, "20261130-190000-abcd", width=160)
    lines = text.splitlines()
    assert lines[0].strip() == "run 20261130-190000-abcd (engine torchelastic)"
    header = next(line for line in lines if "node" in line)
    for col in table.COLUMNS:
        assert col in header, col
    assert any(line.split()[:2] == ["laptop-a", "running"] for line in lines)
    assert any(line.split()[:2] == ["laptop-b", "unreachable"] for line in lines)
    assert "\x1b[" not in text  # no colour codes in Ansible's output
    assert lines[-1] == ("rendezvous store: running on port 29400 at 10.89.0.1 (answering, "
                         "supervisor pid 77, restarts 0)")
    assert table.store_line({"running": False, "answering": False, "port": 29400}) == \
        "rendezvous store: stopped (port 29400)"
    assert table.store_line({}) == "rendezvous store: not read"


@pytest.mark.parametrize("width", [160, 120])
def test_render_keeps_every_reason_whole_and_every_row_on_one_line(width):
    """newcomer, 2026-12-01: the table cut the unreachable reason ("ssh port 22 of 10.89.0.12 does
    not"; the rest folded onto lines of their own, or was cut at 100 characters). A reason too long
    for its cell is printed whole under the table, one line per node."""
    probe = "ssh port 22 of 10.89.0.12 does not answer within 3 s: timed out"
    long = "ChildFailedError: " + "worker 1 of laptop-c exited with signal SIGKILL; " * 3 + "end of reason"
    running = watch_result("laptop-a", UNITS["running"], recs("laptop-a", 0, 120))
    rows = [table.row_of("laptop-a", running),
            table.row_of("laptop-b", {"state": "unreachable", "error": probe}),
            table.row_of("laptop-c", {**running, "state": "failed", "progress": {**running["progress"],
                                                                                  "failure": long}})]
    text = table.render(rows, {}, "20261130-190000-abcd", width=width)
    lines = text.splitlines()
    if width == 160:  # the default (ddp_job_status_width): one line per node; narrower, cells fold
        header = lines.index(next(line for line in lines if line.split()[:2] == ["node", "agent"]))
        assert [line.split()[0] for line in lines[header + 2:header + 5]] == ["laptop-a", "laptop-b",
                                                                              "laptop-c"], text
        assert lines[header + 5].strip() == "", text
    assert f"laptop-b: {probe}" in lines and f"laptop-c: {long}" in lines, text
    assert "laptop-a: " not in text, text  # no failure, nothing below


def test_render_shows_brackets_literally():
    """A survivor's gloo error starts with "[/path/pair.cc:553]": rich read it as a closing markup
    tag and status.yml failed ("closing tag ... doesn't match any open tag")."""
    gloo = ("RuntimeError: [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] "
            "Connection closed")
    row = {c: "-" for c in table.COLUMNS} | {"node": "laptop-b", "agent": "failed", "last failure": gloo}
    text = table.render([row], {"error": "[Errno 111] Connection refused", "port": 29400}, "r1", width=400)
    assert "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed" in text
    assert text.splitlines()[-1] == "rendezvous store: unknown on port 29400 ([Errno 111] Connection refused)"


def test_newest_stderr_per_local_rank():
    d = "/var/lib/ddp-lab/runs/r/logs"
    files = [
        {"path": f"{d}/r_aa/attempt_0/0/stderr.log", "mtime": 100.0},
        {"path": f"{d}/r_aa/attempt_1/0/stderr.log", "mtime": 200.0},
        {"path": f"{d}/r_bb/attempt_0/0/stderr.log", "mtime": 300.0},  # a later launch (resume)
        {"path": f"{d}/r_bb/attempt_0/1/stderr.log", "mtime": 250.0},
        {"path": f"{d}/r_bb/attempt_0/1/stdout.log", "mtime": 400.0},
    ]
    assert filters.newest_stderr(files, [0]) == [f"{d}/r_bb/attempt_0/0/stderr.log"]
    assert filters.newest_stderr(files, [0, 1]) == [f"{d}/r_bb/attempt_0/0/stderr.log",
                                                    f"{d}/r_bb/attempt_0/1/stderr.log"]
    assert filters.newest_stderr(files, [2]) == []


def test_local_ranks_of_a_global_rank():
    workers = [{"host": "a", "local_rank": 0, "rank": 2}, {"host": "a", "local_rank": 1, "rank": 0}]
    assert filters.local_ranks_of(workers, "0") == [1]
    assert filters.local_ranks_of(workers, 2) == [0]
    assert filters.local_ranks_of(workers, "1") == []
    assert filters.local_ranks_of(workers, "") == [0, 1]
    assert filters.local_ranks_of([], None) == []


@pytest.mark.parametrize("node, rank, lines, problems", [
    ("laptop-a", "", "50", []),
    ("laptop-a", "2", 10, []),
    ("", "", "50", ["name the laptop: -e node=<one of laptop-a, laptop-b>"]),
    ("laptop-z", "", "50", ["node=laptop-z is not in the group 'trainers' (one of laptop-a, laptop-b)"]),
    ("laptop-a", "-1", "50", ["rank=-1 is not a global rank (an integer >= 0)"]),
    ("laptop-a", "x", "0", ["rank=x is not a global rank (an integer >= 0)",
                            "lines=0 is not a positive integer"]),
    ("laptop-a", "", "ten", ["lines=ten is not a positive integer"]),
    ("laptop-a", "", "-5", ["lines=-5 is not a positive integer"]),
])
def test_logs_input(node, rank, lines, problems):
    assert filters.logs_input_problems(node, ["laptop-a", "laptop-b"], rank, lines) == problems


# ---------------------------------------------------------------- the playbooks, on local "laptops"

FAKE_SYSTEMCTL = """#!/bin/sh
# systemctl show <unit> -p ...: the unit's state from $FAKE_UNITS/<unit>.show
[ "$1" = show ] && [ -f "$FAKE_UNITS/$2.show" ] && exec cat "$FAKE_UNITS/$2.show"
# systemctl stop <unit>: the time of the stop in <unit>.stopped_at, then the state torchrun leaves
# after a SIGTERM (exit status 1: failed)
if [ "$1" = stop ]; then
  date +%s.%N > "$FAKE_UNITS/$2.stopped_at"; sleep 0.2
  printf 'LoadState=loaded\nActiveState=failed\nSubState=failed\nResult=exit-code\nExecMainStatus=1\n' \
    > "$FAKE_UNITS/$2.show"
  exit 0
fi
echo "LoadState=not-found"
"""


def _case(tmp_path: Path, states: dict[str, str], unreachable: bool = True,
          journalctl: bool = False) -> tuple[Path, dict[str, str]]:
    """Local trainers named after their state, their run folders and fake units; with
    ``unreachable``, one unreachable trainer ``laptop-off`` (TEST-NET address over ssh); with
    ``journalctl``, a fake journalctl (FAKE_JOURNALCTL) on the PATH. Returns the inventory and the
    environment."""
    base, units, runs = tmp_path / "base", tmp_path / "units", tmp_path / "runs"
    fakebin = tmp_path / "bin"
    for d in (units, runs, fakebin):
        d.mkdir(parents=True)
    (fakebin / "systemctl").write_text(FAKE_SYSTEMCTL)
    (fakebin / "systemctl").chmod(0o755)
    run_id = "20261130-190000-abcd"
    (runs / run_id).mkdir()
    (runs / "current").symlink_to(run_id)
    hosts = {}
    for i, (host, state) in enumerate(states.items()):
        unit = f"agent-{host}"
        (units / f"{unit}.show").write_text("".join(f"{k}={v}\n" for k, v in UNITS[state].items()))
        if state != "absent":
            m = base / host / "runs" / run_id / "metrics"
            m.mkdir(parents=True)
            r = recs(host, i, 300 if state == "ended" else 40, end=state == "ended",
                     failure="ValueError: boom" if state == "failed" else None)
            (m / f"{host}-local0.jsonl").write_text("".join(json.dumps(x) + "\n" for x in r))
        hosts[host] = {"ansible_connection": "local", "ddp_lab_base_dir": str(base / host),
                       "ddp_lab_unit": unit}
    if unreachable:
        hosts["laptop-off"] = {"ansible_host": "192.0.2.1", "ansible_connection": "ssh",
                               "ansible_ssh_common_args": "-o ConnectTimeout=2 -o ControlMaster=no"}
    if journalctl:
        (fakebin / "journalctl").write_text(FAKE_JOURNALCTL)
        (fakebin / "journalctl").chmod(0o755)
    inv = {"all": {"children": {
        "trainers": {"hosts": hosts, "vars": {
            "ansible_python_interpreter": sys.executable, "ansible_become_method": "su",
            "ddp_lab_user": "root", "ddp_job_venv": str(Path(sys.executable).parent.parent),
            "ddp_job_runs_dir": str(runs)}},
        "rendezvous": {"hosts": {"controller": {
            "ansible_connection": "local", "ansible_python_interpreter": sys.executable,
            "rendezvous_address": "127.0.0.1", "rendezvous_port": 29499,
            "rendezvous_state_dir": str(tmp_path / "rdzv")}}},
    }}}
    (tmp_path / "rdzv").mkdir()
    path = tmp_path / "hosts.yml"
    path.write_text(json.dumps(inv))
    env = dict(os.environ, ANSIBLE_CONFIG=str(ROOT / "ansible.cfg"), ANSIBLE_NOCOLOR="1",
               ANSIBLE_LOCAL_TEMP=str(tmp_path / "tmp"), ANSIBLE_HOME=str(tmp_path / "home"),
               FAKE_UNITS=str(units))
    env["PATH"] = f"{fakebin}:{BIN}:{env.get('PATH', '')}"
    # ddplab.status runs as on a node, where the wheel is installed in the venv: here train/ stands in
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT / "train"), env.get("PYTHONPATH")) if p)
    return path, env


def _play(inv: Path, env: dict, playbook: str, *extra: str, check: bool = False
          ) -> subprocess.CompletedProcess:
    args = [PLAYBOOK, "-i", str(inv), str(ROOT / playbook)] + (["--check"] if check else [])
    for e in extra:
        args += ["-e", e]
    return subprocess.run(args, capture_output=True, text=True, env=env, timeout=300, cwd=ROOT)


@pytest.mark.skipif(PLAYBOOK is None, reason="ansible-playbook is not installed (make venv)")
def test_status_playbook_table_and_exit_code(tmp_path):
    inv, env = _case(tmp_path, {"laptop-run": "running", "laptop-end": "ended", "laptop-fail": "failed",
                                "laptop-none": "absent"})
    out = _play(inv, env, "status.yml", check=True)
    text = out.stdout + out.stderr
    assert out.returncode != 0, text
    rows = {line.split()[0]: line.split()[1:] for line in text.splitlines()
            if line.startswith(" laptop-")}  # the table's rows (the recap's lines start without a space)
    assert rows["laptop-run"][:3] == ["running", "20261130-190000-abcd", "40/300"], text
    assert rows["laptop-end"][:3] == ["ended", "20261130-190000-abcd", "300/300"], text
    assert rows["laptop-fail"][0] == "failed" and "ValueError: boom" in " ".join(rows["laptop-fail"]), text
    assert rows["laptop-none"][:2] == ["no", "job"], text
    assert rows["laptop-off"][0] == "unreachable", text
    assert "rendezvous store: stopped (port 29499)" in text
    assert "not every laptop is well: laptop-fail: failed, laptop-off: unreachable" in text
    assert text.count("fatal:") == 1 and "UNREACHABLE" not in text, text
    assert "changed=0" in text and "changed=1" not in text


@pytest.mark.skipif(PLAYBOOK is None, reason="ansible-playbook is not installed (make venv)")
def test_status_playbook_exits_zero_when_every_laptop_is_well(tmp_path):
    """Also: without runs/current (a job launched from another checkout) the run is the laptops'."""
    inv, env = _case(tmp_path, {"laptop-run": "running", "laptop-end": "ended"}, unreachable=False)
    (tmp_path / "runs" / "current").unlink()
    for host in ("laptop-run", "laptop-end"):
        (tmp_path / "base" / host / "current_run").write_text("20261130-190000-abcd\n")
    out = _play(inv, env, "status.yml")
    text = out.stdout + out.stderr
    assert out.returncode == 0, text
    assert "run 20261130-190000-abcd" in text, text
    assert any(line.split()[:3] == ["laptop-end", "ended", "20261130-190000-abcd"]
               for line in text.splitlines()), text


@pytest.mark.skipif(PLAYBOOK is None, reason="ansible-playbook is not installed (make venv)")
def test_status_playbook_names_a_laptop_whose_state_cannot_be_read(tmp_path):
    inv, env = _case(tmp_path, {"laptop-run": "running"}, unreachable=False)
    data = json.loads(inv.read_text())
    hosts = data["all"]["children"]["trainers"]["hosts"]
    hosts["laptop-run"]["ddp_job_venv"] = str(tmp_path / "no-venv")  # not provisioned
    inv.write_text(json.dumps(data))
    out = _play(inv, env, "status.yml")
    text = out.stdout + out.stderr
    assert out.returncode != 0, text
    row = next(line for line in text.splitlines() if line.startswith(" laptop-run"))
    assert row.split()[1] == "error" and "progress command failed" in row, text
    assert "not every laptop is well: laptop-run: error" in text, text


@pytest.mark.skipif(PLAYBOOK is None, reason="ansible-playbook is not installed (make venv)")
@pytest.mark.parametrize("extra, message", [
    ((), "name the laptop: -e node=<one of"),
    (("node=laptop-z",), "node=laptop-z is not in the group 'trainers'"),
    (("node=laptop-run", "lines=0"), "lines=0 is not a positive integer"),
    (("node=laptop-run", "rank=abc"), "rank=abc is not a global rank"),
    (("node=laptop-run", "rank=5"), "rank=5 is not held by a worker on laptop-run"),
])
def test_logs_playbook_refuses_bad_input(tmp_path, extra, message):
    inv, env = _case(tmp_path, {"laptop-run": "running"})
    out = _play(inv, env, "logs.yml", *extra)
    text = out.stdout + out.stderr
    assert out.returncode != 0, text
    assert message in text, text
    assert "UNREACHABLE" not in text, text  # refused before any laptop was contacted


FAKE_JOURNALCTL = """#!/bin/sh
# journalctl -u <unit> -n N ...: N numbered lines of the unit
n=$4; i=1; while [ "$i" -le "$n" ]; do echo "$2 journal line $i"; i=$((i + 1)); done
"""


@pytest.mark.skipif(PLAYBOOK is None, reason="ansible-playbook is not installed (make venv)")
def test_logs_playbook_shows_the_journal_and_the_newest_stderr_of_the_rank(tmp_path):
    inv, env = _case(tmp_path, {"laptop-run": "running", "laptop-end": "ended"}, journalctl=True)
    logs = tmp_path / "base/laptop-run/runs/20261130-190000-abcd/logs/20261130-190000-abcd_x1"
    for attempt, text in ((0, "old attempt\n"), (1, "stderr one\nstderr two\nstderr three\n")):
        (logs / f"attempt_{attempt}/0").mkdir(parents=True)
        (logs / f"attempt_{attempt}/0/stderr.log").write_text(text)
        os.utime(logs / f"attempt_{attempt}/0/stderr.log", (NOW - 100 + attempt, NOW - 100 + attempt))
    out = _play(inv, env, "logs.yml", "node=laptop-run", "rank=0", "lines=2")
    text = out.stdout + out.stderr
    assert out.returncode == 0, text
    assert "agent-laptop-run journal line 2" in text and "journal line 3" not in text, text
    assert "attempt_1/0/stderr.log (last 2 lines)" in text and "stderr three" in text, text
    assert "stderr one" not in text and "old attempt" not in text, text
    assert "laptop-end" not in text.split("PLAY RECAP")[0].split("Check the input")[1], text  # one laptop


@pytest.mark.skipif(PLAYBOOK is None, reason="ansible-playbook is not installed (make venv)")
def test_attach_refuses_when_no_trainer_has_the_job(tmp_path):
    inv, env = _case(tmp_path, {"laptop-none": "absent"}, unreachable=False)
    out = _play(inv, env, "attach.yml")
    text = out.stdout + out.stderr
    assert out.returncode != 0, text
    assert "no job of run 20261130-190000-abcd on any trainer; fix: start one with site.yml" in text, text
    assert "Watch the training" not in text, text


@pytest.mark.skipif(PLAYBOOK is None, reason="ansible-playbook is not installed (make venv)")
def test_attach_refuses_a_run_no_trainer_holds(tmp_path):
    """attach.yml -e run_id=<a run no laptop has> while another run's job runs there (newcomer,
    2026-12-01: it watched the other job to its end, stopped the store and 'collected' the unknown
    run into a new folder, exit 0): one line, before the watch, and nothing written."""
    inv, env = _case(tmp_path, {"laptop-run": "running"}, unreachable=False)
    runs = tmp_path / "runs"
    out = _play(inv, env, "attach.yml", "run_id=20990101-000000-zzzz", "ddp_job_watch_interval_s=1",
                f"collect_runs_dir={runs}", f"report_runs_dir={runs}")
    text = out.stdout + out.stderr
    assert out.returncode != 0, text
    assert "no trainer holds run 20990101-000000-zzzz" in text, text
    assert "Watch the training" not in text and "Stop the store" not in text, text
    assert not (runs / "20990101-000000-zzzz").exists(), text


@pytest.mark.skipif(PLAYBOOK is None, reason="ansible-playbook is not installed (make venv)")
def test_status_refuses_a_run_no_trainer_holds(tmp_path):
    """status.yml -e run_id=<a run no laptop has> while another run's job runs there (newcomer,
    2026-12-01: a table headed "run nonsense" with every laptop "running -", exit 0): one line, as
    attach.yml says it (tasks/held.yml), exit non-zero, no table."""
    inv, env = _case(tmp_path, {"laptop-run": "running", "laptop-end": "ended"}, unreachable=False)
    out = _play(inv, env, "status.yml", "run_id=nonsense")
    text = out.stdout + out.stderr
    assert out.returncode != 0, text
    assert "no trainer holds run nonsense" in text and "fix: name a run of runs/" in text, text
    assert "Show the cluster's state" not in text and not any(
        line.startswith(" laptop-") for line in text.splitlines()), text
    out = _play(inv, env, "status.yml", "run_id=20261130-190000-abcd")  # a run they hold: the table
    assert out.returncode == 0 and "Show the cluster's state" in out.stdout, out.stdout + out.stderr


@pytest.mark.skipif(PLAYBOOK is None, reason="ansible-playbook is not installed (make venv)")
def test_collect_refuses_a_run_no_trainer_nor_the_controller_holds(tmp_path):
    """playbooks/collect.yml -e collect_run_id=<unknown> (newcomer, 2026-12-01: the summary
    command's raw module error): one line naming the run, where it was looked for, the laptop not
    reached and the fix; nothing written. A run the controller holds (collected before) is collected."""
    inv, env = _case(tmp_path, {"laptop-end": "ended"})
    runs = tmp_path / "runs"
    out = _play(inv, env, "playbooks/collect.yml", "collect_run_id=20990101-000000-zzzz",
                f"collect_runs_dir={runs}")
    text = out.stdout + out.stderr
    assert out.returncode != 0, text
    line = next(x for x in text.splitlines() if "no trainer and not the controller holds run" in x)
    assert "20990101-000000-zzzz" in line and "on laptop-end" in line, text
    assert "not reached: laptop-off" in line, text
    assert "fix: name a run of" in line and "-e collect_run_id=<run id>" in line, text
    assert "Write summary.json" not in text and not (runs / "20990101-000000-zzzz").exists(), text

    (runs / "20990101-000000-zzzz").mkdir()  # brought home earlier: its nodes may be gone since
    out = _play(inv, env, "playbooks/collect.yml", "collect_run_id=20990101-000000-zzzz",
                f"collect_runs_dir={runs}", "collect_report=false")
    assert "no trainer and not the controller holds run" not in out.stdout + out.stderr
    assert "Write summary.json" in out.stdout, out.stdout + out.stderr


@pytest.mark.skipif(PLAYBOOK is None, reason="ansible-playbook is not installed (make venv)")
def test_attach_follows_the_job_then_collects_and_reports(tmp_path):
    """attach.yml on a job that ended meanwhile: the watch's last lines, then collect and report as
    site.yml does (the same task files: roles/ddp_job/tasks/watch.yml, playbooks/collect.yml,
    playbooks/report.yml)."""
    inv, env = _case(tmp_path, {"laptop-x": "ended", "laptop-y": "ended"}, unreachable=False, journalctl=True)
    runs = tmp_path / "runs"  # collect and report write here, not into the checkout's runs/
    out = _play(inv, env, "attach.yml", "ddp_job_watch_interval_s=1", f"collect_runs_dir={runs}",
                f"report_runs_dir={runs}")
    text = out.stdout + out.stderr
    assert out.returncode == 0, text
    assert "TASK [ddp_job : Watch the training" in text, text
    for host in ("laptop-x", "laptop-y"):
        assert any(line.startswith(host) and "step   300/300" in line and line.endswith("[succeeded]")
                   for line in text.splitlines()), text
    run = tmp_path / "runs" / "20261130-190000-abcd"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["run_id"] == "20261130-190000-abcd", summary
    assert (run / "laptop-x" / "metrics" / "laptop-x-local0.jsonl").is_file()
    assert (run / "report.html").is_file()
    assert f"report: {run}/report.html" in text, text
    # written once, by collect from what it brought home (not again by playbooks/report.yml)
    assert text.count("TASK [collect : Write the report from the collected run]") == 1, text
    assert "TASK [Write the report]" not in text, text


def _as_per_step(tmp_path: Path) -> None:
    """Rewrite the _case laptops' records as the per_step engine writes them (each laptop a replica
    group: engine, participants, committed steps)."""
    for f in (tmp_path / "base").glob(f"*/runs/{RUN_ID}/metrics/*.jsonl"):
        rs = [json.loads(x) for x in f.read_text().splitlines()]
        for r in rs:
            r["engine"] = "per_step"
            if r["event"] == "step":
                r.update(participants=r["world_size"], committed=True, quorum_id=1)
        f.write_text("".join(json.dumps(r) + "\n" for r in rs))


def _last_message(text: str) -> str:
    """The last message a task printed before the recap (a debug task's ``msg``)."""
    msgs = re.findall(r'^\s*"msg": "(.*)"$', text.split("PLAY RECAP")[0], flags=re.M)
    return msgs[-1] if msgs else ""


@pytest.mark.skipif(PLAYBOOK is None, reason="ansible-playbook is not installed (make venv)")
@pytest.mark.parametrize("engine", ["torchelastic", "per_step"])
def test_a_watch_that_saw_the_job_end_leaves_a_page_that_says_so(tmp_path, engine):
    """Issue 27 item 18: a watch to the end without collect (here attach.yml --skip-tags collect, as
    site.yml --tags train) left the live page reloading, "live, step 300 of 300 ... while the job
    runs", for ever: the watch's last build says the job ended and names the collect command, under
    either engine, and so does the play's last line (attach.yml said nothing of collecting)."""
    inv, env = _case(tmp_path, {"laptop-x": "ended", "laptop-y": "ended"}, unreachable=False, journalctl=True)
    if engine == "per_step":
        _as_per_step(tmp_path)
    out = _play(inv, {**env, "ANSIBLE_SKIP_TAGS": "collect"}, "attach.yml", "ddp_job_watch_interval_s=1")
    text = out.stdout + out.stderr
    assert out.returncode == 0, text
    page = (tmp_path / "runs" / RUN_ID / "report.html").read_text()
    assert "http-equiv" not in page and "reloads every" not in page, page
    assert "the job ended: step 300 of 300, last record " in page, page
    assert f"not collected yet: ansible-playbook playbooks/collect.yml -e collect_run_id={RUN_ID}" in page
    if engine == "per_step":
        assert "Recoveries (engine per_step)" in page, page
    assert _last_message(text) == COLLECT_HINT, text[-3000:]


@pytest.mark.skipif(PLAYBOOK is None, reason="ansible-playbook is not installed (make venv)")
def test_site_yml_tags_train_ends_with_the_collect_command(tmp_path):
    """The task that ends site.yml --tags train (playbooks/train.yml's last play, after the watch),
    run alone (--start-at-task; the run id the launch settles given as an extra var): its line is the
    play's last, and it names the collect command."""
    inv, env = _case(tmp_path, {"laptop-x": "ended"}, unreachable=False)
    args = [PLAYBOOK, "-i", str(inv), str(ROOT / "site.yml"), "--tags", "train",
            "--start-at-task", "Say how to collect the run", "-e", f"ddp_lab_run_id={RUN_ID}"]
    out = subprocess.run(args, capture_output=True, text=True, env=env, timeout=300, cwd=ROOT)
    text = out.stdout + out.stderr
    assert out.returncode == 0, text
    assert "TASK [Say how to collect the run]" in text, text
    assert _last_message(text) == COLLECT_HINT, text[-3000:]


def test_the_collect_hint_only_when_this_run_does_not_collect():
    hint = filters.collect_hint
    assert hint("R", ["all"], []) == "" and hint("R", ["train", "collect"], []) == ""
    assert hint("", ["train"], []) == hint(None, ["train"], []) == ""  # no run settled: nothing to collect
    for run_tags, skip_tags in ((["train"], []), (["all"], ["collect"])):
        assert hint("R", run_tags, skip_tags) == (
            "run R ended and is not collected by this play (--tags/--skip-tags); collect it (summary.json, "
            "the final report): ansible-playbook playbooks/collect.yml -e collect_run_id=R")


RUN_ID = "20261130-190000-abcd"
COLLECT_HINT = (f"run {RUN_ID} ended and is not collected by this play (--tags/--skip-tags); collect it"
                f" (summary.json, the final report): ansible-playbook playbooks/collect.yml"
                f" -e collect_run_id={RUN_ID}")


@pytest.mark.parametrize("lines, expected", [
    ("", {}),
    (None, {}),
    ('{"kind": "launch", "time": 1}\n{"kind": "stop", "time": 5, "hosts": ["a"]}\n',
     {"kind": "stop", "time": 5, "hosts": ["a"]}),
    # a resumed run: the stop of the earlier launch does not count
    ('{"kind": "launch", "time": 1}\n{"kind": "stop", "time": 5}\n{"kind": "launch", "time": 9}\n', {}),
    # resumed with -e ddp_job_resume_run_id (prepare.yml writes kind: resume): the earlier stop is over
    ('{"kind": "launch", "time": 1}\n{"kind": "stop", "time": 5}\n{"kind": "resume", "time": 9}\n', {}),
    ('{"kind": "launch", "time": 1}\n{"kind": "fault", "time": 3}\n{"kind": "stop", "time": 5}\n{"kind": "st',
     {"kind": "stop", "time": 5}),  # a torn last line is skipped
    ('[1, 2]\nnot json\n{"kind": "stop", "time": 2}\n', {"kind": "stop", "time": 2}),
])
def test_stop_event_of_the_newest_launch(lines, expected):
    assert filters.stop_event(lines) == expected


def _stop_case(tmp_path: Path, states: dict[str, str]) -> tuple[Path, dict[str, str]]:
    """_case without the unreachable laptop, with a fake pgrep (no training process left) and
    journalctl, and the run's events.jsonl holding its launch."""
    inv, env = _case(tmp_path, states, unreachable=False, journalctl=True)
    (tmp_path / "bin" / "pgrep").write_text("#!/bin/sh\nexit 1\n")
    (tmp_path / "bin" / "pgrep").chmod(0o755)
    launch = {"time": time.time() - 100, "kind": "launch", "run_id": RUN_ID, "hosts": sorted(states)}
    (tmp_path / "runs" / RUN_ID / "events.jsonl").write_text(json.dumps(launch) + "\n")
    return inv, env


def _events(tmp_path: Path) -> list[dict]:
    text = (tmp_path / "runs" / RUN_ID / "events.jsonl").read_text()
    return [json.loads(line) for line in text.splitlines()]


@pytest.mark.skipif(PLAYBOOK is None, reason="ansible-playbook is not installed (make venv)")
def test_stop_records_the_stop_before_the_agents_stop_and_names_the_run(tmp_path):
    """The stop event comes before the SIGTERM (the failure records it causes fall after it, so a
    fault's window never ends on them); only nodes whose agent ran are named; the run is named in
    the output; a second stop finds nothing running and records nothing."""
    inv, env = _stop_case(tmp_path, {"laptop-run": "running", "laptop-end": "ended"})
    out = _play(inv, env, "playbooks/stop.yml")  # stop.yml validates first: 127.0.0.1 is refused
    text = out.stdout + out.stderr
    assert out.returncode == 0, text
    stops = [e for e in _events(tmp_path) if e["kind"] == "stop"]
    assert len(stops) == 1 and stops[0]["run_id"] == RUN_ID and stops[0]["hosts"] == ["laptop-run"], stops
    stopped_at = float((tmp_path / "units" / "agent-laptop-run.stopped_at").read_text())
    assert stops[0]["time"] <= stopped_at, (stops[0], stopped_at)
    assert f"stopped run {RUN_ID} on laptop-run" in text, text
    assert f"-e ddp_job_resume_run_id={RUN_ID}" in text, text

    again = _play(inv, env, "playbooks/stop.yml")
    text = again.stdout + again.stderr
    assert again.returncode == 0, text
    assert f"nothing was running (run {RUN_ID})" in text, text
    assert len([e for e in _events(tmp_path) if e["kind"] == "stop"]) == 1


@pytest.mark.skipif(PLAYBOOK is None, reason="ansible-playbook is not installed (make venv)")
def test_attach_to_a_stopped_run_reports_it_stopped_not_failed(tmp_path):
    """attach.yml after stop.yml: the agents' units failed on the SIGTERM, the run's events hold the
    stop: the play says stopped, succeeds, and collect labels the run stopped."""
    inv, env = _stop_case(tmp_path, {"laptop-x": "failed", "laptop-y": "failed"})
    stop = {"time": time.time() - 10, "kind": "stop", "run_id": RUN_ID, "hosts": ["laptop-x", "laptop-y"]}
    with open(tmp_path / "runs" / RUN_ID / "events.jsonl", "a", encoding="utf-8") as fh:
        fh.write(json.dumps(stop) + "\n")
    runs = tmp_path / "runs"
    out = _play(inv, env, "attach.yml", "ddp_job_watch_interval_s=1", f"collect_runs_dir={runs}",
                f"report_runs_dir={runs}")
    text = out.stdout + out.stderr
    assert out.returncode == 0, text
    assert f"run {RUN_ID} was stopped by stop.yml at" in text and "(laptop-x, laptop-y)" in text, text
    assert "no agent finished" not in text and "journal lines of agent-laptop-x" not in text, text
    summary = json.loads((runs / RUN_ID / "summary.json").read_text())
    assert summary["outcome"] == "stopped", summary


def test_row_of_a_node_stop_yml_stopped_reads_stopped():
    """The SIGTERM of stop.yml fails the agent's unit; a node the run's stop event names is stopped
    (well), one it does not name still failed."""
    stop = {"kind": "stop", "time": time.time() - 5, "hosts": ["laptop-a"]}
    failed = watch_result("laptop-a", UNITS["failed"], recs("laptop-a", 0, 5, failure="stopped by SIGTERM"))
    row = table.row_of("laptop-a", failed, stop)
    assert row["agent"] == "stopped" and row["last failure"].startswith("stopped by stop.yml at "), row
    assert table.row_of("laptop-b", failed, stop)["agent"] == "failed"
    cleared = watch_result("laptop-a", UNITS["absent"], recs("laptop-a", 0, 5))  # unit gone after the stop
    assert table.row_of("laptop-a", cleared, stop)["agent"] == "stopped"
    assert table.row_of("laptop-b", cleared, stop)["agent"] == "no job"
    assert table.row_of("laptop-a", failed, {})["agent"] == "failed"
    assert table.bad_nodes([row]) == []


@pytest.mark.skipif(PLAYBOOK is None, reason="ansible-playbook is not installed (make venv)")
def test_status_after_stop_reads_stopped_and_exits_zero(tmp_path):
    """newcomer, 2026-12-01: after stop.yml, `make status` exited 2 ("failed ... stopped by SIGTERM")
    although collect labels the run stopped. A failed node the stop event does not name still fails."""
    inv, env = _stop_case(tmp_path, {"laptop-x": "failed", "laptop-y": "failed"})
    stop = {"time": time.time() - 10, "kind": "stop", "run_id": RUN_ID, "hosts": ["laptop-x", "laptop-y"]}
    with open(tmp_path / "runs" / RUN_ID / "events.jsonl", "a", encoding="utf-8") as fh:
        fh.write(json.dumps(stop) + "\n")
    out = _play(inv, env, "status.yml")
    text = out.stdout + out.stderr
    assert out.returncode == 0, text
    rows = {line.split()[0]: line.split()[1:] for line in text.splitlines() if line.startswith(" laptop-")}
    assert rows["laptop-x"][0] == "stopped" and rows["laptop-y"][0] == "stopped", text
    assert "stopped by stop.yml at" in text, text

    stop["hosts"] = ["laptop-x"]  # laptop-y failed on its own before the stop
    (tmp_path / "runs" / RUN_ID / "events.jsonl").write_text(json.dumps(stop) + "\n")
    out = _play(inv, env, "status.yml")
    text = out.stdout + out.stderr
    assert out.returncode != 0, text
    assert "not every laptop is well: laptop-y: failed" in text, text
