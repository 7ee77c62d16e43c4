"""per_step: a run the group finished is ``finished`` although a laptop ended cut off from it.

Fixture: the first launch of the newcomer's lab run 20261201-091704-9e9b (records before its
resume): laptop-c partitioned for 200 s at step 58; laptop-a and laptop-b finished 500/500 at 2
participants; laptop-c, back after they had finished, was cut off (quorum 3 -> 128), trained
nothing alone and ended with ``failure`` records (cause ``cut_off``) after their ``end``
records, its torchrun restarts writing ``start`` records after them too. summary.json and the
report called it ``failed`` (the newest ``start`` came after every ``end``), while
docs/running.md says such a run counts as finished.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from ddplab.controller import summary as summary_mod
from ddplab.controller.report.data import run_status
from ddplab.controller.rundir import cut_off_nodes, load_run
from ddplab.runstate import launch_since, run_outcome

FIXTURE = Path(__file__).parent / "fixtures" / "per_step_cut_off_9e9b"


def copy_run(tmp_path: Path, events: bool = True) -> Path:
    run = tmp_path / "20261201-091704-9e9b"
    shutil.copytree(FIXTURE, run)
    if not events:
        (run / "events.jsonl").unlink()
    return run


def test_a_run_the_group_finished_is_finished_with_the_cut_off_laptop_named(tmp_path):
    run = load_run(copy_run(tmp_path))
    assert run_outcome(run.records, run.events) == "finished"
    assert run_status(run, [], [])[0] == (  # the report's badge
        "finished; laptop-c: cut off from the group at step 58 (cut off from quorum 3 to quorum 128); "
        "nothing trained alone, its state and checkpoints kept (not the run's result)")
    summary = summary_mod.build_summary(run.path)
    assert summary["outcome"] == "finished" and summary["steps_completed"] == 500
    [cut] = summary["cut_off"]
    assert (cut["host"], cut["step"]) == ("laptop-c", 58)
    assert (cut["last_group_quorum_id"], cut["quorum_id"]) == (3, 128)
    assert "nothing trained alone" in cut["error"]
    text = summary_mod.human_summary(summary)
    assert text.splitlines()[0].endswith("500/500 steps on 3 node(s) (laptop-a, laptop-b, laptop-c) "
                                         "- finished")
    assert ("laptop-c: cut off from the group at step 58 (cut off from quorum 3 to quorum 128); "
            "nothing trained alone") in text


def test_without_events_the_first_attempts_start_the_launch(tmp_path):
    run = load_run(copy_run(tmp_path, events=False))
    assert run_outcome(run.records, run.events) == "finished"


def test_a_run_where_no_replica_reached_max_steps_stays_failed(tmp_path):
    path = copy_run(tmp_path)
    for host in ("laptop-a", "laptop-b"):  # the survivors cut off too, before the end
        metrics = path / host / "metrics" / f"{host}-local0.jsonl"
        lines = [json.loads(x) for x in metrics.read_text().splitlines()]
        end = next(r for r in lines if r["event"] == "end")
        kept = [r for r in lines if r["event"] != "end" and r.get("step", 0) <= 400]
        kept.append({**end, "event": "failure", "step": 400, "cause": "cut_off",
                     "error": "CutOffError: ...", "last_group_quorum_id": 9, "quorum_id": 12})
        metrics.write_text("".join(json.dumps(r) + "\n" for r in kept))
    run = load_run(path)
    assert run_outcome(run.records, run.events) == "failed"
    cut = [c["host"] for c in cut_off_nodes(run.per_host, run.events)]
    assert cut == ["laptop-a", "laptop-b", "laptop-c"]


def test_a_node_back_in_the_group_after_a_cut_off_is_not_named(tmp_path):
    path = copy_run(tmp_path)
    metrics = path / "laptop-c" / "metrics" / "laptop-c-local0.jsonl"
    lines = [json.loads(x) for x in metrics.read_text().splitlines()]
    lines.append({**lines[0], "time": lines[-1]["time"] + 5, "restart_count": 11})  # started again
    metrics.write_text("".join(json.dumps(r) + "\n" for r in lines))
    run = load_run(path)
    assert cut_off_nodes(run.per_host, run.events) == []


def test_status_reads_the_cut_off_laptop_of_a_finished_run_as_cut_off_not_failed():
    """status.yml agreed with nothing: laptop-c 'failed' and exit 2 ('not every laptop is well')
    for a run the others finished (the lab run of d73aa7e, 20261201-111059-197a, too)."""
    from ansible_collections.ddp_lab.cluster.plugins.action import ddp_job_status_table as table
    from ddplab import status as st

    units = {"ended": {"LoadState": "loaded", "ActiveState": "active", "SubState": "exited",
                       "Result": "success", "ExecMainStatus": "0", "MainPID": "0"},
             "failed": {"LoadState": "loaded", "ActiveState": "failed", "SubState": "failed",
                        "Result": "exit-code", "ExecMainStatus": "1", "MainPID": "0"}}
    run = load_run(FIXTURE)

    def node(host: str, unit: str, records: list[dict]) -> dict:
        return {"state": st.job_state(units[unit], records), "progress": st.node_progress(records),
                "unit": units[unit]}

    nodes = {h: node(h, "failed" if h == "laptop-c" else "ended", run.per_host[h]) for h in run.per_host}
    rows = table.rows_of(nodes)
    assert [r["agent"] for r in rows] == ["ended", "ended", "cut off"]
    assert rows[2]["last failure"].startswith("cut_off: CutOffError: replica laptop-c was cut off")
    assert table.bad_nodes(rows) == []
    # no laptop finished: the cut-off one stays failed (status.yml fails)
    alone = {"laptop-c": nodes["laptop-c"]}
    rows = table.rows_of(alone)
    assert table.bad_nodes(rows) == ["laptop-c: failed"]


def _ps(host: str, event: str, t: float, **kw) -> dict:
    return {"event": event, "time": t, "host": host, "local_rank": 0, "engine": "per_step", **kw}


def test_launch_since_without_events_and_no_first_attempt_start_is_the_oldest_start():
    """Every start a torchrun restart (restart_count > 0), no launch/resume event: max() of an empty
    sequence (ValueError) crashed summary build and the report."""
    assert launch_since([_ps("laptop-a", "start", 1, restart_count=2)], []) == 1
    records = [_ps("laptop-a", "start", 1, restart_count=2), _ps("laptop-a", "step", 2, step=1),
               _ps("laptop-a", "end", 3, step=1)]
    assert run_outcome(records, []) == "finished"


def test_without_events_a_rejoined_agents_start_is_no_launch():
    """A rejoined agent starts at restart_count 0 after its peers finished: its start is not the
    launch (before: the peers' end records fell before it and the run read 'failed')."""
    records = [_ps(h, "start", 0, restart_count=0) for h in ("laptop-a", "laptop-b", "laptop-c")]
    records += [_ps(h, "step", 10, step=1) for h in ("laptop-a", "laptop-b", "laptop-c")]
    records += [_ps(h, "end", 100, step=50) for h in ("laptop-a", "laptop-b")]
    records += [_ps("laptop-c", "start", 120, restart_count=0),
                _ps("laptop-c", "failure", 150, step=1, cause="cut_off", restart_count=0)]
    assert launch_since(records, []) == 0
    assert run_outcome(records, []) == "finished"
    # with the launch event, the launch is the event's time
    assert launch_since(records, [{"kind": "launch", "time": -1.0}]) == -1.0


def test_cut_off_line_of_a_replica_that_never_had_a_group_quorum():
    """Before: 'no quorum for 122 s after quorum None'."""
    never = {"host": "laptop-c", "step": 0, "last_group_quorum_id": None, "quorum_id": None,
             "unreachable_s": 122.4}
    line = summary_mod.cut_off_line(never)
    assert "None" not in line
    assert line.startswith("laptop-c: cut off from the group at step 0 (no quorum for 122 s, never in a "
                           "group quorum); ")
    assert "(in quorum 7, never in a group quorum)" in summary_mod.cut_off_line({**never, "quorum_id": 7})
    assert "(no quorum for 122 s after quorum 3)" in summary_mod.cut_off_line(
        {**never, "last_group_quorum_id": 3})
    assert "(cut off from quorum 3 to quorum 9)" in summary_mod.cut_off_line(
        {**never, "last_group_quorum_id": 3, "quorum_id": 9})
