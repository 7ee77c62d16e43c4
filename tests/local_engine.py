"""A test-only recovery engine: one process, no group, no library (tests/test_engine_interface.py).

It is added to a run the way any engine is: this module (an ``ENGINE`` class implementing
ddplab.engines.base.Engine) and one line in the registry (the test sets
``ddplab.engines.ENGINES["local"]``). Besides training it uses what the interface gives an engine
beyond the happy path, each switched on by a module setting the test chooses:

* ``HOLD_EVERY``: every n-th attempt is held back before anything is computed (:class:`Retry`);
* ``REFUSE_STEP``: the first attempt at that step is not committed (an ``uncommitted`` record);
* ``STOP_AT_STEP``: the attempt at that step raises :class:`LocalStop`, which the engine maps to
  exit code :data:`EXIT_LOCAL_STOP` with cause ``local_stop`` (the core saves the last step);
* its own state in every checkpoint (``local_engine``: commits and attempts so far).
"""

from __future__ import annotations

from enum import Enum
from typing import Any

import numpy as np
from ddplab.data import mix
from ddplab.engines import base

HOLD_EVERY: int | None = None
REFUSE_STEP: int | None = None
STOP_AT_STEP: int | None = None
EXIT_LOCAL_STOP = 5


class LocalHeld(Enum):
    TEST_HOLD = "held back by the test's HOLD_EVERY"


class LocalStop(RuntimeError):
    """The engine's own way to end a run (the test's STOP_AT_STEP)."""


class Local(base.Engine):
    """Plain single-process training: the global batch of the start's plan, in contiguous
    micro-batches of at most ``per_rank_batch_size``, each weighted by its share of it."""

    name = "local"

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.attempts = self.commits = 0
        self.refused = False

    def check(self, check_only: bool) -> None:
        if self.env.world_size != 1:
            raise ValueError(f"fault_tolerance local runs alone, not WORLD_SIZE={self.env.world_size}")

    def attach(self) -> base.Started:
        self.batch = self.run.plan
        return base.Started(model=self.run.model, fields={"local_engine": True},
                            line=f"{self.run.start_text()}; local engine", segment=base.Segment(1))

    def plan(self) -> base.StepPlan | base.Retry:
        run, cfg, batch = self.run, self.cfg, self.batch
        self.attempts += 1
        if HOLD_EVERY and self.attempts % HOLD_EVERY == 0:
            return base.Retry(LocalHeld.TEST_HOLD)
        if STOP_AT_STEP is not None and run.step + 1 == STOP_AT_STEP:
            raise LocalStop(f"stopped before step {STOP_AT_STEP}")
        run.optimizer.zero_grad(set_to_none=True)
        gb, size = batch.global_batch_size, cfg.per_rank_batch_size
        indices = np.arange(run.samples_seen, run.samples_seen + gb, dtype=np.int64)
        micro = tuple(base.MicroBatch(indices[i:i + size], mix(cfg.seed, run.step, i),
                                 weight=len(indices[i:i + size]) / gb)
                      for i in range(0, gb, size))
        return base.StepPlan(self.world, batch, micro)

    def reduce_gradients(self, plan: base.StepPlan) -> float:
        return 0.0  # alone: the gradients are the average already

    def decide(self, plan: base.StepPlan, local: base.LocalResult) -> base.Decision:
        mean = sum(loss * len(m.indices) for loss, m in zip(local.losses, plan.micro_batches,
                                                             strict=True)) / plan.batch.global_batch_size
        return base.Decision(mean, mean, not np.isfinite(local.grad_norm), 0.0)

    def commit(self, plan: base.StepPlan) -> base.Commit:
        step = self.run.step + 1
        if step == REFUSE_STEP and not self.refused:
            self.refused = True
            return base.Commit(committed=False, fields={"engine": self.name},
                               note="(the test refused it once): attempted again")
        self.run.optimizer.step()
        self.commits += 1
        return base.Commit(committed=True, fields={"engine": self.name}, log=step == REFUSE_STEP)

    def state_dict(self) -> dict[str, Any]:
        return {"local_engine": {"commits": self.commits, "attempts": self.attempts}}

    def failure(self, exc: BaseException) -> base.Failure | None:
        if isinstance(exc, LocalStop):
            return base.Failure(EXIT_LOCAL_STOP, "local_stop", {"local_commits": self.commits})
        return None


ENGINE = Local
