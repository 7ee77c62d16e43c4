"""status.yml under both recovery engines: the heading names the engine, and the torchft lighthouse's
line (per_step) shows its state and quorum (action plugin ddp_lab.cluster.ddp_job_status_table,
ddplab.status.node_progress)."""

from __future__ import annotations

import test_status_table as t
from ddplab import status as st

LIGHTHOUSE = {
    "running": True,
    "answering": True,
    "host": "10.89.0.1",
    "port": 29510,
    "supervisor_pid": 88,
    "restarts": 0,
    "quorum_id": 4,
    # torchft's Manager appends ":<uuid>" to the replica id it is given (the node's name)
    "participants": [{"replica_id": "laptop-a:3f2a6c1e-8d6b-4c1e-9a57-0b7e2d4f5a61", "step": 12},
                     {"replica_id": "laptop-c", "step": 12}],
}
STORE = {
    "running": True,
    "answering": True,
    "host": "10.89.0.1",
    "port": 29400,
    "supervisor_pid": 77,
    "restarts": 0,
}


def per_step(records: list[dict]) -> list[dict]:
    return [{**r, "engine": "per_step"} if r["event"] == "start" else r for r in records]


def test_node_progress_names_the_engine():
    assert st.node_progress(per_step(t.recs("laptop-a", 0, 3)))["engine"] == "per_step"
    assert st.node_progress(t.recs("laptop-a", 0, 3))["engine"] == "torchelastic"  # start without it
    assert st.node_progress([])["engine"] is None


def test_per_step_table_shows_engine_and_lighthouse():
    rows = [
        t.table.row_of(h, t.watch_result(h, t.UNITS["running"], per_step(t.recs(h, r, 10))))
        for h, r in (("laptop-a", 0), ("laptop-c", 1))
    ]
    text = t.table.render(rows, STORE, "r1", width=200, lighthouse=LIGHTHOUSE)
    lines = text.splitlines()
    assert lines[0].strip() == "run r1 (engine per_step)"
    assert lines[-2].startswith("rendezvous store: running on port 29400")
    assert lines[-1] == (
        "torchft lighthouse: running on port 29510 at 10.89.0.1 (answering, supervisor pid 88, "
        "restarts 0, quorum id 4, participants laptop-a, laptop-c)"
    )
    # per_step with the lighthouse down: its line says so
    down = t.table.render(rows, STORE, "r1", width=200, lighthouse={"running": False, "port": 29510})
    assert down.splitlines()[-1] == "torchft lighthouse: stopped (port 29510)"
    # per_step starts no controller store (roles/rendezvous): no store line when none runs
    no_store = t.table.render(rows, {"running": False, "port": 29400}, "r1", width=200, lighthouse=LIGHTHOUSE)
    assert "rendezvous store" not in no_store
    assert no_store.splitlines()[-1].startswith("torchft lighthouse: running")


def test_torchelastic_table_has_no_lighthouse_line():
    rows = [
        t.table.row_of("laptop-a", t.watch_result("laptop-a", t.UNITS["running"], t.recs("laptop-a", 0, 5)))
    ]
    text = t.table.render(rows, STORE, "r1", width=200, lighthouse={"running": False, "port": 29510})
    assert text.splitlines()[0].strip() == "run r1 (engine torchelastic)"
    assert "lighthouse" not in text
    assert (
        t.table.engine_of([{"engine": "per_step"}, {"engine": "torchelastic"}, {"engine": ""}])
        == "per_step/torchelastic"
    )
