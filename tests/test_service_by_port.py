"""The controller's store and lighthouse are found by what listens on their port, not only by a
pidfile (issue 27 item 5: after benchmarks/recovery.py stopped its per_step run, the lighthouse and
its supervisor kept serving port 29510 with their pidfile gone; ``make status`` said ``torchft
lighthouse: stopped``, ``stop.yml`` and collect's stop did nothing). status reports such a service
as running, with whose it is (this state folder's, another checkout's, another program); stop ends
this checkout's and says why it leaves the others. Never "stopped" while something serves.

Real supervised services on free ports of this machine (psutil reads the listening sockets)."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from ddplab.controller import lighthouse as lh
from ddplab.controller import rdzv_store, supervisor
from labharness import free_port

REPO = Path(__file__).resolve().parents[1]


def _listening(port: int) -> bool:
    return bool(supervisor._listening_pids(port)[0])


def _gone(pid: int) -> bool:
    return not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


@pytest.fixture
def orphan_lighthouse(tmp_path):
    """A supervised lighthouse whose pidfile is gone (it serves on); yields (port, state dir, start doc)."""
    port, sd = free_port(), tmp_path / ".rdzv"
    started = lh.start("127.0.0.1", port, sd, wait_s=60)
    (sd / f"lighthouse-{port}.json").unlink()
    try:
        yield port, sd, started
    finally:
        for pid in (started["supervisor_pid"], started["server_pid"]):
            if psutil.pid_exists(pid):
                psutil.Process(pid).kill()


def test_a_lighthouse_without_its_pidfile_is_running_and_stop_ends_it(orphan_lighthouse, capsys):
    port, sd, started = orphan_lighthouse
    st = lh.status(port, sd)
    # failed before: {"running": false, ...}, i.e. "torchft lighthouse: stopped"
    assert st["running"] and st["answering"] and st["recorded"] is False and st["owner"] == "ours", st
    assert st["supervisor_pid"] == started["supervisor_pid"] and st["quorum_id"] == 0
    sup = started["supervisor_pid"]
    assert st["note"] == f"a ddp-lab lighthouse of this checkout (supervisor pid {sup}) with no pidfile"
    assert lh.main(["status", "--port", str(port), "--state-dir", str(sd)]) == 0
    capsys.readouterr()
    would = supervisor.stop(lh.SERVICE, port, sd, check=True)
    assert would["changed"] and would["running"] and _listening(port), would
    out = lh.stop(port, sd)
    assert out["changed"] and out["note"].startswith("stopped a ddp-lab lighthouse of this checkout"), out
    assert not _listening(port)
    assert _gone(started["supervisor_pid"]) and _gone(started["server_pid"])
    assert lh.status(port, sd) == {"running": False, "answering": False, "port": port}


def test_a_lighthouse_whose_supervisor_died_is_found_by_its_program(orphan_lighthouse):
    port, sd, started = orphan_lighthouse
    psutil.Process(started["supervisor_pid"]).kill()  # the server serves on, alone
    psutil.Process(started["supervisor_pid"]).wait(10)
    assert _listening(port)
    st = lh.status(port, sd)
    assert st["running"] and st["owner"] == "ours" and st["supervisor_pid"] is None, st
    assert "its supervisor gone" in st["note"], st
    out = lh.stop(port, sd)
    assert out["changed"] and not _listening(port), out


def test_another_checkouts_store_is_named_and_left(tmp_path, capsys):
    """Another state folder's store is not this checkout's: never its running supervisor (status
    said running, so the preflight read exit 1, "the supervisor runs but the store does not
    answer", and blamed this checkout), but a port held by it, named with its state folder."""
    port, theirs, mine = free_port(), tmp_path / "other" / ".rdzv", tmp_path / "mine" / ".rdzv"
    started = rdzv_store.start("127.0.0.1", port, theirs, wait_s=60)
    try:
        st = rdzv_store.status(port, mine)
        assert st["running"] is False and st["owner"] == "other" and "supervisor_pid" not in st, st
        assert f"of another checkout (state folder {theirs.resolve()}" in st["held_by"], st
        # the CLI the preflight asks (for another address than the one it serves): not running
        assert rdzv_store.main(["status", "--port", str(port), "--host", "192.0.2.10",
                                "--state-dir", str(mine)]) == 3
        assert json.loads(capsys.readouterr().out)["held_by"] == st["held_by"]
        out = rdzv_store.stop(port, mine)
        assert out["changed"] is False and out["running"] is False and out["owner"] == "other", out
        assert out["note"].startswith(f"store on port {port} left running: it is a ddp-lab store of"
                                      " another checkout"), out
        assert f"python -m ddplab.controller.rdzv_store stop --port {port} --state-dir" in out["note"], out
        assert _listening(port)
    finally:
        rdzv_store.stop(port, theirs)
    assert not psutil.pid_exists(started["supervisor_pid"]) or _gone(started["supervisor_pid"])


def test_another_program_on_the_port_is_not_stopped_nor_called_stopped(tmp_path):
    with socket.socket() as s:
        s.bind(("0.0.0.0", 0))
        s.listen()
        port = s.getsockname()[1]
        st = lh.status(port, tmp_path)
        assert st["running"] is False and "not a ddp-lab lighthouse" in st["held_by"], st
        out = lh.stop(port, tmp_path)
        assert out["changed"] is False and out["note"].startswith(f"port {port} is held by "), out
        assert "nothing was stopped" in out["note"]


def test_the_status_line_says_whose_it_is(orphan_lighthouse):
    from ansible_collections.ddp_lab.cluster.plugins.action import ddp_job_status_table as table

    port, sd, started = orphan_lighthouse
    line = table.lighthouse_line(lh.status(port, sd))
    assert line.startswith(f"torchft lighthouse: running on port {port} at 127.0.0.1 (answering"), line
    assert "with no pidfile" in line and "stopped" not in line, line
    held = table.service_line("rendezvous store", {"running": False, "port": 1, "held_by": "nginx (pid 7)"})
    assert held == "rendezvous store: not running; port 1 is held by nginx (pid 7)"


def test_stop_playbook_ends_a_store_without_its_pidfile(tmp_path):
    """stop.yml (its rendezvous play) stops the store found by its port and says so."""
    port, sd = free_port(), tmp_path / "rdzv"
    started = rdzv_store.start("127.0.0.1", port, sd, wait_s=60)
    (sd / f"store-{port}.json").unlink()
    try:
        inv = tmp_path / "hosts.yml"
        local = {"ansible_connection": "local", "ansible_python_interpreter": sys.executable}
        inv.write_text(json.dumps({"all": {"children": {
            "trainers": {"hosts": {}},
            "rendezvous": {"hosts": {"controller": {
                **local, "rendezvous_address": "127.0.0.1", "rendezvous_port": port,
                "rendezvous_state_dir": str(sd)}}}}}}))
        env = {"ANSIBLE_CONFIG": str(REPO / "ansible.cfg"), "ANSIBLE_NOCOLOR": "1",
               "PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin", "HOME": str(tmp_path),
               "ANSIBLE_LOCAL_TEMP": str(tmp_path / "tmp")}
        out = subprocess.run([str(Path(sys.executable).parent / "ansible-playbook"), "-i", str(inv),
                              str(REPO / "stop.yml"), "--tags", "stop", "--limit", "controller"],
                             capture_output=True, text=True, env=env, cwd=REPO, timeout=300)
        text = out.stdout + out.stderr
        assert out.returncode == 0, text[-3000:]
        sup = started["supervisor_pid"]
        assert (f"stopped a ddp-lab store of this checkout (supervisor pid {sup}) with no pidfile, found by"
                f" its port {port}") in text, text[-3000:]
        deadline = time.monotonic() + 10
        while _listening(port) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not _listening(port)
    finally:
        if psutil.pid_exists(started["supervisor_pid"]):
            psutil.Process(started["supervisor_pid"]).kill()


def test_collect_of_an_ended_run_ends_its_store_without_a_pidfile(tmp_path):
    """collect's stop step (roles/collect/tasks/services.yml) finds the run's store by its port."""
    from test_collect_services import _collect
    from test_status_table import _case

    inv, env = _case(tmp_path, {"laptop-x": "ended", "laptop-y": "ended"}, unreachable=False)
    for metrics in (tmp_path / "base").glob("*/runs/*/metrics/*.jsonl"):  # the run ended just now
        records = [json.loads(x) for x in metrics.read_text().splitlines()]
        metrics.write_text("".join(json.dumps({**r, "time": time.time() + 5}) + "\n" for r in records))
    sd = tmp_path / "rdzv"
    if _listening(29499):
        pytest.skip("port 29499 (the _case inventory's store port) is in use")
    started = rdzv_store.start("127.0.0.1", 29499, sd, wait_s=60)
    (sd / "store-29499.json").unlink()
    try:
        text = _collect(tmp_path, inv, env)
        said = "the run ended on every trainer: stopping its rendezvous store on port 29499"
        assert said in text, text[-3000:]
        assert "found by its port 29499" in text, text[-3000:]
        deadline = time.monotonic() + 10
        while _listening(29499) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not _listening(29499)
    finally:
        if psutil.pid_exists(started["supervisor_pid"]):
            psutil.Process(started["supervisor_pid"]).kill()
