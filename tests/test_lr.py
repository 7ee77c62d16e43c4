"""Batch policy (keep_per_rank / keep_global) and the warmup + cosine learning-rate schedule."""

import math

import pytest
from ddplab.lr import BatchPolicyError, lr_at, plan_batch, ramp_lr_scale


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_keep_per_rank_scales_lr_with_global_batch(world_size):
    plan = plan_batch("keep_per_rank", world_size, 12, 36)
    assert plan.per_rank_batch_size == 12
    assert plan.grad_accum_steps == 1
    assert plan.global_batch_size == 12 * world_size
    assert plan.lr_scale == pytest.approx(12 * world_size / 36)


@pytest.mark.parametrize(
    ("world_size", "micro", "accum"), [(1, 12, 3), (2, 9, 2), (3, 12, 1), (4, 9, 1), (6, 6, 1)]
)
def test_keep_global_accumulates_to_the_same_batch(world_size, micro, accum):
    plan = plan_batch("keep_global", world_size, 12, 36, global_batch_size=36)
    assert (plan.per_rank_batch_size, plan.grad_accum_steps) == (micro, accum)
    assert world_size * plan.per_rank_batch_size * plan.grad_accum_steps == 36
    assert plan.global_batch_size == 36
    assert plan.lr_scale == 1.0


def test_keep_global_without_global_batch_uses_current_product():
    plan = plan_batch("keep_global", 2, 12, 24)
    assert plan.global_batch_size == 24 and plan.grad_accum_steps == 1


def test_keep_global_indivisible_is_a_clear_error():
    with pytest.raises(BatchPolicyError, match="global_batch_size 36 is not divisible by world_size 5"):
        plan_batch("keep_global", 5, 12, 36, global_batch_size=36)


@pytest.mark.parametrize(("args", "match"), [
    (("keep_per_rank", 0, 12, 36), "world_size"),
    (("keep_per_rank", 1, 0, 36), "per_rank_batch_size"),
    (("keep_per_rank", 1, 12, -1), "reference_batch_size"),
    (("sideways", 1, 12, 36), "unknown batch_policy"),
])
def test_plan_rejects_bad_values(args, match):
    with pytest.raises(ValueError, match=match):
        plan_batch(*args)


def test_schedule_values():
    base, scale, warm, total, floor = 1e-3, 2.0, 10, 110, 0.1
    peak = base * scale

    def lr(step):
        return lr_at(step, base, scale, warm, total, floor)

    # linear warmup reaching the peak on the last warmup step
    assert lr(0) == pytest.approx(peak / 10)
    assert lr(4) == pytest.approx(peak * 5 / 10)
    assert lr(9) == pytest.approx(peak)
    # cosine: peak at the start, midpoint halfway, floor at the end (and after)
    assert lr(10) == pytest.approx(peak)
    assert lr(60) == pytest.approx(peak * (floor + (1 - floor) * 0.5))
    assert lr(35) == pytest.approx(peak * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * 0.25))))
    assert lr(110) == pytest.approx(peak * floor)
    assert lr(500) == pytest.approx(peak * floor)
    decay = [lr(s) for s in range(10, 111)]
    assert all(a >= b for a, b in zip(decay, decay[1:], strict=False))


def test_schedule_without_warmup_starts_at_peak():
    assert lr_at(0, 3e-3, 1.0, 0, 100, 0.0) == pytest.approx(3e-3)
    assert lr_at(100, 3e-3, 1.0, 0, 100, 0.0) == pytest.approx(0.0)


def test_linear_scaling_rule_between_world_sizes():
    """Goyal et al.: the same step at 3x the global batch gets 3x the learning rate."""
    one = plan_batch("keep_per_rank", 1, 12, 12)
    three = plan_batch("keep_per_rank", 3, 12, 12)
    for step in (0, 5, 50, 99):
        assert lr_at(step, 1e-3, three.lr_scale, 10, 100, 0.1) == pytest.approx(
            3 * lr_at(step, 1e-3, one.lr_scale, 10, 100, 0.1)
        )


# --- LR ramp after a world-size change (issue 15 case 4) -------------------------------------
ONE, TWO, THREE = 12 / 36, 24 / 36, 36 / 36  # keep_per_rank scales at 1, 2, 3 ranks x 12


@pytest.mark.parametrize(("old", "new"), [(ONE, TWO), (THREE, TWO), (TWO, THREE)],
                         ids=["1->2", "3->2", "2->3"])
def test_world_size_change_ramps_linearly_from_old_to_new(old, new):
    segments = [(0, old), (40, new)]
    ramp = [ramp_lr_scale(segments, t, 30) for t in range(38, 72)]
    assert ramp[:2] == [old, old]  # steps 38, 39: before the change
    assert ramp[2] == pytest.approx(old + (new - old) / 30)  # step 40: one 30th of the way
    assert ramp_lr_scale(segments, 54, 30) == pytest.approx(old + (new - old) * 15 / 30)
    assert ramp_lr_scale(segments, 69, 30) == pytest.approx(new)  # reached after 30 steps
    assert ramp[-1] == new
    deltas = [b - a for a, b in zip(ramp, ramp[1:], strict=False)]
    assert all(abs(d) <= abs(new - old) / 30 + 1e-12 for d in deltas)  # never a jump
    assert all(d * (new - old) >= 0 for d in deltas)  # monotone towards the new value


def test_issue_example_lr_moves_gradually_from_one_to_two_ranks():
    """1 -> 2 ranks at step 40 (small preset, 350 steps): the LR no longer doubles in one step."""
    def lr(t, segments):
        return lr_at(t, 1e-2, ramp_lr_scale(segments, t, 30), 30, 350, 0.1)
    segments = [(0, ONE), (40, TWO)]
    assert lr(39, segments) == pytest.approx(3.327e-3, rel=1e-3)
    jump = lr_at(40, 1e-2, TWO, 30, 350, 0.1)  # what the old code used at step 40: x2 at once
    assert jump / lr(39, segments) == pytest.approx(2.0, rel=1e-2)
    assert lr(40, segments) / lr(39, segments) == pytest.approx(1 + 1 / 30, rel=1e-3)
    assert lr(69, segments) == pytest.approx(lr_at(69, 1e-2, TWO, 30, 350, 0.1))


def test_change_during_a_ramp_starts_from_the_rate_in_effect():
    segments = [(0, ONE), (40, TWO), (50, THREE)]
    at_49 = ONE + (TWO - ONE) * 10 / 30
    assert ramp_lr_scale(segments, 49, 30) == pytest.approx(at_49)
    assert ramp_lr_scale(segments, 50, 30) == pytest.approx(at_49 + (THREE - at_49) / 30)
    assert ramp_lr_scale(segments, 79, 30) == pytest.approx(THREE)


def test_restart_at_the_same_scale_continues_the_ramp_and_zero_jumps():
    base = [(0, ONE), (40, TWO)]
    again = [*base, (45, TWO), (45, TWO)]
    assert [ramp_lr_scale(again, t, 30) for t in range(80)] == [ramp_lr_scale(base, t, 30) for t in range(80)]
    assert ramp_lr_scale(base, 40, 0) == TWO
    assert ramp_lr_scale([(0, ONE)], 5, 30) == ONE  # first start: no ramp (warmup does that)
    with pytest.raises(ValueError):
        ramp_lr_scale([], 0, 30)
