"""The fault role's filters that hold what tasks/resolve.yml and tasks/report.yml computed in Jinja
(issue 14 review): who is the target, who still trains, how long to wait, which nodes are down, how
each agent ended and the one-line outcome. Pure functions of the progress results and host vars."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml
from ansible_collections.ddp_lab.cluster.plugins.filter import fault as ff

ROLE = Path(__file__).resolve().parents[1] / "roles" / "fault"


def _worker(node, rank, time, world_size=2):
    return {"node": node, "rank": rank, "time": time, "world_size": world_size}


# laptop-a and laptop-b train (ranks 0 and 1), laptop-c's agent failed, laptop-d was not read (off)
PROGRESS = {
    "laptop-a": {"state": "running", "agent": {"running": True}, "workers": [_worker("laptop-a", 0, 20)]},
    "laptop-b": {"state": "running", "agent": {"running": True}, "workers": [_worker("laptop-b", 1, 10)]},
    "laptop-c": {"state": "failed", "agent": {"running": False, "state": "failed", "substate": "failed"},
                 "workers": [_worker("laptop-c", 2, 5, world_size=3)]},
    "laptop-d": {"skipped": True},
}


def test_resolve_by_rank_names_its_node_the_world_size_and_a_peer_to_watch_from():
    plan = ff.resolve(PROGRESS, {}, "", 1, "kill-agent")
    assert plan["active"] == ["laptop-a", "laptop-b"]
    assert [w["node"] for w in plan["workers"]] == ["laptop-c", "laptop-b", "laptop-a"]  # oldest first
    assert plan["rank_holders"] == ["laptop-b"] and plan["target"] == "laptop-b"
    assert plan["target_rank"] == 1 and plan["world_size"] == 2
    assert plan["others"] == ["laptop-a"] and plan["probe"] == "laptop-a"
    assert plan["ranks"] == "laptop-b=1, laptop-a=0"
    assert plan["states"] == {"laptop-a": "running", "laptop-b": "running", "laptop-c": "failed",
                              "laptop-d": "down"}
    assert plan["agents"] == "laptop-a running, laptop-b running, laptop-c failed, laptop-d down"


def test_resolve_by_node_rejoin_and_a_rank_nobody_holds():
    plan = ff.resolve(PROGRESS, {}, "laptop-c", -1, "rejoin")
    assert plan["target"] == "laptop-c" and plan["target_rank"] is None  # no rank before the re-form
    assert plan["rank_holders"] == [] and plan["probe"] == "laptop-a"
    assert ff.resolve(PROGRESS, {}, "laptop-c", -1, "kill-agent")["target_rank"] == 2  # its newest record
    nobody = ff.resolve(PROGRESS, {}, "", 2, "kill-worker")  # laptop-c holds 2 but does not run
    assert nobody["rank_holders"] == [] and nobody["target"] is None
    alone = ff.resolve({"laptop-a": PROGRESS["laptop-a"]}, {}, "laptop-a", -1, "poweroff")
    assert alone["others"] == [] and alone["probe"] == "laptop-a"
    idle = ff.resolve({"laptop-c": PROGRESS["laptop-c"], "laptop-d": None}, {}, "laptop-c", -1, "rejoin")
    assert idle["ranks"] == "none" and idle["world_size"] is None and idle["active"] == []
    with pytest.raises(ValueError):
        ff.resolve(PROGRESS, {}, "", "abc", "kill-agent")


def test_resolve_names_a_node_stop_yml_stopped():
    stop = {"hosts": ["laptop-c"], "time": 0}
    assert ff.resolve(PROGRESS, stop, "laptop-c", -1, "rejoin")["states"]["laptop-c"].startswith(
        "stopped by stop.yml at ")


def test_wait_timeout_given_or_the_modes_default_plus_the_duration():
    defaults = {"kill-agent": 240, "freeze": "120"}
    assert ff.wait_timeout("kill-agent", 0, defaults, 0) == 240
    assert ff.wait_timeout("freeze", "0", defaults, "30.0") == 150
    assert ff.wait_timeout("freeze", 45, defaults, 30) == 45
    with pytest.raises(KeyError):
        ff.wait_timeout("explode", 0, defaults, 0)


def test_intent_line():
    plan = ff.resolve(PROGRESS, {}, "", 1, "freeze")
    assert ff.intent(plan, False, "freeze", "r1", 30.0, 150) == (
        "Injecting freeze into laptop-b (rank 1, world size 2) of run r1 for 30.0 s; watching from"
        " laptop-a for up to 150 s")
    rejoin = ff.resolve(PROGRESS, {}, "laptop-c", -1, "rejoin")
    assert ff.intent(rejoin, True, "rejoin", "r1", 0, 240) == (
        "Would inject rejoin into laptop-c (rank ?, world size 2) of run r1; watching from laptop-a"
        " for up to 240 s")


def test_host_values_and_down_hosts():
    hostvars = {"a": {"__fault_up": True}, "b": {"__fault_up": False}, "c": {}}
    up = ff.host_values(["a", "b", "c"], hostvars, "__fault_up")
    assert up == {"a": True, "b": False, "c": None}
    # a host hostvars does not hold (Ansible's hostvars gives an undefined there): None, no KeyError
    assert ff.host_values(["a", "gone"], hostvars, "__fault_up") == {"a": True, "gone": None}
    assert ff.down_hosts(up) == "b,c"
    assert ff.down_hosts({"a": True}) == ""


JOURNAL = """\
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
Root Cause (first observed failure):
[0]:
  time      : 2026-11-29_18:01:02
  exitcode  : -9 (pid: 12186)
  error_file: <N/A>
"""


def test_agent_end_from_the_unit_and_the_journal():
    unit = {"ActiveState": "failed", "ExecMainStatus": "1"}
    assert ff.agent_end("laptop-b", unit, JOURNAL) == (
        "laptop-b: failed (exit 1), torchrun gave up (no restart left), first failed worker: exit code"
        " -9 (pid: 12186)")
    running = {"ActiveState": "active", "ExecMainStatus": "0"}
    assert ff.agent_end("laptop-a", running, "") == "laptop-a: active"
    assert ff.agent_end("laptop-a", None, None) == "laptop-a: ?"


def test_not_recovered_line():
    ends = {"laptop-a": "laptop-a: failed (exit 1)", "laptop-b": None}
    ended = ff.not_recovered({"phase": "ended", "measure": {"cause": "signal: SIGKILL"}}, "r1", "kill-agent",
                             "laptop-b", 1, 240, ends, "ddp-lab-agent")
    assert ended == (
        "run r1 ended after kill-agent of laptop-b (rank 1). Agents: laptop-a: failed (exit 1); laptop-b."
        " Last failure record: signal: SIGKILL. The job is over; fix: start a new run with site.yml (more"
        " faults per run need a higher ddp_job_max_restarts)")
    # an agent still active: never "the job is over" (issue 27 item 15; tests/test_one_fault_at_a_time.py)
    still = ff.not_recovered({"phase": "ended"}, "r1", "kill-agent", "laptop-b", 1, 240,
                             {"laptop-a": "laptop-a: active", "laptop-b": None}, "u")
    assert "The job is over" not in still and "The job still runs on laptop-a" in still, still
    waiting = ff.not_recovered({"phase": "waiting", "measure": {"cause": "x " * 150}}, "r1", "freeze",
                               "laptop-b", None, 150, ends, "ddp-lab-agent")
    assert waiting.startswith("run r1 did not recover within 150 s after freeze of laptop-b. Agents:")
    assert waiting.endswith(" x x.... Fix: look at journalctl -u ddp-lab-agent on the nodes, or wait longer"
                            " (-e fault_wait_timeout_s=...)")
    assert "Last failure record: none." in ff.not_recovered({"phase": "ended"}, "r1", "poweroff", "b", None,
                                                           1, {}, "u")


def test_measured_lines():
    assert ff.measured_lines(["fault 1"], "/runs/r1", True) == [
        "fault 1", "", "summary: /runs/r1/summary.json", "report: /runs/r1/report.html"]
    assert ff.measured_lines([], "/runs/r1", False) == ["", "summary: /runs/r1/summary.json"]


# Jinja beyond substitution: conditionals, list building and searching inside {{ }}.
LOGIC = re.compile(r"\bif\b|zip\(|selectattr|rejectattr|dict2items|regex_|\bmap\(|flatten|\bsort\b"
                   r"|\bfirst\b|\blast\b")


@pytest.mark.parametrize("name", ["report.yml", "resolve.yml"])
def test_report_and_resolve_tasks_only_substitute(name):
    text = (ROLE / "tasks" / name).read_text()
    yaml.safe_load(text)
    found = [e for e in re.findall(r"\{\{.*?\}\}", text, flags=re.S) if LOGIC.search(e)]
    assert found == [], found
