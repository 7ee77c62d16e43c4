""""Did the group finish the run" has one home, ddplab.records.group_finished: the collected run's
outcome (ddplab.runstate.run_outcome), a node's state (ddplab.status: ``finished``,
job_state without systemd, past_run_state) and the status table's cut-off rows agree.

Before, each decided it on its own: node_progress's ``finished`` and job_state without systemd
counted an ``end`` record of an earlier launch of a resumed run (the run said finished while its
newest launch trained on), and the table's cut-off rule asked whether another row read ``ended``
(its agent unit's exit), not whether the group reached max_steps.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from ansible_collections.ddp_lab.cluster.plugins.action import ddp_job_status_table as table_plugin
from ddplab import status as st
from ddplab.records import group_finished, newest_start_time
from ddplab.runstate import run_outcome

ROOT = Path(__file__).resolve().parent.parent


def _table():
    return table_plugin


def rec(event: str, t: float | None, **kw) -> dict:
    out = {"event": event, "host": "laptop-a", "rank": 0, "local_rank": 0, "world_size": 2,
           "restart_count": 0, **kw}
    if t is not None:
        out["time"] = t
    return out


START = rec("start", 1.0, max_steps=10)
CASES = {
    "ended": ([START, rec("step", 2.0, step=10, loss=2.0), rec("end", 3.0, step=10)], True),
    "failed": ([START, rec("step", 2.0, step=4, loss=2.0), rec("failure", 3.0, step=4, error="boom")], False),
    "still training": ([START, rec("step", 2.0, step=4, loss=2.0)], False),
    # a finished run resumed with more steps: the earlier launch's end record does not count
    "resumed after its end": ([START, rec("step", 2.0, step=10, loss=2.0), rec("end", 3.0, step=10),
                               rec("start", 10.0, max_steps=20, resumed_from_step=10),
                               rec("step", 11.0, step=11, loss=1.9)], False),
    "an end record without a time": ([START, rec("step", 2.0, step=10, loss=2.0), rec("end", None, step=10)],
                                     True),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_run_outcome_and_the_node_state_agree_on_whether_the_group_finished(case):
    records, finished = CASES[case]
    assert group_finished(records, newest_start_time(records)) is finished
    assert (run_outcome(records, []) == "finished") is finished, case
    assert (st.past_run_state(records) == "succeeded") is finished, case
    assert st.node_progress(records)["finished"] is finished, case
    # without systemd (no unit information) the records decide the job's state
    assert st.job_state({}, records) == ("succeeded" if finished else "running"), case


UNITS = {"failed": {"LoadState": "loaded", "ActiveState": "failed", "SubState": "failed",
                    "Result": "exit-code", "ExecMainStatus": "1", "MainPID": "0"},
         "ended": {"LoadState": "loaded", "ActiveState": "active", "SubState": "exited",
                   "Result": "success", "ExecMainStatus": "0", "MainPID": "0"}}


def _node(host: str, unit: str, records: list[dict]) -> dict:
    records = [{**r, "host": host, "engine": "per_step"} for r in records]
    return {"state": st.job_state(UNITS[unit], records), "progress": st.node_progress(records),
            "unit": UNITS[unit]}


CUT = rec("failure", 3.5, step=4, cause="cut_off", error="CutOffError: replica laptop-c was cut off")


def test_a_cut_off_replica_reads_cut_off_when_the_group_finished_whatever_the_finishers_unit_says():
    """laptop-a reached max_steps (its end record) and its agent unit then failed (an error after
    the end record): the group finished the run, as summary.json says, so laptop-c, cut off from
    it, reads ``cut off`` (before: ``failed``, no row read ``ended``)."""
    table = _table()
    nodes = {"laptop-a": _node("laptop-a", "failed", CASES["ended"][0]),
             "laptop-c": _node("laptop-c", "failed", [START, rec("step", 2.0, step=4, loss=2.0), CUT])}
    rows = table.rows_of(nodes)
    assert [r["agent"] for r in rows] == ["failed", "cut off"]


def test_a_cut_off_replica_stays_failed_when_no_replica_reached_max_steps():
    """laptop-a's unit exited 0 but no replica wrote an end record (the group did not finish:
    summary.json says failed): laptop-c stays ``failed`` (before: ``cut off``, a row read ``ended``)."""
    table = _table()
    nodes = {"laptop-a": _node("laptop-a", "ended", CASES["still training"][0]),
             "laptop-c": _node("laptop-c", "failed", [START, rec("step", 2.0, step=4, loss=2.0), CUT])}
    rows = table.rows_of(nodes)
    assert [r["agent"] for r in rows] == ["ended", "failed"]
    assert table.bad_nodes(rows) == ["laptop-c: failed"]
