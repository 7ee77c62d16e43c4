"""Which run the controller's store or lighthouse serves (issue 27 item 5, "whose it is"): a
service found by its port (pidfile gone) said whose checkout it was, not which run it served.
Each launch whose agents it serves writes the run record beside its pidfile
(``python -m ddplab.controller.<module> serves``, roles/rendezvous tasks/serves.yml); status names
the run while the record names the same process, also without the pidfile, and for another
checkout's service by that checkout's record; status.yml's line says ``serving run R``, or, with
no record, the run looked at when its running agents point at the service's port.

Real supervised stores on free ports of this machine; status.yml on local "laptops"
(tests/test_status_table.py's fake units)."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import pytest
from ddplab.controller import rdzv_store, supervisor
from labharness import free_port
from rdzv_harness import kill_tree

REPO = Path(__file__).resolve().parents[1]
RUN = "20261202-010000-beef"


def _table():
    from ansible_collections.ddp_lab.cluster.plugins.action import ddp_job_status_table as table

    return table


@contextlib.contextmanager
def _supervised(sd: Path):
    """A supervised store on a free port with state in ``sd``; yields (port, start doc); its
    supervisor and server are killed after (also when the test stopped it already)."""
    port = free_port()
    started = rdzv_store.start("127.0.0.1", port, sd, wait_s=60)
    try:
        yield port, started
    finally:
        kill_tree(started["supervisor_pid"])
        kill_tree(started["server_pid"])


@pytest.fixture
def store(tmp_path):
    """(port, state dir, start doc) of :func:`_supervised`."""
    with _supervised(tmp_path / ".rdzv") as (port, started):
        yield port, tmp_path / ".rdzv", started


def test_the_run_record_names_the_run_with_and_without_the_pidfile(store, capsys):
    port, sd, started = store
    assert rdzv_store.status(port, sd)["run_id"] is None  # no launch recorded one yet
    assert rdzv_store.main(["serves", "--port", str(port), "--state-dir", str(sd), "--run-id", RUN]) == 0
    assert json.loads(capsys.readouterr().out) == {"changed": True, "run_id": RUN, "port": port}
    assert supervisor.record_run(rdzv_store.SERVICE, port, sd, RUN)["changed"] is False  # the same again
    assert rdzv_store.status(port, sd)["run_id"] == RUN
    (sd / f"store-{port}.json").unlink()  # found by its port from now on
    st = rdzv_store.status(port, sd)
    assert st["recorded"] is False and st["run_id"] == RUN, st
    line = _table().store_line(st)
    sup = started["supervisor_pid"]
    assert line == (f"rendezvous store: running on port {port} at 127.0.0.1 (answering, supervisor pid {sup},"
                    f" restarts ?, serving run {RUN}; a ddp-lab store of this checkout (supervisor pid {sup})"
                    " with no pidfile)"), line
    assert rdzv_store.stop(port, sd)["changed"]
    assert not (sd / f"store-{port}.run.json").exists()  # gone with the store


def test_a_record_of_an_earlier_process_on_the_port_is_not_taken(store):
    port, sd, started = store
    record = sd / f"store-{port}.run.json"
    earlier = {"run_id": RUN, "pid": started["supervisor_pid"], "ctime": 1.0, "since": 1.0}  # pid reused
    record.write_text(json.dumps(earlier))
    assert rdzv_store.status(port, sd)["run_id"] is None
    assert "serving run" not in _table().store_line(rdzv_store.status(port, sd))


def test_another_checkouts_store_says_which_run_by_its_own_record(store, tmp_path):
    port, theirs, started = store
    supervisor.record_run(rdzv_store.SERVICE, port, theirs, RUN)
    st = rdzv_store.status(port, tmp_path / "mine" / ".rdzv")
    assert st["running"] is False and st["owner"] == "other", st
    assert st["held_by"].endswith(f"; supervisor pid {started['supervisor_pid']}; serving run {RUN})"), st


def test_serves_without_a_store_of_this_checkout_records_nothing(tmp_path):
    port = free_port()
    out = supervisor.record_run(rdzv_store.SERVICE, port, tmp_path, RUN)
    assert out["changed"] is False, out
    assert out["note"].startswith(f"no store of this checkout runs on port {port}"), out
    assert not list(tmp_path.iterdir())


def test_without_a_record_the_run_whose_running_agents_point_at_the_port():
    table = _table()
    doc = {"running": True, "answering": True, "host": "10.89.0.1", "port": 29400, "supervisor_pid": None,
           "restarts": None, "recorded": False, "run_id": None}

    def node(state, endpoint):
        return {"state": state, "unit_holds_run": True, "endpoints": {"store": endpoint, "lighthouse": None}}

    nodes = {"laptop-a": node("running", "10.89.0.1:29400"), "laptop-b": node("running", "10.89.0.1:29400")}
    assert table.with_served_run(doc, nodes, "store", RUN)["run_id"] == RUN
    assert f"serving run {RUN}" in table.store_line(table.with_served_run(doc, nodes, "store", RUN))
    other_port = {"laptop-a": node("running", "10.89.0.1:29401")}
    ended = {"laptop-a": node("succeeded", "10.89.0.1:29400")}
    for others in (other_port, ended, {}):
        assert table.with_served_run(doc, others, "store", RUN)["run_id"] is None, others
    recorded = {**doc, "run_id": "20261201-000000-aaaa"}  # the record wins: the newest launch's
    assert table.with_served_run(recorded, nodes, "store", RUN)["run_id"] == "20261201-000000-aaaa"


def test_status_playbook_line_names_the_run_of_a_store_found_by_its_port(tmp_path):
    from test_status_table import _case, _play

    inv, env = _case(tmp_path, {"laptop-x": "ended"}, unreachable=False)
    sd = tmp_path / "rdzv"
    with _supervised(sd) as (port, started):
        supervisor.record_run(rdzv_store.SERVICE, port, sd, RUN)
        (sd / f"store-{port}.json").unlink()
        out = _play(inv, env, "status.yml", f"rendezvous_port={port}")
        text = out.stdout + out.stderr
        assert out.returncode == 0, text[-3000:]
        line = next(x for x in text.splitlines() if x.lstrip().startswith("rendezvous store"))
        sup = started["supervisor_pid"]
        assert f"(answering, supervisor pid {sup}, restarts ?, serving run {RUN};" in line, line
