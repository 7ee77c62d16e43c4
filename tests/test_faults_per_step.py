"""ddplab.faults under the per_step engine (torchft): survivors are not restarted, recovery is the
first committed step at the new participant count, uncommitted steps never count (issue 13 item 3)."""

import pytest
from ddplab import faults
from test_faults import ABC, T0, Run

AB = ("laptop-a", "laptop-b")
PS = {"engine": "per_step"}


@pytest.fixture
def run(tmp_path):
    return Run(tmp_path)


def start(run, hosts, time, **kw):
    for h in hosts:  # each replica group's own torchrun: rank 0, world size 1 at start
        run.rec(h, "start", time, 0, 1, resumed_from_step=0, samples_seen=0, **PS, **kw)


def steps(run, hosts, first, last, t_first, dt=1.0, quorum_id=1, committed=True):
    for s in range(first, last + 1):
        for rank, h in enumerate(hosts):
            run.rec(
                h,
                "step",
                t_first + (s - first) * dt + 0.001 * rank,
                rank,
                len(hosts),
                step=s,
                loss=3.0,
                step_time_s=dt,
                participants=len(hosts),
                quorum_id=quorum_id,
                committed=committed,
                **PS,
            )


def test_kill_agent_survivors_commit_at_two_without_restart(run):
    start(run, ABC, T0 - 1)
    steps(run, ABC, 1, 20, T0)  # step 20 at T0+19
    run.fault("kill-agent", "laptop-c", T0 + 19.5, rank=2)
    for rank, h in enumerate(AB):  # the vote failed (uncommitted, the old participants): retried
        run.rec(
            h,
            "step",
            T0 + 20.0 + 0.001 * rank,
            rank,
            3,
            step=21,
            participants=3,
            quorum_id=1,
            committed=False,
            **PS,
        )
    steps(run, AB, 21, 30, T0 + 20.6, quorum_id=2)
    (m,) = run.measures()
    assert m.outcome == "recovered"
    assert m.detected_s == pytest.approx(0.5) and m.detected_by == "uncommitted step on laptop-a"
    assert m.recovered_s == pytest.approx(1.1)
    assert (m.world_size_before, m.world_size_after) == (3, 2)
    assert (m.last_step_before, m.resumed_from_step, m.steps_lost) == (20, 21, 0)
    assert m.restarts == 0  # no survivor restarted
    assert m.stall_s == pytest.approx(1.6, abs=0.01)  # committed step 20 at +19 -> 21 at +20.6


def test_rejoin_counts_the_new_replica_only(run):
    start(run, ABC, T0 - 1)
    steps(run, AB, 1, 10, T0)
    run.fault("rejoin", "laptop-c", T0 + 10.0)
    start(run, ["laptop-c"], T0 + 13.0)
    steps(run, AB, 11, 13, T0 + 10.0)
    steps(run, ABC, 14, 20, T0 + 14.5, quorum_id=3)
    (m,) = run.measures()
    assert (m.outcome, m.world_size_before, m.world_size_after) == ("recovered", 2, 3)
    assert m.recovered_s == pytest.approx(4.5) and m.steps_lost == 0
    assert m.restarts == 1 and m.detected_by == "start on laptop-c"


def test_a_lost_step_is_counted_when_the_group_goes_back(run):
    start(run, ABC, T0 - 1)
    steps(run, ABC, 1, 20, T0)
    run.fault("poweroff", "laptop-a", T0 + 19.5, rank=0)
    steps(run, ("laptop-b", "laptop-c"), 19, 25, T0 + 21.0, quorum_id=2)  # restarted from step 19
    (m,) = run.measures()
    assert (m.resumed_from_step, m.steps_lost) == (19, 2)


def test_throttle_without_a_quorum_change_is_ridden_out(run):
    start(run, ABC, T0 - 1)
    steps(run, ABC, 1, 10, T0)
    run.fault("throttle", "laptop-b", T0 + 9.5, duration_s=5)
    steps(run, ABC, 11, 20, T0 + 10.0, dt=2.0)
    (m,) = run.measures()
    assert m.outcome == "continued" and m.recovered_s is None and m.steps_lost == 0
    assert m.step_time_ratio == pytest.approx(2.0)


def test_uncommitted_steps_are_never_completed_steps():
    recs = [
        {"event": "step", "step": 5, "time": 1.0, "host": "a"},
        {"event": "step", "step": 6, "time": 2.0, "host": "a", "committed": False},
        {"event": "step", "step": 6, "time": 3.0, "host": "a", "committed": True},
    ]
    assert [r["time"] for r in faults._steps(recs)] == [1.0, 3.0]
    assert faults.is_per_step([{"engine": "per_step"}]) and not faults.is_per_step(recs)


def test_summary_names_the_engine_and_counts_restarted_processes(run):
    """Every replica group's torchrun starts its worker as rank 0: counting rank-0 starts as group
    restarts (torchelastic's rule) would call three first starts two restarts."""
    from ddplab.controller import summary as sm

    start(run, ABC, T0 - 1)
    steps(run, ABC, 1, 10, T0)
    run.fault("kill-agent", "laptop-c", T0 + 9.5)
    steps(run, AB, 11, 15, T0 + 10.5, quorum_id=2)
    start(run, ["laptop-c"], T0 + 16)  # rejoined: one new process
    steps(run, ABC, 16, 20, T0 + 17, quorum_id=3)
    s = sm.build_summary(run.dir)
    assert s["engine"] == "per_step" and s["restarts"] == 1
    assert [e["world_size"] for e in s["world_size_timeline"]][-2:] == [2, 3]
    text = sm.human_summary(s)
    assert "participants: " in text and "processes restarted: 1 (engine per_step)" in text
    assert sm.run_engine([{"event": "start", "time": 1.0}]) == "torchelastic"


def test_report_says_which_engine_ran(run):
    from ddplab.controller.report import build_report

    start(run, ABC, T0 - 1)
    steps(run, ABC, 1, 10, T0)
    run.fault("poweroff", "laptop-a", T0 + 9.5, rank=0)
    steps(run, ("laptop-b", "laptop-c"), 11, 20, T0 + 10.6, quorum_id=2)
    path, _ = build_report(run.dir)
    html = path.read_text()
    assert "Recoveries (engine per_step)" in html and "Participants (engine per_step)" in html
    assert "<th>participants</th>" in html


def test_a_stop_ends_the_measurement_window(run):
    """stop.yml after a freeze that was ridden out: the survivors' restart during the stop is no
    recovery (seen in benchmarks/recovery.py: torchelastic freeze 30 s 'recovered' 111 s later)."""
    run.start(ABC, T0 - 1)
    run.steps(ABC, 1, 60, T0)
    run.fault("freeze", "laptop-a", T0 + 9.5, rank=0, duration_s=30)
    with (run.dir / "events.jsonl").open("a") as fh:
        fh.write('{"time": %f, "kind": "stop"}\n' % (T0 + 60.5))
    run.failure("laptop-b", T0 + 60.6, 1, 3, step=60)
    run.start(["laptop-c"], T0 + 66.0, resumed_from_step=60, restart_count=1)
    run.steps(["laptop-c"], 61, 62, T0 + 67.0)
    (m,) = run.measures()
    assert m.outcome == "continued" and m.recovered_s is None and m.restarts == 0


def test_a_throttle_closed_by_the_next_fault_continued_under_per_step(run):
    """The next injection 20 s into a 90 s throttle: the replicas committed steps in its window at
    the same participant count; that is training through it, not 'not recovered'."""
    start(run, ABC, T0 - 1)
    steps(run, ABC, 1, 10, T0)
    run.fault("throttle", "laptop-c", T0 + 9.5, rank=2, duration_s=90)
    steps(run, ABC, 11, 30, T0 + 10.0)
    run.fault("kill-agent", "laptop-a", T0 + 29.8, rank=0)
    steps(run, ("laptop-b", "laptop-c"), 31, 40, T0 + 31.0, quorum_id=2)
    throttle, kill = run.measures()
    assert (throttle.outcome, throttle.world_size_after, throttle.steps_lost) == ("continued", 3, 0)
    assert throttle.notes == ["trained on through it, steps 12->30; its window closed at +20.3 s by"
                              " kill-agent of laptop-a, before its 90 s were over"]
    assert (kill.outcome, kill.world_size_after) == ("recovered", 2)
