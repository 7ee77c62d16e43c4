"""Divergence guard: decide, before the optimizer applies a step, that training has diverged.

A character model that guesses uniformly over a vocabulary of ``V`` characters has a cross-entropy
of ``ln V`` nats (4.17 for tiny-shakespeare's 65). Once warmup is over, a training loss more than
``margin`` nats above that is worse than knowing nothing: the weights are being destroyed (measured
on the tiny preset with ``base_lr`` 50: finite losses of 80-130). A non-finite loss or gradient
norm is always divergence. The trainer stops such a step before ``optimizer.step()``, so the model
and every checkpoint keep the last good state.
"""

from __future__ import annotations

import math

#: Exit code of a run stopped by the guard (see ddplab.train).
EXIT_DIVERGED = 3


class Diverged(RuntimeError):
    """Training diverged at ``step`` (the step that was not applied); ``reason`` says how."""

    def __init__(self, step: int, reason: str, loss: float, grad_norm: float) -> None:
        super().__init__(f"training diverged at step {step}: {reason}; the step was not applied")
        self.step = step
        self.reason = reason
        self.loss = loss
        self.grad_norm = grad_norm


def uniform_loss(vocab_size: int) -> float:
    """Cross-entropy (nats) of uniform guessing over ``vocab_size`` classes: ``ln(vocab_size)``."""
    if vocab_size < 1:
        raise ValueError(f"vocab_size = {vocab_size} must be >= 1")
    return math.log(vocab_size)


def divergence_reason(
    loss: float, grad_norm: float, step: int, *, vocab_size: int, warmup_steps: int, margin: float,
) -> str | None:
    """Why the step that takes the model from ``step`` to ``step + 1`` must not be applied, or None.

    Args:
        loss: mean training loss of the step over all ranks (nats per character).
        grad_norm: L2 norm of the all-reduced gradients (before clipping).
        step: optimizer steps completed so far.
        vocab_size: number of classes; the loss limit is ``ln(vocab_size) + margin``.
        warmup_steps: the loss limit applies from ``step >= warmup_steps`` on (non-finite: always).
        margin: nats above uniform guessing that still count as training.
    """
    if not math.isfinite(loss):
        return f"non-finite loss ({loss})"
    if not math.isfinite(grad_norm):
        return f"non-finite gradient norm ({grad_norm})"
    limit = uniform_loss(vocab_size) + margin
    if step >= warmup_steps and loss > limit:
        return (f"loss {loss:.4g} above uniform guessing ln({vocab_size}) + {margin:g} = {limit:.4g}")
    return None
