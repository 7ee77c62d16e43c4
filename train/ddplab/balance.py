"""Speed-balanced batches: each rank's share of the global batch follows its measured speed.

Every synchronous step waits for the slowest rank. With ``batch_balance: speed`` the global batch
(what the batch policy says, unchanged) is dealt to the step's group in shares proportional to
each member's measured throughput, so that every member finishes its forward/backward at about the
same time. Both engines plan their steps through :class:`SpeedBalancer` (``ddplab.engines``: the
engine calls :meth:`Balancer.split` in its ``plan``); the trainer core measures each attempt's work
and calls :meth:`Balancer.observe` before the commit and :meth:`Balancer.commit` with it.

The plan of a step (:class:`Split`):

* shares ``s_0 .. s_{P-1}`` (samples, by position in the group), ``sum = global batch``, each >= 1;
  member ``r`` takes the contiguous block ``r`` of ``[samples_seen, samples_seen + global batch)``
  (:func:`share_sample_indices`), so a committed step consumes exactly the samples an equal split
  would, and sampling stays a function of the position in the data (stateless);
* the engine cuts a block into micro-batches of at most ``per_rank_batch_size`` (gradient
  accumulation) weighted ``samples x P / global batch`` (:func:`weighted_micro_batches`): the
  group's average of the gradients is then the mean over every sample of the global batch
  (design.md, "Unequal batches and DDP"), whichever engine averages them.

The estimate: after each attempt, one sum over the step's group gathers every member's
``[member id, samples, work seconds]`` (the core's forward/backward time less the seconds the
engine spent communicating), so every member folds the same numbers into the same state. A
member's speed is the median of its last :data:`WINDOW` measured ``samples / work`` (robust to
a slow step: the first after a start, a checkpoint write). Shares are planned by
:func:`allocate` (unit jobs on uniform machines: the makespan-optimal integer split).

When the plan changes (:class:`BalanceState`):

* ``start``: no member has a measured speed yet (an equal split);
* ``group``: the members or the global batch changed (a world-size change, a quorum of other
  participants): planned at once from the speeds known, a newcomer counted at the median speed;
* ``calibrated``: the first plan from measurements alone, once every member has
  :data:`CALIBRATION` of them (the short calibration at start, or after a newcomer), when it
  beats the current shares by more than :data:`THRESHOLD`; then the best plan once every
  member's window is full (:data:`WINDOW` measurements: the calibration's few were noisy);
* ``speed`` (hysteresis): at least :data:`COOLDOWN` steps after the last plan, when the step's
  predicted compute time with the current shares, ``max_r s_r / v_r``, exceeds the best plan's by
  more than the margin on :data:`PATIENCE` consecutive steps; the margin is :data:`THRESHOLD`, or
  2 x :data:`NOISE_SIGMAS` standard errors of a member's speed (:meth:`BalanceState.noise`) when
  that is larger. Noise does not move the shares back and forth (+-20 % per step: not once in
  1000 steps); a laptop that throttles (thermal, kill-node's ``throttle``) or recovers is
  re-planned ``(WINDOW + 1) / 2 + PATIENCE - 1`` to about ``WINDOW + PATIENCE`` steps after its
  speed changed (its median has moved; while the window spans the change its spread counts as
  noise).

Agreement: the state changes only when a step commits, from the values every member gathered,
and it travels with the training state (checkpoints, a live peer's state sent to a joiner), so
every member plans the same shares. Member ids are exchanged (one sum of ``P`` numbers) when the
group may have changed: once per process for a group that is fixed for the process's life
(``Group.key`` None: e.g. torchrun's world), else whenever ``Group.key`` differs from the key of
the last committed step (e.g. a quorum's id, which changes with the members).
A re-plan applies from the next step on, on every member at once: ranks never disagree on indices.

Imports of ddplab: the data hash and the engine interface's types only (the engines use it).
"""

from __future__ import annotations

import copy
import hashlib
import heapq
import math
import statistics
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from ddplab.config import BATCH_BALANCES
from ddplab.data import mix, share_sample_indices
from ddplab.engines.base import Group, MicroBatch, StepPlan
from ddplab.lr import equal_shares

if TYPE_CHECKING:
    from ddplab.config import TrainConfig  # noqa: TC004 (already imported at run time)

#: ``batch_balance`` values (ddplab.config's, which validates them).
MODES = BATCH_BALANCES
#: Measured speeds kept per member (their median is its speed; odd: a sustained change moves the
#: median from the old speed to the new at once, after (WINDOW + 1) // 2 measurements).
WINDOW = 15
#: Measurements every member needs before the first plan made from them.
CALIBRATION = 3
#: Steps after a plan before the hysteresis may re-plan (a window measured with the new shares).
COOLDOWN = WINDOW
#: Re-plan when the current shares' predicted compute time exceeds the best plan's by this share,
#: or by 2 x :data:`NOISE_SIGMAS` standard errors of a member's speed (two members' errors add
#: up in the comparison), whichever is larger: noisy laptops need a larger gain before the shares
#: move (+-20 % noise per step: a margin of about 35 %; +-5 %: THRESHOLD).
THRESHOLD = 0.10
NOISE_SIGMAS = 3.0
#: ... on this many consecutive steps (a window that is lucky for a step or two moves nothing).
PATIENCE = 5
#: Why a plan was made (the ``batch_plan`` field of the step record that first uses it).
REASONS = ("start", "group", "calibrated", "speed")


def member_id(name: str) -> int:
    """A member's id: the first 6 bytes of sha256(``name``), an int below 2**48 that a float64
    holds exactly (the ids travel in a float64 sum)."""
    return int.from_bytes(hashlib.sha256(name.encode()).digest()[:6], "big")


def predicted_time(shares: Sequence[int], speeds: Sequence[float]) -> float:
    """The step's compute time the shares predict: ``max_r shares[r] / speeds[r]`` (seconds, with
    speeds in samples per second)."""
    return max(s / v for s, v in zip(shares, speeds, strict=True))


def allocate(total: int, speeds: Sequence[float]) -> list[int]:
    """Integer shares of ``total`` samples, each >= 1, minimising :func:`predicted_time`.

    Unit jobs on uniform machines: every sample goes, one at a time, to the member where it would
    finish first (``(shares[r] + 1) / speeds[r]`` smallest, ties to the lowest position), starting
    from one each; that greedy is makespan-optimal. O(total x log members). Deterministic: equal
    inputs give equal shares on every member.

    Raises:
        ValueError: ``total`` below the number of members, or a speed that is not a positive
            finite number.
    """
    n = len(speeds)
    if n < 1 or total < n:
        raise ValueError(f"{total} samples cannot give {n} member(s) at least one each")
    if not all(math.isfinite(v) and v > 0 for v in speeds):
        raise ValueError(f"speeds must be positive finite numbers, got {list(speeds)}")
    shares = [1] * n
    heap = [(2 / v, r) for r, v in enumerate(speeds)]
    heapq.heapify(heap)
    for _ in range(total - n):
        _, r = heapq.heappop(heap)
        shares[r] += 1
        heapq.heappush(heap, ((shares[r] + 1) / speeds[r], r))
    return shares


def weighted_micro_batches(indices: np.ndarray, cap: int, group_size: int, global_batch: int,
                           seed: int, step: int) -> tuple[MicroBatch, ...]:
    """A rank's block in micro-batches of at most ``cap`` samples (the first ones full), each
    weighted ``samples x group_size / global_batch`` with ``accum`` 1 (the group's average is the
    mean over the global batch), the dropout seeded by (seed, step, first sample). Empty indices:
    no micro-batch."""
    chunks = [indices[i:i + cap] for i in range(0, len(indices), cap)]
    return tuple(MicroBatch(chunk, mix(seed, step, int(chunk[0])),
                            weight=len(chunk) * group_size / global_batch)
                 for chunk in chunks)


def plan_samples(plan: StepPlan) -> int:
    """This rank's samples in ``plan`` (its share of the step)."""
    return sum(len(m.indices) for m in plan.micro_batches)


@dataclass
class BalanceState:
    """What every member of a group holds alike (a checkpoint's ``batch_balance``).

    ``key``: the ``Group.key`` of the last committed step (None: a group fixed for the process's
    life, or not known); ``order``: member ids by position in that step's group; ``shares``:
    member id -> samples per step of the current plan; ``speeds``: member id -> its last
    :data:`WINDOW` measured speeds (samples per second, oldest first); ``stage``: how much the
    plan is based on (:meth:`stage_of`: 0 priors, 1 a calibration of :data:`CALIBRATION`
    measurements each, 2 full windows); ``over``: consecutive steps the hysteresis found the
    shares worse than the margin; ``plan_step``: the first step the plan applies to;
    ``reason``: why it was made (:data:`REASONS`).
    """

    key: str | None = None
    order: list[int] = field(default_factory=list)
    shares: dict[int, int] = field(default_factory=dict)
    speeds: dict[int, list[float]] = field(default_factory=dict)
    stage: int = 0
    over: int = 0
    plan_step: int = 0
    reason: str = "start"

    def to_dict(self) -> dict[str, Any]:
        """Plain values only (loads with ``torch.load(weights_only=True)``)."""
        return {"key": self.key, "order": list(self.order), "shares": dict(self.shares),
                "speeds": {k: list(v) for k, v in self.speeds.items()},
                "stage": self.stage, "over": self.over, "plan_step": self.plan_step,
                "reason": self.reason}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> BalanceState:
        """The state :meth:`to_dict` wrote. Raises KeyError/TypeError/ValueError on another shape."""
        return cls(key=d["key"], order=[int(i) for i in d["order"]],
                   shares={int(k): int(v) for k, v in d["shares"].items()},
                   speeds={int(k): [float(x) for x in v] for k, v in d["speeds"].items()},
                   stage=int(d["stage"]), over=int(d["over"]), plan_step=int(d["plan_step"]),
                   reason=str(d["reason"]))

    def speed(self, member: int) -> float | None:
        """The member's speed estimate (samples/s): the median of its window; None unmeasured."""
        window = self.speeds.get(member)
        return statistics.median(window) if window else None

    def noise(self, ids: Sequence[int]) -> float:
        """The relative standard error of a member's speed estimate, pooled over ``ids``:
        ``1.858 x MAD / sqrt(n)``, with MAD the median of ``|x / median - 1|`` over every
        member's window and n the shortest window (the median's standard error for normal
        noise, 1.2533 sigma / sqrt(n), sigma = 1.4826 MAD); pooled, so that one window's luck
        does not open the margin. 0.0 below two measurements each."""
        windows = [self.speeds.get(i) or [] for i in ids]
        n = min(len(w) for w in windows)
        if n < 2:
            return 0.0
        dev = []
        for window in windows:
            mid = statistics.median(window)
            dev.extend(abs(x / mid - 1) for x in window)
        return 1.858 * statistics.median(dev) / math.sqrt(n)

    def stage_of(self, ids: Sequence[int]) -> int:
        """0: a member of ``ids`` has fewer than :data:`CALIBRATION` measurements; 1: one has
        fewer than :data:`WINDOW`; 2: every window is full."""
        fewest = min(len(self.speeds.get(i, ())) for i in ids)
        return 0 if fewest < CALIBRATION else 1 if fewest < WINDOW else 2

    def estimates(self, ids: Sequence[int]) -> list[float] | None:
        """A speed per member of ``ids``: its own, or for a member not measured yet the median of
        the others'; None when none is measured."""
        known = {i: v for i in ids if (v := self.speed(i)) is not None}
        if not known:
            return None
        prior = statistics.median(known.values())
        return [known.get(i, prior) for i in ids]

    def replan(self, ids: Sequence[int], total: int, step: int, reason: str) -> None:
        """A new plan for ``ids`` from the estimates (equal shares without any), from ``step``."""
        est = self.estimates(ids)
        shares = equal_shares(total, len(ids)) if est is None else allocate(total, est)
        self.shares = dict(zip(ids, shares, strict=True))
        self.stage = self.stage_of(ids)
        self.plan_step, self.reason = step, reason

    def plan_for(self, ids: Sequence[int], total: int, step: int) -> list[int]:
        """The shares of step ``step`` by position of ``ids``: the current plan when it is for
        these members and this global batch, else a new one (``group``; ``start`` when nothing is
        measured)."""
        if set(self.shares) != set(ids) or sum(self.shares.values()) != total:
            measured = any(self.speed(i) is not None for i in ids)
            self.replan(ids, total, step, "group" if measured else "start")
        return [self.shares[i] for i in ids]

    def fold(self, ids: Sequence[int], samples: Sequence[int], work_s: Sequence[float],
             next_step: int) -> None:
        """Add one step's measurements (by position of ``ids``; a work of 0 or less is no
        measurement) and decide the plan of ``next_step`` on: ``calibrated`` when the plan's
        stage rises (:meth:`stage_of`: the first plan from :data:`CALIBRATION` measurements
        each when it beats the current shares by :data:`THRESHOLD`; the best plan once the
        windows are full), else ``speed`` by the hysteresis rule (module doc)."""
        for i, n, w in zip(ids, samples, work_s, strict=True):
            if n > 0 and w > 0 and math.isfinite(w):
                window = self.speeds.setdefault(i, [])
                window.append(n / w)
                del window[:-WINDOW]
        stage = self.stage_of(ids)
        if stage == 0:
            return
        calibration = stage > self.stage
        self.stage = max(self.stage, stage)
        if not calibration and next_step - self.plan_step < COOLDOWN:
            return
        est = self.estimates(ids)
        total = sum(self.shares[i] for i in ids)
        current = [self.shares[i] for i in ids]
        best = allocate(total, est)
        # the calibration: THRESHOLD on its few measurements, then the best plan of full windows
        margin = ((THRESHOLD if stage == 1 else 0.0) if calibration
                  else max(THRESHOLD, 2 * NOISE_SIGMAS * self.noise(ids)))
        worse = best != current and predicted_time(current, est) > (1 + margin) * predicted_time(best, est)
        self.over = self.over + 1 if worse else 0
        if worse and (calibration or self.over >= PATIENCE):
            self.shares = dict(zip(ids, best, strict=True))
            self.plan_step, self.reason, self.over = next_step, "calibrated" if calibration else "speed", 0


@dataclass(frozen=True)
class Split:
    """A step's plan as this member takes part in it: ``shares`` by position, this member's
    ``rank`` and sample ``indices``, the member ``ids`` by position, and ``reason`` when the plan
    starts with this step (None: it went on)."""

    shares: tuple[int, ...]
    rank: int
    indices: np.ndarray
    ids: tuple[int, ...]
    reason: str | None


class Balancer:
    """``batch_balance: off``: every engine keeps its own equal layout (:meth:`split` answers
    None) and nothing is gathered; the step records still carry the rank's ``batch_share``."""

    mode = "off"

    def split(self, group: Group, global_batch: int) -> Split | None:
        """The plan of the next step for this member of ``group`` (sum of the shares:
        ``global_batch``), or None: the engine's own equal layout."""
        return None

    def observe(self, plan: StepPlan, work_s: float) -> None:
        """The attempt's work (seconds of forward/backward, communication excluded), after the
        group decided on the step and before it commits."""

    def commit(self) -> None:
        """The attempt committed: its plan and measurements become the state."""

    def changed(self) -> bool:
        """The committed step began a new plan (its record is written off ``log_interval``)."""
        return False

    def record_fields(self, plan: StepPlan) -> dict[str, Any]:
        """Fields of the step record: ``batch_share`` (this rank's samples in the step)."""
        return {"batch_share": plan_samples(plan)}

    def state_dict(self) -> dict[str, Any] | None:
        """The training state's ``batch_balance`` (None: off)."""
        return None

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        """Take the state of a checkpoint or a peer's transfer (None, or another mode's: kept)."""


class SpeedBalancer(Balancer):
    """``batch_balance: speed`` (see the module doc).

    Args:
        run: the trainer core's run (ddplab.engines.base.Run): its committed ``step`` and
            ``samples_seen``, read at each split, and its engine's ``member_name``, this worker's
            name among the members (read when first needed).
        rank0: this worker prints the console line of a new plan.
    """

    mode = "speed"

    def __init__(self, run: Any, rank0: bool) -> None:
        self.run, self.rank0 = run, rank0
        self.state = BalanceState()
        self.pending: BalanceState | None = None  # the attempt's state, the state once it commits
        self.current: Split | None = None  # the attempt's split
        self.group: Group | None = None
        self.life_ids_known = False  # a group of key None: its ids were exchanged and committed
        self.exchanged_fixed = False  # the attempt exchanged the ids of a group of key None
        self._me: int | None = None
        self.warned_duplicates = False

    @property
    def me(self) -> int:
        if self._me is None:
            self._me = member_id(self.run.engine.member_name)
        return self._me

    # --- one attempt --------------------------------------------------------------------------
    def split(self, group: Group, global_batch: int) -> Split | None:
        """The next step's shares for ``group`` (the members' ids exchanged first when the group
        may have changed). None (the engine's equal layout) when ``global_batch`` is below the
        group's size; an equal split when the exchange failed (the step will not commit) or two
        members share a name."""
        self.pending = self.current = None
        self.group = group
        if global_batch < group.size:
            return None
        step, seen = self.run.step + 1, self.run.samples_seen
        pending = copy.deepcopy(self.state)
        ids = self._ids(group, pending)
        if ids is None:  # the sum failed or the names collide: equal, and nothing to commit
            shares = equal_shares(global_batch, group.size)
            return Split(tuple(shares), group.rank, share_sample_indices(seen, group.rank, shares),
                         (), None)
        shares = pending.plan_for(ids, global_batch, step)
        self.pending = pending
        reason = pending.reason if pending.plan_step == step else None
        self.current = Split(tuple(shares), group.rank,
                             share_sample_indices(seen, group.rank, shares),
                             tuple(ids), reason)
        return self.current

    def _ids(self, group: Group, pending: BalanceState) -> list[int] | None:
        """Member ids by position: the committed order when it is this group's, else exchanged
        in one sum (``pending`` takes the new order and key)."""
        if group.size == 1:
            ids = [self.me]
        elif (len(self.state.order) == group.size
              and (self.life_ids_known if group.key is None else self.state.key == group.key)):
            return list(self.state.order)
        else:
            vec = torch.zeros(group.size, dtype=torch.float64)
            vec[group.rank] = float(self.me)
            if not group.sum(vec):
                return None
            ids = [int(x) for x in vec.tolist()]
        if len(set(ids)) != len(ids):
            if not self.warned_duplicates and self.rank0:
                print("[ddplab] warning: batch_balance speed: two members of the group have the same "
                      "name (ft_replica_id or host name): equal batches", file=sys.stderr, flush=True)
            self.warned_duplicates = True
            return None
        pending.order, pending.key = ids, group.key
        self.exchanged_fixed = group.key is None
        return ids

    def observe(self, plan: StepPlan, work_s: float) -> None:
        """Gather ``[id, samples, work seconds]`` of every member (one sum over the step's group)
        and fold them into the attempt's state. A failed sum folds nothing (the step will not
        commit)."""
        split, pending, group = self.current, self.pending, self.group
        if split is None or pending is None or group is None:
            return
        size = group.size
        vec = torch.zeros(3 * size, dtype=torch.float64)
        valid = work_s if math.isfinite(work_s) and work_s > 0 else 0.0
        vec[3 * group.rank:3 * group.rank + 3] = torch.tensor(
            [float(self.me), float(plan_samples(plan)), valid], dtype=torch.float64)
        if size > 1 and not group.sum(vec):
            self.pending = None
            return
        rows = vec.view(size, 3).tolist()
        ids = [int(r[0]) for r in rows]
        if tuple(ids) != split.ids:  # another order than planned: learn it, plan again next step
            pending.order, pending.key = ids, None
            self.exchanged_fixed = False
            return
        pending.fold(ids, [int(r[1]) for r in rows], [r[2] for r in rows],
                     self.run.step + 2)

    def commit(self) -> None:
        """The attempt committed (the core's step already counts it): its state becomes the
        state; rank 0 announces a plan that began with this step or begins with the next."""
        if self.pending is None:
            return
        before = (self.state.shares, self.state.plan_step)
        self.state, self.pending = self.pending, None
        if self.exchanged_fixed:
            self.life_ids_known = True
        s = self.state
        new = s.plan_step in (self.run.step, self.run.step + 1) and (s.shares, s.plan_step) != before
        if self.rank0 and new:
            shares = "/".join(str(s.shares[i]) for i in s.order)
            speeds = "/".join(f"{v:.1f}" if (v := s.speed(i)) else "?" for i in s.order)
            print(f"[ddplab] step {s.plan_step}: batch shares {shares} of {sum(s.shares.values())} "
                  f"(speeds {speeds} samples/s; {s.reason})", flush=True)

    def changed(self) -> bool:
        split = self.current
        return split is not None and split.reason is not None

    def record_fields(self, plan: StepPlan) -> dict[str, Any]:
        """``batch_share``, ``batch_shares`` (every member's, by rank), ``batch_speeds`` (their
        speed estimates with this step's measurements, samples/s, null: none yet) and
        ``batch_plan`` (why, on the first step of a plan)."""
        fields = super().record_fields(plan)
        split = self.current
        if split is None:
            return fields
        speeds = [self.state.speed(i) for i in split.ids]
        fields.update(batch_shares=list(split.shares),
                      batch_speeds=[None if v is None else round(v, 2) for v in speeds])
        if split.reason is not None:
            fields["batch_plan"] = split.reason
        return fields

    # --- state --------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"mode": self.mode, **self.state.to_dict()}

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        """Take a checkpoint's or a peer's state; another mode's or none starts over (equal)."""
        if isinstance(state, dict) and state.get("mode") == self.mode:
            self.state = BalanceState.from_dict(state)
        else:
            self.state = BalanceState()
        self.life_ids_known = False


def for_config(cfg: TrainConfig, run: Any, rank0: bool) -> Balancer:
    """The balancer of ``cfg.batch_balance`` for the core's ``run`` (see :class:`SpeedBalancer`)."""
    return SpeedBalancer(run, rank0) if cfg.batch_balance == "speed" else Balancer()
