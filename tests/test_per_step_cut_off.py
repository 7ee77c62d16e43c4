"""per_step engine: a replica cut off from the group never trains on alone (issue 13, found on the
lab in run 20261201-034545-afba: laptop-a, partitioned at step 2042 until laptop-b and laptop-c had
finished step 2400 and exited, then trained steps 2042-2400 alone on samples the group had already
trained, and summary.json reported its validation loss).

Local replica groups as in tests/test_per_step_e2e.py (agent + lighthouse processes). One replica's
worker is frozen (SIGSTOP: no heartbeat, no collective, as under a partition) until its peer has
trained to the end and exited, then thawed. The lighthouse gives the thawed replica a quorum of one
whose id skips the quorums the peer formed without it:

* the peer, left alone while it was IN the last quorum (its own ids follow on), trains on to the
  end at 1 participant (per_step's whole point);
* the thawed replica does not commit a single step more: it waits ``ft_rejoin_wait_s`` for a peer
  to heal from, then ends with a ``failure`` record (cause ``cut_off``) naming the quorums it missed,
  its checkpoints kept, exit 4; its agent does not restart it (``--max-restarts 1`` left unused)
  and ends (exit 1); no step and no sample is committed twice across the replicas.

Thawed while its peer still trains, the replica is cut off too but heals from the peer at once.
And a peer frozen in turn, back while the cut-off replica waited alone, is the group (both were
cut off: ddplab.engines.torchft_replica.Replica.exonerated): both train on.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest
import test_per_step_e2e as e2e
from labharness import free_port
from test_per_step_e2e import Replica, assert_samples_distinct, wait_until, worker_pid

lighthouse = e2e.lighthouse  # the fixture: a lighthouse process on a free port

pytestmark = pytest.mark.slow

WAIT_S = 8  # ft_rejoin_wait_s


def two_in_step(tmp_path, data_path, lighthouse, steps: int, **overrides) -> tuple[list[Replica], float]:
    """node0 and node1 (start barrier 2), started; returns them once node1 committed ``steps``
    steps at 2 participants, with the time of the first one."""
    settings = {"max_steps": 100000, "eval_interval": 50, "ckpt_interval": 100000,
                "ft_start_replicas": 2, "ft_rejoin_wait_s": WAIT_S, **overrides}
    reps = [Replica(tmp_path, f"node{i}", lighthouse, data_path,
                    **{k: v[i] if isinstance(v, tuple) else v for k, v in settings.items()})
            for i in range(2)]
    for rep in reps:
        rep.start()
    t_two = wait_until("2 participants", lambda: e2e.first_at(reps, 2, 0.0), reps, 90)
    wait_until(f"{steps} steps at 2", lambda: len(reps[1].committed(t_two)) >= steps, reps, 60)
    return reps, t_two


def stop(reps: list[Replica]) -> str:
    """SIGTERM every replica, wait for them; returns the load average for the figures."""
    for rep in reps:
        rep.signal(signal.SIGTERM)
    for rep in reps:
        rep.wait(30)
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def test_a_replica_cut_off_until_the_group_finished_does_not_train_on_alone(
        tmp_path, data_path, lighthouse):
    reps, _ = two_in_step(tmp_path, data_path, lighthouse, 25, max_steps=80, eval_interval=20,
                          ckpt_interval=20, max_restarts=(0, 1))
    peer, victim = reps
    frozen = time.time()
    os.kill(worker_pid(victim), signal.SIGSTOP)
    assert peer.wait(120) == 0, peer.output()  # alone from the freeze on, to the end
    last_with_peer = max(r["step"] for r in victim.committed())
    thawed = time.time()
    os.kill(worker_pid(victim), signal.SIGCONT)
    code = victim.wait(60)
    left_s = time.time() - thawed
    load = " ".join(Path("/proc/loadavg").read_text().split()[:3])
    print(f"\nper_step cut-off replica: thawed -> exit {code} in {left_s:.1f} s with "
          f"ft_rejoin_wait_s {WAIT_S}, not restarted (load {load})")

    # the peer: in every quorum, alone after the freeze, to the end, each step once
    assert [r["step"] for r in peer.committed()] == list(range(1, 81))
    assert {r["participants"] for r in peer.committed(frozen + 1)} == {1}
    # the thawed replica: nothing committed after the freeze, a clear failure, checkpoint kept
    # (a worker frozen between its commit and that step's record writes the record once thawed:
    # the step it committed with its peer before the freeze, not one trained alone)
    together = {r["step"] for r in peer.committed() if r["participants"] == 2}
    in_flight = [r["step"] for r in victim.committed(thawed)
                 if r["step"] == last_with_peer + 1 and r["participants"] == 2 and r["step"] in together]
    last_with_peer += len(in_flight)
    after = [r["step"] for r in victim.committed(thawed) if r["step"] not in in_flight]
    assert not after, f"the cut-off replica trained on alone: steps {after[0]}-{after[-1]}"
    assert code == 1, victim.output()
    failure = [r for r in victim.records() if r["event"] == "failure"]
    # one end, not one per torchrun restart: the worker exits 4 (cut off) and the agent does not
    # restart it (before: the restarted worker stopped at once, but each restart spent one of
    # --max-restarts; on the lab 7 came ~5 s apart)
    assert [r["cause"] for r in failure] == ["cut_off"], failure
    assert [r["restart_count"] for r in failure] == [0], failure
    assert len([r for r in victim.records() if r["event"] == "start"]) == 1
    assert "exit 4: cut off from its per_step group" in victim.output(tail=0)
    assert "not restarted (1 of --max-restarts 1 left unused)" in victim.output(tail=0)
    assert failure[0]["step"] == last_with_peer, failure
    error = failure[0]["error"]
    assert "node1 was cut off" in error and "nothing trained alone" in error, error
    assert failure[0]["last_group_quorum_id"] < failure[0]["quorum_id"] - 1, failure
    assert "nothing trained alone" in victim.output(tail=0)
    assert (victim.out / "checkpoints" / "ckpt-00000020.pt").exists()
    assert not (victim.out / "result.json").exists()  # no "final" model of its own
    assert assert_samples_distinct(reps) == 80  # no step, no sample committed twice


def test_a_cut_off_replica_whose_group_is_still_there_is_healed_and_trains_on(
        tmp_path, data_path, lighthouse):
    # the same freeze, thawed while the peer still trains: the quorum skips ids for the thawed
    # replica too, but its peer took part in them, so the step commits and it belongs again
    reps, _ = two_in_step(tmp_path, data_path, lighthouse, 10)
    peer, victim = reps
    frozen = time.time()
    os.kill(worker_pid(victim), signal.SIGSTOP)
    wait_until("the peer alone", lambda: e2e.first_at([peer], 1, frozen), reps, 60)
    thawed = time.time()
    os.kill(worker_pid(victim), signal.SIGCONT)
    back = wait_until("2 participants after the thaw", lambda: e2e.first_at(reps, 2, thawed), reps, 60)
    wait_until("10 more steps", lambda: len(victim.committed(back)) >= 10, reps, 60)
    load = stop(reps)
    print(f"\nper_step cut-off replica, group still there: thaw -> 2 participants "
          f"{back - thawed:.2f} s (load {load})")

    # by step, not by record time: a step the victim committed with its peer just before the
    # freeze may be recorded only once it is thawed (CI at 4d93eb3: quorum 2 'after' the thaw)
    alone = [r["step"] for r in peer.committed(frozen) if r["participants"] == 1]
    before = [r for r in victim.committed() if r["step"] < min(alone)]
    after = [r for r in victim.committed(thawed) if r["step"] > max(alone)]
    assert after[0]["participants"] == 2 and after[0]["quorum_id"] > before[-1]["quorum_id"] + 1
    assert "was cut off" not in victim.output(tail=0)  # never waited: a peer of the group was there
    kept = json.loads((victim.out / "ft-group-quorum.json").read_text())
    assert kept["quorum_id"] >= after[0]["quorum_id"]  # it follows the group's quorums again
    steps = sorted({r["step"] for rep in reps for r in rep.committed()})
    assert steps == list(range(1, steps[-1] + 1)), "a step lost"
    assert assert_samples_distinct(reps) == steps[-1]


def test_a_peer_back_from_a_freeze_while_a_cut_off_replica_waits_is_the_group(
        tmp_path, data_path, lighthouse):
    # node1 frozen, node0 trains alone; node0 frozen in turn and node1 thawed: node1 is cut off
    # and waits alone (its lone quorums commit nothing). node0 thawed: its quorum skips the ids
    # of node1's lone quorums, so both are cut off; node0 missed nothing but quorums node1 formed
    # while waiting (ddplab.engines.torchft_replica.Replica.exonerated): it is the group, node1 heals
    # from it and both train on (before: each waited ft_rejoin_wait_s and stopped, the run ended on
    # a false alarm)
    reps, t_two = two_in_step(tmp_path, data_path, lighthouse, 10, ft_rejoin_wait_s=20)
    group, victim = reps
    os.kill(worker_pid(victim), signal.SIGSTOP)
    alone = wait_until("node0 alone", lambda: e2e.first_at([group], 1, t_two), reps, 60)
    wait_until("10 steps alone", lambda: len(group.committed(alone)) >= 10, reps, 30)
    os.kill(worker_pid(group), signal.SIGSTOP)
    os.kill(worker_pid(victim), signal.SIGCONT)
    wait_until("node1 waiting, cut off", lambda: "was cut off" in victim.output(tail=0), reps, 30)
    thawed = time.time()
    os.kill(worker_pid(group), signal.SIGCONT)
    back = wait_until("2 participants after both thaws", lambda: e2e.first_at(reps, 2, thawed),
                      reps, 30)
    wait_until("10 steps at 2 again", lambda: len(victim.committed(back)) >= 10, reps, 60)
    load = stop(reps)
    print(f"\nper_step overlapping freezes: node0 thawed while node1 waited cut off -> 2 "
          f"participants {back - thawed:.2f} s (load {load})")

    assert "is back in the group" in victim.output(tail=0)
    for rep in reps:
        causes = [r["cause"] for r in rep.records() if r["event"] == "failure"]
        assert causes == ["signal"], (rep.name, causes)  # the SIGTERM at the end only
    # node1 healed from node0: what node0 trained alone is kept, nothing committed twice
    alone_steps = {r["step"] for r in group.committed(alone) if r["participants"] == 1}
    rejoined = victim.committed(back)[0]
    assert rejoined["step"] > max(alone_steps)
    steps = sorted({r["step"] for rep in reps for r in rep.committed()})
    assert steps == list(range(1, steps[-1] + 1)), "a step lost"
    assert assert_samples_distinct(reps) == steps[-1]


def test_a_lighthouse_out_of_reach_past_the_quorum_timeout_is_ridden_out_in_one_life(
        tmp_path, data_path, lighthouse):
    # the lighthouse frozen (SIGSTOP) longer than ft_quorum_timeout_s, as a partition of the
    # controller looks to a replica: every quorum call raises TimeoutError. Before, that ended the
    # worker (cause error) and torchrun restarted it, once per timeout (the newcomer's 200 s
    # partition spent 3 restarts so); now each worker asks again in its own life and trains on.
    # ft_timeout_s 5: after the thaw both replicas configure a new process group at once; at the
    # default 1.5 s that configure can time out on a machine the other tests load, again and again
    reps, _ = two_in_step(tmp_path, data_path, lighthouse, 10, ft_quorum_timeout_s=3,
                          ft_rejoin_wait_s=60, max_restarts=1, ft_timeout_s=5)
    lighthouse.proc.send_signal(signal.SIGSTOP)
    frozen = time.time()
    wait_until("a quorum call timed out", lambda: all(
        "no quorum from the lighthouse" in rep.output(tail=0) for rep in reps), reps, 30)
    time.sleep(max(0.0, frozen + 8 - time.time()))
    lighthouse.proc.send_signal(signal.SIGCONT)
    thawed = time.time()
    back = wait_until("2 participants after the thaw", lambda: e2e.first_at(reps, 2, thawed), reps, 60)
    wait_until("10 more steps", lambda: all(len(rep.committed(back)) >= 10 for rep in reps), reps, 60)
    load = stop(reps)
    print(f"\nper_step lighthouse frozen 8 s (ft_quorum_timeout_s 3): thaw -> 2 participants "
          f"{back - thawed:.2f} s, no restart (load {load})")

    for rep in reps:
        assert len([r for r in rep.records() if r["event"] == "start"]) == 1, rep.name
        causes = [r["cause"] for r in rep.records() if r["event"] == "failure"]
        assert causes == ["signal"], (rep.name, causes)  # the SIGTERM at the end only
        assert "a quorum again" in rep.output(tail=0)
    steps = sorted({r["step"] for rep in reps for r in rep.committed()})
    assert steps == list(range(1, steps[-1] + 1)), "a step lost"
    assert assert_samples_distinct(reps) == steps[-1]


def test_a_lighthouse_out_of_reach_for_good_ends_each_replica_once(tmp_path, data_path, lighthouse):
    # the same, frozen past ft_quorum_timeout_s + ft_rejoin_wait_s: each replica ends once, cut off
    # (no quorum for that long), checkpoints kept, its agent ends without a restart
    reps, _ = two_in_step(tmp_path, data_path, lighthouse, 10, ft_quorum_timeout_s=2,
                          ft_rejoin_wait_s=4, ckpt_interval=5, max_restarts=2)
    lighthouse.proc.send_signal(signal.SIGSTOP)
    frozen = time.time()
    codes = [rep.wait(60) for rep in reps]
    ended_s = time.time() - frozen
    load = " ".join(Path("/proc/loadavg").read_text().split()[:3])
    print(f"\nper_step lighthouse out of reach: both replicas ended {ended_s:.1f} s after the "
          f"freeze (ft_quorum_timeout_s 2 + ft_rejoin_wait_s 4), no restart (load {load})")

    assert codes == [1, 1], [rep.output() for rep in reps]
    for rep in reps:
        failure = [r for r in rep.records() if r["event"] == "failure"]
        assert [r["cause"] for r in failure] == ["cut_off"], (rep.name, failure)
        assert failure[0]["unreachable_s"] >= 6 and failure[0]["quorum_id"] is None, failure
        assert "got no quorum from the lighthouse" in failure[0]["error"]
        assert "nothing trained alone" in failure[0]["error"]
        assert len([r for r in rep.records() if r["event"] == "start"]) == 1, rep.name
        assert "not restarted (2 of --max-restarts 2 left unused)" in rep.output(tail=0)
        assert not (rep.out / "result.json").exists()
        assert list((rep.out / "checkpoints").glob("ckpt-*.pt"))


def test_a_node_rejoined_after_the_group_finished_does_not_train_alone(tmp_path, data_path, lighthouse):
    # node1's agent and worker SIGKILLed (kill-agent), node0 trains on alone to the end; node1's
    # agent started again (a rejoin: a new agent, the same run.json and ft_launch_id) under the
    # same lighthouse. Before, a new agent had no kept group quorum id, counted as a first start
    # and trained steps to the end alone; now it reads its node's kept id (same launch), sees the
    # gap, waits ft_rejoin_wait_s for a peer and ends once, cut off
    reps, _ = two_in_step(tmp_path, data_path, lighthouse, 10, max_steps=60, eval_interval=20,
                          ckpt_interval=20, ft_launch_id="run-L1")
    group, victim = reps
    victim.signal(signal.SIGKILL)
    victim.wait(30)
    assert group.wait(120) == 0, group.output()
    before = {r["step"] for r in victim.committed()}
    rejoined = time.time()
    victim.start()
    code = victim.wait(90)
    left_s = time.time() - rejoined
    load = " ".join(Path("/proc/loadavg").read_text().split()[:3])
    print(f"\nper_step node rejoined after the group finished: ended {left_s:.1f} s after its agent "
          f"started (ft_rejoin_wait_s {WAIT_S}, load {load})")

    assert code == 1, victim.output()
    assert {r["step"] for r in victim.committed(rejoined)} <= before, "trained alone after the rejoin"
    starts = [r for r in victim.records() if r["event"] == "start" and r["time"] >= rejoined]
    assert starts and starts[0]["ft_group_quorum_id"] is not None  # the kept id, same launch
    failure = [r for r in victim.records() if r["event"] == "failure" and r["time"] >= rejoined]
    assert [r["cause"] for r in failure] == ["cut_off"], failure
    assert "nothing trained alone" in failure[0]["error"]
    assert not (victim.out / "result.json").exists()


def test_a_worker_started_while_the_lighthouse_is_out_of_reach_waits_for_it_in_one_life(
        tmp_path, data_path):
    # a replica started (a rejoin, a restart) while a partition keeps the lighthouse out of
    # reach. Before, torchft's Manager gave up connecting (RuntimeError 'failed to connect ...
    # within timeout'), which ended the worker, and each torchrun restart waited one connect
    # timeout again (the newcomer's partition: 60 s each); now torchft's own connect keeps trying
    # (connect_timeout ft_quorum_timeout_s + ft_rejoin_wait_s) in the same life. Out of reach:
    # nothing listens on the lighthouse's (reserved) port until it is started (a frozen
    # lighthouse that listens would accept the connect)
    port = free_port()
    rep = Replica(tmp_path, "node0", f"http://127.0.0.1:{port}", data_path, max_steps=30,
                  eval_interval=10, ft_quorum_timeout_s=2, ft_rejoin_wait_s=60)
    rep.start()
    wait_until("the connect is slow", lambda: "keeps trying to connect" in rep.output(tail=0), [rep], 60)
    up = time.time()
    lighthouse = e2e.start_lighthouse(tmp_path / "lighthouse.log", port=port)
    try:
        code = rep.wait(120)
    finally:
        lighthouse.proc.kill()
        lighthouse.proc.wait()
    load = " ".join(Path("/proc/loadavg").read_text().split()[:3])
    first = rep.committed(up)[0]["time"] - up if rep.committed(up) else None
    print(f"\nper_step worker started with the lighthouse out of reach: first step {first:.2f} s "
          f"after the lighthouse started, no restart (load {load})")

    assert code == 0, rep.output()
    assert [r["step"] for r in rep.committed()] == list(range(1, 31))
    assert len([r for r in rep.records() if r["event"] == "start"]) == 1
    assert "failed to connect to" not in rep.output(tail=0)  # no connect gave up
