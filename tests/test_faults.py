"""Recovery measurement (ddplab.faults) on synthetic run folders, one per fault mode.

Each test writes what a real run leaves on the controller -- runs/<run_id>/<host>/metrics/*.jsonl
with the CONTRACTS.md records and events.jsonl with the injections -- and checks the measured entry.
"""

import json

import pytest
from ddplab import faults
from ddplab.controller import rundir
from ddplab.controller import summary as sm

T0 = 1_000.0  # time of step 1


class Run:
    """Builder of a synthetic run folder: workers append records, the play appends events."""

    def __init__(self, root, run_id="r1"):
        self.dir = root / run_id
        self.dir.mkdir(parents=True)
        self.rc = {}

    def rec(self, host, event, time, rank, world_size, **fields):
        rc = fields.pop("restart_count", self.rc.get(host, 0))
        self.rc[host] = rc
        r = {"event": event, "time": time, "host": host, "rank": rank, "local_rank": 0,
             "world_size": world_size, "restart_count": rc, **fields}
        path = self.dir / host / "metrics" / f"{host}-local0.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a") as fh:
            fh.write(json.dumps(r) + "\n")

    def start(self, hosts, time, resumed_from_step=0, restart_count=None):
        for rank, h in enumerate(hosts):
            kw = {} if restart_count is None else {"restart_count": restart_count}
            self.rec(h, "start", time, rank, len(hosts), resumed_from_step=resumed_from_step,
                     samples_seen=0, batch_policy="keep_per_rank", **kw)

    def steps(self, hosts, first, last, t_first, dt=1.0, step_time=None):
        """Steps first..last (inclusive) by ``hosts``; step s completes at t_first + (s - first) * dt."""
        for s in range(first, last + 1):
            t = t_first + (s - first) * dt
            for rank, h in enumerate(hosts):
                self.rec(h, "step", t + 0.001 * rank, rank, len(hosts), step=s, loss=3.0,
                         step_time_s=step_time or dt, compute_s=0.5, allreduce_s=0.5)

    def failure(self, host, time, rank, world_size, step, saved=True, error="gloo: Connection reset by peer"):
        self.rec(host, "failure", time, rank, world_size, step=step, error=error, saved=saved)

    def fault(self, mode, node, time, rank=None, duration_s=None):
        with (self.dir / "events.jsonl").open("a") as fh:
            fh.write(json.dumps({"time": time, "kind": "fault", "mode": mode, "node": node, "rank": rank,
                                 "duration_s": duration_s}) + "\n")

    def measures(self):
        return faults.measure_all(rundir.load_events(self.dir), rundir.load_run(self.dir).records)


ABC = ("laptop-a", "laptop-b", "laptop-c")
AB = ("laptop-a", "laptop-b")


@pytest.fixture
def run(tmp_path):
    return Run(tmp_path)


def test_kill_agent_three_to_two_with_emergency_checkpoint(run):
    run.start(ABC, T0 - 1)
    run.steps(ABC, 1, 20, T0)                       # step 20 at T0+19
    run.fault("kill-agent", "laptop-c", T0 + 19.5, rank=2)
    run.failure("laptop-a", T0 + 19.8, 0, 3, step=20)
    run.failure("laptop-b", T0 + 19.9, 1, 3, step=20)
    run.start(AB, T0 + 24.0, resumed_from_step=20, restart_count=1)
    run.steps(AB, 21, 30, T0 + 25.0)
    (m,) = run.measures()
    assert (m.mode, m.node, m.rank, m.outcome) == ("kill-agent", "laptop-c", 2, "recovered")
    assert m.detected_s == pytest.approx(0.3)
    assert m.detected_by == "failure on laptop-a"
    assert m.recovered_s == pytest.approx(5.5)
    assert (m.world_size_before, m.world_size_after) == (3, 2)
    assert (m.last_step_before, m.resumed_from_step, m.steps_lost) == (20, 20, 0)
    assert m.restarts == 2
    assert m.stall_s == pytest.approx(6.0, abs=0.01)       # step 20 at +19 -> step 21 at +25
    d = m.to_dict()
    for key in ("mode", "node", "rank", "injected_at", "detected_s", "recovered_s", "steps_lost",
                "world_size_before", "world_size_after"):
        assert key in d
    json.dumps(d)


def test_steps_lost_counts_from_the_failure_records_step_not_the_sparse_step_log(run):
    """log_interval 5: step records at 5, 10, 15; the failure says step 17 was the last completed;
    the group resumes from the periodic checkpoint of step 15 -> 2 steps lost."""
    run.start(ABC, T0 - 1)
    for s in (5, 10, 15):
        run.steps(ABC, s, s, T0 + s)
    run.fault("poweroff", "laptop-b", T0 + 17.5, rank=1)
    run.failure("laptop-a", T0 + 18, 0, 3, step=17, saved=False)
    run.start(("laptop-a", "laptop-c"), T0 + 22, resumed_from_step=15, restart_count=1)
    run.steps(("laptop-a", "laptop-c"), 20, 20, T0 + 27)
    (m,) = run.measures()
    assert (m.last_step_before, m.resumed_from_step, m.steps_lost) == (17, 15, 2)
    assert m.recovered_s == pytest.approx(9.5)


def test_rejoin_two_to_three_without_spending_restarts(run):
    run.start(AB, T0 - 1, restart_count=1)
    run.steps(AB, 1, 10, T0)
    run.fault("rejoin", "laptop-c", T0 + 9.2)
    # membership change: the agents restart their workers, restart_count unchanged
    run.start(ABC, T0 + 12.0, resumed_from_step=10, restart_count=None)
    run.rc["laptop-c"] = 0
    run.steps(ABC, 11, 15, T0 + 13.0)
    (m,) = run.measures()
    assert m.outcome == "recovered"
    assert (m.world_size_before, m.world_size_after) == (2, 3)
    assert m.detected_s == pytest.approx(2.8)
    assert m.detected_by.startswith("start on")
    assert m.recovered_s == pytest.approx(3.8)
    assert m.steps_lost == 0


def test_rejoin_loses_the_steps_after_the_last_checkpoint_without_an_emergency_save(run):
    run.start(AB, T0 - 1)
    run.steps(AB, 1, 18, T0)
    run.fault("rejoin", "laptop-c", T0 + 17.5)
    run.start(ABC, T0 + 20.0, resumed_from_step=15)
    run.steps(ABC, 16, 18, T0 + 21.0)
    (m,) = run.measures()
    assert (m.last_step_before, m.resumed_from_step, m.steps_lost) == (18, 15, 3)


def test_freeze_longer_than_the_pg_timeout_shrinks_then_regrows(run):
    run.start(ABC, T0 - 1)
    run.steps(ABC, 1, 10, T0)
    run.fault("freeze", "laptop-c", T0 + 9.5, rank=2, duration_s=90)
    # the survivors give up on the silent peer after the gloo timeout (60 s)
    run.failure("laptop-a", T0 + 69.6, 0, 3, step=10, error="gloo: Timed out waiting 60000ms")
    run.failure("laptop-b", T0 + 69.7, 1, 3, step=10, error="gloo: Timed out waiting 60000ms")
    run.start(AB, T0 + 75.0, resumed_from_step=10, restart_count=1)
    run.steps(AB, 11, 30, T0 + 76.0)
    # laptop-c wakes up at T0+99.5, fails, rejoins: the group grows back to 3
    run.failure("laptop-c", T0 + 100.0, 2, 3, step=10)
    run.start(ABC, T0 + 104.0, resumed_from_step=30, restart_count=1)
    run.steps(ABC, 31, 35, T0 + 105.0)
    (m,) = run.measures()
    assert m.outcome == "recovered"
    assert m.detected_s == pytest.approx(60.1)
    assert m.recovered_s == pytest.approx(66.5)
    assert (m.world_size_before, m.world_size_after, m.steps_lost) == (3, 2, 0)
    assert m.restarts == 5
    assert m.step_time_ratio is None or m.step_time_ratio > 0


def test_short_freeze_is_ridden_out_without_restart(run):
    run.start(ABC, T0 - 1)
    run.steps(ABC, 1, 10, T0)
    run.fault("freeze", "laptop-a", T0 + 9.5, rank=0, duration_s=8)
    run.steps(ABC, 11, 20, T0 + 18.0)              # step 11 completes once laptop-a is continued
    (m,) = run.measures()
    assert m.outcome == "continued"
    assert m.detected_s is None and m.recovered_s is None
    assert (m.world_size_before, m.world_size_after, m.steps_lost, m.restarts) == (3, 3, 0, 0)
    assert m.stall_s == pytest.approx(9.0, abs=0.01)


def test_partition_shrinks_to_the_connected_pair(run):
    run.start(ABC, T0 - 1)
    run.steps(ABC, 1, 12, T0)
    run.fault("partition", "laptop-b", T0 + 11.4, rank=1, duration_s=120)
    run.failure("laptop-b", T0 + 31.0, 1, 3, step=12, error="gloo: Connection closed by peer")
    run.failure("laptop-a", T0 + 71.4, 0, 3, step=12, error="gloo: Timed out")
    run.start(("laptop-a", "laptop-c"), T0 + 75.0, resumed_from_step=12, restart_count=1)
    run.steps(("laptop-a", "laptop-c"), 13, 20, T0 + 76.5)
    (m,) = run.measures()
    assert m.detected_s == pytest.approx(19.6)
    assert m.detected_by == "failure on laptop-b"
    assert m.recovered_s == pytest.approx(76.5 - 11.4)
    assert (m.world_size_before, m.world_size_after, m.steps_lost) == (3, 2, 0)


def test_kill_worker_restarts_at_the_same_world_size(run):
    run.start(ABC, T0 - 1)
    run.steps(ABC, 1, 10, T0)
    run.fault("kill-worker", "laptop-c", T0 + 9.3, rank=2)
    run.failure("laptop-a", T0 + 9.4, 0, 3, step=10)
    run.failure("laptop-b", T0 + 9.4, 1, 3, step=10)
    run.rc["laptop-c"] = 1                          # torchrun restarts c's worker: restart_count 1
    run.start(ABC, T0 + 12.0, resumed_from_step=10)
    run.steps(ABC, 11, 14, T0 + 13.0)
    (m,) = run.measures()
    assert m.outcome == "recovered"
    assert (m.world_size_before, m.world_size_after, m.steps_lost) == (3, 3, 0)
    assert m.detected_s == pytest.approx(0.1)
    assert m.recovered_s == pytest.approx(3.7)


def test_detection_by_a_higher_restart_count_when_no_start_or_failure_record(run):
    run.start(ABC, T0 - 1)
    run.steps(ABC, 1, 5, T0)
    run.fault("kill-worker", "laptop-a", T0 + 4.5)
    run.rec("laptop-a", "val", T0 + 6.0, 0, 3, restart_count=1, step=5, val_loss=2.0, train_loss=2.0)
    (m,) = run.measures()
    assert m.detected_s == pytest.approx(1.5)
    assert m.detected_by == "val on laptop-a"


def test_restarts_exhausted_ends_without_recovery_and_names_the_cause(run):
    run.start(ABC, T0 - 1)
    run.steps(ABC, 1, 8, T0)
    run.fault("kill-worker", "laptop-b", T0 + 7.5, rank=1)
    for k, t in enumerate((T0 + 8.0, T0 + 12.0), start=1):
        run.failure("laptop-a", t, 0, 3, step=8)
        run.failure("laptop-b", t + 0.1, 1, 3, step=8, error="RuntimeError: worker killed")
        run.start(ABC, t + 2.0, resumed_from_step=8, restart_count=k)
    run.failure("laptop-b", T0 + 16.0, 1, 3, step=8, error="RuntimeError: worker killed")
    (m,) = run.measures()
    assert m.outcome == "not_recovered"
    assert m.recovered_s is None and m.world_size_after is None and m.steps_lost is None
    assert m.detected_s == pytest.approx(0.5)
    assert m.restarts == 6
    assert m.cause == "laptop-b (rank 1): RuntimeError: worker killed"
    table = faults.format_table([m])
    assert "not recovered - laptop-b (rank 1): RuntimeError: worker killed" in table


def test_throttle_reports_the_slowdown(run):
    run.start(ABC, T0 - 1)
    run.steps(ABC, 1, 30, T0, dt=1.0)
    run.fault("throttle", "laptop-b", T0 + 29.5, rank=1, duration_s=20)
    run.steps(ABC, 31, 39, T0 + 31.5, dt=2.0, step_time=2.0)   # the last at T0 + 47.5
    (m,) = run.measures()
    assert m.outcome == "not_recovered"             # nothing completed after the throttle yet
    run.steps(ABC, 40, 45, T0 + 51.0)
    (m,) = run.measures()
    assert m.outcome == "continued"
    assert m.step_time_ratio == pytest.approx(2.0)
    assert "2.00x slower" in faults.format_table([m])


def test_finished_during_the_fault(run):
    run.start(ABC, T0 - 1)
    run.steps(ABC, 1, 5, T0)
    run.fault("throttle", "laptop-b", T0 + 4.5, duration_s=30)
    run.rec("laptop-a", "end", T0 + 4.8, 0, 3, step=5, final_train_loss=2.0, final_val_loss=2.1, wall_s=6)
    (m,) = run.measures()
    assert m.outcome == "finished"


def test_no_data_after_the_injection_is_pending(run):
    run.start(ABC, T0 - 1)
    run.steps(ABC, 1, 5, T0)
    run.fault("poweroff", "laptop-a", T0 + 4.5)
    (m,) = run.measures()
    assert m.outcome == "no_data" and m.world_size_before == 3 and m.detected_s is None


def test_each_injection_is_measured_on_its_own_window(run):
    """poweroff c (3->2), then rejoin c (2->3): the rejoin's recovery is not the poweroff's."""
    run.start(ABC, T0 - 1)
    run.steps(ABC, 1, 10, T0)
    run.fault("poweroff", "laptop-c", T0 + 9.5, rank=2)
    run.failure("laptop-a", T0 + 9.7, 0, 3, step=10)
    run.start(AB, T0 + 13.0, resumed_from_step=10, restart_count=1)
    run.steps(AB, 11, 20, T0 + 14.0)
    run.fault("rejoin", "laptop-c", T0 + 23.5, rank=2)
    run.start(ABC, T0 + 26.0, resumed_from_step=20)
    run.steps(ABC, 21, 25, T0 + 27.0)
    off, back = run.measures()
    assert (off.world_size_before, off.world_size_after, off.recovered_s) == (3, 2, pytest.approx(4.5))
    assert off.restarts == 2
    assert (back.world_size_before, back.world_size_after, back.recovered_s) == (2, 3, pytest.approx(3.5))
    assert back.steps_lost == 0 and back.last_step_before == 20


def test_steps_lost_is_not_inflated_by_steps_redone_after_an_earlier_rollback(run):
    run.start(ABC, T0 - 1)
    run.steps(ABC, 1, 20, T0)
    run.fault("kill-agent", "laptop-c", T0 + 19.5)
    run.start(AB, T0 + 22, resumed_from_step=15, restart_count=1)     # 5 lost
    run.steps(AB, 16, 18, T0 + 23)
    run.fault("kill-worker", "laptop-b", T0 + 25.5)
    run.failure("laptop-a", T0 + 25.6, 0, 2, step=18)
    run.start(AB, T0 + 27, resumed_from_step=18, restart_count=2)
    run.steps(AB, 19, 20, T0 + 28)
    first, second = run.measures()
    assert first.steps_lost == 5
    assert (second.last_step_before, second.steps_lost) == (18, 0)


def test_node_of_rank_follows_the_newest_records(run):
    run.start(ABC, T0 - 1)
    run.steps(ABC, 1, 3, T0)
    # after a restart, laptop-c holds rank 0 and laptop-a rank 1 (laptop-b gone)
    run.rec("laptop-c", "start", T0 + 10, 0, 2, resumed_from_step=3)
    run.rec("laptop-a", "start", T0 + 10, 1, 2, resumed_from_step=3)
    recs = rundir.load_run(run.dir).records
    assert faults.node_of_rank(recs, 0) == "laptop-c"
    assert faults.node_of_rank(recs, 1) == "laptop-a"
    assert faults.node_of_rank(recs, 2) is None


def test_partial_lines_and_foreign_events_are_skipped(run):
    run.start(ABC, T0 - 1)
    run.steps(ABC, 1, 3, T0)
    with (run.dir / "laptop-a" / "metrics" / "laptop-a-local0.jsonl").open("a") as fh:
        fh.write('{"event": "step", "time": 10')    # a fetch during an append
    with (run.dir / "events.jsonl").open("a") as fh:
        fh.write(json.dumps({"time": T0, "kind": "play", "phase": "train"}) + "\n")
    assert len(rundir.load_run(run.dir).records) == 12
    assert run.measures() == []


@pytest.mark.parametrize("event, msg", [
    ({"kind": "fault", "mode": "explode", "node": "x", "time": 1.0}, "unknown mode 'explode'"),
    ({"kind": "fault", "mode": "freeze", "node": "x"}, "numeric 'time'"),
    ({"kind": "fault", "mode": "freeze", "time": 1.0}, "without a 'node'"),
])
def test_malformed_fault_events_are_named(event, msg):
    with pytest.raises(ValueError, match=msg):
        faults.injections([event])


def test_cli_prints_the_table_and_writes_summary_faults(run, capsys):
    run.start(ABC, T0 - 1)
    run.steps(ABC, 1, 10, T0)
    run.fault("kill-agent", "laptop-b", T0 + 9.5, rank=1)
    run.failure("laptop-a", T0 + 9.6, 0, 3, step=10)
    run.start(("laptop-a", "laptop-c"), T0 + 12.0, resumed_from_step=10, restart_count=1)
    run.steps(("laptop-a", "laptop-c"), 11, 12, T0 + 13.0)
    (run.dir / "summary.json").write_text(json.dumps({"run_id": "r1", "steps_completed": 12, "faults": []}))
    assert sm.main(["faults", str(run.dir)]) == 0
    out = capsys.readouterr().out
    assert "kill-agent" in out and "laptop-b" in out and "3->2" in out and "recovered" in out
    summary = json.loads((run.dir / "summary.json").read_text())
    assert summary["steps_completed"] == 12
    (entry,) = summary["faults"]
    got = (entry["mode"], entry["node"], entry["recovered_s"], entry["steps_lost"])
    assert got == ("kill-agent", "laptop-b", 3.5, 0)
    assert sm.main(["faults", str(run.dir), "--json", "--last", "--no-write"]) == 0
    assert json.loads(capsys.readouterr().out)[0]["world_size_after"] == 2
    assert sm.main(["faults", str(run.dir), "--rank-of", "1"]) == 0
    assert capsys.readouterr().out.strip() == "laptop-c"


def test_cli_reads_live_metrics_from_another_folder(run, tmp_path, capsys):
    run.fault("poweroff", "laptop-a", T0 + 1.5)
    live = Run(tmp_path / "live", "fetch")
    live.start(ABC, T0 - 1)
    live.steps(ABC, 1, 2, T0)
    assert sm.main(["faults", str(run.dir), "--metrics", str(live.dir), "--json", "--no-write"]) == 0
    (entry,) = json.loads(capsys.readouterr().out)
    assert entry["world_size_before"] == 3 and entry["outcome"] == "no_data"
    assert not (run.dir / "summary.json").exists()


def test_cli_errors_are_one_line(tmp_path, capsys):
    assert sm.main(["faults", str(tmp_path / "missing")]) == 2
    assert "no such run folder" in capsys.readouterr().err
    d = tmp_path / "r"
    d.mkdir()
    bad = {"kind": "fault", "mode": "nap", "node": "a", "time": 1}
    (d / "events.jsonl").write_text(json.dumps(bad) + "\n")
    assert sm.main(["faults", str(d)]) == 2
    assert "unknown mode 'nap'" in capsys.readouterr().err
    assert sm.main(["faults", str(d), "--rank-of", "0"]) == 3


def test_progress_phase_from_one_nodes_records(run):
    run.start(ABC, T0 - 1)
    run.steps(ABC, 1, 10, T0)
    inj = faults.Injection(T0 + 9.5, "freeze", "laptop-c", duration_s=20)

    def phase(active=True):
        return faults.progress_phase(faults.measure(inj, rundir.load_run(run.dir).records), active)

    assert phase() == "waiting"
    assert phase(active=False) == "ended"
    run.steps(ABC, 11, 11, T0 + 15)                 # a step during the fault: not over yet
    assert phase() == "waiting"
    run.steps(ABC, 12, 12, T0 + 30)                 # after the fault's end: ridden out
    assert phase() == "continued"
    run.start(AB, T0 + 31, resumed_from_step=12, restart_count=1)
    run.steps(AB, 13, 13, T0 + 32)
    assert phase(active=False) == "recovered"


def test_steps_in_flight_after_an_instant_fault_are_not_a_recovery(run):
    """poweroff: the node's systemd shuts down for a few seconds; the old group completes steps
    after the injection. That is neither a recovery nor riding the fault out."""
    run.start(ABC, T0 - 1)
    run.steps(ABC, 1, 10, T0)
    inj = faults.Injection(T0 + 7.5, "poweroff", "laptop-a")
    m = faults.measure(inj, rundir.load_run(run.dir).records)
    assert m.outcome == "not_recovered"
    assert faults.progress_phase(m, True) == "waiting"
    run.failure("laptop-b", T0 + 11, 1, 3, step=10)
    run.start(("laptop-b", "laptop-c"), T0 + 15, resumed_from_step=10, restart_count=1)
    run.steps(("laptop-b", "laptop-c"), 11, 12, T0 + 16)
    m = faults.measure(inj, rundir.load_run(run.dir).records)
    assert (m.outcome, m.world_size_after, m.steps_lost, m.last_step_before) == ("recovered", 2, 0, 10)
    assert m.recovered_s == pytest.approx(8.5)


def test_newest_per_worker_lists_ranks_world_size_and_step(run):
    run.start(ABC, T0 - 1)
    run.steps(ABC, 1, 4, T0)
    run.rec("laptop-b", "failure", T0 + 5, 1, 3, step=4, error="x", saved=True)
    ws = faults.newest_per_worker(rundir.load_run(run.dir).records)
    assert [(w["host"], w["rank"], w["event"], w["step"], w["world_size"]) for w in ws] == [
        ("laptop-a", 0, "step", 4, 3), ("laptop-c", 2, "step", 4, 3), ("laptop-b", 1, "failure", 4, 3)]


@pytest.mark.parametrize("stop_at, blamed", [(70.5, False), (70.7, True)])
def test_a_stop_during_a_freeze_is_not_its_cause_when_recorded_before_the_sigterm(run, stop_at, blamed):
    """stop.yml records its stop event before it stops the agents (roles/ddp_job tasks/stopped.yml):
    the SIGTERM's failure records come after it and the freeze's row names no SIGTERM. Recorded
    after them (stop.yml before this change, the second case) the row blamed the stop's SIGTERM."""
    run.start(ABC, T0 - 1)
    run.steps(ABC, 1, 60, T0)
    run.fault("freeze", "laptop-b", T0 + 59.5, rank=1, duration_s=90)
    sigterm = "SignalException: Process 7114 got signal: 15"
    run.failure("laptop-a", T0 + 70.6, 0, 3, step=60, error=sigterm)
    with (run.dir / "events.jsonl").open("a") as fh:
        fh.write('{"time": %f, "kind": "stop"}\n' % (T0 + stop_at))
    (m,) = run.measures()
    assert m.outcome != "recovered"
    assert ("got signal: 15" in (m.cause or "")) is blamed, m


def _throttle_then_kill_agent(run):
    """Issue 27 item 15's run: a 90 s throttle of laptop-c, then 20 s later a kill-agent of laptop-a;
    steps 11 -> 48 ran (slower) in the throttle's window, laptop-b and c trained on after the kill."""
    run.start(ABC, T0 - 1)
    run.steps(ABC, 1, 10, T0, dt=0.25)                              # step 10 at T0 + 2.25
    run.fault("throttle", "laptop-c", T0 + 2.5, rank=2, duration_s=90)
    run.steps(ABC, 11, 48, T0 + 3.0, dt=0.5)                        # step 48 at T0 + 21.5
    run.fault("kill-agent", "laptop-a", T0 + 22.5, rank=0)
    run.failure("laptop-b", T0 + 22.7, 1, 3, step=48)
    run.failure("laptop-c", T0 + 22.8, 2, 3, step=48)
    run.start(("laptop-b", "laptop-c"), T0 + 27.0, resumed_from_step=48, restart_count=1)
    run.steps(("laptop-b", "laptop-c"), 49, 60, T0 + 28.0)


def test_a_throttle_whose_window_the_next_fault_closed_counts_the_steps_it_trained(run):
    """Before: not_recovered, cause 'no step completed after the fault and no failure record was
    written', although 38 steps completed in its window (only steps after its 90 s counted)."""
    _throttle_then_kill_agent(run)
    throttle, kill = run.measures()
    assert (throttle.outcome, throttle.steps_lost, throttle.restarts) == ("continued", 0, 0), throttle
    assert throttle.path_text() == "3->3"
    assert throttle.step_time_ratio == pytest.approx(2.0)
    assert throttle.notes == ["trained on through it, steps 12->48; its window closed at +20.0 s by"
                              " kill-agent of laptop-a, before its 90 s were over"]
    assert (kill.outcome, kill.world_size_after, kill.steps_lost) == ("recovered", 2, 0)


def test_the_summary_line_of_a_cut_short_throttle_says_continued_and_no_none(run):
    _throttle_then_kill_agent(run)
    summary = sm.build_summary(run.dir)
    text = sm.human_summary(summary, run.dir)
    assert "None" not in text, text
    line = next(x for x in text.splitlines() if x.startswith("fault throttle laptop-c"))
    assert line == ("fault throttle laptop-c: world size 3->3, detected - s, recovered - s, steps lost 0"
                    " - continued: trained on through it, steps 12->48; its window closed at +20.0 s by"
                    " kill-agent of laptop-a, before its 90 s were over"), line
    assert "no step completed" not in json.dumps(summary["faults"][0])
    kill = next(x for x in text.splitlines() if x.startswith("fault kill-agent laptop-a"))
    assert kill.endswith(" - recovered"), kill


def test_a_freeze_closed_before_its_end_with_only_the_step_in_flight_says_why(run):
    """A freeze stops the group: the one step in flight at the injection is no training through it,
    and the cause says the window closed early instead of 'no step completed after the fault'."""
    run.start(ABC, T0 - 1)
    run.steps(ABC, 1, 10, T0)
    run.fault("freeze", "laptop-b", T0 + 9.5, rank=1, duration_s=90)
    run.steps(ABC, 11, 11, T0 + 10.0)                                 # in flight at the injection
    with (run.dir / "events.jsonl").open("a") as fh:
        fh.write(json.dumps({"time": T0 + 39.5, "kind": "stop"}) + "\n")
    (m,) = run.measures()
    assert m.outcome == "not_recovered"
    assert m.cause == ("no step completed in its window after the one in flight; its window closed at"
                       " +30.0 s by the stop, before its 90 s were over and no failure record was written")


def test_a_throttle_under_way_names_the_steps_it_trained_so_far(run):
    """Measured while the throttle lasts (kill-node's wait): not over yet (the play waits for a step
    after its end), and the cause no longer says that no step completed."""
    run.start(ABC, T0 - 1)
    run.steps(ABC, 1, 10, T0)
    inj = faults.Injection(T0 + 9.5, "throttle", "laptop-c", duration_s=60)
    run.steps(ABC, 11, 20, T0 + 11.0, dt=2.0)
    m = faults.measure(inj, rundir.load_run(run.dir).records)
    assert faults.progress_phase(m, True) == "waiting"
    assert m.cause == ("no step completed after the fault's 60 s were over (10 step(s) completed during it)"
                       " and no failure record was written")
