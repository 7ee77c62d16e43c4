"""The interface between the trainer core (ddplab.train) and a recovery engine.

An engine is how the replicas of a run keep in step: who takes part in a step, how the gradients
are averaged over them, when the update is applied and what happens when a peer is lost. The core
runs one attempt at an optimizer step with the same four calls for every engine::

    plan = engine.plan()                        # the step's group and this rank's micro-batches
    # forward/backward of plan.micro_batches through Started.model (engine.no_sync() but the last)
    comm_s = engine.reduce_gradients(plan)      # average the gradients over plan.group
    decision = engine.decide(plan, local)       # the group's sums: mean loss, a gradient not finite
    commit = engine.commit(plan)                # the optimizer steps only when the group commits

torchft's own DDP example needs two of them (``optimizer.zero_grad`` starts the quorum:
:meth:`Engine.plan`; ``optimizer.step`` commits: :meth:`Engine.commit`); the two between are where
an engine with its own gradient reduction (torchft's all-reduce, a compressing comm hook) and its
own vote (a start barrier, a cut-off check) put them. ``plan`` and ``decide`` may answer
:class:`Retry`: nothing was applied, the core attempts the same step again. A diverged step is
the core's to refuse (ddplab.divergence), between ``decide`` and ``commit``.

Around the steps: :meth:`Engine.check` (bad input, before anything is written),
:meth:`Engine.connect` (the process group, before the checkpoint agreement), :meth:`Engine.attach`
(wrap the model/optimizer once they hold the agreed state), :meth:`Engine.state_dict` (what it adds
to a checkpoint), :meth:`Engine.failure` (its exceptions as exit codes), :meth:`Engine.close`, and
:meth:`Engine.parameter_copies` (its buffers, for ddplab.memory's estimate before a run starts).

Each result is a typed value; an engine's own state stays in the engine. An engine reads the
core's run through :class:`Run` (the core object itself, typed by what an engine may use).
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

if TYPE_CHECKING:
    import numpy as np
    import torch

    from ddplab.config import TrainConfig
    from ddplab.distributed import DistEnv
    from ddplab.lr import BatchPlan
    from ddplab.metrics import MetricsWriter


@dataclass(frozen=True)
class Group:
    """The processes that take part in one collective operation with this one.

    ``rank`` is this process's rank among them, ``size`` their number. ``sum`` adds a float64
    tensor over them in place and returns False when that (or an earlier collective of the step)
    failed without raising (the tensor is then meaningless and the step will not commit); an engine
    whose collectives raise on failure always returns True. ``key``: the same on every member for
    as long as the members and their ranks stay the same (per_step: the launch and quorum id);
    None: the group does not change during this process's life (torchrun's world).
    ddplab.balance exchanges the members' names when the key says the group may have changed.
    """

    rank: int
    size: int
    sum: Callable[[torch.Tensor], bool]
    key: str | None = None


@dataclass(frozen=True)
class MicroBatch:
    """One forward/backward pass of this rank.

    ``indices``: global sample indices (int64, ddplab.data's sampler maps them to windows).
    ``dropout_seed``: ``torch.manual_seed`` before the pass when the model has dropout, so every
    draw is a function of the run's position (no generator state to checkpoint).
    The loss enters backward as ``loss * weight / accum``: ``weight`` is the share of the group's
    average this pass stands for (its samples x group size / global batch, so that the average over
    the group is the mean over every sample of the global batch: design.md, "Unequal batches"),
    ``accum`` the number of equal micro-batches that share one weight (1 when ``weight`` already
    counts this pass's own samples).
    """

    indices: np.ndarray
    dropout_seed: int
    weight: float = 1.0
    accum: int = 1


@dataclass(frozen=True)
class StepPlan:
    """One attempt at the next optimizer step, as this rank takes part in it.

    ``group``: who takes part (their average is the update); ``batch``: the step's batch figures
    as the records show them (ddplab.lr.BatchPlan: world size = the group's size, this rank's
    samples and micro-batches, the global batch and its LR scale); ``micro_batches``: this rank's
    passes, in order.
    """

    group: Group
    batch: BatchPlan
    micro_batches: tuple[MicroBatch, ...]


@dataclass(frozen=True)
class LocalResult:
    """What this rank computed: each micro-batch's mean loss (nats per character, in the order of
    the plan) and the L2 norm of the averaged gradients before clipping."""

    losses: tuple[float, ...]
    grad_norm: float


@dataclass(frozen=True)
class Decision:
    """The group's answer on the step (from :meth:`Engine.decide`).

    ``mean_loss``: the mean loss over the step's global batch, None when the group's sum failed
    (nothing is decided on it and the step will not commit); ``local_loss``: this rank's mean;
    ``any_bad``: some rank's gradient norm is not finite; ``comm_s``: seconds spent in the
    collectives of the call.
    """

    mean_loss: float | None
    local_loss: float
    any_bad: bool
    comm_s: float


@dataclass(frozen=True)
class Retry:
    """Nothing was computed or applied: the core attempts the same step again. ``reason`` is the
    engine's own enum member (why; the engine has said so on the console when it matters)."""

    reason: Enum


@dataclass(frozen=True)
class Segment:
    """Open a segment of the run's world-size history (``world_size_history``: its LR scale
    drives the ramp after a change of the global batch, ddplab.lr.ramp_lr_scale). The core adds
    the time, the step, the restart count and the batch plan's figures; ``fields`` are the
    engine's own, written after ``world_size``."""

    world_size: int
    fields: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Started:
    """What :meth:`Engine.attach` set up.

    ``model``: the module the core runs forward/backward through (e.g. the model wrapped in DDP);
    ``fields``: the engine's fields of the ``start`` record; ``line``: the start's console line
    (rank 0; the core adds the parameter and thread counts); ``segment``: a history segment to
    open at this start, or None.
    """

    model: torch.nn.Module
    fields: Mapping[str, Any]
    line: str
    segment: Segment | None = None


@dataclass(frozen=True)
class Commit:
    """The outcome of :meth:`Engine.commit`.

    ``committed``: the update was applied (the core advances the step and the data position);
    False: nothing changed, the step is attempted again and the core writes an ``uncommitted``
    record (never a ``step`` record) with ``fields`` and the console line ``step N not committed
    {note}``. ``fields``: the engine's fields of that record or of the step's ``step`` record.
    ``log``: write the step record even off ``log_interval`` (e.g. the group changed).
    ``segment``: a history segment that opens with this step, or None.
    """

    committed: bool
    fields: Mapping[str, Any] = field(default_factory=dict)
    log: bool = False
    segment: Segment | None = None
    note: str = ""


@dataclass(frozen=True)
class Failure:
    """An engine's exception as the worker's end: exit ``code`` (ddplab.exit_codes), the
    ``failure`` record's ``cause`` and its extra ``fields``."""

    code: int
    cause: str
    fields: Mapping[str, Any] = field(default_factory=dict)


class Run(Protocol):
    """What an engine reads and calls of the trainer core's run (ddplab.train.Trainer).

    ``model``/``optimizer`` exist from :meth:`Engine.attach` on; ``step``, ``samples_seen``,
    ``first_global_batch`` and ``history`` are the committed position, read when needed (a state
    received from a peer in :meth:`Engine.plan` moves them).
    """

    out: Path
    metrics: MetricsWriter
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    plan: BatchPlan  # the batch plan of this start (ddplab.lr.plan_batch at WORLD_SIZE)
    balance: Any  # a ddplab.balance.Balancer (not imported: ddplab.balance builds on this module)
    step: int
    samples_seen: int
    first_global_batch: int | None
    history: list[dict[str, Any]]
    resumed_from: int | None

    def start_text(self) -> str:
        """"resumed from step N" or "fresh start" (with the allow_fresh_start reason)."""

    def state_dict(self, reason: str) -> dict[str, Any]:
        """The whole training state (a checkpoint's; what a joining peer needs)."""

    def load_peer_state(self, state: dict[str, Any]) -> None:
        """Apply a state a live peer sent. Raises CheckpointError: another model, seed or data."""

    def check_signals(self) -> None:
        """Raise the core's Terminated when a signal arrived whose exception was lost (it can
        fire inside a library's future callback that runs in this thread)."""


class Engine(ABC):
    """One recovery engine of a run (see the module doc for the calls and their order).

    Args:
        cfg: the run configuration.
        env: this process's place in torchrun's job.
        run: the core's run (:class:`Run`); an engine reads it, never replaces its objects.
    """

    #: The engine's ``fault_tolerance`` name (ddplab.engines.ENGINES).
    name: ClassVar[str]
    #: After a failure, the interpreter's exit may block on the engine's background threads (a
    #: peer is gone): the worker then leaves without the teardown (ddplab.train.cli).
    exit_may_block: ClassVar[bool] = False
    #: How the engine's gradient all-reduce compresses (ddplab.config.GRAD_COMPRESSIONS), for the
    #: step records.
    grad_compression: str = "none"

    def __init__(self, cfg: TrainConfig, env: DistEnv, run: Run) -> None:
        self.cfg = cfg
        self.env = env
        self.run = run

    @classmethod
    def parameter_copies(cls, cfg: TrainConfig, world_size: int) -> int:
        """How many float32 buffers of the model's size the engine holds beside the weights,
        gradients and optimizer state, in a run of ``cfg`` at ``world_size`` (the ``engine`` term
        of ddplab.memory's estimate: 4 bytes x parameters each). Asked before the engine exists
        (``--check``). Default: none."""
        return 0

    # --- setup --------------------------------------------------------------------------------
    def check(self, check_only: bool) -> None:  # noqa: B027 (an optional hook: most engines need none)
        """Refuse a configuration or environment this engine cannot run, before anything is
        written (``check_only``: ``--check``, outside the node's unit environment).

        Raises:
            ValueError (or a subclass): one line naming what to fix.
        """

    def connect(self) -> None:  # noqa: B027 (an optional hook)
        """Join the processes this worker shares collectives with (before the core agrees on a
        checkpoint with them through :attr:`world`)."""

    @abstractmethod
    def attach(self) -> Started:
        """Set up around ``run.model`` and ``run.optimizer``, which hold the state this start
        resumes (wrap them, register hooks, join a lighthouse)."""

    @property
    def member_name(self) -> str:
        """This worker's name among the members of its groups, the same across its restarts
        (ddplab.balance keys the members' speeds by it). Default: host and local rank."""
        return f"{self.env.host}/local{self.env.local_rank}"

    @property
    def world(self) -> Group:
        """The processes this worker shares every collective with for its whole life (torchrun's
        world: the checkpoint agreement and the evaluation after a step run over them)."""
        from ddplab.distributed import sum_over_world

        return Group(self.env.rank, self.env.world_size, sum_over_world)

    def no_sync(self) -> contextlib.AbstractContextManager[Any]:
        """Context of a micro-batch that is not the last of the step: gradients accumulate
        locally, without communication (DDP's ``no_sync``). Default: nothing to hold back."""
        return contextlib.nullcontext()

    # --- one attempt at a step ----------------------------------------------------------------
    @abstractmethod
    def plan(self) -> StepPlan | Retry:
        """Zero the gradients and plan the next step: its group and this rank's micro-batches
        (of ``run.samples_seen`` on). May block until a group forms; may move the run's state
        (a joiner receives a peer's). :class:`Retry`: no step can be attempted now."""

    @abstractmethod
    def reduce_gradients(self, plan: StepPlan) -> float:
        """Average the gradients over ``plan.group`` (where backward did not already); return
        the seconds spent communicating them."""

    @abstractmethod
    def decide(self, plan: StepPlan, local: LocalResult) -> Decision | Retry:
        """The group's sums the core decides on (the mean loss of the global batch, a gradient
        norm not finite), and the engine's own votes on the step; :class:`Retry` when the group
        holds the step back (nothing applied)."""

    @abstractmethod
    def commit(self, plan: StepPlan) -> Commit:
        """Apply the update when the group commits it (the optimizer steps here only). Runs in
        the core's critical section (signals deferred)."""

    def grad_bytes(self, plan: StepPlan) -> int:
        """Bytes the committed step's gradient all-reduces handed to the ring: ``D`` of the step
        records' wire model (ddplab.wire; ``2(N-1)/N * D`` per rank at ``plan.group.size``).
        Default: one fp32 all-reduce of every trained parameter's gradient, 4 bytes per element
        (ddplab.compression.payload_bytes of ``none``)."""
        return 4 * sum(p.numel() for p in self.run.model.parameters() if p.requires_grad)

    def evaluates_in_next_step(self, step: int) -> bool:
        """Whether the evaluation (and periodic checkpoint) of committed step ``step`` runs at
        the next attempt, over its group, instead of right after ``step`` over :attr:`world`
        (when the group forms anew before every step, its participants evaluate together)."""
        return False

    def replays(self, failure: Mapping[str, Any]) -> bool:
        """Whether this worker's group is the one that wrote the ``failure`` record of the
        attempt before a restart (then resuming the same checkpoint with the same settings
        replays its divergence). Default: it had the same world size."""
        return failure.get("world_size") == self.env.world_size

    # --- state, failure, end ------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """What the engine adds to a training state (a checkpoint's, a transfer's); its keys
        replace the core's of the same name."""
        return {}

    def load_state(self, state: Mapping[str, Any]) -> None:  # noqa: B027 (an optional hook)
        """The checkpoint this start resumes (the whole state, :meth:`state_dict`'s keys among it),
        given before :meth:`attach`. Default: nothing of the engine's own to restore."""

    def finish(self) -> None:  # noqa: B027 (an optional hook)
        """After the last committed step, before the final evaluation and checkpoint (replicas
        that hold models of their own between syncs bring them together). Default: nothing."""

    def failure(self, exc: BaseException) -> Failure | None:
        """The exit code, cause and record fields of one of the engine's own exceptions, or None
        (not the engine's: the core's rules apply)."""
        return None

    def close(self) -> None:  # noqa: B027 (an optional hook)
        """Stop what the engine started (after the run, also after a failure; must not block)."""
