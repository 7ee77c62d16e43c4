"""Entry point: ``python -m ddplab.train [--config run.json] [--key value ...]``.

Runs alone (rank 0 of 1, no process group) or as one worker under ``torchrun`` (gloo + DDP). Every
(re)start reads ``WORLD_SIZE`` and re-applies the batch policy, agrees with the other nodes on the
newest valid checkpoint and resumes from it. When a collective fails or the agent stops the
worker (SIGTERM), the worker saves the last *completed* step before it exits non-zero, so the
restarted group loses no step. See docs/training.md.

Under ``fault_tolerance: per_step`` the worker is the one worker of its node's replica group
(ddplab.ft): before every step it joins the quorum of the live replica groups, averages the
gradients over the participants and applies the step only when all of them commit it; a failed
step is retried with the next quorum, no process restarts, and a joining replica receives the
state from a live peer. Its own checkpoint is read at start for a restart of the whole cluster.

Exit codes: 0 finished ``max_steps``; 1 training failed (after an emergency checkpoint when
possible); 2 bad input or an output that cannot be written (one line, before the first step where
it can be known); 3 training diverged (the step was not applied, no checkpoint written; see
ddplab.divergence); 4 per_step: cut off from the group (no quorum with a peer of the group, or none
at all, within its waits: nothing trained alone, checkpoints kept); ddplab.agent does not restart a
worker that exits 4, a restart would only wait again; 128 + signal when stopped by a signal.
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
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from ddplab import telemetry
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
    mix,
    participant_sample_indices,
    rank_sample_indices,
)
from ddplab.distributed import (
    DistEnv,
    TimedAllReduce,
    agree_on_checkpoint,
    all_reduce_scalar,
    destroy_process_group,
    init_process_group,
    wait,
)
from ddplab.divergence import EXIT_DIVERGED, Diverged, divergence_reason
from ddplab.exit_codes import EXIT_CUT_OFF
from ddplab.lr import (
    BatchPlan,
    BatchPolicyError,
    lr_at,
    participants_global_batch,
    plan_batch,
    ramp_lr_scale,
)
from ddplab.metrics import UNCOMMITTED_EVENT, MetricsWriter
from ddplab.model import GPT, GPTConfig
from ddplab.outputs import OutputError, check_writable_dir, fsync_dir
from ddplab.records import read_jsonl

CHECKPOINT_FORMAT = 1
EXIT_OK, EXIT_FAILED, EXIT_BAD_INPUT = 0, 1, 2
#: per_step: the last quorum the replica took part in with the group, kept beside the checkpoints
#: (ddplab.ft.Replica.follow_quorum), so that a restarted worker can tell it was cut off.
GROUP_QUORUM_FILE = "ft-group-quorum.json"
#: per_step: why no participant commits a step (Trainer.per_step_divergence_guard).
HELD_BY_START_BARRIER, ALL_CUT_OFF = "held by the start barrier", "every participant cut off"
#: per_step: pause between two quorums while fewer than ft_min_replicas replicas participate.
MIN_REPLICAS_POLL_S = 0.5
#: per_step: most rounds (each ended by a sum over the participants) of an evaluation.
EVAL_ROUNDS = 8
#: Errors that mean bad input or an unwritable output: one line, exit 2.
INPUT_ERRORS = (DataError, CheckpointError, BatchPolicyError, OutputError, ValueError)


class Terminated(BaseException):
    """SIGTERM/SIGINT arrived (torchrun stops the surviving workers this way)."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"stopped by {signal.Signals(signum).name}")
        self.signum = signum


class SignalGuard:
    """Turn SIGTERM/SIGINT into :class:`Terminated`, deferred while a critical section runs.

    The optimizer update and checkpoint writes are critical: a signal arriving there is raised
    when the section ends, so the state saved afterwards is always a whole step.
    """

    def __init__(self) -> None:
        self.depth = 0
        self.pending: int | None = None
        self.received: int | None = None  # the last signal handled, raised or not
        self._previous: dict[int, Any] = {}

    def install(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._previous[sig] = signal.signal(sig, self._handle)

    def uninstall(self) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous.clear()

    def _handle(self, signum: int, _frame: Any) -> None:
        self.received = signum
        if self.depth:
            self.pending = signum
            return
        raise Terminated(signum)

    def check(self) -> None:
        """Raise :class:`Terminated` when a signal arrived, even if the exception the handler
        raised was lost: under per_step it can fire inside a torch future callback that torchft
        runs in this thread, where the exception becomes a failed collective (seen: a SIGTERMed
        replica trained on for 30 s until torchrun killed it)."""
        if self.received is not None and not self.depth:
            raise Terminated(self.received)

    def shield(self) -> None:
        """From now on every SIGTERM/SIGINT is only recorded (the emergency path: its checkpoint
        and records are written whatever arrives; the process exits right after)."""
        self.depth += 1

    @contextlib.contextmanager
    def critical(self):
        self.depth += 1
        try:
            yield
        finally:
            self.depth -= 1
        if not self.depth and self.pending is not None:
            raise Terminated(self.pending)


def _atomic_write_text(path: Path, text: str) -> None:
    """Temp file, fsync, rename, fsync the folder (the rename itself survives a power cut).

    Raises:
        OutputError: the file cannot be written (the temp file is removed).
    """
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "w", encoding="utf-8") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
        fsync_dir(path.parent)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise OutputError(f"cannot write {path} ({exc.strerror or exc}): fix the folder or "
                          "set another out_dir") from None


def agent_identity() -> str:
    """``"<pid>:<start time>"`` of this worker's parent, the torchrun agent that started it: the
    same for every worker one agent starts (its restarts), another for each launch of the job."""
    import psutil

    parent = psutil.Process(os.getppid())
    return f"{parent.pid}:{parent.create_time():.3f}"


class Trainer:
    """One worker's run: setup, agreement, training loop, evaluation, checkpoints, metrics."""

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
        self.consistent = True  # model/optimizer hold a whole step (False inside the update)
        self.metrics: MetricsWriter | None = None
        self.last_train_loss: float | None = None
        self.last_val: tuple[float, float] | None = None
        self.last_val_step: int | None = None
        self.session_tokens = 0
        self.loop_seconds = 0.0
        self.fresh_start_reason: str | None = None
        self.replica: Any = None  # per_step: ddplab.ft.Replica (None under torchelastic)
        self.participants = env.world_size  # per_step: participants of the last committed step
        self.per_step = cfg.fault_tolerance == "per_step"
        self.waiting_for_replicas = False  # per_step: fewer participants than ft_min_replicas
        # per_step: the first commit of this session waits for ft_start_replicas (start barrier)
        self.session_commits = 0
        self.start_wait_began: float | None = None  # first attempt held back by the barrier
        # per_step: the group quorum id last kept on disk (GROUP_QUORUM_FILE); a cut-off
        # replica's wait for a peer has been announced
        self.kept_quorum_id: int | None = None
        self.announced_cut_off = False
        self.waited_for_quorum_id: int | None = None  # see previous_cut_off
        self.announced_no_quorum = False  # per_step: a failed quorum call was announced

    # --- setup: everything that can reject bad input runs before anything is written ---------
    def validate_inputs(self, check_only: bool = False) -> None:
        """Dataset, block size, output folders and batch policy.

        ``check_only`` (``--check``) changes nothing on disk: a missing dataset is not downloaded
        (``self.data`` stays None) and the folders are not created. A run creates the output
        folders and probes that it can write each, before the process group and the first step.

        Raises:
            DataError, CheckpointError, OutputError, BatchPolicyError: one clear message each.
        """
        cfg = self.cfg
        if self.per_step:
            if self.env.world_size != 1:
                raise ValueError(f"fault_tolerance per_step runs one worker per replica group, not "
                                 f"WORLD_SIZE={self.env.world_size}: launch torchrun with "
                                 "--nnodes 1 --nproc-per-node 1 on each node")
            from ddplab import ft  # torchft is only needed (and imported) under per_step
            if not check_only:  # --check runs outside the unit, without its environment
                ft.endpoint()  # raises FaultToleranceError (a ValueError): DDPLAB_GLOO_ADDR unset
        self.data: CharDataset | None = None
        if not check_only or dataset_present(cfg.data_path, cfg.data_url):
            self.data = load_dataset(cfg.data_path, cfg.data_url, cfg.data_sha256)
            self.data.check_block_size(cfg.block_size)
        self.store = CheckpointStore(self.out / "checkpoints", cfg.keep_checkpoints,
                                     accept=self._incompatibility)
        self.store.check(create=False)
        for folder, what in ((self.out, "output"), (self.store.dir, "checkpoint"),
                             (self.out / "metrics", "metrics")):
            check_writable_dir(folder, what, create=not check_only)
        if not self.per_step and cfg.batch_policy == "keep_global" and cfg.global_batch_size is not None:
            plan_batch(cfg.batch_policy, self.env.world_size, cfg.per_rank_batch_size,
                       cfg.reference_batch_size, cfg.global_batch_size)

    def threads(self) -> int:
        """Intra-op threads: ``threads`` or the node's physical cores shared by its local workers."""
        if self.cfg.threads:
            return self.cfg.threads
        return max(1, telemetry.physical_cores() // self.env.local_world_size)

    def setup(self) -> None:
        cfg, env = self.cfg, self.env
        self.store.check(create=True)
        torch.set_num_threads(self.threads())
        if (env.rank == 0 and env.distributed and os.environ.get("TORCHELASTIC_RUN_ID")
                and os.environ.get("TORCH_DISABLE_SHARE_RDZV_TCP_STORE") != "1"):
            print("[ddplab] warning: TORCH_DISABLE_SHARE_RDZV_TCP_STORE is not 1: with torch's shared "
                  "bootstrap store a restarted worker group can read the previous round's gloo "
                  "addresses and fail to connect; set it in torchrun's environment",
                  file=sys.stderr, flush=True)
        init_process_group(env, cfg.pg_timeout_s)
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
        gcfg = GPTConfig(vocab_size=len(self.data.vocab), block_size=cfg.block_size,
                         n_layer=cfg.n_layer, n_head=cfg.n_head, n_embd=cfg.n_embd, dropout=cfg.dropout)
        self.model = GPT(gcfg)
        self.optimizer = torch.optim.AdamW(
            self.model.param_groups(cfg.weight_decay), lr=cfg.base_lr, betas=(cfg.beta1, cfg.beta2),
        )
        if state is not None:
            self.apply_state(state)
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
        if not self.per_step:  # per_step: a segment per change of participants (commit_step)
            self.history.append({
                "time": round(self.session_start, 3), "step": self.step,
                "world_size": env.world_size, "restart_count": env.restart_count,
                **{k: v for k, v in self.plan.to_dict().items() if k != "world_size"},
            })

        self.ddp: torch.nn.Module = self.model
        self.comm = TimedAllReduce(env.world_size)
        if env.distributed:
            self.ddp = DDP(self.model)
            self.ddp.register_comm_hook(self.comm, TimedAllReduce.hook)
            self._settle_buckets()

        self.train_sampler = WindowSampler(len(self.data.train), cfg.block_size, cfg.seed, STREAM_TRAIN)
        self.eval_samplers = {
            "val": (self.data.val, WindowSampler(len(self.data.val), cfg.block_size, cfg.seed,
                                                 STREAM_VAL_EVAL)),
            "train": (self.data.train, WindowSampler(len(self.data.train), cfg.block_size, cfg.seed,
                                                     STREAM_TRAIN_EVAL)),
        }
        replica_fields = self.start_replica()  # per_step: join the lighthouse (ddplab.ft)
        self.metrics.write(
            "start", resumed_from_step=self.resumed_from, samples_seen=self.samples_seen,
            batch_policy=self.plan.batch_policy, per_rank_batch_size=self.plan.per_rank_batch_size,
            global_batch_size=self.plan.global_batch_size, grad_accum_steps=self.plan.grad_accum_steps,
            lr_scale=self.plan.lr_scale, reference_batch_size=self.plan.reference_batch_size,
            threads=torch.get_num_threads(), params=self.model.num_params(),
            checkpoint_holder_rank=agreement.holder, max_steps=cfg.max_steps, run_id=cfg.run_id,
            pid=os.getpid(), fresh_start_reason=self.fresh_start_reason,
            engine=cfg.fault_tolerance, **replica_fields,
        )
        if env.rank == 0 and self.per_step:
            how = f"checkpoint of step {self.step}" if state is not None else "no checkpoint"
            print(f"[ddplab] per_step replica {self.replica.replica_id} at {self.replica.addr} "
                  f"({how}; a live peer's newer state replaces it at the first quorum), "
                  f"{self.model.num_params():,} params, {torch.get_num_threads()} threads",
                  flush=True)
        elif env.rank == 0:
            how = f"resumed from step {self.step}" if state is not None else "fresh start"
            if self.fresh_start_reason:
                how += f" (allow_fresh_start: {self.fresh_start_reason})"
            print(f"[ddplab] {how}; world_size {env.world_size}, restart {env.restart_count}, "
                  f"{self.plan.batch_policy}: global batch {self.plan.global_batch_size} = "
                  f"{env.world_size} x {self.plan.per_rank_batch_size} x {self.plan.grad_accum_steps}, "
                  f"lr x{self.plan.lr_scale:.3g}, {self.model.num_params():,} params, "
                  f"{torch.get_num_threads()} threads", flush=True)

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
        self.optimizer.zero_grad(set_to_none=True)
        self.comm.reset()

    def _incompatibility(self, state: dict[str, Any]) -> str | None:
        """Why a loaded checkpoint state cannot resume this run (None: it can). The store's
        ``accept`` test, part of the one validity definition (ddplab.checkpoint)."""
        saved = state.get("config", {})
        saved = saved if isinstance(saved, dict) else {}
        diffs = [f"{k}: checkpoint {saved.get(k)!r}, config {getattr(self.cfg, k)!r}"
                 for k in (*MODEL_SHAPE_FIELDS, "seed") if saved.get(k) != getattr(self.cfg, k)]
        if self.data is not None and state.get("vocab") != self.data.vocab.chars:
            diffs.append("vocabulary differs (another dataset)")
        return f"does not match this run ({'; '.join(diffs)})" if diffs else None

    def config_sha256(self) -> str:
        """SHA-256 of the configuration (sorted JSON): equal settings give equal digests."""
        text = json.dumps(self.cfg.to_dict(), sort_keys=True, default=str)
        return hashlib.sha256(text.encode()).hexdigest()

    def _refuse_repeated_divergence(self, resume_step: int | None) -> None:
        """After a torchrun restart, stop at once when the attempt before this one diverged
        from the same checkpoint step (``resume_step``, None: fresh start), at the same world size
        (any participants under per_step) and with the same configuration: resuming would replay
        the same steps into the same divergence (a resume at equal world size is bit-identical).
        A first launch always trains.
        Every rank takes part in the all-reduce, so all of them stop or none.

        Raises:
            Diverged: with the step, loss and gradient norm of the recorded divergence.
        """
        env, previous = self.env, None
        if env.restart_count > 0 and self.metrics and self.metrics.path.exists():
            failures = [r for r in read_jsonl(self.metrics.path)[0] if r.get("event") == "failure"]
            last = failures[-1] if failures else {}
            if (last.get("cause") == "divergence" and last.get("restart_count") == env.restart_count - 1
                    # per_step: the record's world_size is the participants of that step, and
                    # a restarted replica joins whatever quorum is live (its peers diverged too)
                    and (self.per_step or last.get("world_size") == env.world_size)
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
            **self.replica_state(),
        }

    def apply_state(self, state: dict[str, Any]) -> None:
        """Load a training state (a checkpoint's, or under per_step a live peer's)."""
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.step = int(state["step"])
        self.samples_seen = int(state["samples_seen"])
        self.history = list(state.get("world_size_history", []))
        self.first_start_time = float(state.get("first_start_time", self.session_start))
        self.first_global_batch = state.get("first_global_batch_size")
        rng = state.get("rng", {})
        if isinstance(rng, dict) and isinstance(rng.get("torch"), torch.Tensor):
            torch.set_rng_state(rng["torch"])

    def replica_state(self) -> dict[str, Any]:
        """The per_step additions to a state: torch's RNG state (the draws are seeded per step,
        this carries the rest) and the torchft Manager's counters. Empty under torchelastic.
        No quorum id: ids belong to one lighthouse and one launch (:meth:`read_group_quorum_id`
        keeps the group's beside the checkpoints); checkpoints written with the former
        ``ft_group_quorum_id`` field load as before (it is not read)."""
        if not self.per_step:
            return {}
        return {"rng": {"scheme": "stateless", "seed": self.cfg.seed, "torch": torch.get_rng_state()},
                "ft_manager": self.replica.state() if self.replica else {"step": self.step}}

    def load_peer_state(self, state: dict[str, Any]) -> None:
        """per_step: apply the state a live peer sent when this replica joined or fell behind.

        Raises:
            CheckpointError: the peer trains another model, seed or dataset.
        """
        why = self._incompatibility(state)
        if why:
            raise CheckpointError(f"the state received from a live peer {why}: every replica "
                                  "of a run needs the same run.json")
        self.apply_state(state)
        print(f"[ddplab] state of step {self.step} received from a live peer", flush=True)

    def start_replica(self) -> dict[str, Any]:
        """per_step: start this node's replica group (ddplab.ft.Replica); return the fields of
        the ``start`` record that describe it (none under torchelastic)."""
        if not self.per_step:
            return {}
        from ddplab import ft

        cfg = self.cfg
        self.kept_quorum_id = self.read_group_quorum_id()
        self.waited_for_quorum_id = self.previous_cut_off()
        self.replica = ft.Replica(cfg, self.optimizer, lambda: self.state_dict("transfer"),
                                  self.load_peer_state, step=self.step,
                                  group_quorum_id=self.kept_quorum_id)
        return {"ft_group_quorum_id": self.kept_quorum_id, "ft_rejoin_wait_s": cfg.ft_rejoin_wait_s,
                "replica_id": self.replica.replica_id, "ft_addr": self.replica.addr,
                "ft_manager_port": cfg.ft_manager_port, "ft_store_port": self.replica.store_port,
                "ft_lighthouse": cfg.ft_lighthouse, "ft_start_replicas": cfg.ft_start_replicas,
                "ft_start_timeout_s": cfg.ft_start_timeout_s, "ft_timeout_s": cfg.ft_timeout_s}

    def read_group_quorum_id(self) -> int | None:
        """per_step: the last quorum this replica took part in with the group before this worker
        started, as GROUP_QUORUM_FILE keeps it (at every change), when it was written in the same
        launch: by the same agent (a worker torchrun restarted) or, with ``ft_launch_id``, by any
        agent of the same launch (a rejoin's new agent: the rejoin keeps run.json). Then a rejoin
        after the group went on, or finished, sees the gap and never trains alone (before, a new
        agent counted as a first start). None otherwise: a first start, an unreadable file, or a
        file of another launch: a resume (a new ``ft_launch_id``) may have a new lighthouse that
        numbers its quorums from 1 again, and compared with ids of another lighthouse every replica
        of a per_step resume was 'cut off' and none trained (newcomer, 2026-12-01). Checkpoints
        carry no quorum id for the same reason."""
        try:
            kept = json.loads((self.out / GROUP_QUORUM_FILE).read_text())
        except (OSError, ValueError):
            return None
        launch = self.cfg.ft_launch_id
        if not isinstance(kept, dict) or not (
                kept.get("agent") == agent_identity() or (launch and kept.get("launch") == launch)):
            return None
        return kept["quorum_id"] if isinstance(kept.get("quorum_id"), int) else None

    def previous_cut_off(self) -> int | None:
        """per_step: when the attempt before this torchrun restart stopped cut off (its
        ``failure`` record, cause ``cut_off``), the last group quorum id it waited from, else
        None. It waited ``ft_rejoin_wait_s`` already: cut off from the same quorum, this attempt
        stops at once (``--max-restarts`` attempts would each wait again)."""
        env = self.env
        if env.restart_count == 0 or not self.metrics.path.exists():
            return None
        failures = [r for r in read_jsonl(self.metrics.path)[0] if r.get("event") == "failure"]
        last = failures[-1] if failures else {}
        if last.get("cause") == "cut_off" and last.get("restart_count") == env.restart_count - 1:
            quorum_id = last.get("last_group_quorum_id")
            return quorum_id if isinstance(quorum_id, int) else None
        return None

    def keep_group_quorum_id(self) -> None:
        """per_step: write the replica's group quorum id to GROUP_QUORUM_FILE when it changed
        (a quorum change or a failed commit: rare but for the waits, at most one per 0.5 s)."""
        quorum_id = self.replica.group_quorum_id
        if quorum_id is None or quorum_id == self.kept_quorum_id:
            return
        _atomic_write_text(self.out / GROUP_QUORUM_FILE, json.dumps(
            {"quorum_id": quorum_id, "replica_id": self.replica.replica_id, "step": self.step,
             "lighthouse": self.cfg.ft_lighthouse, "agent": agent_identity(),
             "launch": self.cfg.ft_launch_id,
             "time": round(time.time(), 3)}) + "\n")
        self.kept_quorum_id = quorum_id

    def wait_for_the_group(self, participants: int) -> None:
        """per_step: this replica was cut off (ddplab.ft.Replica.follow_quorum) and no
        participant of this quorum took part in the group's quorums since: its state may be
        behind steps the group committed, so it commits nothing, alone or with others cut off
        like it. It votes against the step and waits for a peer of the group to heal from, at
        most ``ft_rejoin_wait_s`` from the quorum that showed the gap (not again after a torchrun
        restart that followed such a wait: :meth:`previous_cut_off`).

        Raises:
            ddplab.ft.CutOffError: the wait is over (the group finished or is gone).
        """
        from ddplab import ft

        cfg, cut = self.cfg, self.replica.cut_off
        waited = time.monotonic() - cut.since
        who = "alone" if participants == 1 else f"with {participants - 1} other cut-off replica(s)"
        again = self.waited_for_quorum_id == cut.last_quorum_id  # the attempt before waited
        if again or waited >= cfg.ft_rejoin_wait_s:
            missed = (f"quorum {cut.last_quorum_id + 1}" if cut.quorum_id - cut.last_quorum_id == 2
                      else f"quorums {cut.last_quorum_id + 1}-{cut.quorum_id - 1}")
            raise ft.CutOffError(
                f"replica {self.replica.replica_id} was cut off from quorum {cut.last_quorum_id} to "
                f"quorum {cut.quorum_id}: the group went on without it ({missed}) and no peer of "
                f"the group came back within ft_rejoin_wait_s {cfg.ft_rejoin_wait_s:g} s"
                f"{' (waited by the attempt before this restart)' if again else ''}; nothing "
                f"trained alone, its state of step {self.step} and its checkpoints are kept. Fix: "
                "if the group finished, its result is the run's (this node's is not); else start "
                "the group again (this replica heals from a peer ahead), or raise "
                "ft_rejoin_wait_s (playbook: ddp_job_ft_rejoin_wait_s)", cut)
        if not self.announced_cut_off:
            self.announced_cut_off = True
            print(f"[ddplab] step {self.step + 1}: replica {self.replica.replica_id} was cut off "
                  f"from quorum {cut.last_quorum_id} to quorum {cut.quorum_id} and is {who}: it "
                  f"trains nothing until a peer of the group is back (at most ft_rejoin_wait_s "
                  f"{cfg.ft_rejoin_wait_s:g} s)", flush=True)
        self.replica.abstain("cut off from the group: waiting for a peer of the group")
        time.sleep(MIN_REPLICAS_POLL_S)

    def wait_for_a_quorum(self) -> None:
        """per_step: the quorum call got no quorum within ``ft_quorum_timeout_s`` (the lighthouse
        is out of reach, e.g. a partition, or this worker was frozen in the call): nothing was
        computed or voted. The worker asks again within its own life: a torchrun restart would
        meet the same partition and spend one of ``--max-restarts`` per timeout (the newcomer's
        200 s partition spent 3, then 7 more). After ``ft_quorum_timeout_s + ft_rejoin_wait_s``
        without a quorum the group has gone on without this replica, or is gone.

        Raises:
            ddplab.ft.CutOffError: no quorum for that long (``unreachable_s`` set).
        """
        from ddplab import ft

        cfg, replica = self.cfg, self.replica
        waited, bound = replica.no_quorum_s, cfg.ft_quorum_timeout_s + cfg.ft_rejoin_wait_s
        last = replica.group_quorum_id
        if waited >= bound:
            raise ft.no_quorum_error(cfg, replica.replica_id, last, replica.quorum_at, waited,
                                     replica.quorum_error, self.step)
        if not self.announced_no_quorum:
            self.announced_no_quorum = True
            print(f"[ddplab] step {self.step + 1}: no quorum from the lighthouse within "
                  f"ft_quorum_timeout_s {cfg.ft_quorum_timeout_s:g} s ({replica.quorum_error}); "
                  f"asking again, nothing trained (at most {bound:g} s without a quorum)",
                  flush=True)
        time.sleep(MIN_REPLICAS_POLL_S)

    def save_checkpoint(self, reason: str) -> None:
        with self.guard.critical():
            result = self.store.save(self.state_dict(reason))
        if result.written:
            self.metrics.write("checkpoint", step=result.step, path=str(result.path),
                               bytes=result.bytes, seconds=round(result.seconds, 4), reason=reason)
            self.metrics.sync()

    # --- training -----------------------------------------------------------------------------
    def train_step(self) -> None:
        """One optimizer step, and its metrics record when it is a logging step.

        Every collective of the step (gradient all-reduce, then the all-reduce of the loss that the
        divergence guard decides on) runs *before* the optimizer update; a diverged step raises
        :class:`Diverged` there, unapplied. The update, the counters and the record are one
        critical section. So a failure either leaves the previous step whole, or comes after
        this step is complete and logged: the step a survivor saves is always the last one logged.
        """
        cfg, env, plan = self.cfg, self.env, self.plan
        t0 = time.perf_counter()
        lr_scale = self.lr_scale_at(self.step)
        lr = lr_at(self.step, cfg.base_lr, lr_scale, cfg.warmup_steps, cfg.max_steps,
                   cfg.min_lr_ratio)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.zero_grad(set_to_none=True)
        self.comm.reset()
        loss_sum = 0.0
        for micro in range(plan.grad_accum_steps):
            indices = rank_sample_indices(self.samples_seen, env.rank, env.world_size,
                                          plan.per_rank_batch_size, micro)
            x, y = get_batch(self.data.train, self.train_sampler, indices)
            if cfg.dropout > 0:
                torch.manual_seed(mix(cfg.seed, self.step, env.rank, micro))
            last = micro == plan.grad_accum_steps - 1
            sync = contextlib.nullcontext() if last or not env.distributed else self.ddp.no_sync()
            with sync:
                _, loss = self.ddp(x, y)
                (loss / plan.grad_accum_steps).backward()  # all-reduce happens in the last backward
            loss_sum += loss.item()
        # Reaching this line means every gradient all-reduce of this step succeeded.
        local_loss = loss_sum / plan.grad_accum_steps
        step = self.step + 1
        log_now = step % cfg.log_interval == 0 or step == cfg.max_steps
        grad_norm = self.clip_gradients()
        t_guard = time.perf_counter()
        mean_loss = self.stop_if_diverged(local_loss, grad_norm)  # a collective; raises Diverged
        allreduce_s = self.comm.seconds + (time.perf_counter() - t_guard if env.distributed else 0.0)
        with self.guard.critical():
            self.consistent = False
            self.optimizer.step()
            self.step = step
            self.samples_seen += plan.global_batch_size
            self.consistent = True
            step_s = time.perf_counter() - t0
            self.session_tokens += plan.global_batch_size * cfg.block_size
            if log_now:
                self.log_step(mean_loss, local_loss, lr, lr_scale, step_s, allreduce_s)

    def per_step_train_step(self) -> bool:
        """One attempt at the next optimizer step under per_step; True when it was committed.

        1. Join the quorum (a replica behind the others receives a live peer's state here);
           after an evaluation step, evaluate it first, dealt over the participants
           (:meth:`per_step_evaluate`: no participant is late for the next quorum).
        2. Take this participant's block of the step's samples (a function of ``samples_seen``,
           the participant rank and the participants: ddplab.data.participant_sample_indices)
           and the Goyal learning rate of the step's global batch (ramped, ddplab.lr).
        3. Forward/backward locally, average the gradients over the participants (one
           all-reduce of all gradients), clip, run the divergence guard and the start barrier
           (one sum over participants; :meth:`ready_to_start`).
        4. Vote: the update is applied only when every participant commits; otherwise nothing
           changes (not the weights, step, data position nor LR history) and the caller retries.
        Every commit of a new participant count and every ``log_interval``-th step gets a
        ``step`` record (participants, quorum_id, committed: true); an attempt that did not
        commit gets an ``uncommitted`` record instead (:meth:`record_uncommitted`).
        """
        cfg, replica = self.cfg, self.replica
        t0 = time.perf_counter()
        self.guard.check()
        started = replica.start_step()
        self.guard.check()
        if started is None:  # no quorum within ft_quorum_timeout_s: nothing computed, ask again
            self.wait_for_a_quorum()
            return False
        if self.announced_no_quorum:
            print(f"[ddplab] step {self.step + 1}: a quorum again (quorum {replica.quorum_id})",
                  flush=True)
            self.announced_no_quorum = False
        rank, participants = started
        if replica.step != self.step:
            raise RuntimeError(f"torchft is at step {replica.step}, the training state at step "
                               f"{self.step}: the state transfer did not apply")
        self.keep_group_quorum_id()
        if replica.cut_off is not None and participants == 1:  # no peer of the group to heal from
            self.wait_for_the_group(participants)
            return False
        if participants < cfg.ft_min_replicas:
            # every participant sees the same count: none computes and the vote fails for all
            replica.commit()
            if not self.waiting_for_replicas:
                print(f"[ddplab] step {self.step + 1}: {participants} participant(s), waiting for "
                      f"ft_min_replicas {cfg.ft_min_replicas}", flush=True)
            self.waiting_for_replicas = True
            time.sleep(MIN_REPLICAS_POLL_S)
            return False
        self.waiting_for_replicas = False
        evaluated = self.per_step_evaluate(rank, participants) if self.per_step_eval_due() else None
        eval_s = evaluated[2] if evaluated else 0.0
        global_batch = participants_global_batch(
            cfg.batch_policy, participants, cfg.per_rank_batch_size,
            # keep_global without a size: the global batch of the run's first committed step
            cfg.global_batch_size or self.first_global_batch or participants * cfg.per_rank_batch_size)
        indices = participant_sample_indices(self.samples_seen, rank, participants, global_batch)
        chunks = [indices[i:i + cfg.per_rank_batch_size]
                  for i in range(0, len(indices), cfg.per_rank_batch_size)]
        self.plan = BatchPlan(cfg.batch_policy, participants, len(indices), len(chunks), global_batch,
                              cfg.reference_batch_size, global_batch / cfg.reference_batch_size)
        lr_scale = ramp_lr_scale(self.lr_segments(self.plan.lr_scale), self.step, cfg.ramp_steps())
        lr = lr_at(self.step, cfg.base_lr, lr_scale, cfg.warmup_steps, cfg.max_steps,
                   cfg.min_lr_ratio)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        loss_sum = 0.0  # sum of this participant's per-sample losses
        for chunk in chunks:
            x, y = get_batch(self.data.train, self.train_sampler, chunk)
            if cfg.dropout > 0:
                torch.manual_seed(mix(cfg.seed, self.step, int(chunk[0])))
            _, loss = self.model(x, y)
            # weighted so that the average over participants is the mean over the global batch
            (loss * (len(chunk) * participants / global_batch)).backward()
            loss_sum += loss.item() * len(chunk)
        allreduce_s = replica.average_gradients(self.model.parameters())
        grad_norm = self.clip_gradients()
        t_guard = time.perf_counter()
        mean_loss = self.per_step_divergence_guard(loss_sum, grad_norm, global_batch, participants)
        allreduce_s += time.perf_counter() - t_guard
        self.guard.check()
        if mean_loss == HELD_BY_START_BARRIER:  # no participant commits
            self.held_by_start_barrier(participants)
            return False
        if mean_loss == ALL_CUT_OFF:  # every participant was cut off: none commits
            self.wait_for_the_group(participants)
            return False
        previous = self.participants
        with self.guard.critical():
            self.consistent = False
            committed = replica.commit()  # the vote; the optimizer steps only when committed
            first_commit = committed and self.session_commits == 0
            if committed:
                if evaluated:  # the evaluation of the step before, now that all agree on it
                    self.record_eval(self.step, evaluated[0], evaluated[1], participants=participants,
                                     eval_s=round(eval_s, 6))
                self.session_commits += 1
                self.step += 1
                self.samples_seen += global_batch
                self.session_tokens += global_batch * cfg.block_size
                self.first_global_batch = self.first_global_batch or global_batch
                self.participants = participants
                self.record_participants(participants, replica.quorum_id)
                if replica.cut_off is not None:  # committed with a peer of the group
                    replica.rejoined()
                    if self.announced_cut_off:
                        print(f"[ddplab] step {self.step}: replica {replica.replica_id} is back in "
                              f"the group (quorum {replica.quorum_id})", flush=True)
                    self.announced_cut_off = False
            self.consistent = True
            step_s = time.perf_counter() - t0 - eval_s  # the evaluation has its own record
            self.metrics.set_common(rank=rank, world_size=participants)
            first = int(indices[0]) if len(indices) else self.samples_seen
            samples = [first, first + len(indices)]
            if not committed:  # no step: an attempt record, never a step record
                self.record_uncommitted(participants, step_s, samples)
            elif (participants != previous or self.step % cfg.log_interval == 0
                    or self.step == cfg.max_steps or first_commit):
                start = self.start_barrier_fields() if first_commit else {}
                self.log_step(mean_loss, loss_sum / max(1, len(indices)), lr, lr_scale, step_s,
                              allreduce_s, participants=participants,
                              quorum_id=replica.quorum_id, committed=True, engine="per_step",
                              samples=samples, **start)
        return committed

    def record_uncommitted(self, participants: int, attempt_s: float, samples: list[int]) -> None:
        """per_step: the attempt at step ``self.step + 1`` did not commit (torchft's
        ``should_commit`` returned False: this replica group's vote failed, so its optimizer did
        not step; torchft.Manager.should_commit). Nothing changed; the step is attempted again with
        the next quorum. Written as an ``uncommitted`` record (``attempted_step``, ``committed:
        false``, ``participants``, ``quorum_id``, ``error`` = why the vote failed, ``attempt_s`` in
        seconds, ``samples`` = the [first, stop) indices that were not trained), never as a
        ``step`` record: a step record describes a committed step only, so a replica's step
        records have unique, increasing step numbers and the progress readers never show a step
        that is taken back (issue 14: laptop-c read 120/500 while running, 119/500 after)."""
        replica, attempted = self.replica, self.step + 1
        error = replica.error_text()
        self.metrics.write(UNCOMMITTED_EVENT, attempted_step=attempted, committed=False,
                           participants=participants, quorum_id=replica.quorum_id, error=error,
                           attempt_s=round(attempt_s, 6), samples=samples, engine="per_step")
        if self.env.rank == 0:
            print(f"[ddplab] step {attempted} not committed (quorum {replica.quorum_id}, "
                  f"{participants} participant(s){'; ' + error if error else ''}): attempted "
                  "again with the next quorum", flush=True)

    def lr_segments(self, lr_scale: float) -> list[tuple[int, float]]:
        """per_step: the LR-scale segments of the committed history, plus the next step's when
        its scale differs (ddplab.lr.ramp_lr_scale ramps from the old scale to it)."""
        segments = [(int(h["step"]), float(h["lr_scale"])) for h in self.history if "lr_scale" in h]
        if not segments or segments[-1][1] != lr_scale:
            segments.append((self.step, lr_scale))
        return segments

    def record_participants(self, participants: int, quorum_id: int) -> None:
        """per_step: after a commit, open a history segment when the participants changed (the
        ``world_size_history`` of result.json; its ``lr_scale`` drives the LR ramp)."""
        if self.history and self.history[-1].get("participants") == participants:
            return
        self.history.append({
            "time": round(time.time(), 3), "step": self.step - 1, "world_size": participants,
            "participants": participants, "quorum_id": quorum_id,
            "restart_count": self.env.restart_count,
            **{k: v for k, v in self.plan.to_dict().items() if k != "world_size"},
        })

    def per_step_divergence_guard(self, loss_sum: float, grad_norm: float, global_batch: int,
                                  participants: int) -> float | str:
        """per_step's divergence guard, start barrier and cut-off check, in one sum over the
        participants of [loss sum, "gradient norm not finite", "ready to go", "cut off"].
        Returns the global batch's mean loss (NaN when the sum failed: the step will not commit,
        nothing is decided on it), or why no participant commits (every participant sees the
        same sum): HELD_BY_START_BARRIER (:meth:`ready_to_start`) or ALL_CUT_OFF (no
        participant took part in the group's last quorums, and none missed only quorums formed
        by another one waiting: ddplab.ft.Replica.exonerated; :meth:`wait_for_the_group`).

        Raises:
            Diverged: the step must not be applied (every participant sees the same sums).
        """
        ready = self.ready_to_start(participants)
        both = torch.tensor([loss_sum, 0.0 if math.isfinite(grad_norm) else 1.0, float(ready),
                             float(self.replica.cut_off is not None)], dtype=torch.float64)
        if not self.replica.sum(both):
            return float("nan")
        if both[2] == 0:
            return HELD_BY_START_BARRIER
        if both[3] == participants and not self.replica.exonerated():
            return ALL_CUT_OFF
        mean_loss, any_bad = float(both[0]) / global_batch, bool(both[1] > 0)
        return self.check_divergence(mean_loss, any_bad, grad_norm)

    def ready_to_start(self, participants: int) -> bool:
        """per_step start barrier, this replica's vote: the first step of a job waits until
        ``ft_start_replicas`` replicas participate, at most ``ft_start_timeout_s`` from the
        replica's start. A replica that committed a step in this session is always ready, so a
        joiner never holds live peers back: the barrier binds only when every participant is
        new (the start of the job, or a restart of the whole cluster). The step goes when any
        participant is ready (the first one to time out releases all)."""
        cfg = self.cfg
        return (self.session_commits > 0 or participants >= cfg.ft_start_replicas
                or time.time() - self.session_start >= cfg.ft_start_timeout_s)

    def held_by_start_barrier(self, participants: int) -> None:
        """per_step: the start barrier held this attempt back; say so once, pause, retry."""
        cfg = self.cfg
        if self.start_wait_began is None:
            self.start_wait_began = time.time()
            print(f"[ddplab] step {self.step + 1}: {participants} of ft_start_replicas "
                  f"{cfg.ft_start_replicas} replicas participate, waiting for the others (at most "
                  f"ft_start_timeout_s {cfg.ft_start_timeout_s:g} s from a replica's start)",
                  flush=True)
        self.replica.abstain("waiting for ft_start_replicas")
        time.sleep(MIN_REPLICAS_POLL_S)

    def start_barrier_fields(self) -> dict[str, Any]:
        """Fields of the first committed step record of a session: the start barrier's target
        (``start_replicas``) and how long this replica was held back by it (``start_wait_s``)."""
        began = self.start_wait_began
        return {"start_replicas": self.cfg.ft_start_replicas,
                "start_wait_s": round(time.time() - began, 3) if began is not None else 0.0}

    def check_divergence(self, mean_loss: float, any_bad: bool, grad_norm: float) -> float:
        """Decide on the next step from the loss averaged over all ranks (or participants) and
        "some gradient norm is not finite"; return ``mean_loss``.

        Raises:
            Diverged: the step must not be applied (ddplab.divergence).
        """
        cfg = self.cfg
        reason = divergence_reason(mean_loss, float("nan") if any_bad else grad_norm, self.step,
                                   vocab_size=len(self.data.vocab), warmup_steps=cfg.warmup_steps,
                                   margin=cfg.divergence_margin)
        if reason:
            raise Diverged(self.step + 1, reason, mean_loss, grad_norm)
        return mean_loss

    def lr_scale_at(self, step: int) -> float:
        """The LR scale of ``step``: the batch plan's, ramped after a world-size change
        (:func:`ddplab.lr.ramp_lr_scale` over this run's world-size history)."""
        segments = [(int(h["step"]), float(h["lr_scale"])) for h in self.history if "lr_scale" in h]
        return ramp_lr_scale(segments or [(0, self.plan.lr_scale)], step, self.cfg.ramp_steps())

    def clip_gradients(self) -> float:
        """Clip to ``grad_clip`` (0: no clipping); return the L2 norm of the gradients before.

        ``clip_grad_norm_`` with ``max_norm = inf`` scales by exactly 1.0, so the norm is measured
        without changing the gradients.
        """
        max_norm = self.cfg.grad_clip if self.cfg.grad_clip > 0 else float("inf")
        return float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm))

    def stop_if_diverged(self, local_loss: float, grad_norm: float) -> float:
        """The divergence guard (ddplab.divergence); return the mean loss over all ranks.

        One all-reduce of two numbers (this rank's loss, "my gradient norm is not finite"; none
        when alone), so every rank takes the same decision on the same values and none hangs.

        Raises:
            Diverged: the step must not be applied.
        """
        bad = 0.0 if math.isfinite(grad_norm) else 1.0
        mean_loss, any_bad = local_loss, bool(bad)
        if dist.is_initialized():
            both = torch.tensor([local_loss, bad], dtype=torch.float64)
            wait(dist.all_reduce(both, op=dist.ReduceOp.SUM, async_op=True))
            mean_loss, any_bad = float(both[0]) / self.env.world_size, bool(both[1] > 0)
        return self.check_divergence(mean_loss, any_bad, grad_norm)

    def log_step(self, mean_loss: float, local_loss: float, lr: float, lr_scale: float,
                 step_s: float, allreduce_s: float, **extra: Any) -> None:
        """The ``step`` record (and console line) of the last completed (committed) step;
        ``extra`` are more fields (per_step: participants, quorum_id, committed, engine)."""
        cfg, env, plan = self.cfg, self.env, self.plan
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
            **extra,
        )
        if env.rank == 0:
            print(f"[ddplab] step {self.step}/{cfg.max_steps} "
                  f"loss {mean_loss:.4f} lr {lr:.2e} ws {plan.world_size} {tokens_per_s:,.0f} tok/s "
                  f"(all-reduce {allreduce_s * 1e3:.1f} ms of {step_s * 1e3:.1f} ms)", flush=True)

    @torch.no_grad()
    def eval_sums(self, rank: int, ranks: int,
                  reduce: Callable[[torch.Tensor], bool] | None = None) -> torch.Tensor | None:
        """This rank's share of the evaluation: the summed per-window losses of windows
        ``rank, rank + ranks, ...`` of the ``eval_iters * per_rank_batch_size`` fixed windows of
        the val and train splits, in batches of ``per_rank_batch_size``.

        ``reduce`` (per_step) sums a partial [val, train] over the participants in place and
        returns False when that failed; it is called after each of at most ``EVAL_ROUNDS``
        equal rounds of batches, the same number on every rank: these small collectives keep
        the participants in step, so a slower one is never more than a round behind (well
        within a collective's timeout). Returns a float64 tensor of shape (2,): [val sum,
        train sum]; None when a ``reduce`` failed.
        """
        cfg = self.cfg
        size = cfg.per_rank_batch_size
        total = cfg.eval_iters * size
        mine = np.arange(rank, total, ranks, dtype=np.int64)
        batches = math.ceil(math.ceil(total / ranks) / size)  # rank 0's share, the largest
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
                if reduce is not None and not reduce(part):
                    return None
                sums += part
        finally:
            self.model.train()
        return sums

    def evaluate(self) -> tuple[float, float]:
        """Mean loss over fixed windows of the val and train splits (same set at every world size).

        ``eval_iters * per_rank_batch_size`` windows per split, dealt round-robin to the ranks and
        summed with an all-reduce, so the figure does not depend on the world size.
        """
        n = self.cfg.eval_iters * self.cfg.per_rank_batch_size
        sums = self.eval_sums(self.env.rank, self.env.world_size)
        return all_reduce_scalar(float(sums[0]), "sum") / n, all_reduce_scalar(float(sums[1]), "sum") / n

    def run_eval(self) -> None:
        """Evaluate; a diverged validation loss stops the run before this step is checkpointed.

        Raises:
            Diverged: the validation loss is non-finite or above the guard's limit.
        """
        val_loss, train_loss = self.evaluate()
        self.check_eval(self.step, val_loss)
        self.record_eval(self.step, val_loss, train_loss)

    def check_eval(self, step: int, val_loss: float) -> None:
        """The divergence guard on the validation loss of ``step``.

        Raises:
            Diverged: the validation loss is non-finite or above the guard's limit.
        """
        reason = divergence_reason(val_loss, 0.0, step, vocab_size=len(self.data.vocab),
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

    def per_step_eval_due(self) -> bool:
        """per_step: whether the attempt at the next step evaluates the committed one first.

        A function of the committed step only, which every participant of a quorum shares (a
        joiner is healed before it asks): all of them run the same collectives. Each
        ``eval_interval``-th step but the last (evaluated locally: no step follows)."""
        return 0 < self.step < self.cfg.max_steps and self.step % self.cfg.eval_interval == 0

    def per_step_evaluate(self, rank: int, participants: int) -> tuple[float, float, float] | None:
        """per_step: evaluate the committed step inside the next step's quorum, the windows dealt
        over the participants (each takes 1/participants of them, so all take the same time and
        none is late for the next quorum) and summed over them; then the periodic checkpoint
        of the step (kept until its validation passed). Returns (val loss, train loss, seconds),
        or None when the sum failed (the step will not commit; it is retried with the next quorum).

        Raises:
            Diverged: the validation loss diverged (every participant sees the same sum).
        """
        t0 = time.perf_counter()
        sums = self.eval_sums(rank, participants, reduce=self.replica.sum)
        if sums is None:
            return None
        n = self.cfg.eval_iters * self.cfg.per_rank_batch_size
        val_loss, train_loss = float(sums[0]) / n, float(sums[1]) / n
        self.check_eval(self.step, val_loss)
        if self.step % self.cfg.ckpt_interval == 0:
            self.save_checkpoint("periodic")
        return val_loss, train_loss, time.perf_counter() - t0

    def loop(self) -> None:
        cfg, env = self.cfg, self.env
        loop_t0 = time.perf_counter()
        while self.step < cfg.max_steps:
            if not self.per_step:
                self.train_step()
            elif not self.per_step_train_step():
                continue  # not committed: retried with the next quorum, never counted
            done = self.step == cfg.max_steps
            # per_step: evaluated (then checkpointed) in the next step's quorum (per_step_evaluate)
            in_next_quorum = self.per_step and self.per_step_eval_due()
            if (self.step % cfg.eval_interval == 0 or done) and not in_next_quorum:
                self.run_eval()
            if (env.local_rank == 0 and not in_next_quorum
                    and (self.step % cfg.ckpt_interval == 0 or done)):
                self.save_checkpoint("final" if done else "periodic")
        self.loop_seconds = time.perf_counter() - loop_t0

    def finish(self) -> None:
        cfg, env = self.cfg, self.env
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
        _atomic_write_text(self.out / "sample.txt", sample)
        tok_s = self.session_tokens / self.loop_seconds if self.loop_seconds > 0 else None
        result = {
            "run_id": cfg.run_id, "steps": self.step, "max_steps": cfg.max_steps,
            "final_train_loss": train_loss, "final_val_loss": val_loss,
            "final_step_loss": self.last_train_loss, "samples_seen": self.samples_seen,
            "tokens_seen": self.samples_seen * cfg.block_size, "wall_s": round(wall, 3),
            "session_wall_s": round(now - self.session_start, 3), "world_size": self.participants,
            "engine": cfg.fault_tolerance,
            "restart_count": env.restart_count, "world_size_history": self.history,
            "batch_policy": self.plan.batch_policy, "global_batch_size": self.plan.global_batch_size,
            "session_tokens_per_s": round(tok_s, 1) if tok_s else None,
            "params": self.model.num_params(), "config": cfg.to_dict(),
        }
        _atomic_write_text(self.out / "result.json", json.dumps(result, indent=2) + "\n")
        print(f"[ddplab] done: step {self.step}, val loss {val_loss:.4f}, train loss {train_loss:.4f}, "
              f"wall {wall:.1f} s", flush=True)

    def sample_text(self) -> str:
        """``sample_chars`` characters generated from a newline, seeded by ``seed``."""
        if self.cfg.sample_chars == 0:
            return ""
        gen = torch.Generator().manual_seed(self.cfg.seed)
        start = self.data.vocab.encode("\n") if "\n" in self.data.vocab.chars else np.zeros(1, np.uint16)
        idx = torch.tensor(start.astype(np.int64))[None, :]
        out = self.model.generate(idx, self.cfg.sample_chars, temperature=0.8, generator=gen)
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
        cannot be written), EXIT_CUT_OFF (per_step, cause cut_off) or EXIT_FAILED.
        """
        self.guard.shield()  # a SIGTERM arriving from here on cannot cut the save or the records
        if isinstance(exc, Terminated):
            code, cause = 128 + exc.signum, "signal"
        elif isinstance(exc, Diverged):
            code, cause = EXIT_DIVERGED, "divergence"
        elif isinstance(exc, OutputError | CheckpointError):
            code, cause = EXIT_BAD_INPUT, "output"
        elif isinstance(exc, getattr(sys.modules.get("ddplab.ft"), "CutOffError", ())):  # per_step
            code, cause = EXIT_CUT_OFF, "cut_off"
        else:
            code, cause = EXIT_FAILED, "error"
        saved = self.emergency_save(exc)
        extra = ({"loss": exc.loss, "grad_norm": exc.grad_norm, "failed_step": exc.step,
                  "resumed_from_step": getattr(self, "resumed_from", None),
                  "config_sha256": self.config_sha256()} if isinstance(exc, Diverged) else {})
        if cause == "cut_off":
            extra = {"last_group_quorum_id": exc.cut_off.last_quorum_id,
                     "quorum_id": exc.cut_off.quorum_id, "rejoin_wait_s": self.cfg.ft_rejoin_wait_s,
                     "unreachable_s": exc.cut_off.unreachable_s}
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
        if trainer.replica:
            trainer.replica.shutdown()
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
                          "checkpoints": trainer.store.steps()}, indent=2))
        return EXIT_OK
    return run(cfg, env)


def cli(argv: list[str] | None = None) -> None:
    """Console-script entry: run :func:`main` and exit with its code."""
    code = main(argv)
    sys.stdout.flush()
    sys.stderr.flush()
    if code != EXIT_OK and (dist.is_initialized() or "ddplab.ft" in sys.modules):
        # A peer is gone: tearing the process group down (or joining torchft's quorum thread,
        # per_step) can block; leave without it.
        os._exit(code)
    sys.exit(code)


def worker(*argv: str) -> None:
    """Function entrypoint of a worker forked from ``ddplab.agent`` (torchrun ``--start-method
    fork``): the process already holds torch and this package, so a (re)start skips the imports.

    ``argv`` are the arguments after ``-m ddplab.train``. The signal handlers the agent set for
    itself (torchelastic turns SIGTERM/SIGINT/SIGHUP/SIGQUIT into an exception in the agent) are
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
