"""One fault at a time (issue 27 item 15): a kill-agent 20 s into a 90 s throttle was accepted; the
throttle's play, watching from the killed laptop, then said "the job is over; fix: start a new
run" while the other laptops trained, and summary.json recorded the throttle not_recovered with a
raw None in its line. Now a second kill-node.yml is refused in one line naming the fault under way
and when it ends (ddplab.controller.launch_lock --kind fault, held by the first kill-node play); a
play that loses sight of the job while an agent still runs never calls it over; no None in a
summary line."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import psutil
import pytest
from ansible_collections.ddp_lab.cluster.plugins.filter import fault as fault_filters
from ddplab.controller import launch_lock
from ddplab.controller.summary import human_summary
from test_status_table import PLAYBOOK, RUN_ID, _case, _play

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def first_fault(tmp_path):
    """A live stand-in kill-node play holding the fault lock of a 90 s throttle."""
    proc = subprocess.Popen(["sleep", "300"])
    try:
        lock = tmp_path / "locks" / ".fault.lock"
        doc = launch_lock.acquire(
            lock,
            f"throttle of laptop-y in run {RUN_ID}",
            holder=psutil.Process(proc.pid),
            kind="fault",
            until=time.time() + 90,
        )
        yield proc, doc
    finally:
        proc.kill()
        proc.wait()


def test_the_fault_refusal_names_the_fault_and_when_it_ends(tmp_path, first_fault):
    proc, doc = first_fault
    with pytest.raises(launch_lock.LockHeld) as err:
        launch_lock.acquire(tmp_path / "locks" / ".fault.lock", "kill-agent of laptop-x", kind="fault")
    line = str(err.value)
    ends = time.strftime("%H:%M:%S", time.localtime(doc["until"]))
    assert line.startswith(
        f"another fault is under way: throttle of laptop-y in run {RUN_ID} (kill-node.yml,"
        f" ansible-playbook pid {proc.pid}, since "
    ), line
    assert f", it ends at {ends} (in " in line and "nothing was injected" in line and "\n" not in line


@pytest.mark.skipif(PLAYBOOK is None, reason="ansible-playbook is not installed (make venv)")
def test_a_second_kill_node_is_refused_before_it_injects(tmp_path, first_fault):
    proc, _ = first_fault
    inv, env = _case(tmp_path, {"laptop-x": "running", "laptop-y": "running"}, unreachable=False)
    data = json.loads(inv.read_text())  # kill-node.yml's validate refuses a loopback rendezvous address
    data["all"]["children"]["rendezvous"]["hosts"]["controller"]["rendezvous_address"] = "192.0.2.10"
    tv = data["all"]["children"]["trainers"]["vars"]
    tv["python_env_prefix"] = tv["ddp_job_venv"]  # the fault role reads the nodes' venv by this name
    inv.write_text(json.dumps(data))
    (tmp_path / "runs" / ".fault.lock").write_bytes((tmp_path / "locks" / ".fault.lock").read_bytes())
    out = _play(
        inv, env, "kill-node.yml", "fault=kill-agent", "node=laptop-x", f"fault_runs_dir={tmp_path / 'runs'}"
    )
    text = " ".join((out.stdout + out.stderr).split())
    assert out.returncode != 0, text[-3000:]
    assert (
        f"another fault is under way: throttle of laptop-y in run {RUN_ID} (kill-node.yml, ansible-playbook"
        f" pid {proc.pid}" in text
    ), text[-3000:]
    assert "Inject the fault" not in text and "kill --signal" not in text, text[-3000:]


def test_a_job_that_trains_on_is_never_called_over():
    progress = {"phase": "ended", "measure": {"cause": "the watched node's agent ended"}}
    ends = {
        "laptop-a": "laptop-a: failed (exit 137)",
        "laptop-b": "laptop-b: active",
        "laptop-c": "laptop-c: active",
    }
    line = fault_filters.not_recovered(
        progress, RUN_ID, "throttle", "laptop-c", 2, 150, ends, "ddp-lab-agent"
    )
    assert "The job is over" not in line, line
    assert f"run {RUN_ID} lost sight of the job after throttle of laptop-c (rank 2)" in line
    assert "The job still runs on laptop-b, laptop-c" in line
    over = fault_filters.not_recovered(
        progress,
        RUN_ID,
        "kill-agent",
        "laptop-a",
        0,
        150,
        {"laptop-a": "laptop-a: failed", "laptop-b": "laptop-b: inactive"},
        "u",
    )
    assert "The job is over" in over


def test_no_raw_none_in_a_summary_fault_line():
    summary = {
        "run_id": RUN_ID,
        "hosts": ["laptop-a"],
        "steps_completed": 48,
        "max_steps": 100,
        "faults": [
            {
                "mode": "throttle",
                "node": "laptop-c",
                "world_size_before": 3,
                "world_size_after": None,
                "detected_s": None,
                "recovered_s": None,
                "steps_lost": None,
                "outcome": "not_recovered",
            }
        ],
    }
    line = next(x for x in human_summary(summary).splitlines() if x.startswith("fault throttle"))
    assert "None" not in line and "steps lost -" in line, line
