"""The diloco engine end to end: a torchft lighthouse and replica groups as local processes started
as the ddp_job unit starts them (tests/test_per_step_e2e.py's harness, ``fault_tolerance diloco``).

* two replicas to the end: a sync at every multiple of sync_every and none between (no collective
  in an inner step: allreduce_s 0, no gradient bytes), the same validation losses and the same
  final weights on both, disjoint samples within each round, result.json names the engine;
* three replicas, one SIGKILLed between two syncs (frozen first, killed only when its own last
  record says it is inside a round: it has not asked for the next sync's quorum): the survivors
  are not held (no sync fails, no step is repeated or lost) and go on at 2 participants; the killed
  one started again from an empty folder waits for the group's next sync, receives the global
  parameters and the outer optimizer's state there from a live peer, and every replica ends with
  the same weights;
* a sync whose attempt fails (its barrier sum, or torchft's vote: what a peer lost inside the sync
  does to the survivors) is attempted again at once and loses no inner step: the run ends with the
  weights of a run without the failure, bit for bit, and the ``uncommitted`` record names the
  collective's own error;
* a stop of every replica between two syncs (SIGTERM: each saves its own step, inside the round
  or waiting at its sync) and a resume from their own checkpoints ends with the weights of an
  uninterrupted run, bit for bit.
"""

from __future__ import annotations

import json
import shutil
import signal
import time

import pytest
import torch
from ddplab.checkpoint import CheckpointStore
from test_per_step_e2e import Replica, lighthouse, val_losses, wait_until  # noqa: F401  (fixture)

pytestmark = pytest.mark.slow


def diloco(tmp_path, name, lighthouse_address, data_path, **overrides) -> Replica:  # noqa: F811
    settings = dict(sync_every=10, eval_interval=20, ckpt_interval=20, log_interval=1, sample_chars=0)
    settings.update(overrides)
    return Replica(tmp_path, name, lighthouse_address, data_path, engine="diloco", **settings)


def steps(rep: Replica) -> list[dict]:
    return [r for r in rep.records() if r["event"] == "step"]


def final_weights(rep: Replica) -> dict[str, torch.Tensor]:
    store = CheckpointStore(rep.out / "checkpoints")
    return store.load(store.steps()[-1])["model"]


def same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def last_step(rep: Replica) -> int:
    records = steps(rep)
    return records[-1]["step"] if records else 0


def freeze_inside_a_round(rep: Replica, every: int) -> int:
    """Freeze ``rep`` (SIGSTOP, every thread stopped) at a moment it is inside a round, and return
    the step of its last record. A replica's step record is written before it attempts its next
    step, and a sync is attempted only after the record of a step that is a multiple of
    ``every``: so a frozen replica whose last record is another step is training that round's
    next inner step and has not asked the lighthouse for the next sync's quorum. Frozen at a
    multiple of ``every`` (waiting at, or in, the sync), it is thawed and frozen again after its
    next record."""
    while True:
        rep.freeze()
        step = last_step(rep)
        if step % every:
            return step
        rep.signal(signal.SIGCONT)
        wait_until(f"{rep.name}'s record after step {step}", lambda: last_step(rep) > step  # noqa: B023
                   and time.time(), [rep], 120)


def test_two_replicas_sync_every_h_steps_and_end_with_one_model(tmp_path, data_path, lighthouse):  # noqa: F811
    reps = [diloco(tmp_path, f"node{i}", lighthouse, data_path, max_steps=45, ft_start_replicas=2)
            for i in range(2)]
    for rep in reps:
        rep.start()
    assert [rep.wait(180) for rep in reps] == [0, 0], "\n".join(rep.output() for rep in reps)
    results = [json.loads((rep.out / "result.json").read_text()) for rep in reps]
    assert [(r["engine"], r["steps"]) for r in results] == [("diloco", 45), ("diloco", 45)]
    for rep in reps:
        records = steps(rep)
        assert [r["step"] for r in records] == list(range(1, 46))
        synced = [r["step"] for r in records if r.get("sync")]
        assert synced == [1, 11, 21, 31, 41]  # the syncs at steps 0, 10, 20, 30, 40 (then the last: 45)
        for r in records:
            assert r["engine"] == "diloco" and r["participants"] == 2
            if r.get("sync"):
                assert r["sync_participants"] == 2 and r["grad_bytes"] > 0 and r["allreduce_s"] > 0
                assert 0 <= r["sync_quorum_s"] <= r["sync_s"]
            else:  # an inner step: no collective, no gradient on the wire
                assert r["allreduce_s"] == 0 and r["grad_bytes"] == 0 and r["wire_model_bytes"] == 0
        assert not [r for r in rep.records() if r["event"] == "uncommitted"]
        start = next(r for r in rep.records() if r["event"] == "start")
        assert start["engine"] == "diloco" and start["sync_every"] == 10 and start["outer_lr"] == 0.7
    # evaluations read the common model right after a sync, the last one after the final sync
    assert val_losses(reps[0]) == val_losses(reps[1]) and set(val_losses(reps[0])) == {20, 40, 45}
    assert same_weights(final_weights(reps[0]), final_weights(reps[1]))
    # within a round the replicas trained on disjoint halves of each step's samples
    for a, b in zip(steps(reps[0]), steps(reps[1]), strict=True):
        assert not set(range(*a["samples"])) & set(range(*b["samples"]))
        assert a["global_batch_size"] == 8 and a["per_rank_batch_size"] == 4
        assert a["lr_scale"] == round(4 / 12, 9)  # the inner optimizer's own batch (Goyal)


def test_a_replica_killed_between_syncs_holds_nobody_and_rejoins_from_a_peer(
        tmp_path, data_path, lighthouse):  # noqa: F811
    reps = [diloco(tmp_path, f"node{i}", lighthouse, data_path, max_steps=100000, eval_interval=20,
                   ckpt_interval=100000, ft_start_replicas=3, ft_timeout_s=3) for i in range(3)]
    for rep in reps:
        rep.start()
    at = wait_until("all three past step 25", lambda: all(
        steps(r) and steps(r)[-1]["step"] >= 25 for r in reps) and time.time(), reps, 240)
    killed_at = freeze_inside_a_round(reps[2], every=10)
    assert any(r.get("sync") and r["sync_participants"] == 3 for r in steps(reps[2]))  # of the group
    reps[2].signal(signal.SIGKILL)
    reps[2].wait(30)
    # the survivors go on at 2 participants: the round's sync leaves the killed replica out
    end_of_round = (killed_at // 10 + 1) * 10
    wait_until("a sync of the two survivors", lambda: all(
        any(r.get("sync") and r["sync_participants"] == 2 for r in steps(s)) for s in reps[:2])
        and time.time(), reps[:2], 120)
    for rep in reps[:2]:  # at the end of the round it was killed in, or before (a survivor late)
        first = next(r["step"] for r in steps(rep) if r.get("sync") and r["sync_participants"] == 2)
        assert first <= end_of_round + 1, (rep.name, killed_at, first)
    shutil.rmtree(reps[2].out)  # started again with nothing of its own
    reps[2].start()
    back = wait_until("the rejoined replica's first step", lambda: steps(reps[2]) and time.time(),
                      reps, 240)
    joined = steps(reps[2])[0]
    assert joined["sync"] and joined["step"] > 30 and joined["step"] % 10 == 1  # at a sync of the group
    wait_until("a sync of three after the rejoin", lambda: all(
        any(r.get("sync") and r["sync_participants"] == 3 and r["time"] > back for r in steps(s))
        for s in reps) and time.time(), reps, 120)
    wait_until("an evaluation of the rejoined replica", lambda: val_losses(reps[2]) and time.time(),
               reps, 120)
    stopped = time.time()  # a sync in flight when the replicas stop may fail: not the fault's
    for rep in reps:
        rep.signal(signal.SIGTERM)
    for rep in reps:
        rep.wait(60)
    for rep in reps[:2]:  # the survivors lost nothing: every step once, no failed sync
        numbers = [r["step"] for r in steps(rep)]
        assert numbers == list(range(1, numbers[-1] + 1))
        failed = [r for r in rep.records() if r["event"] == "uncommitted" and r["time"] < stopped]
        assert not failed, (rep.name, killed_at, joined["step"], failed)
        assert len([r for r in rep.records() if r["event"] == "start"]) == 1  # never restarted
    print(f"killed at step {killed_at} ({at:.0f}), rejoined at step {joined['step']}")
    # from the rejoin on, the three evaluate the same model
    common = set(val_losses(reps[0])) & set(val_losses(reps[1])) & set(val_losses(reps[2]))
    assert common and all(val_losses(reps[0])[s] == val_losses(r)[s] for s in common for r in reps)


def test_a_stop_between_syncs_and_a_resume_end_as_an_uninterrupted_run(tmp_path, data_path, lighthouse):  # noqa: F811
    settings = dict(max_steps=60, ft_start_replicas=2, ckpt_interval=1000)
    for run in ("plain", "stopped"):
        (tmp_path / run).mkdir()
    plain = [diloco(tmp_path / "plain", f"node{i}", lighthouse, data_path, **settings) for i in range(2)]
    for rep in plain:
        rep.start()
    assert [rep.wait(180) for rep in plain] == [0, 0]
    stopped = [diloco(tmp_path / "stopped", f"node{i}", lighthouse, data_path, **settings) for i in range(2)]
    for rep in stopped:
        rep.start()
    wait_until("both past step 33", lambda: all(steps(r) and steps(r)[-1]["step"] >= 33 for r in stopped)
               and time.time(), stopped, 180)
    for rep in stopped:
        rep.signal(signal.SIGTERM)
    for rep in stopped:
        rep.wait(60)
    saved = [CheckpointStore(rep.out / "checkpoints").steps()[-1] for rep in stopped]
    # each stopped at its own step, inside the round 30-40 or waiting at its end (the sync at 40)
    assert all(33 <= s <= 40 for s in saved), saved
    for rep in stopped:
        rep.start()
    assert [rep.wait(180) for rep in stopped] == [0, 0], "\n".join(rep.output() for rep in stopped)
    for a, b in zip(plain, stopped, strict=True):
        assert same_weights(final_weights(a), final_weights(b))
    assert val_losses(stopped[0])[60] == val_losses(plain[0])[60]
