"""diloco: a sync whose attempt fails loses no inner step (issue 26: "lose 0 inner steps").

A peer lost inside a sync (it had asked for the sync's quorum, so the lighthouse put it in) makes
the survivors' collectives of that sync fail: torchft reports the error to each survivor's
Manager, whose vote then fails. The engine puts the replica's own parameters back (torchft
restores the last global ones), writes an ``uncommitted`` record (``sync: true``) naming the
collective's error and attempts the sync again at once with the next quorum. Nothing of the
round is lost, so the run ends exactly as a run whose syncs never failed.

One replica in this process (ddplab.train.Trainer with the real torchft Manager and DiLoCo) under a
real lighthouse; a failure is reported to the Manager as torchft reports a failed all-reduce,
once in the barrier sum of the sync at step 10 and once in torchft's pseudo-gradient sync at
step 20.
"""

from __future__ import annotations

import pytest
import test_per_step_e2e as e2e
import torch
from ddplab.checkpoint import CheckpointStore
from ddplab.records import read_jsonl
from test_ft_commit_records import in_process_replica

lighthouse = e2e.lighthouse  # the fixture: a lighthouse process on a free port

pytestmark = pytest.mark.slow

SETTINGS = dict(max_steps=30, sync_every=10, eval_interval=30, ckpt_interval=100,
                fault_tolerance="diloco", sample_chars=0)
BARRIER_FAILS = "gloo all-reduce of the barrier failed (injected)"
SYNC_FAILS = "gloo all-reduce of the pseudo-gradients failed (injected)"


def records(trainer) -> list[dict]:
    return [r for path in sorted((trainer.out / "metrics").glob("*.jsonl")) for r in read_jsonl(path)[0]]


def final_model(trainer) -> dict[str, torch.Tensor]:
    store = CheckpointStore(trainer.out / "checkpoints")
    return store.load(store.steps()[-1])["model"]


def inject_failures(trainer) -> list[tuple[int, str]]:
    """Make the first sum of the sync at step 10 and the first fragment sync at step 20 fail as a
    lost peer makes them fail; returns the log of (step, what failed)."""
    engine = trainer.engine
    replica, fragment = engine.replica, engine.fragment
    real_sum, real_perform = replica.sum, fragment.perform_sync
    failed: list[tuple[int, str]] = []

    def summing(tensor):
        if engine.sync_due() and trainer.step == 10 and not failed:
            replica.manager.report_error(RuntimeError(BARRIER_FAILS))
            failed.append((trainer.step, "barrier"))
        return real_sum(tensor)

    def performing():
        if trainer.step == 20 and len(failed) == 1:
            replica.manager.report_error(RuntimeError(SYNC_FAILS))
            failed.append((trainer.step, "sync"))
        return real_perform()

    replica.sum, fragment.perform_sync = summing, performing
    return failed


def test_a_failed_sync_is_attempted_again_and_loses_no_inner_step(
        tmp_path, data_path, lighthouse, tiny, clean_env, capsys):
    with in_process_replica(tmp_path / "plain", data_path, lighthouse, tiny, clean_env, **SETTINGS) as plain:
        plain.setup()
        plain.loop()
        plain.finish()
    with in_process_replica(tmp_path / "failed", data_path, lighthouse, tiny, clean_env,
                            **SETTINGS) as trainer:
        trainer.setup()
        failed = inject_failures(trainer)
        trainer.loop()
        trainer.finish()
    assert failed == [(10, "barrier"), (20, "sync")]
    recs = records(trainer)
    steps = [r for r in recs if r["event"] == "step"]
    assert [r["step"] for r in steps] == list(range(1, 31))  # every inner step once
    assert [r["step"] for r in steps if r.get("sync")] == [1, 11, 21]  # each sync committed
    uncommitted = [r for r in recs if r["event"] == "uncommitted"]
    assert [(r["attempted_step"], r["sync"], r["error"]) for r in uncommitted] == [
        (11, True, f"RuntimeError: {BARRIER_FAILS}"), (21, True, f"RuntimeError: {SYNC_FAILS}")]
    # nothing of the rounds was lost: the same model as the run whose syncs never failed
    weights, expected = final_model(trainer), final_model(plain)
    assert weights.keys() == expected.keys() and all(torch.equal(weights[k], expected[k]) for k in weights)
    vals = [[r["val_loss"] for r in records(t) if r["event"] == "val"] for t in (plain, trainer)]
    assert vals[0] == vals[1] and vals[0]
    assert "step 20: sync not committed" in capsys.readouterr().out
