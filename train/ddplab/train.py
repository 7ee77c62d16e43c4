"""Entry point: ``python -m ddplab.train [--config run.json] [--key value ...]``.

Runs alone (rank 0 of 1) or as one worker under ``torchrun``. The :class:`Trainer` reads like a
training script: inputs, the run's setup (data, checkpoint agreement, model, optimizer, the recovery
engine), the loop (``while step < max_steps``: plan -> forward/backward -> the engine reduces,
decides, commits -> evaluation and checkpoints), the end, and the failure path. How the replicas
of a run keep in step is the engine's (``fault_tolerance``; ddplab.engines: one interface, one
module per engine, chosen once in :class:`Trainer`'s constructor).

Every (re)start agrees with the other ranks on the newest valid checkpoint and resumes from it.
When a collective fails or the agent stops the worker (SIGTERM), the worker saves the last
*completed* step before it exits non-zero, so the restarted group loses no step. See
docs/training.md.

Exit codes: 0 finished ``max_steps``; 1 training failed (after an emergency checkpoint when
possible); 2 bad input or an output that cannot be written (one line, before the first step where
it can be known); 3 training diverged (the step was not applied, no checkpoint written; see
ddplab.divergence); an engine's own failures have codes of their own (ddplab.exit_codes: 4, cut
off from the group); 128 + signal when stopped by a signal.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import signal
import sys
import time
import traceback
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch
import torch.distributed as dist

from ddplab import balance, cpushare, engines, memory, telemetry, wire
from ddplab.checkpoint import CheckpointError, CheckpointStore, deserialize
from ddplab.config import MODEL_SHAPE_FIELDS, ConfigError, TrainConfig, parse_args
from ddplab.data import (
    STREAM_TRAIN,
    STREAM_TRAIN_EVAL,
    STREAM_VAL_EVAL,
    CharDataset,
    DataError,
    WindowSampler,
    dataset_present,
    get_batch,
    load_dataset,
)
from ddplab.distributed import DistEnv, agree_on_checkpoint, all_reduce_scalar, destroy_process_group
from ddplab.divergence import EXIT_DIVERGED, Diverged, divergence_reason
from ddplab.engines.base import Commit, Decision, Group, LocalResult, Retry, Segment, StepPlan
from ddplab.lr import BatchPlan, BatchPolicyError, lr_at, plan_batch, ramp_lr_scale
from ddplab.metrics import UNCOMMITTED_EVENT, MetricsWriter
from ddplab.model import GPT, GPTConfig
from ddplab.outputs import OutputError, atomic_write_text, check_writable_dir
from ddplab.records import read_jsonl
from ddplab.signals import SignalGuard, Terminated

CHECKPOINT_FORMAT = 1
EXIT_OK, EXIT_FAILED, EXIT_BAD_INPUT = 0, 1, 2
#: Most rounds (each ended by a sum over the group) of an evaluation.
EVAL_ROUNDS = 8
#: Errors that mean bad input or an unwritable output: one line, exit 2.
INPUT_ERRORS = (DataError, CheckpointError, BatchPolicyError, OutputError, ValueError)


class Evaluation(NamedTuple):
    """An evaluation made inside a step's group, recorded when that step commits."""

    val_loss: float
    train_loss: float
    seconds: float


class Trainer:
    """One worker's run: inputs, setup, the training loop, evaluation, checkpoints, metrics."""

    def __init__(self, cfg: TrainConfig, env: DistEnv) -> None:
        self.cfg = cfg
        self.env = env
        self.out = Path(cfg.out_dir)
        self.guard = SignalGuard()
        self.session_start = time.time()
        # state of the run (filled by setup / restore)
        self.step = 0
        self.samples_seen = 0
        self.history: list[dict[str, Any]] = []
        self.first_start_time = self.session_start
        self.first_global_batch: int | None = None
        self.world_size = env.world_size  # the group size of the last committed step
        self.consistent = True  # model/optimizer hold a whole step (False inside the update)
        self.metrics: MetricsWriter | None = None
        self.last_train_loss: float | None = None
        self.last_val: tuple[float, float] | None = None
        self.last_val_step: int | None = None
        self.session_tokens = 0
        self.loop_seconds = 0.0
        self.resumed_from: int | None = None
        self.fresh_start_reason: str | None = None
        # how the replicas keep in step: the one place an engine is chosen (ddplab.engines)
        self.engine = engines.engine_class(cfg.fault_tolerance)(cfg, env, self)
        # batch_balance: how the engines deal a step's global batch to its group (ddplab.balance)
        self.balance = balance.for_config(cfg, self, rank0=env.rank == 0)

    # --- inputs: everything that can reject bad input runs before anything is written ---------
    def validate_inputs(self, check_only: bool = False) -> None:
        """The engine's settings, dataset, block size, memory (ddplab.memory), output folders.

        ``check_only`` (``--check``) changes nothing on disk: a missing dataset is not downloaded
        (``self.data`` stays None) and the folders are not created. A run creates the output
        folders and probes that it can write each, before the process group and the first step.

        Raises:
            DataError, CheckpointError, OutputError, BatchPolicyError, ValueError: one clear
            message each.
        """
        cfg = self.cfg
        self.engine.check(check_only)
        self.data: CharDataset | None = None
        if not check_only or dataset_present(cfg.data_path, cfg.data_url):
            self.data = load_dataset(cfg.data_path, cfg.data_url, cfg.data_sha256)
            self.data.check_block_size(cfg.block_size)
            self.model_vocab_size()  # raises ValueError: vocab_size below the dataset's
        # raises MemoryFitError (a ValueError): the estimated peak exceeds the node's memory
        self.memory = memory.check_fits(cfg, self.model_vocab_size() if self.data else None,
                                        self.env.world_size, self.env.local_world_size)
        self.store = CheckpointStore(self.out / "checkpoints", cfg.keep_checkpoints,
                                     accept=self._incompatibility)
        self.store.check(create=False)
        self.store.refuse_not_ours()
        for folder, what in ((self.out, "output"), (self.store.dir, "checkpoint"),
                             (self.out / "metrics", "metrics")):
            check_writable_dir(folder, what, create=not check_only)

    def threads(self) -> int:
        """Intra-op threads: ``threads``, else the rule of :mod:`ddplab.cpushare` on this process's
        CPU share (cgroup quota, affinity, physical cores) and its local workers."""
        if self.cfg.threads:
            return self.cfg.threads
        return cpushare.threads_for(cpushare.read_share().share, self.env.local_world_size)

    # --- setup: the group, the agreed checkpoint, model, optimizer, engine --------------------
    def setup(self) -> None:
        cfg, env = self.cfg, self.env
        self.store.check(create=True)
        torch.set_num_threads(self.threads())
        self.engine.connect()
        self.metrics = MetricsWriter(self.out / "metrics", env.host, env.rank, env.local_rank,
                                     env.world_size, env.restart_count)
        agreement = agree_on_checkpoint(self.store)
        for path, why in agreement.local.rejected:
            print(f"[rank {env.rank}] skipping checkpoint {path}: {why}", file=sys.stderr, flush=True)
        self._refuse_silent_fresh_start(agreement.step is None, agreement.local)
        self.resumed_from = agreement.step  # None: fresh start (set again below, same value)
        self._refuse_repeated_divergence(agreement.step)
        state = None
        if agreement.data is not None:
            state = deserialize(agreement.data)

        torch.manual_seed(cfg.seed)  # identical initial weights on every rank
        gcfg = GPTConfig(vocab_size=self.model_vocab_size(), block_size=cfg.block_size,
                         n_layer=cfg.n_layer, n_head=cfg.n_head, n_embd=cfg.n_embd, dropout=cfg.dropout)
        self.model = GPT(gcfg)
        self.optimizer = torch.optim.AdamW(
            self.model.param_groups(cfg.weight_decay), lr=cfg.base_lr, betas=(cfg.beta1, cfg.beta2),
        )
        if state is not None:
            self.apply_state(state)
            self.engine.load_state(state)
            if env.local_rank == 0 and not agreement.local_has_it:
                # this node rejoined without that checkpoint: keep a local copy right away
                with self.guard.critical():
                    saved = self.store.save_bytes(self.step, agreement.data)
                if saved.written:
                    self.metrics.write("checkpoint", step=saved.step, path=str(saved.path),
                                       bytes=saved.bytes, seconds=round(saved.seconds, 4),
                                       reason="catch-up")
        self.resumed_from = self.step if state is not None else None

        global_batch = cfg.global_batch_size or self.first_global_batch
        self.plan: BatchPlan = plan_batch(cfg.batch_policy, env.world_size, cfg.per_rank_batch_size,
                                          cfg.reference_batch_size, global_batch)
        if self.first_global_batch is None:
            self.first_global_batch = self.plan.global_batch_size
        self.train_sampler = WindowSampler(len(self.data.train), cfg.block_size, cfg.seed, STREAM_TRAIN)
        self.eval_samplers = {
            "val": (self.data.val, WindowSampler(len(self.data.val), cfg.block_size, cfg.seed,
                                                 STREAM_VAL_EVAL)),
            "train": (self.data.train, WindowSampler(len(self.data.train), cfg.block_size, cfg.seed,
                                                     STREAM_TRAIN_EVAL)),
        }

        started = self.engine.attach()
        self.module = started.model  # forward/backward run through the engine's wrapper
        self.wire = wire.NicMeter(wire.gloo_interface(env.gloo_addr))  # bytes on the wire per step
        if started.segment is not None:
            self.open_segment(started.segment, self.session_start)
        self.metrics.write(
            "start", resumed_from_step=self.resumed_from, samples_seen=self.samples_seen,
            batch_policy=self.plan.batch_policy, per_rank_batch_size=self.plan.per_rank_batch_size,
            global_batch_size=self.plan.global_batch_size, grad_accum_steps=self.plan.grad_accum_steps,
            lr_scale=self.plan.lr_scale, reference_batch_size=self.plan.reference_batch_size,
            threads=torch.get_num_threads(), params=self.model.num_params(),
            checkpoint_holder_rank=agreement.holder, max_steps=cfg.max_steps, run_id=cfg.run_id,
            pid=os.getpid(), fresh_start_reason=self.fresh_start_reason,
            engine=cfg.fault_tolerance, batch_balance=cfg.batch_balance, **started.fields,
        )
        if env.rank == 0:
            print(f"[ddplab] {started.line}, {self.model.num_params():,} params, "
                  f"{torch.get_num_threads()} threads", flush=True)

    def model_vocab_size(self) -> int:
        """Rows of the model's embedding and output head: ``vocab_size`` (a padded vocabulary),
        else the dataset's characters.

        Raises:
            ValueError: ``vocab_size`` is below the dataset's characters.
        """
        chars = len(self.data.vocab)
        size = self.cfg.vocab_size or chars
        if size < chars:
            raise ValueError(f"config key 'vocab_size' = {size}: below the dataset's {chars} characters; "
                             "fix: null (the dataset's) or a larger number")
        return size

    def start_text(self) -> str:
        """How this start began, for its console line: "resumed from step N" or "fresh start"
        (with the reason when ``allow_fresh_start`` let it start over)."""
        how = f"resumed from step {self.step}" if self.resumed_from is not None else "fresh start"
        if self.fresh_start_reason:
            how += f" (allow_fresh_start: {self.fresh_start_reason})"
        return how

    def _incompatibility(self, state: dict[str, Any]) -> str | None:
        """Why a loaded checkpoint state cannot resume this run (None: it can). The store's
        ``accept`` test, part of the one validity definition (ddplab.checkpoint)."""
        saved = state.get("config", {})
        saved = saved if isinstance(saved, dict) else {}
        diffs = [f"{k}: checkpoint {saved.get(k)!r}, config {getattr(self.cfg, k)!r}"
                 for k in (*MODEL_SHAPE_FIELDS, "seed") if saved.get(k) != getattr(self.cfg, k)]
        if self.data is not None and state.get("vocab") != self.data.vocab.chars:
            diffs.append("vocabulary differs (another dataset)")
        if diffs:
            return f"does not match this run ({'; '.join(diffs)})"
        written_by = saved.get("run_id")
        if written_by not in (self.cfg.run_id, self.cfg.adopt_run_id):
            return (f"was written by run {written_by!r}, not this run {self.cfg.run_id!r} (to "
                    f"continue from it: adopt_run_id {written_by!r}, --adopt-run-id; playbook: "
                    "ddp_job_adopt_run_id)")
        return None

    def config_sha256(self) -> str:
        """SHA-256 of the configuration (sorted JSON): equal settings give equal digests."""
        text = json.dumps(self.cfg.to_dict(), sort_keys=True, default=str)
        return hashlib.sha256(text.encode()).hexdigest()

    def _refuse_repeated_divergence(self, resume_step: int | None) -> None:
        """After a torchrun restart, stop at once when the attempt before this one diverged
        from the same checkpoint step (``resume_step``, None: fresh start), in the same group
        (the engine's :meth:`~ddplab.engines.base.Engine.replays`) and with the same configuration:
        resuming would replay the same steps into the same divergence (a resume at equal world
        size is bit-identical). A first launch always trains.
        Every rank takes part in the all-reduce, so all of them stop or none.

        Raises:
            Diverged: with the step, loss and gradient norm of the recorded divergence.
        """
        env, previous = self.env, None
        if env.restart_count > 0 and self.metrics and self.metrics.path.exists():
            failures = [r for r in read_jsonl(self.metrics.path)[0] if r.get("event") == "failure"]
            last = failures[-1] if failures else {}
            if (last.get("cause") == "divergence" and last.get("restart_count") == env.restart_count - 1
                    and self.engine.replays(last)
                    and last.get("resumed_from_step", -1) == resume_step
                    and last.get("config_sha256") == self.config_sha256()):
                previous = last
        if all_reduce_scalar(float(previous is not None), "max") == 0:
            return
        previous = previous or {}
        failed = previous.get("failed_step", previous.get("step", resume_step or 0))
        loss, grad_norm = previous.get("loss"), previous.get("grad_norm")
        raise Diverged(failed, f"restart {env.restart_count} would repeat it: restart "
                       f"{env.restart_count - 1} diverged there from the same checkpoint (step "
                       f"{resume_step or 0}), world size and settings",
                       float("nan") if loss is None else loss,
                       float("nan") if grad_norm is None else grad_norm)

    def _refuse_silent_fresh_start(self, none_agreed: bool, local: Any) -> None:
        """Checkpoints exist somewhere but none is valid: stop, unless ``allow_fresh_start``.

        Every rank takes part in the all-reduce, so all of them stop or all start over.

        Raises:
            CheckpointError: one line listing this node's unusable checkpoints and the fix.
        """
        if not none_agreed:
            return
        found = all_reduce_scalar(float(local.found_unusable), "max") > 0
        if not found:
            return
        reasons = [why for _, why in local.rejected] + [
            f"{p.name}: set aside earlier" for p in local.set_aside]
        why = (f"found checkpoints in {self.store.dir} but none is usable: "
               + ("; ".join(reasons) if reasons else "the unusable ones are on another node"))
        if not self.cfg.allow_fresh_start:
            raise CheckpointError(
                f"{why}. Fix or move them (or use the same model config, seed and data), or set "
                "allow_fresh_start (--allow-fresh-start; playbook: ddp_job_allow_fresh_start) "
                "to start over")
        self.fresh_start_reason = why

    # --- state --------------------------------------------------------------------------------
    def state_dict(self, reason: str) -> dict[str, Any]:
        return {
            "format": CHECKPOINT_FORMAT,
            "step": self.step,
            "samples_seen": self.samples_seen,
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "config": self.cfg.to_dict(),
            "vocab": self.data.vocab.chars,
            "world_size_history": self.history,
            "first_start_time": self.first_start_time,
            "first_global_batch_size": self.first_global_batch,
            "train_loss": self.last_train_loss,  # mean loss of the last logged step (sidecar)
            # Every random draw is a function of (seed, step, rank, micro-step) or of
            # (seed, global sample index), so no generator state needs restoring.
            "rng": {"scheme": "stateless", "seed": self.cfg.seed},
            "saved_by": {"host": self.env.host, "rank": self.env.rank, "reason": reason,
                         "time": time.time()},
            "batch_balance": self.balance.state_dict(),  # the shares and speeds (ddplab.balance)
            **self.engine.state_dict(),
        }

    def apply_state(self, state: dict[str, Any]) -> None:
        """Load a training state (a checkpoint's, or a live peer's)."""
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.step = int(state["step"])
        self.samples_seen = int(state["samples_seen"])
        self.history = list(state.get("world_size_history", []))
        self.first_start_time = float(state.get("first_start_time", self.session_start))
        self.first_global_batch = state.get("first_global_batch_size")
        self.balance.load_state_dict(state.get("batch_balance"))
        rng = state.get("rng", {})
        if isinstance(rng, dict) and isinstance(rng.get("torch"), torch.Tensor):
            torch.set_rng_state(rng["torch"])

    def load_peer_state(self, state: dict[str, Any]) -> None:
        """Apply the state a live peer sent when this worker joined or fell behind (the engine
        receives it: ddplab.engines.base.Run).

        Raises:
            CheckpointError: the peer trains another model, seed or dataset.
        """
        why = self._incompatibility(state)
        if why:
            raise CheckpointError(f"the state received from a live peer {why}: every replica "
                                  "of a run needs the same run.json")
        self.apply_state(state)
        print(f"[ddplab] state of step {self.step} received from a live peer", flush=True)

    def check_signals(self) -> None:
        """:meth:`ddplab.signals.SignalGuard.check`, for an engine (ddplab.engines.base.Run)."""
        self.guard.check()

    def open_segment(self, segment: Segment, at: float) -> None:
        """Open a segment of the world-size history (``world_size_history`` of checkpoints and
        result.json; its ``lr_scale`` drives the LR ramp) at the current step and batch plan."""
        self.history.append({
            "time": round(at, 3), "step": self.step, "world_size": segment.world_size,
            **segment.fields, "restart_count": self.env.restart_count,
            **{k: v for k, v in self.plan.to_dict().items() if k != "world_size"},
        })

    def save_checkpoint(self, reason: str) -> None:
        with self.guard.critical():
            result = self.store.save(self.state_dict(reason))
        if result.written:
            self.metrics.write("checkpoint", step=result.step, path=str(result.path),
                               bytes=result.bytes, seconds=round(result.seconds, 4), reason=reason)
            self.metrics.sync()

    # --- training -----------------------------------------------------------------------------
    def loop(self) -> None:
        cfg, env = self.cfg, self.env
        loop_t0 = time.perf_counter()
        while self.step < cfg.max_steps:
            if not self.train_step():
                continue  # not committed: attempted again, never counted
            done = self.step == cfg.max_steps
            if self.engine.evaluates_in_next_step(self.step):
                continue  # evaluated (then checkpointed) inside the next step's group
            if self.step % cfg.eval_interval == 0 or done:
                self.run_eval()
            if env.local_rank == 0 and (self.step % cfg.ckpt_interval == 0 or done):
                self.save_checkpoint("final" if done else "periodic")
        self.loop_seconds = time.perf_counter() - loop_t0

    def train_step(self) -> bool:
        """One attempt at the next optimizer step; True when it was committed.

        The engine plans the step (its group, this rank's micro-batches), this rank runs forward
        and backward, the engine averages the gradients and returns the group's sums, the
        divergence guard decides (:class:`Diverged`: the step is not applied), and the engine
        commits: the update, the counters and the step's record are one critical section. So a
        failure either leaves the previous step whole, or comes after this step is complete and
        logged: the step a survivor saves is always the last one logged. An attempt the engine
        held back (:class:`~ddplab.engines.base.Retry`) or did not commit changes nothing and is
        attempted again.
        """
        t0 = time.perf_counter()
        self.wire.begin()
        self.guard.check()
        plan = self.engine.plan()
        if isinstance(plan, Retry):
            return False
        self.plan = plan.batch
        evaluated = self.evaluate_before(plan) if self.engine.evaluates_in_next_step(self.step) else None
        lr, lr_scale = self.set_lr(plan.batch)
        work_t0 = time.perf_counter()
        losses = self.forward_backward(plan)
        comm_s = self.engine.reduce_gradients(plan)
        work_s = time.perf_counter() - work_t0 - comm_s  # this rank's own work, waiting excluded
        local = LocalResult(losses, self.clip_gradients())
        decision = self.engine.decide(plan, local)
        self.guard.check()
        if isinstance(decision, Retry):
            return False
        if decision.mean_loss is not None:
            self.check_divergence(decision.mean_loss, decision.any_bad, local.grad_norm)
        self.balance.observe(plan, work_s)  # the group's speeds: one sum when balancing
        with self.guard.critical():
            self.consistent = False
            commit = self.engine.commit(plan)  # the optimizer steps only when the group commits
            if commit.committed:
                self.wire.end(self.engine.grad_bytes(plan), plan.group.size)
                self.advance(plan, commit, evaluated)
            self.consistent = True
            step_s = time.perf_counter() - t0 - (evaluated.seconds if evaluated else 0.0)
            self.metrics.set_common(rank=plan.group.rank, world_size=plan.group.size)
            self.record_attempt(plan, commit, decision, lr, lr_scale, step_s, comm_s + decision.comm_s)
        return commit.committed

    def set_lr(self, batch: BatchPlan) -> tuple[float, float]:
        """Set the learning rate of the next step; return it and its LR scale: the batch plan's
        scale (Goyal et al. 2017), ramped after a change of the global batch
        (:func:`ddplab.lr.ramp_lr_scale` over the run's world-size history), then warmup and
        cosine (:func:`ddplab.lr.lr_at`)."""
        cfg = self.cfg
        segments = [(int(h["step"]), float(h["lr_scale"])) for h in self.history if "lr_scale" in h]
        if not segments or segments[-1][1] != batch.lr_scale:
            segments.append((self.step, batch.lr_scale))
        lr_scale = ramp_lr_scale(segments, self.step, cfg.ramp_steps())
        lr = lr_at(self.step, cfg.base_lr, lr_scale, cfg.warmup_steps, cfg.max_steps, cfg.min_lr_ratio)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        return lr, lr_scale

    def forward_backward(self, plan: StepPlan) -> tuple[float, ...]:
        """This rank's passes; returns each micro-batch's mean loss. Gradients accumulate over
        the micro-batches (the engine's ``no_sync`` holds their communication back until the
        last)."""
        cfg, losses = self.cfg, []
        for i, micro in enumerate(plan.micro_batches):
            x, y = get_batch(self.data.train, self.train_sampler, micro.indices)
            if cfg.dropout > 0:
                torch.manual_seed(micro.dropout_seed)
            last = i == len(plan.micro_batches) - 1
            with contextlib.nullcontext() if last else self.engine.no_sync():
                _, loss = self.module(x, y)
                (loss * micro.weight / micro.accum).backward()
            losses.append(loss.item())
        return tuple(losses)

    def clip_gradients(self) -> float:
        """Clip to ``grad_clip`` (0: no clipping); return the L2 norm of the gradients before.

        ``clip_grad_norm_`` with ``max_norm = inf`` scales by exactly 1.0, so the norm is measured
        without changing the gradients.
        """
        max_norm = self.cfg.grad_clip if self.cfg.grad_clip > 0 else float("inf")
        return float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm))

    def check_divergence(self, mean_loss: float, any_bad: bool, grad_norm: float) -> None:
        """The divergence guard on the group's mean loss and "some gradient norm is not finite".

        Raises:
            Diverged: the step must not be applied (ddplab.divergence).
        """
        cfg = self.cfg
        reason = divergence_reason(mean_loss, float("nan") if any_bad else grad_norm, self.step,
                                   vocab_size=self.model.cfg.vocab_size, warmup_steps=cfg.warmup_steps,
                                   margin=cfg.divergence_margin)
        if reason:
            raise Diverged(self.step + 1, reason, mean_loss, grad_norm)

    def advance(self, plan: StepPlan, commit: Commit, evaluated: Evaluation | None) -> None:
        """The step committed: record the evaluation made inside it, open the history segment
        the engine asked for, and move the run's position by one step and its global batch."""
        gb = plan.batch.global_batch_size
        if evaluated:  # the evaluation of the step before, now that the group agrees on it
            self.record_eval(self.step, evaluated.val_loss, evaluated.train_loss,
                             participants=plan.group.size, eval_s=round(evaluated.seconds, 6))
        if commit.segment is not None:
            self.open_segment(commit.segment, time.time())
        self.step += 1
        self.balance.commit()
        self.samples_seen += gb
        self.session_tokens += gb * self.cfg.block_size
        self.first_global_batch = self.first_global_batch or gb
        self.world_size = plan.group.size

    def record_attempt(self, plan: StepPlan, commit: Commit, decision: Decision, lr: float,
                       lr_scale: float, step_s: float, comm_s: float) -> None:
        """A committed step's ``step`` record at each ``log_interval``-th step, the last one and
        when the engine asks (``Commit.log``); an attempt that did not commit gets an
        ``uncommitted`` record instead (``attempted_step``, ``committed: false``, ``attempt_s`` in
        seconds and the engine's fields), never a ``step`` record: a step record describes a
        committed step only, so a rank's step records have unique, increasing step numbers and
        the progress readers never show a step that is taken back."""
        cfg = self.cfg
        if not commit.committed:
            attempted = self.step + 1
            self.metrics.write(UNCOMMITTED_EVENT, attempted_step=attempted, committed=False,
                               attempt_s=round(step_s, 6), **commit.fields)
            if self.env.rank == 0:
                print(f"[ddplab] step {attempted} not committed {commit.note}", flush=True)
        elif (commit.log or self.balance.changed() or self.step % cfg.log_interval == 0
              or self.step == cfg.max_steps):
            mean_loss = decision.mean_loss if decision.mean_loss is not None else math.nan
            self.log_step(mean_loss, decision.local_loss, lr, lr_scale, step_s, comm_s, plan.batch,
                          **commit.fields, **self.balance.record_fields(plan))

    def log_step(self, mean_loss: float, local_loss: float, lr: float, lr_scale: float,
                 step_s: float, allreduce_s: float, plan: BatchPlan, **extra: Any) -> None:
        """The ``step`` record (and console line) of the last committed step; ``extra`` are the
        engine's fields."""
        cfg, env = self.cfg, self.env
        tokens_per_s = plan.global_batch_size * cfg.block_size / step_s
        self.last_train_loss = mean_loss
        self.metrics.write(
            "step", step=self.step, loss=round(mean_loss, 6),
            local_loss=round(local_loss, 6),
            lr=lr, lr_scale=round(lr_scale, 9), global_batch_size=plan.global_batch_size,
            per_rank_batch_size=plan.per_rank_batch_size, grad_accum_steps=plan.grad_accum_steps,
            samples_seen=self.samples_seen, step_time_s=round(step_s, 6),
            compute_s=round(step_s - allreduce_s, 6), allreduce_s=round(allreduce_s, 6),
            tokens_per_s=round(tokens_per_s, 1), cpu_mhz=telemetry.cpu_mhz(), temp_c=telemetry.temp_c(),
            max_rss_mb=telemetry.max_rss_mb(), grad_compression=self.engine.grad_compression,
            **self.wire.fields(), **extra,
        )
        if env.rank == 0:
            print(f"[ddplab] step {self.step}/{cfg.max_steps} "
                  f"loss {mean_loss:.4f} lr {lr:.2e} ws {plan.world_size} {tokens_per_s:,.0f} tok/s "
                  f"(all-reduce {allreduce_s * 1e3:.1f} ms of {step_s * 1e3:.1f} ms)", flush=True)

    # --- evaluation ---------------------------------------------------------------------------
    @torch.no_grad()
    def eval_sums(self, group: Group) -> torch.Tensor | None:
        """This rank's share of the evaluation, summed over ``group``: the summed per-window
        losses of windows ``rank, rank + size, ...`` of the ``eval_iters * per_rank_batch_size``
        fixed windows of the val and train splits, in batches of ``per_rank_batch_size``.

        A partial [val, train] is summed over the group after each of at most ``EVAL_ROUNDS``
        equal rounds of batches, the same number on every rank: these small collectives keep the
        group in step, so a slower rank is never more than a round behind (well within a
        collective's timeout). Returns a float64 tensor of shape (2,): [val sum, train sum];
        None when a sum failed (``Group.sum`` False).
        """
        cfg = self.cfg
        size = cfg.per_rank_batch_size
        total = cfg.eval_iters * size
        mine = np.arange(group.rank, total, group.size, dtype=np.int64)
        batches = math.ceil(math.ceil(total / group.size) / size)  # rank 0's share, the largest
        per_round = math.ceil(batches / EVAL_ROUNDS)
        sums = torch.zeros(2, dtype=torch.float64)
        self.model.eval()
        try:
            for first in range(0, batches, per_round):
                part = torch.zeros(2, dtype=torch.float64)
                for b in range(first, min(batches, first + per_round)):
                    chunk = mine[b * size:(b + 1) * size]
                    for i, split in enumerate(("val", "train") if len(chunk) else ()):
                        tokens, sampler = self.eval_samplers[split]
                        x, y = get_batch(tokens, sampler, chunk)
                        _, loss = self.model(x, y)
                        part[i] += float(loss.item()) * len(chunk)
                if not group.sum(part):
                    return None
                sums += part
        finally:
            self.model.train()
        return sums

    def evaluate(self, group: Group) -> tuple[float, float] | None:
        """Mean loss over fixed windows of the val and train splits (same set at every group size),
        dealt round-robin to ``group`` and summed over it, so the figure does not depend on the
        group's size; None when a sum failed."""
        sums = self.eval_sums(group)
        if sums is None:
            return None
        n = self.cfg.eval_iters * self.cfg.per_rank_batch_size
        return float(sums[0]) / n, float(sums[1]) / n

    def run_eval(self) -> None:
        """Evaluate over the world; a diverged validation loss stops the run before this step is
        checkpointed.

        Raises:
            Diverged: the validation loss is non-finite or above the guard's limit.
            RuntimeError: the world's sum failed without raising (an engine's world should raise).
        """
        result = self.evaluate(self.engine.world)
        if result is None:
            raise RuntimeError(f"the evaluation of step {self.step} failed: a sum over the world failed")
        self.check_eval(self.step, result[0])
        self.record_eval(self.step, *result)

    def evaluate_before(self, plan: StepPlan) -> Evaluation | None:
        """Evaluate the committed step inside the next step's group (the engine's choice: its
        group forms anew before every step): the windows dealt over ``plan.group``, so each takes
        1/size of them and none is late for the rest of the step; then the periodic checkpoint of
        the step (kept until its validation passed). Recorded when the step commits; None when
        the sum failed (the step will not commit; it is attempted again).

        Raises:
            Diverged: the validation loss diverged (every member sees the same sum).
        """
        t0 = time.perf_counter()
        result = self.evaluate(plan.group)
        if result is None:
            return None
        self.check_eval(self.step, result[0])
        if self.env.local_rank == 0 and self.step % self.cfg.ckpt_interval == 0:
            self.save_checkpoint("periodic")
        return Evaluation(result[0], result[1], time.perf_counter() - t0)

    def check_eval(self, step: int, val_loss: float) -> None:
        """The divergence guard on the validation loss of ``step``.

        Raises:
            Diverged: the validation loss is non-finite or above the guard's limit.
        """
        reason = divergence_reason(val_loss, 0.0, step, vocab_size=self.model.cfg.vocab_size,
                                   warmup_steps=self.cfg.warmup_steps,
                                   margin=self.cfg.divergence_margin)
        if reason:
            raise Diverged(step, f"validation {reason}", val_loss, float("nan"))

    def record_eval(self, step: int, val_loss: float, train_loss: float, **extra: Any) -> None:
        """The ``val`` record (and console line) of the evaluation of ``step``."""
        self.last_val = (val_loss, train_loss)
        self.last_val_step = step
        self.metrics.write("val", step=step, val_loss=round(val_loss, 6),
                           train_loss=round(train_loss, 6), **extra)
        if self.env.rank == 0:
            print(f"[ddplab] step {step}: val loss {val_loss:.4f}, train loss {train_loss:.4f}",
                  flush=True)

    # --- the end ------------------------------------------------------------------------------
    def finish(self) -> None:
        cfg, env = self.cfg, self.env
        self.engine.finish()
        if self.last_val_step != self.step:
            self.run_eval()
        if env.local_rank == 0:
            self.save_checkpoint("final")  # no-op when the loop already wrote this step
        val_loss, train_loss = self.last_val
        now = time.time()
        wall = now - self.first_start_time
        self.metrics.write("end", step=self.step, final_train_loss=round(train_loss, 6),
                           final_val_loss=round(val_loss, 6), wall_s=round(wall, 3),
                           session_wall_s=round(now - self.session_start, 3))
        if env.rank != 0:
            return
        sample = self.sample_text()
        atomic_write_text(self.out / "sample.txt", sample)
        tok_s = self.session_tokens / self.loop_seconds if self.loop_seconds > 0 else None
        result = {
            "run_id": cfg.run_id, "steps": self.step, "max_steps": cfg.max_steps,
            "final_train_loss": train_loss, "final_val_loss": val_loss,
            "final_step_loss": self.last_train_loss, "samples_seen": self.samples_seen,
            "tokens_seen": self.samples_seen * cfg.block_size, "wall_s": round(wall, 3),
            "session_wall_s": round(now - self.session_start, 3), "world_size": self.world_size,
            "engine": cfg.fault_tolerance,
            "restart_count": env.restart_count, "world_size_history": self.history,
            "batch_policy": self.plan.batch_policy, "global_batch_size": self.plan.global_batch_size,
            "session_tokens_per_s": round(tok_s, 1) if tok_s else None,
            "params": self.model.num_params(), "config": cfg.to_dict(),
        }
        atomic_write_text(self.out / "result.json", json.dumps(result, indent=2) + "\n")
        print(f"[ddplab] done: step {self.step}, val loss {val_loss:.4f}, train loss {train_loss:.4f}, "
              f"wall {wall:.1f} s", flush=True)

    def sample_text(self) -> str:
        """``sample_chars`` characters generated from a newline, seeded by ``seed``."""
        if self.cfg.sample_chars == 0:
            return ""
        gen = torch.Generator().manual_seed(self.cfg.seed)
        start = self.data.vocab.encode("\n") if "\n" in self.data.vocab.chars else np.zeros(1, np.uint16)
        idx = torch.tensor(start.astype(np.int64))[None, :]
        out = self.model.generate(idx, self.cfg.sample_chars, temperature=0.8, generator=gen,
                                  vocab_limit=len(self.data.vocab))
        return self.data.vocab.decode(out[0].tolist()) + "\n"

    # --- failure --------------------------------------------------------------------------------
    def emergency_save(self, error: BaseException) -> bool:
        """Save the last completed step after a failure; any surviving rank may do it (the
        node's checkpoint lock serialises writers and an existing valid file is kept).

        Not after divergence (the last completed step produced the diverging loss) nor an
        output failure. The caller has shielded the process from further signals.
        """
        if (isinstance(error, Diverged | OutputError | CheckpointError) or not self.consistent
                or self.step == 0 or not hasattr(self, "optimizer")):
            return False
        try:
            result = self.store.save(self.state_dict("emergency"))
        except (CheckpointError, OSError) as exc:
            print(f"[rank {self.env.rank}] emergency checkpoint failed: {exc}", file=sys.stderr, flush=True)
            return False
        if result.written and self.metrics:
            self.metrics.write("checkpoint", step=result.step, path=str(result.path),
                               bytes=result.bytes, seconds=round(result.seconds, 4), reason="emergency")
        return True

    def fail(self, exc: BaseException) -> int:
        """The emergency path: shield from signals, save, write the ``failure`` record, report.

        Returns the exit code: 128 + signal, EXIT_DIVERGED, EXIT_BAD_INPUT (an output that
        cannot be written), the engine's code for its own exceptions
        (:meth:`~ddplab.engines.base.Engine.failure`) or EXIT_FAILED.
        """
        self.guard.shield()  # a SIGTERM arriving from here on cannot cut the save or the records
        extra: dict[str, Any] = {}
        if isinstance(exc, Terminated):
            code, cause = 128 + exc.signum, "signal"
        elif isinstance(exc, Diverged):
            code, cause = EXIT_DIVERGED, "divergence"
        elif isinstance(exc, OutputError | CheckpointError):
            code, cause = EXIT_BAD_INPUT, "output"
        elif (failure := self.engine.failure(exc)) is not None:
            code, cause, extra = failure.code, failure.cause, dict(failure.fields)
        else:
            code, cause = EXIT_FAILED, "error"
        saved = self.emergency_save(exc)
        if isinstance(exc, Diverged):
            extra = {"loss": exc.loss, "grad_norm": exc.grad_norm, "failed_step": exc.step,
                     "resumed_from_step": self.resumed_from, "config_sha256": self.config_sha256()}
        if self.metrics:
            with contextlib.suppress(OutputError):
                self.metrics.write("failure", step=self.step, error=f"{type(exc).__name__}: {exc}",
                                   saved=saved, cause=cause, **extra)
                self.metrics.close()
        if code == EXIT_BAD_INPUT:
            print(f"ddplab.train: error: {exc}", file=sys.stderr, flush=True)
            return code
        if cause == "error":
            traceback.print_exc()
        print(f"[rank {self.env.rank}] failed at step {self.step} ({cause}: {exc}); "
              f"emergency checkpoint {'saved' if saved else 'not saved'}", file=sys.stderr, flush=True)
        return code


def run(cfg: TrainConfig, env: DistEnv | None = None) -> int:
    """Train with ``cfg`` as this process's rank; return the process exit code."""
    env = env or DistEnv.from_environ()
    trainer = Trainer(cfg, env)
    try:
        trainer.validate_inputs()
    except INPUT_ERRORS as exc:
        print(f"ddplab.train: error: {exc}", file=sys.stderr, flush=True)
        return EXIT_BAD_INPUT
    trainer.guard.install()
    try:
        try:
            trainer.setup()
        except (CheckpointError, BatchPolicyError, DataError, OutputError) as exc:
            print(f"ddplab.train: error: {exc}", file=sys.stderr, flush=True)
            return EXIT_BAD_INPUT
        trainer.loop()
        trainer.finish()
    except (Exception, Terminated) as exc:
        while True:
            try:
                return trainer.fail(exc)
            except Terminated:  # arrived before fail() raised its shield: start it again
                continue
    finally:
        trainer.guard.uninstall()
        trainer.engine.close()
    if trainer.metrics:
        trainer.metrics.close()
    destroy_process_group()
    return EXIT_OK


def main(argv: list[str] | None = None) -> int:
    """CLI entry; returns the exit code (see the module docstring)."""
    try:
        cfg, check = parse_args(argv)
        env = DistEnv.from_environ()
    except SystemExit as exc:  # argparse: --help, or an unknown flag (it printed the message)
        return exc.code if isinstance(exc.code, int) else EXIT_BAD_INPUT
    except (ConfigError, ValueError) as exc:
        print(f"ddplab.train: error: {exc}", file=sys.stderr, flush=True)
        return EXIT_BAD_INPUT
    if check:
        trainer = Trainer(cfg, env)
        try:
            trainer.validate_inputs(check_only=True)
            plan = plan_batch(cfg.batch_policy, env.world_size, cfg.per_rank_batch_size,
                              cfg.reference_batch_size, cfg.global_batch_size)
        except INPUT_ERRORS as exc:
            print(f"ddplab.train: error: {exc}", file=sys.stderr, flush=True)
            return EXIT_BAD_INPUT
        data = trainer.data
        print(json.dumps({"config": cfg.to_dict(), "world_size": env.world_size,
                          "batch_plan": plan.to_dict(),
                          "dataset": "present" if data else f"missing: a run downloads {cfg.data_url}",
                          "vocab_size": len(data.vocab) if data else None,
                          "train_chars": len(data.train) if data else None,
                          "val_chars": len(data.val) if data else None,
                          "checkpoints": trainer.store.steps(),
                          "memory_estimate_bytes": trainer.memory.node_bytes,
                          "memory": trainer.memory.to_dict()}, indent=2))
        return EXIT_OK
    return run(cfg, env)


def cli(argv: list[str] | None = None) -> None:
    """Console-script entry: run :func:`main` and exit with its code."""
    code = main(argv)
    sys.stdout.flush()
    sys.stderr.flush()
    if code != EXIT_OK and (dist.is_initialized() or engines.exit_may_block()):
        # A peer is gone: tearing the process group down (or joining an engine's background
        # threads) can block; leave without it.
        os._exit(code)
    sys.exit(code)


def worker(*argv: str) -> None:
    """Function entrypoint of a worker forked from ``ddplab.agent`` (torchrun ``--start-method
    fork``): the process already holds torch and this package, so a (re)start skips the imports.

    ``argv`` are the arguments after ``-m ddplab.train``. The signal handlers the agent set for
    itself (torch's elastic agent turns SIGTERM/SIGINT/SIGHUP/SIGQUIT into an exception) are
    reset to the default action before anything runs, so a signal before :class:`SignalGuard`
    installs its own ends the worker as a failure (SIGINT too: torch's process wrapper would turn
    a KeyboardInterrupt into exit 0). Torchrun's environment (RANK, WORLD_SIZE, ...) is set by the
    agent in this process before the call and read only here, never at import. Exits the process
    with :func:`main`'s code (SystemExit, or ``os._exit`` after a failed collective).
    """
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT):
        signal.signal(sig, signal.SIG_DFL)
    sys.argv = [sys.argv[0], *argv]
    cli(list(argv))


if __name__ == "__main__":
    cli()
