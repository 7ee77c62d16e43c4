"""The divergence guard's decision (ddplab.divergence): non-finite values always stop a step; a
loss far above uniform guessing stops it once warmup is over."""

import math

import pytest
from ddplab.divergence import Diverged, divergence_reason, uniform_loss

LIMITS = {"vocab_size": 65, "warmup_steps": 30, "margin": 3.0}


def test_uniform_loss_is_ln_vocab():
    assert uniform_loss(65) == pytest.approx(4.1744, abs=1e-4)
    with pytest.raises(ValueError):
        uniform_loss(0)


@pytest.mark.parametrize("loss", [math.nan, math.inf, -math.inf])
def test_non_finite_loss_stops_even_during_warmup(loss):
    assert "non-finite loss" in divergence_reason(loss, 1.0, 0, **LIMITS)


@pytest.mark.parametrize("norm", [math.nan, math.inf])
def test_non_finite_gradient_norm_stops(norm):
    assert "non-finite gradient norm" in divergence_reason(2.0, norm, 100, **LIMITS)


def test_loss_above_uniform_plus_margin_stops_after_warmup_only():
    limit = math.log(65) + 3.0  # 7.17 nats
    assert divergence_reason(limit - 0.01, 1.0, 30, **LIMITS) is None
    reason = divergence_reason(85.0, 3.0, 30, **LIMITS)  # base_lr 50 on the tiny preset: 80-130
    assert reason.startswith("loss 85 above uniform guessing ln(65) + 3 = 7.174")
    assert divergence_reason(85.0, 3.0, 29, **LIMITS) is None  # still warming up


def test_normal_training_losses_pass():
    for step, loss in [(0, 4.35), (10, 3.3), (100, 2.5), (350, 1.97)]:
        assert divergence_reason(loss, 0.8, step, **LIMITS) is None


def test_diverged_message_names_step_and_cause():
    exc = Diverged(351, "non-finite loss (nan)", math.nan, math.nan)
    assert str(exc) == "training diverged at step 351: non-finite loss (nan); the step was not applied"
    assert exc.step == 351 and exc.reason.startswith("non-finite")
