"""Batch policy and learning-rate schedule.

Linear scaling rule with gradual warmup (Goyal et al. 2017, "Accurate, Large Minibatch SGD:
Training ImageNet in 1 Hour", sections 2.1-2.2): when the global batch is ``k`` times the
reference batch, multiply the learning rate by ``k``; ramp it up linearly over the first steps.
After warmup the rate follows a half-cosine (Loshchilov & Hutter 2017, SGDR, without restarts)
down to ``min_lr_ratio`` times the peak at ``max_steps``.

The plan is recomputed from ``WORLD_SIZE`` at every (re)start, so a world-size change re-applies
the policy:

* ``keep_per_rank``: each rank keeps ``per_rank_batch_size``; global batch = W * per_rank;
  the LR follows the global batch.
* ``keep_global``: the global batch stays fixed (``global_batch_size``, or the global batch of
  the run's first start when unset); each rank processes ``global / W`` samples per step as
  ``grad_accum_steps`` micro-batches of the largest size <= ``per_rank_batch_size`` that divides
  ``global / W``; the LR stays the same.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass


class BatchPolicyError(ValueError):
    """The batch policy cannot be applied at this world size."""


@dataclass(frozen=True)
class BatchPlan:
    """How one optimizer step is split. ``global_batch_size = world_size * micro * accum``."""

    batch_policy: str
    world_size: int
    per_rank_batch_size: int  # micro-batch: samples per forward/backward pass on one rank
    grad_accum_steps: int
    global_batch_size: int
    reference_batch_size: int
    lr_scale: float  # global_batch_size / reference_batch_size (Goyal et al. 2017)

    def to_dict(self) -> dict:
        return asdict(self)


def plan_batch(
    batch_policy: str,
    world_size: int,
    per_rank_batch_size: int,
    reference_batch_size: int,
    global_batch_size: int | None = None,
) -> BatchPlan:
    """Apply the batch policy at ``world_size``.

    Raises:
        BatchPolicyError: ``keep_global`` with a global batch that ``world_size`` does not divide.
        ValueError: a non-positive size or an unknown policy.
    """
    for name, value in (("world_size", world_size), ("per_rank_batch_size", per_rank_batch_size),
                        ("reference_batch_size", reference_batch_size)):
        if value <= 0:
            raise ValueError(f"{name} = {value} must be > 0")
    if batch_policy == "keep_per_rank":
        micro, accum = per_rank_batch_size, 1
        global_batch = world_size * per_rank_batch_size
    elif batch_policy == "keep_global":
        global_batch = global_batch_size or world_size * per_rank_batch_size
        if global_batch <= 0:
            raise ValueError(f"global_batch_size = {global_batch} must be > 0")
        if global_batch % world_size:
            raise BatchPolicyError(
                f"batch_policy keep_global: global_batch_size {global_batch} is not divisible by "
                f"world_size {world_size}; choose a global_batch_size that every expected world "
                f"size divides (e.g. {math.lcm(1, 2, 3) * per_rank_batch_size} for 1..3 ranks)"
            )
        per_rank_total = global_batch // world_size
        micro = max(d for d in range(1, min(per_rank_batch_size, per_rank_total) + 1)
                    if per_rank_total % d == 0)
        accum = per_rank_total // micro
    else:
        raise ValueError(f"unknown batch_policy {batch_policy!r}")
    return BatchPlan(
        batch_policy=batch_policy,
        world_size=world_size,
        per_rank_batch_size=micro,
        grad_accum_steps=accum,
        global_batch_size=global_batch,
        reference_batch_size=reference_batch_size,
        lr_scale=global_batch / reference_batch_size,
    )


def equal_shares(total: int, members: int) -> list[int]:
    """``total`` samples dealt to ``members`` positions in rank order, the remainder one each to
    the first ``total % members``: ``[total // members + (r < total % members) for r in ...]``.
    The layout of an unbalanced step (every engine) and the baseline balancing is measured against.

    Raises:
        ValueError: ``members`` < 1 or ``total`` < 0.
    """
    if members < 1 or total < 0:
        raise ValueError(f"cannot deal {total} samples to {members} members")
    base, extra = divmod(total, members)
    return [base + (r < extra) for r in range(members)]


def participants_global_batch(
    batch_policy: str, participants: int, per_rank_batch_size: int, global_batch_size: int | None
) -> int:
    """Global batch of one step of ``participants`` replica groups (the replica-group engines,
    whose participants may change from step to step).

    ``keep_per_rank``: ``participants * per_rank_batch_size`` (the LR then follows it, Goyal et
    al. 2017); ``keep_global``: ``global_batch_size`` whatever the participants (it need not be
    divisible: :func:`equal_shares` deals the remainder).

    Raises:
        ValueError: a non-positive size or an unknown policy.
    """
    if participants <= 0 or per_rank_batch_size <= 0:
        raise ValueError("participants and per_rank_batch_size must be > 0")
    if batch_policy == "keep_per_rank":
        return participants * per_rank_batch_size
    if batch_policy == "keep_global":
        if not global_batch_size or global_batch_size <= 0:
            raise ValueError("keep_global needs a global_batch_size > 0")
        return global_batch_size
    raise ValueError(f"unknown batch_policy {batch_policy!r}")


def lr_at(
    step: int, base_lr: float, lr_scale: float, warmup_steps: int, max_steps: int, min_lr_ratio: float
) -> float:
    """Learning rate for the optimizer step that takes the model from ``step`` to ``step + 1``.

    ``peak = base_lr * lr_scale``; linear warmup ``peak * (step + 1) / warmup_steps`` for
    ``step < warmup_steps``; then ``min + (peak - min) * (1 + cos(pi * p)) / 2`` with
    ``p = (step - warmup_steps) / (max_steps - warmup_steps)`` clipped to [0, 1] and
    ``min = min_lr_ratio * peak``.
    """
    peak = base_lr * lr_scale
    if step < warmup_steps:
        return peak * (step + 1) / warmup_steps
    span = max(1, max_steps - warmup_steps)
    progress = min(1.0, max(0.0, (step - warmup_steps) / span))
    floor = min_lr_ratio * peak
    return floor + (peak - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def ramp_lr_scale(segments: list[tuple[int, float]], step: int, ramp_steps: int) -> float:
    """LR scale in effect at optimizer step ``step`` when the world size changed over time.

    ``segments`` are ``(first_step, lr_scale)`` per (re)start, ascending by step (the world-size
    history of a checkpoint); ``ramp_steps`` is the ramp length R (0 = jump at once). Gradual
    warmup of Goyal et al. 2017 ("Accurate, Large Minibatch SGD", section 2.2), re-applied at
    every change of the global batch: when a segment starting at step ``s`` changes the scale from
    ``a`` (the scale in effect at step ``s - 1``, itself possibly mid-ramp) to ``b``, step ``t >= s``
    uses ``a + (b - a) * min(1, (t - s + 1) / R)``, so ``b`` is reached at step ``s + R - 1``.
    A restart that keeps the scale continues the running ramp unchanged (exact resume).

    Raises:
        ValueError: empty ``segments`` or ``ramp_steps < 0``.
    """
    if not segments:
        raise ValueError("ramp_lr_scale needs at least one (first_step, lr_scale) segment")
    if ramp_steps < 0:
        raise ValueError(f"ramp_steps = {ramp_steps} must be >= 0")

    def at(start: int, a: float, b: float, t: int) -> float:
        if ramp_steps == 0 or a == b:
            return b
        frac = min(1.0, max(0.0, (t - start + 1) / ramp_steps))
        return a + (b - a) * frac

    start, from_scale, to_scale = segments[0][0], segments[0][1], segments[0][1]
    for seg_start, scale in segments[1:]:
        if seg_start > step:
            break
        if scale == to_scale:
            continue  # same global batch: the running ramp goes on
        from_scale = at(start, from_scale, to_scale, seg_start - 1)
        start, to_scale = seg_start, scale
    return at(start, from_scale, to_scale, step)
