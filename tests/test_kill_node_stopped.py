"""kill-node.yml names a node's agent as status.yml does (ddplab.runstate's words): "stopped by
stop.yml" for a run that stop.yml stopped (its ``kind: stop`` event, the fact status.yml and
collect read), not "failed" (newcomer: kill-node said ``failed`` where status said ``stopped``).

Inventory, run and play helpers of tests/test_fault_unreachable.py: laptop-a is a laptop that is
off (closed SSH port), laptop-b this machine, holding the run's metrics, with no agent running.
"""

from __future__ import annotations

import json
import os
import sys
import time

import pytest
from test_fault_unreachable import PLAYBOOK, ROOT, closed_port, inventory, play, write_run  # noqa: F401

pytestmark = [
    pytest.mark.skipif(PLAYBOOK is None, reason="ansible-playbook is not installed (make venv)"),
    pytest.mark.skipif(os.geteuid() != 0, reason="the role reads the run's files as ddp_lab_user (root)"),
]


def kill_agent_of_b(tmp_path, port, monkeypatch):
    """The run of test_fault_unreachable and a kill-node.yml of laptop-b to call; laptop-b reads its
    metrics with ``python -m ddplab.status`` from a "venv" that is this Python with the checkout."""
    base, run_dir = write_run(tmp_path)
    (tmp_path / "venv/bin").mkdir(parents=True)
    (tmp_path / "venv/bin/python").symlink_to(sys.executable)
    monkeypatch.setenv("PYTHONPATH", str(ROOT / "train"))
    settings = ["fault=kill-agent", "node=laptop-b", "run_id=r1", "ddp_lab_user=root",
                f"ddp_lab_base_dir={base}", f"python_env_prefix={tmp_path / 'venv'}",
                f"fault_runs_dir={run_dir.parent}"]
    return run_dir, lambda: play(tmp_path, inventory(tmp_path, port), ROOT / "kill-node.yml", *settings)


def test_a_node_stop_yml_stopped_is_called_stopped(tmp_path, closed_port, monkeypatch):  # noqa: F811
    run_dir, run = kill_agent_of_b(tmp_path, closed_port, monkeypatch)
    stop_t = 1_796_116_067.49
    with (run_dir / "events.jsonl").open("a") as fh:
        fh.write(json.dumps({"time": stop_t, "kind": "stop", "run_id": "r1", "hosts": ["laptop-b"]}) + "\n")
    r = run()
    out = " ".join((r.stdout + r.stderr).split())
    assert r.returncode != 0, out
    when = time.strftime("%H:%M:%S", time.localtime(stop_t))
    said = f"laptop-b: no job of run r1 is running there (its agent: stopped by stop.yml at {when})"
    assert said in out, out
    assert "failed" not in out.split("no job of run r1", 1)[1].split(")", 1)[0], out


# systemctl show <unit> -p ...: the agent unit as $FAKE_UNIT_STATE says (ActiveState SubState)
FAKE_SYSTEMCTL = """#!/bin/sh
set -- $FAKE_UNIT_STATE
printf 'LoadState=loaded\\nActiveState=%s\\nSubState=%s\\n' "$1" "$2"
printf 'Result=%s\\nExecMainStatus=%s\\nMainPID=0\\n' "$3" "$4"
"""


@pytest.mark.parametrize("unit, said", [
    ("failed failed exit-code 1", "failed"),  # a worker's error ended the agent
    # stop.yml cleared an ended job (no stop event): the unit is gone, the run's records end in a
    # step (no end, no failure record): interrupted, the word status.yml shows (ddplab.runstate)
    ("inactive dead success 0", "interrupted"),
])
def test_a_node_not_stopped_is_named_by_its_unit(tmp_path, closed_port, monkeypatch, unit, said):  # noqa: F811
    """Without a stop event, the target is named by its state in the run-state model's words (a
    fake systemctl gives the agent unit), not "stopped by stop.yml"."""
    fakebin = tmp_path / "fakebin"
    fakebin.mkdir()
    (fakebin / "systemctl").write_text(FAKE_SYSTEMCTL)
    (fakebin / "systemctl").chmod(0o755)
    monkeypatch.setenv("PATH", f"{fakebin}:{os.environ.get('PATH', '')}")
    monkeypatch.setenv("FAKE_UNIT_STATE", unit)
    _run_dir, run = kill_agent_of_b(tmp_path, closed_port, monkeypatch)
    r = run()
    out = " ".join((r.stdout + r.stderr).split())
    assert r.returncode != 0, out
    assert f"laptop-b: no job of run r1 is running there (its agent: {said}); fix: start the job" in out, out
    assert "stopped by stop.yml" not in out, out
