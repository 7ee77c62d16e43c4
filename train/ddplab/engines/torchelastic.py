"""The ``torchelastic`` engine: DDP over torchrun's world, restart-the-world on a change.

The group is torchrun's world for the whole life of a worker: ``WORLD_SIZE`` ranks in one gloo
process group (ddplab.distributed). DDP averages the gradients during the last backward pass of a
step through the timed comm hook (ddplab.distributed.TimedAllReduce, or with ``grad_compression``
ddplab.compression's hook around it: fp16, bf16, PowerSGD), the divergence guard adds two
numbers over the ranks, and every step commits: a failed collective raises, the worker saves its
last completed step and exits, and torchrun restarts every worker of the new world (the core
agrees on the newest checkpoint at each start). The batch plan is fixed at the start
(ddplab.lr.plan_batch at ``WORLD_SIZE``); micro-step ``m`` of rank ``r`` takes the samples of
ddplab.data.rank_sample_indices, so keep_global with accumulation reads the same samples at
every world size. With ``batch_balance: speed`` the ranks' shares follow their speeds
(ddplab.balance: contiguous blocks, each rank's micro-batches weighted by their samples).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import sys
import time
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from ddplab import compression
from ddplab.balance import plan_samples, weighted_micro_batches
from ddplab.data import mix, rank_sample_indices
from ddplab.distributed import init_process_group, wait
from ddplab.engines.base import (
    Commit,
    Decision,
    Engine,
    LocalResult,
    MicroBatch,
    Segment,
    Started,
    StepPlan,
)
from ddplab.lr import plan_batch

if TYPE_CHECKING:
    from ddplab.config import TrainConfig


class TorchElastic(Engine):
    """DDP over torchrun's world (see the module doc)."""

    name = "torchelastic"

    def check(self, check_only: bool) -> None:
        """keep_global with a ``global_batch_size`` this world size does not divide.

        Raises:
            BatchPolicyError: one line naming a size every expected world size divides.
        """
        cfg = self.cfg
        if cfg.batch_policy == "keep_global" and cfg.global_batch_size is not None:
            plan_batch(cfg.batch_policy, self.env.world_size, cfg.per_rank_batch_size,
                       cfg.reference_batch_size, cfg.global_batch_size)

    @classmethod
    def parameter_copies(cls, cfg: TrainConfig, world_size: int) -> int:
        """DDP's gradient buckets above one rank, and PowerSGD's error feedback beside them."""
        if world_size <= 1:
            return 0
        return 2 if cfg.grad_compression == "powersgd" else 1

    def connect(self) -> None:
        """Join the gloo process group of torchrun's world (``pg_timeout_s`` per collective; a
        peer that answers nothing for ``peer_timeout_s`` fails the collective as a crashed one
        does, ddplab.distributed.bound_unanswered)."""
        env = self.env
        if (env.rank == 0 and env.distributed and os.environ.get("TORCHELASTIC_RUN_ID")
                and os.environ.get("TORCH_DISABLE_SHARE_RDZV_TCP_STORE") != "1"):
            print("[ddplab] warning: TORCH_DISABLE_SHARE_RDZV_TCP_STORE is not 1: with torch's shared "
                  "bootstrap store a restarted worker group can read the previous round's gloo "
                  "addresses and fail to connect; set it in torchrun's environment",
                  file=sys.stderr, flush=True)
        init_process_group(env, self.cfg.pg_timeout_s, self.cfg.peer_timeout_s)

    def attach(self) -> Started:
        """Wrap the model in DDP with the timed comm hook of ``grad_compression`` (more than one
        rank; ddplab.compression.comm_hook); a history segment opens at every (re)start."""
        run, env, cfg = self.run, self.env, self.cfg
        self.batch = run.plan
        self.grad_compression = cfg.grad_compression
        self.grad_shapes = compression.grad_shapes(run.model)
        self.comm, hook = compression.comm_hook(
            cfg.grad_compression, env.world_size, powersgd_rank=cfg.powersgd_rank,
            powersgd_start_step=cfg.powersgd_start_step, seed=cfg.seed)
        self.ddp: torch.nn.Module = run.model
        if env.distributed:
            self.ddp = DDP(run.model, bucket_cap_mb=cfg.bucket_cap_mb)
            self.ddp.register_comm_hook(self.comm, hook)
            self._settle_buckets()
            if isinstance(self.comm, compression.CompressedAllReduce):
                self.comm.start(run.step)  # the settling pass is not a step of the run
        b = self.batch
        line = (f"{run.start_text()}; world_size {env.world_size}, restart {env.restart_count}, "
                f"{b.batch_policy}: global batch {b.global_batch_size} = {env.world_size} x "
                f"{b.per_rank_batch_size} x {b.grad_accum_steps}, lr x{b.lr_scale:.3g}")
        return Started(model=self.ddp, fields={}, line=line, segment=Segment(env.world_size))

    def _settle_buckets(self) -> None:
        """One throw-away forward/backward so that DDP builds its final gradient buckets now.

        DDP first buckets the gradients in reverse parameter order and rebuilds the buckets in
        gradient-ready order after the first backward. The position of a value in a bucket decides
        the order in which the ring all-reduce adds the ranks' contributions, so without this pass
        the first step after every (re)start would round differently from the same step of an
        uninterrupted run. With it, every optimizer step uses the same layout and a resumed run is
        bit-identical to an uninterrupted one at the same world size. The gradients are discarded.
        """
        x = torch.zeros(1, self.cfg.block_size, dtype=torch.long)
        _, loss = self.ddp(x, x)
        loss.backward()
        self.run.optimizer.zero_grad(set_to_none=True)
        self.comm.reset()

    def no_sync(self) -> contextlib.AbstractContextManager[Any]:
        """DDP's ``no_sync`` (alone: nothing to hold back)."""
        return self.ddp.no_sync() if self.env.distributed else contextlib.nullcontext()

    def plan(self) -> StepPlan:
        """The start's batch plan; micro-step ``m`` takes rank_sample_indices(samples_seen, rank,
        world size, micro-batch, m), its dropout seeded by (seed, step, rank, m). Balanced
        (``run.balance`` splits): this rank's share of the global batch in micro-batches of at most
        ``per_rank_batch_size`` (ddplab.balance.weighted_micro_batches)."""
        run, env, b, cfg = self.run, self.env, self.batch, self.cfg
        run.optimizer.zero_grad(set_to_none=True)
        self.comm.reset()
        group = self.world
        split = run.balance.split(group, b.global_batch_size)
        if split is not None:
            micro = weighted_micro_batches(split.indices, cfg.per_rank_batch_size, group.size,
                                           b.global_batch_size, cfg.seed, run.step)
            batch = dataclasses.replace(b, per_rank_batch_size=len(split.indices),
                                        grad_accum_steps=len(micro))
            return StepPlan(group, batch, micro)
        micro = tuple(
            MicroBatch(rank_sample_indices(run.samples_seen, env.rank, env.world_size,
                                           b.per_rank_batch_size, m),
                       mix(cfg.seed, run.step, env.rank, m), weight=1.0, accum=b.grad_accum_steps)
            for m in range(b.grad_accum_steps))
        return StepPlan(group, b, micro)

    def reduce_gradients(self, plan: StepPlan) -> float:
        """Nothing left to do: DDP's comm hook averaged them in the last backward; its seconds."""
        return self.comm.seconds

    def decide(self, plan: StepPlan, local: LocalResult) -> Decision:
        """One all-reduce of [this rank's part of the mean loss, "its gradient norm is not
        finite"] (none when alone): every rank decides on the same values, none hangs. A rank's
        part weighs each micro-batch's loss as its backward did (``weight / accum``), so the sum
        over the ranks / world size is the mean over the global batch, also with unequal shares."""
        pairs = list(zip(local.losses, plan.micro_batches, strict=True))
        part = sum(loss * m.weight / m.accum for loss, m in pairs)
        local_loss = sum(loss * len(m.indices) for loss, m in pairs) / max(1, plan_samples(plan))
        bad = 0.0 if math.isfinite(local.grad_norm) else 1.0
        mean_loss, any_bad, comm_s = part, bool(bad), 0.0
        if dist.is_initialized():
            t0 = time.perf_counter()
            both = torch.tensor([part, bad], dtype=torch.float64)
            wait(dist.all_reduce(both, op=dist.ReduceOp.SUM, async_op=True))
            mean_loss, any_bad = float(both[0]) / self.env.world_size, bool(both[1] > 0)
            comm_s = time.perf_counter() - t0
        return Decision(mean_loss, local_loss, any_bad, comm_s)

    def grad_bytes(self, plan: StepPlan) -> int:
        """D of the step just committed under ``grad_compression`` (ddplab.compression.payload_bytes;
        PowerSGD counts its plain start steps)."""
        cfg = self.cfg
        return compression.payload_bytes(self.grad_compression, self.grad_shapes, self.run.step,
                                         cfg.powersgd_rank, cfg.powersgd_start_step)

    def commit(self, plan: StepPlan) -> Commit:
        """Every step that reached this point commits (a failed collective raised before)."""
        self.run.optimizer.step()
        return Commit(committed=True)


ENGINE = TorchElastic
