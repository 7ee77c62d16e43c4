"""collect of a run over on every trainer ends its rendezvous store and lighthouse (newcomer,
session 8: after ``site.yml -e ddp_job_watch=false`` and ``collect.yml``, an 11:10 lighthouse was
still up an hour later; only stop.yml and attach.yml ended them). Not while the run still runs,
nor a later launch's (a trainer's current_run names another run, or the service started after the
run's last record).

The store is a stand-in supervisor (a ``sleep`` whose pidfile is in the state folder, as
tests/test_reset.py does), local "laptops" as in tests/test_status_table.py."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import psutil
import pytest
from test_status_table import PLAYBOOK, _case, _play

RUN_ID = "20261130-190000-abcd"
pytestmark = pytest.mark.skipif(PLAYBOOK is None, reason="ansible-playbook is not installed (make venv)")


@pytest.fixture
def store(tmp_path):
    """A live stand-in store supervisor on port 29499 (the _case inventory's) with its pidfile;
    yields (process, pidfile, set_started_at)."""
    proc = subprocess.Popen(["sleep", "infinity"])  # until the fixture ends it
    pidfile = tmp_path / "rdzv" / "store-29499.json"

    def started(at: float) -> None:
        pidfile.write_text(json.dumps({"host": "127.0.0.1", "port": 29499, "supervisor_pid": proc.pid,
                                       "supervisor_ctime": psutil.Process(proc.pid).create_time(),
                                       "started_at": at}))
    try:
        yield proc, pidfile, started
    finally:
        proc.kill()
        proc.wait()


def _collect(tmp_path: Path, inv: Path, env: dict, *extra: str) -> str:
    out = _play(inv, env, "playbooks/collect.yml", f"collect_runs_dir={tmp_path / 'runs'}",
                "collect_report=false", *extra)
    text = out.stdout + out.stderr
    assert out.returncode == 0, text
    return text


def _gone(proc: subprocess.Popen, wait_s: float = 5.0) -> bool:
    try:
        proc.wait(wait_s)
        return True
    except subprocess.TimeoutExpired:
        return False


def test_collect_of_a_run_ended_everywhere_ends_its_store(tmp_path, store):
    inv, env = _case(tmp_path, {"laptop-x": "ended", "laptop-y": "ended"}, unreachable=False)
    proc, pidfile, started = store
    started(time.time() - 3600)  # launched with the run, an hour ago
    text = _collect(tmp_path, inv, env)
    assert "the run ended on every trainer: stopping its rendezvous store on port 29499" in text, text
    assert _gone(proc), "the store's supervisor still runs"
    assert not pidfile.exists()


def test_collect_leaves_the_store_of_a_run_that_still_runs(tmp_path, store):
    inv, env = _case(tmp_path, {"laptop-x": "ended", "laptop-y": "running"}, unreachable=False)
    proc, pidfile, started = store
    started(time.time() - 3600)
    text = _collect(tmp_path, inv, env, "collect_snapshot=true")  # a copy now: the run goes on
    # the run is not over (collect_run_over): the store stays, and a line says why (issue 27 item 16:
    # never without a word)
    assert ("rendezvous store on port 29499 left running: the run is not over on every trainer (it still"
            " runs on laptop-y)") in text, text
    assert "stopping its rendezvous store" not in text, text
    assert not _gone(proc, 0.5) and pidfile.exists()


def test_collect_leaves_a_later_launchs_store(tmp_path, store):
    """The older run ended everywhere, but a later launch holds the store: started after the run's
    last record (before the launch shipped), or a trainer's current_run names the later run."""
    inv, env = _case(tmp_path, {"laptop-x": "ended", "laptop-y": "ended"}, unreachable=False)
    for metrics in (tmp_path / "base").glob(f"*/runs/{RUN_ID}/metrics/*.jsonl"):  # ended 10 min ago
        records = [json.loads(x) for x in metrics.read_text().splitlines()]
        metrics.write_text("".join(json.dumps({**r, "time": r["time"] - 600}) + "\n" for r in records))
    proc, pidfile, started = store
    started(time.time() - 300)  # 5 min after the run's last record
    text = _collect(tmp_path, inv, env)
    assert "rendezvous store on port 29499 left running: the rendezvous store started after the run's last " \
        "record (a later launch's)" in text, text
    assert not _gone(proc, 0.5) and pidfile.exists()

    started(time.time() - 3600)  # before the run's end: a store the later launch reused
    (tmp_path / "base" / "laptop-y" / "current_run").write_text("20261130-200000-later\n")
    text = _collect(tmp_path, inv, env, f"collect_run_id={RUN_ID}")
    assert "stopping its rendezvous store" not in text, text
    assert not _gone(proc, 0.5) and pidfile.exists()
