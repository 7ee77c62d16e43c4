"""kill-node.yml after a per_step group finished the run (issue 14, item 2).

The newcomer's run: laptop-a and laptop-b finished the run (step 2500), laptop-c had been cut off
from the group (a failure with cause ``cut_off``, exit 4: status.yml reads it ``cut off``).
``kill-node.yml -e fault=rejoin -e node=laptop-c`` then said ``no other trainer runs run R
(agents: ... laptop-c failed) ...; fix: start the job on the trainers with site.yml`` (a NEW run).
It must say that the run is finished (its group ended at step N), that a rejoin has nothing to
join, and call laptop-c ``cut off`` as status.yml does.
"""

from __future__ import annotations

import json
import os
import sys

import pytest
import yaml
from ansible_collections.ddp_lab.cluster.plugins.filter import fault as fault_filters
from test_fault_unreachable import PLAYBOOK, ROOT, play

FINISHED = {"finished": True, "step": 2500, "stop_cause": None}
CUT_OFF = {"finished": False, "step": 2073, "stop_cause": "cut_off"}


def progress(doc: dict, running: bool = False, state: str = "failed") -> dict:
    """A node_status result: the job's state, the agent unit and ddplab.status's progress document."""
    return {"state": "running" if running else state, "agent": {"running": running}, "workers": [],
            "progress": doc}


def test_a_replica_cut_off_from_a_finished_group_is_called_cut_off():
    states = fault_filters.agent_states({
        "laptop-a": progress(FINISHED, state="succeeded"), "laptop-b": progress(FINISHED, state="succeeded"),
        "laptop-c": progress(CUT_OFF)})
    assert states["laptop-c"] == "cut off"
    # without a laptop that finished the run, the unit's state as before (status.yml: failed)
    states = fault_filters.agent_states({"laptop-a": progress({}, running=True),
                                         "laptop-c": progress(CUT_OFF)})
    assert states == {"laptop-a": "running", "laptop-c": "failed"}


def test_the_refusal_names_the_finished_run_and_the_cut_off_node():
    plan = fault_filters.resolve({
        "laptop-a": progress(FINISHED, state="succeeded"), "laptop-b": progress(FINISHED, state="succeeded"),
        "laptop-c": progress(CUT_OFF)}, {}, "laptop-c", -1, "rejoin")
    assert plan["finished"] == {"hosts": ["laptop-a", "laptop-b"], "step": 2500}
    line = fault_filters.finished_refusal(plan, "rejoin", "R")
    assert line.startswith("run R is finished: its group ended at step 2500 (laptop-a, laptop-b); "
                           "a rejoin of laptop-c has nothing to join")
    assert "laptop-c cut off" in line and "collect_run_id=R" in line and "\n" not in line
    line = fault_filters.finished_refusal(plan, "poweroff", "R")
    assert "there is no training to inject poweroff into" in line
    # a run already collected (make demo collects it) is not sent to be collected again
    summary = {"exists": True, "path": "/c/runs/R/summary.json"}
    line = fault_filters.finished_refusal(plan, "poweroff", "R", summary)
    assert line.endswith("fix: nothing to recover: its result and report are collected "
                         "(/c/runs/R/summary.json), or start a new run with site.yml")
    assert "collect_run_id" not in line
    assert "collect_run_id=R" in fault_filters.finished_refusal(plan, "poweroff", "R", {"exists": False})
    # a run still going on one laptop is not finished for kill-node.yml (the task's condition)
    plan = fault_filters.resolve({"laptop-a": progress(FINISHED, state="succeeded"),
                                  "laptop-b": progress({}, running=True)}, {}, "laptop-c", -1, "rejoin")
    assert plan["finished"]["hosts"] == ["laptop-a"] and plan["active"] == ["laptop-b"]


def records(host: str, last: dict) -> str:
    common = {"host": host, "rank": 0, "local_rank": 0, "world_size": 2, "restart_count": 0,
              "engine": "per_step"}
    recs = [{"event": "start", "time": 1000.0, **common, "resumed_from_step": None}]
    recs += [{"event": "step", "time": 1000.0 + s, **common, "step": s, "committed": True,
              "participants": 2, "step_time_s": 1.0} for s in range(1, 6)]
    recs.append({"time": 1010.0, **common, **last})
    return "".join(json.dumps(r) + "\n" for r in recs)


def kill_node_on_a_finished_run(tmp_path, monkeypatch, *extra: str):
    """kill-node.yml on run r1 that laptop-a finished (the end record of step 10) while laptop-b's
    newest record is a cut_off failure; both laptops are this machine (local connection, each with
    its own base folder). Returns (returncode, the play's output in one line)."""
    hosts = {}
    for host, last in (("laptop-a", {"event": "end", "step": 10}),
                       ("laptop-b", {"event": "failure", "step": 5, "cause": "cut_off",
                                     "error": "CutOffError: replica laptop-b was cut off"})):
        base = tmp_path / host
        (base / "runs/r1/metrics").mkdir(parents=True)
        (base / f"runs/r1/metrics/{host}-local0.jsonl").write_text(records(host, last))
        hosts[host] = {"ansible_connection": "local", "ansible_python_interpreter": sys.executable,
                       "ddp_lab_base_dir": str(base), "python_env_prefix": sys.prefix}
    inv = tmp_path / "hosts.yml"
    inv.write_text(yaml.safe_dump({"all": {"children": {
        "trainers": {"hosts": hosts},
        "rendezvous": {"hosts": {"controller": {"ansible_connection": "local",
                                                "rendezvous_address": "10.255.0.1"}}}}}}))
    # node_status runs `python -m ddplab.status` on the node: here this Python, train/ on its path
    paths = (str(ROOT / "train"), os.environ.get("PYTHONPATH"))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in paths if p))
    r = play(tmp_path, inv, ROOT / "kill-node.yml", *extra, "run_id=r1", "ddp_lab_user=root")
    return r.returncode, " ".join((r.stdout + r.stderr).split())


needs_a_play = pytest.mark.skipif(
    PLAYBOOK is None or os.geteuid() != 0,
    reason="needs ansible-playbook (make venv) and root (the role reads the run's files as ddp_lab_user)")


@needs_a_play
def test_kill_node_rejoin_after_the_group_finished_says_the_run_is_finished(tmp_path, monkeypatch):
    rc, out = kill_node_on_a_finished_run(tmp_path, monkeypatch, "fault=rejoin", "node=laptop-b")
    assert rc != 0, out
    assert ("run r1 is finished: its group ended at step 10 (laptop-a); a rejoin of laptop-b has "
            "nothing to join") in out, out
    assert "laptop-b cut off" in out, out
    assert "start the job on the trainers" not in out, out


@needs_a_play
def test_kill_node_by_rank_on_a_finished_run_says_the_run_is_finished(tmp_path, monkeypatch):
    """The README's example (-e fault=kill-agent -e rank=0) on a finished run: no worker holds a
    rank any more, but the refusal is that the run is finished, not ``a rank below the world size``."""
    rc, out = kill_node_on_a_finished_run(tmp_path, monkeypatch, "fault=kill-agent", "rank=0")
    assert rc != 0, out
    assert ("run r1 is finished: its group ended at step 10 (laptop-a); there is no training to "
            "inject kill-agent into") in out, out
    assert "no running worker" not in out and "a rank below the world size" not in out, out
