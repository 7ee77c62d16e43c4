"""per_step: a ``step`` record describes a committed step only (issue 14, item 1).

The newcomer saw, under per_step, the same step number twice in one replica's records (an attempt
at world size 3 whose vote failed, written as a ``step`` record with ``committed: false``, then the
committed step at world size 2), and status read laptop-c at ``120/500`` while it ran and
``119/500`` after it ended. torchft's ``Manager.should_commit`` decides per replica group whether
its optimizer steps ("the optimizer must only be stepped if this returns True"); a failed vote
applies nothing and the step is attempted again. So a failed attempt writes an ``uncommitted``
record (``attempted_step``), never a ``step`` record.

One replica in this process (ddplab.train.Trainer with the real torchft Manager) under a real
lighthouse on localhost; the commit of one attempt fails because a collective error is reported
to the Manager, as torchft does when an all-reduce fails.
"""

from __future__ import annotations

import contextlib

import pytest
import test_per_step_e2e as e2e
from labharness import free_port

lighthouse = e2e.lighthouse  # the fixture: a lighthouse process on a free port

pytestmark = pytest.mark.slow

FAILED_ATTEMPT = 3  # the third attempt's vote fails (the first attempt at step 3)


@contextlib.contextmanager
def in_process_replica(out, data_path, lighthouse, tiny, clean_env, **settings):
    """A ddplab.train.Trainer in this process: one replica group (the real torchft Manager) of
    ``lighthouse`` named node0, ``settings`` over a tiny run's; closed on exit."""
    from ddplab.config import parse_args
    from ddplab.distributed import DistEnv
    from ddplab.train import Trainer

    clean_env.setenv("DDPLAB_GLOO_ADDR", "127.0.0.1")
    clean_env.setenv("RUST_LOG", "warn")
    clean_env.delenv("DDPLAB_RDZV_ENDPOINT", raising=False)
    cfg, _ = parse_args(tiny(out, data_path, ft_lighthouse=lighthouse, ft_replica_id="node0",
                             ft_manager_port=free_port(), **settings))
    trainer = Trainer(cfg, DistEnv.from_environ())
    trainer.validate_inputs()
    trainer.guard.install()
    try:
        yield trainer
    finally:
        trainer.guard.uninstall()
        trainer.engine.close()
        if trainer.metrics:
            trainer.metrics.close()


@pytest.fixture
def trainer(tmp_path, data_path, lighthouse, tiny, clean_env):
    with in_process_replica(tmp_path / "out", data_path, lighthouse, tiny, clean_env, max_steps=6,
                            eval_interval=100, ckpt_interval=100, fault_tolerance="per_step") as trainer:
        yield trainer


def test_a_step_whose_commit_fails_writes_no_step_record(trainer, capsys):
    from ddplab.records import read_jsonl

    trainer.setup()
    replica = trainer.engine.replica
    average, attempts = replica.average_gradients, []

    def failing_on_one_attempt(params):
        seconds = average(params)
        attempts.append(trainer.step + 1)
        if len(attempts) == FAILED_ATTEMPT:  # what torchft does when the all-reduce failed
            replica.manager.report_error(RuntimeError("all-reduce failed (injected)"))
        return seconds

    replica.average_gradients = failing_on_one_attempt
    trainer.loop()
    records = [r for path in sorted((trainer.out / "metrics").glob("*.jsonl")) for r in read_jsonl(path)[0]]

    assert attempts == [1, 2, 3, 3, 4, 5, 6]  # the failed attempt was made again, nothing skipped
    steps = [r for r in records if r["event"] == "step"]
    assert [r["step"] for r in steps] == [1, 2, 3, 4, 5, 6]  # unique: one record per committed step
    assert all(r["committed"] is True for r in steps)
    (uncommitted,) = [r for r in records if r["event"] == "uncommitted"]
    assert uncommitted["attempted_step"] == 3 and uncommitted["committed"] is False
    assert "step" not in uncommitted  # no reader takes it for the step the replica is at
    assert uncommitted["error"] == "RuntimeError: all-reduce failed (injected)"
    assert uncommitted["participants"] == 1 and uncommitted["engine"] == "per_step"
    # the attempt's samples were not trained: the committed step 3 takes the same ones again
    assert uncommitted["samples"] == next(r["samples"] for r in steps if r["step"] == 3)
    assert trainer.step == 6 and replica.step == 6
    out = capsys.readouterr().out
    assert "step 3 not committed (quorum" in out and "3/6 NOT COMMITTED" not in out


def test_an_uncommitted_attempt_record_is_the_detection_of_a_fault(tmp_path):
    """ddplab.faults reads the ``uncommitted`` record as the step records with ``committed:
    false`` before it: the survivors' failed vote is when the group noticed the fault, and it
    never counts as a step (detected_s, last_step_before and steps_lost as before the change)."""
    from test_faults import T0, Run
    from test_faults_per_step import AB, PS, start, steps

    run = Run(tmp_path)
    start(run, (*AB, "laptop-c"), T0 - 1)
    steps(run, (*AB, "laptop-c"), 1, 20, T0)  # step 20 at T0+19
    run.fault("kill-agent", "laptop-c", T0 + 19.5, rank=2)
    for rank, h in enumerate(AB):  # the survivors' vote on step 21 failed: retried
        run.rec(h, "uncommitted", T0 + 20.0 + 0.001 * rank, rank, 3, attempted_step=21,
                participants=3, quorum_id=1, committed=False, **PS)
    steps(run, AB, 21, 30, T0 + 20.6, quorum_id=2)
    (m,) = run.measures()
    assert m.detected_s == pytest.approx(0.5) and m.detected_by == "uncommitted step on laptop-a"
    assert m.recovered_s == pytest.approx(1.1) and (m.world_size_before, m.world_size_after) == (3, 2)
    assert (m.last_step_before, m.steps_lost) == (20, 0)
