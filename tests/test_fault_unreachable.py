"""A node that is off is not contacted: the fault role prints no "fatal: UNREACHABLE" for it.

The inventory's laptop-a is a laptop reached over SSH on a closed port of this machine (a
powered-off laptop, as the controller sees it); laptop-b is this machine (local connection) and
holds the run's metrics. Output is Ansible's default callback, as a user reads it.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
PLAYBOOK = shutil.which("ansible-playbook", path=str(BIN)) or shutil.which("ansible-playbook")

pytestmark = pytest.mark.skipif(PLAYBOOK is None, reason="ansible-playbook is not installed (make venv)")


@pytest.fixture
def closed_port():
    """A TCP port of 127.0.0.1 that refuses connections (bound, not listening) for the test."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        yield sock.getsockname()[1]


def inventory(tmp_path: Path, port: int) -> Path:
    inv = {"all": {"children": {
        "trainers": {"hosts": {
            "laptop-a": {"ansible_host": "127.0.0.1", "ansible_port": port},
            "laptop-b": {"ansible_connection": "local", "ansible_python_interpreter": sys.executable}}},
        "rendezvous": {"hosts": {"controller": {"ansible_connection": "local",
                                                "rendezvous_address": "10.255.0.1"}}},
    }}}
    path = tmp_path / "hosts.yml"
    path.write_text(yaml.safe_dump(inv))
    return path


def play(tmp_path: Path, inv: Path, playbook: Path, *extra: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, ANSIBLE_CONFIG=str(ROOT / "ansible.cfg"), ANSIBLE_NOCOLOR="1",
               ANSIBLE_LOCAL_TEMP=str(tmp_path / "tmp"), ANSIBLE_HOME=str(tmp_path / "home"),
               ANSIBLE_STDOUT_CALLBACK="default", PATH=f"{BIN}:{os.environ.get('PATH', '')}")
    args = [PLAYBOOK, "-i", str(inv), str(playbook)]
    for e in extra:
        args += ["-e", e]
    return subprocess.run(args, capture_output=True, text=True, env=env, timeout=300, cwd=ROOT)


def write_run(tmp_path: Path) -> tuple[Path, Path]:
    """Run r1: laptop-b's metrics (world size 2, then 1 after laptop-a went off at t=1005) and the
    poweroff event on the controller. Returns (node base dir, controller run dir)."""
    base, run_dir = tmp_path / "base", tmp_path / "runs/r1"
    (base / "runs/r1/metrics").mkdir(parents=True)
    run_dir.mkdir(parents=True)
    common = {"host": "laptop-b", "rank": 0, "local_rank": 0}
    before = {**common, "world_size": 2, "restart_count": 0}
    after = {**common, "world_size": 1, "restart_count": 1}
    recs = [{"event": "start", "time": 1000.0, **before, "resumed_from_step": None}]
    recs += [{"event": "step", "time": 1000.0 + i, **before, "step": i, "step_time_s": 1.0}
             for i in range(1, 5)]
    recs += [{"event": "start", "time": 1010.0, **after, "resumed_from_step": 4}]
    recs += [{"event": "step", "time": 1010.0 + i, **after, "step": 4 + i, "step_time_s": 1.0}
             for i in range(1, 4)]
    (base / "runs/r1/metrics/laptop-b-local0.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    event = {"time": 1005.0, "kind": "fault", "mode": "poweroff", "node": "laptop-a", "rank": 1,
             "duration_s": None, "run_id": "r1", "world_size": 2}
    (run_dir / "events.jsonl").write_text(json.dumps(event) + "\n")
    return base, run_dir


def test_report_after_a_poweroff_does_not_contact_the_node_that_is_off(tmp_path, closed_port):
    """The tail of a successful `kill-node.yml -e fault=poweroff`: fetch, measure, print."""
    base, run_dir = write_run(tmp_path)
    playbook = tmp_path / "report.yml"
    playbook.write_text(yaml.safe_dump([{
        "name": "Report after laptop-a was powered off", "hosts": "trainers", "gather_facts": False,
        "tasks": [
            {"name": "Set what resolve.yml and record-wait.yml set", "ansible.builtin.set_fact": {
                "ddp_lab_run_id": "r1", "__fault_run_dir": str(run_dir), "__fault_target": "laptop-a",
                "__fault_target_rank": 1, "__fault_wait_timeout": 10,
                "__fault_progress": {"phase": "recovered"}}},
            {"name": "Report", "ansible.builtin.include_role": {"name": "fault", "tasks_from": "report"},
             "vars": {"fault_mode": "poweroff", "ddp_lab_user": "root", "ddp_lab_base_dir": str(base)}},
        ]}]))
    r = play(tmp_path, inventory(tmp_path, closed_port), playbook)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    assert "fatal:" not in out and "UNREACHABLE" not in out, out
    assert "poweroff  laptop-a  1     2->1" in out, out  # the measured entry, from laptop-b's metrics
    assert (run_dir / ".live/laptop-b/metrics/laptop-b-local0.jsonl").is_file()


@pytest.mark.skipif(os.geteuid() != 0, reason="the role reads the run's files as ddp_lab_user (root here)")
def test_rejoin_of_a_node_that_is_off_reads_nothing_from_it(tmp_path, closed_port):
    """`kill-node.yml -e fault=rejoin` while the node is still off: it is reported down, never dialled.
    (No agent runs on this machine, so the play stops at its check that another node trains.)"""
    base, _run_dir = write_run(tmp_path)
    r = play(tmp_path, inventory(tmp_path, closed_port), ROOT / "kill-node.yml", "fault=rejoin",
             "node=laptop-a", "run_id=r1", "ddp_lab_user=root", f"ddp_lab_base_dir={base}")
    out = r.stdout + r.stderr
    assert "UNREACHABLE" not in out, out
    assert "agents: laptop-a down" in " ".join(out.split()), out
