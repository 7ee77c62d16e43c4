"""Speed-balanced batches (ddplab.balance), without processes: the integer split, the speed
estimate's hysteresis (no re-plan on noise, one after a sustained slowdown or recovery, a plan at
once when the group changes), the state through a checkpoint, and several members in lockstep
(threads summing through a barrier, as a group's collective does) agreeing on every plan.
The same over gloo and torchft: tests/test_balance_distributed.py."""

from __future__ import annotations

import io
import itertools
import random
import threading
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from ddplab import balance
from ddplab.balance import (
    CALIBRATION,
    COOLDOWN,
    PATIENCE,
    THRESHOLD,
    WINDOW,
    BalanceState,
    SpeedBalancer,
    allocate,
    predicted_time,
    share_sample_indices,
    weighted_micro_batches,
)
from ddplab.config import ConfigError, build_config
from ddplab.engines.base import Group, StepPlan
from ddplab.lr import plan_batch


# --- the split ----------------------------------------------------------------------------------
def best_makespan(total: int, speeds: list[float]) -> float:
    """Brute force: the smallest predicted time over every split with each share >= 1."""
    n = len(speeds)
    best = float("inf")
    for cut in itertools.combinations(range(1, total), n - 1):
        shares = [b - a for a, b in zip((0, *cut), (*cut, total), strict=True)]
        best = min(best, predicted_time(shares, speeds))
    return best


def test_allocate_is_makespan_optimal_sums_to_the_batch_and_gives_everyone_one():
    rng = random.Random(7)
    for _ in range(300):
        n = rng.randint(1, 4)
        total = rng.randint(n, 24)
        speeds = [rng.uniform(0.05, 5.0) for _ in range(n)]
        shares = allocate(total, speeds)
        assert sum(shares) == total and min(shares) >= 1
        assert predicted_time(shares, speeds) == pytest.approx(best_makespan(total, speeds), rel=1e-12)


def test_allocate_follows_speed_and_is_deterministic():
    assert allocate(36, [0.6, 0.6, 0.3]) == allocate(36, [0.6, 0.6, 0.3]) == [15, 14, 7]
    assert allocate(36, [1.0, 1.0, 1.0]) == [12, 12, 12]
    assert allocate(10, [1.0, 1.0, 1.0]) == [4, 3, 3]  # ties to the lowest position
    assert allocate(3, [100.0, 1.0, 1.0]) == [1, 1, 1]  # never below one sample
    with pytest.raises(ValueError, match="2 samples cannot give 3"):
        allocate(2, [1.0, 1.0, 1.0])
    with pytest.raises(ValueError, match="positive finite"):
        allocate(6, [1.0, 0.0])


def test_blocks_partition_the_global_batch_and_weights_give_the_global_mean():
    shares = [9, 4, 2]
    blocks = [share_sample_indices(100, r, shares) for r in range(3)]
    assert np.array_equal(np.concatenate(blocks), np.arange(100, 115))
    micro = [weighted_micro_batches(b, 4, 3, 15, seed=1, step=0) for b in blocks]
    assert [[len(m.indices) for m in ms] for ms in micro] == [[4, 4, 1], [4], [2]]
    # sum over ranks of sum(weight x mean loss) / group size = the mean over the 15 samples
    losses = {i: float(i) for i in range(100, 115)}
    avg = sum(m.weight * np.mean([losses[int(i)] for i in m.indices]) for ms in micro for m in ms) / 3
    assert avg == pytest.approx(np.mean(list(losses.values())), rel=1e-12)
    assert all(m.accum == 1 for ms in micro for m in ms)


# --- the estimate and its hysteresis ------------------------------------------------------------
IDS = [11, 22, 33]


def simulate(speed_at, steps: int, total: int = 36, noise: float = 0.2, seed: int = 3,
             ids: list[int] = IDS) -> tuple[BalanceState, list[tuple[int, str, list[int]]]]:
    """Run ``steps`` steps of one state: each member's work is its samples / (speed x a uniform
    noise factor in [1 - noise, 1 + noise]); returns the state and the plans (step, reason, shares)."""
    rng = random.Random(seed)
    state, plans = BalanceState(), []
    for step in range(1, steps + 1):
        shares = state.plan_for(ids, total, step)
        if state.plan_step == step:
            plans.append((step, state.reason, shares))
        work = [s / (speed_at(i, step) * rng.uniform(1 - noise, 1 + noise)) for i, s in zip(ids, shares,
                                                                                         strict=True)]
        state.fold(ids, shares, work, step + 1)
    return state, plans


def calibration(plans: list) -> list:
    """``plans`` without its start and calibration (asserted: an equal start, then plans
    ``calibrated`` only at the step after CALIBRATION and after WINDOW measurements)."""
    assert plans[0] == (1, "start", [12, 12, 12]), plans
    rest = plans[1:]
    while rest and rest[0][1] == "calibrated":
        assert rest.pop(0)[0] in (CALIBRATION + 1, WINDOW + 1), plans
    return rest


def test_calibration_then_no_oscillation_on_noise():
    """Speeds 0.6/0.6/0.3 with +-10 % and +-20 % noise on every step, 1000 steps, 20 seeds: an
    equal start, the calibration (the plan of CALIBRATION measurements each, the best plan once
    the windows are full), then not one re-plan."""
    for noise, seed in itertools.product((0.1, 0.2), range(20)):
        _, plans = simulate(lambda i, s: {11: 0.6, 22: 0.6, 33: 0.3}[i], 1000, noise=noise, seed=seed)
        assert plans[1][:2] == (CALIBRATION + 1, "calibrated"), plans
        assert calibration(plans) == [], (noise, seed, plans)
        assert all(5 <= p[2][2] <= 9 for p in plans[1:]), plans  # the slow one: 36 x 0.3 / 1.5 = 7.2


def test_equal_speeds_with_noise_stay_near_equal_shares():
    for seed in range(10):
        state, plans = simulate(lambda i, s: 0.6, 1000, noise=0.2, seed=seed)
        assert calibration(plans) == [], plans
        assert all(abs(v - 12) <= 1 for v in state.shares.values()), plans


def test_a_sustained_slowdown_and_the_recovery_each_replan_soon():
    """Member 33 throttled to a quarter from step 200 to 400 (+-10 % noise, 8 seeds): re-planned
    within (WINDOW + 1) / 2 + PATIENCE steps of the slowdown and WINDOW + PATIENCE of the
    recovery, the slow member then
    at most 7 of 36 samples (36 x 0.25 / 1.45 = 6.2), equal shares again after it; at most one
    refinement each."""
    def speed(i: int, step: int) -> float:
        return 0.25 if i == 33 and 200 <= step < 400 else 0.6

    for seed in range(8):
        _, plans = simulate(speed, 700, noise=0.1, seed=seed)
        slow = [p for p in plans if 200 < p[0] < 400]
        back = [p for p in plans if p[0] > 400]
        assert plans[:1] == [(1, "start", [12, 12, 12])] and all(p[1] == "speed" for p in slow + back)
        assert 1 <= len(slow) <= 2 and 1 <= len(back) <= 2, plans
        assert slow[0][0] <= 200 + (WINDOW + 1) // 2 + PATIENCE and slow[-1][2][2] <= 7, plans
        assert back[0][0] <= 400 + WINDOW + PATIENCE and back[-1][2][2] >= 11, plans


def test_a_slowdown_below_the_threshold_does_not_replan():
    _, plans = simulate(lambda i, s: 0.6 * (1 - THRESHOLD / 2) if i == 33 and s > 100 else 0.6, 400,
                        noise=0.0)
    assert plans == [(1, "start", [12, 12, 12])], plans


def test_replans_wait_for_the_cooldown():
    """Two changes 3 steps apart: the second waits COOLDOWN steps after the first plan."""
    def speed(i: int, step: int) -> float:
        if i == 33:
            return 0.15 if step >= 103 else (0.3 if step >= 100 else 0.6)
        return 0.6

    _, plans = simulate(speed, 300, noise=0.0)
    steps = [p[0] for p in plans if p[1] == "speed"]
    assert steps and all(b - a >= COOLDOWN for a, b in zip(steps, steps[1:], strict=False)), plans


def test_a_new_member_is_planned_at_once_at_the_median_speed_then_calibrated():
    state, _ = simulate(lambda i, s: {11: 1.0, 22: 0.5, 33: 0.5}[i], 40, noise=0.0)
    ids = [*IDS, 44]
    shares = state.plan_for(ids, 48, 41)
    assert (state.reason, state.plan_step, state.stage) == ("group", 41, 0)
    assert abs(shares[3] - shares[1]) <= 1 and shares[0] > 2 * shares[3] - 2, shares  # at 0.5
    for step in range(41, 41 + CALIBRATION):
        state.fold(ids, [state.shares[i] for i in ids],
                   [state.shares[i] / {11: 1.0, 22: 0.5, 33: 0.5, 44: 2.0}[i] for i in ids], step + 1)
    assert (state.reason, state.stage) == ("calibrated", 1)
    assert state.shares[44] > state.shares[11], state.shares  # the newcomer is the fastest


def test_a_new_global_batch_replans_with_the_speeds_known():
    state, _ = simulate(lambda i, s: {11: 1.0, 22: 1.0, 33: 0.5}[i], 30, noise=0.0)
    assert state.plan_for(IDS, 24, 31) == [10, 10, 4] and state.reason == "group"


def test_the_state_survives_a_checkpoint():
    state, _ = simulate(lambda i, s: {11: 0.6, 22: 0.6, 33: 0.3}[i], 50)
    buf = io.BytesIO()
    torch.save({"batch_balance": {"mode": "speed", **state.to_dict()}}, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=True)["batch_balance"]
    again = BalanceState.from_dict(loaded)
    assert again == state


# --- members in lockstep ------------------------------------------------------------------------
class Collective:
    """A sum over the threads of one group (the members' ``Group.sum``), through a barrier."""

    def __init__(self, size: int) -> None:
        self.barrier = threading.Barrier(size)
        self.parts: dict[int, torch.Tensor] = {}
        self.calls = 0

    def sum_for(self, rank: int):
        def total(tensor: torch.Tensor) -> bool:
            self.parts[rank] = tensor.clone()
            self.barrier.wait()
            tensor.copy_(sum(self.parts.values()))
            self.barrier.wait()
            if rank == 0:
                self.calls += 1
            return True
        return total


class Member:
    """One member: its balancer on a fake run (committed step and samples)."""

    def __init__(self, name: str, speed: float) -> None:
        self.speed = speed
        self.run = SimpleNamespace(step=0, samples_seen=0, engine=SimpleNamespace(member_name=name))
        self.balancer = SpeedBalancer(self.run, rank0=False)


def lockstep(members: list[Member], steps: int, total: int, key=None) -> list[list]:
    """``steps`` steps of a group of ``members`` (ranks in list order), each in its own thread.
    Returns per step the (shares, indices) every member planned; asserts they agree."""
    coll = Collective(len(members))
    out: list[list] = [[None] * len(members) for _ in range(steps)]

    def member(rank: int, m: Member) -> None:
        group = Group(rank, len(members), coll.sum_for(rank), key=key)
        for k in range(steps):
            split = m.balancer.split(group, total)
            micro = weighted_micro_batches(split.indices, 4, group.size, total, 1, m.run.step)
            batch = plan_batch("keep_global", 1, 4, 12, total)
            plan = StepPlan(group, batch, micro)
            m.balancer.observe(plan, len(split.indices) / m.speed)
            m.run.step += 1
            m.run.samples_seen += total
            m.balancer.commit()
            out[k][rank] = (split.shares, split.indices, m.balancer.record_fields(plan))

    threads = [threading.Thread(target=member, args=(r, m)) for r, m in enumerate(members)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for row in out:
        assert len({tuple(r[0]) for r in row}) == 1, row  # one plan for all
        assert np.array_equal(np.concatenate([r[1] for r in row]),
                              np.arange(row[0][1][0] - sum(row[0][0][:0]),
                                        row[0][1][0] + sum(row[0][0])))  # a partition
    out.append(coll.calls)
    return out


def test_members_in_lockstep_agree_and_exchange_names_once_per_life():
    members = [Member("a", 4.0), Member("b", 2.0), Member("c", 1.0)]
    out = lockstep(members, 12, 14)
    calls = out.pop()
    assert calls == 1 + 12  # the names once (a group of key None), then one gather a step
    assert out[0][0][0] == (5, 5, 4) and out[-1][0][0] == (8, 4, 2)
    fields = out[CALIBRATION][2][2]
    assert fields["batch_share"] == 2 and fields["batch_shares"] == [8, 4, 2]
    assert fields["batch_plan"] == "calibrated" and fields["batch_speeds"] == [4.0, 2.0, 1.0]
    assert "batch_plan" not in out[CALIBRATION + 1][0][2]


def test_a_group_of_new_members_in_another_order_keeps_each_members_speed():
    """The state of three members moved to a group of four in another order (a torchelastic
    restart, a per_step quorum): names exchanged again, each known member keeps its speed."""
    members = [Member("a", 4.0), Member("b", 2.0), Member("c", 1.0)]
    lockstep(members, 8, 14)
    state = members[0].balancer.state_dict()
    again = [Member("c", 1.0), Member("d", 1.0), Member("a", 4.0), Member("b", 2.0)]
    for m in again:
        m.balancer.load_state_dict(state)
        m.run.step, m.run.samples_seen = 8, 8 * 14
    out = lockstep(again, 6, 16, key="launch/7")
    calls = out.pop()
    assert calls == 1 + 6
    first = out[0][0]
    assert first[2]["batch_plan"] == "group" and first[2]["batch_shares"][2] > first[2]["batch_shares"][3]
    assert out[-1][0][0] == (2, 2, 8, 4)  # d calibrated at c's speed


def test_a_key_that_changes_exchanges_the_names_again():
    members = [Member("a", 1.0), Member("b", 1.0)]
    lockstep(members, 3, 8, key="q/1")
    out = lockstep(members, 3, 8, key="q/2")
    assert out.pop() == 1 + 3
    out = lockstep(members, 3, 8, key="q/2")
    assert out.pop() == 3


def test_off_plans_nothing_and_records_the_share():
    off = balance.for_config(build_config({}), SimpleNamespace(), rank0=False)
    group = Group(0, 2, lambda t: True)
    assert off.split(group, 8) is None and off.state_dict() is None and not off.changed()
    micro = weighted_micro_batches(np.arange(6), 4, 2, 12, 1, 0)
    assert off.record_fields(StepPlan(group, plan_batch("keep_global", 2, 4, 12, 12), micro)) == {
        "batch_share": 6}


def test_batch_balance_setting():
    assert build_config({}).batch_balance == "off"
    assert build_config({"batch_balance": "speed"}).batch_balance == "speed"
    with pytest.raises(ConfigError, match=r"'batch_balance' = 'fast': must be one of off, speed"):
        build_config({"batch_balance": "fast"})
    assert build_config({"batch_balance": False}).batch_balance == "off"  # YAML's unquoted off
    with pytest.raises(ConfigError, match="diloco's inner steps run alone: use off"):
        build_config({"batch_balance": "speed", "fault_tolerance": "diloco",
                      "ft_lighthouse": "http://127.0.0.1:29510"})
    with pytest.raises(ConfigError, match=r"'batch_balance' = 'True': must be one of off, speed"):
        build_config({"batch_balance": True})


def test_a_resume_keeps_the_runs_batch_balance_unless_given():
    from ddplab.config import resume_plan

    recorded = {"run_id": "r1", "preset": "tiny", "max_steps": 100, "batch_balance": "speed"}
    plan = resume_plan("r1", recorded, {}, reached_step=50)
    assert plan.settings["batch_balance"] == "speed" and not plan.changes
    names = {"batch_balance": "ddp_job_batch_balance"}
    plan = resume_plan("r1", recorded, {"batch_balance": "off"}, 50, names)
    assert plan.changes == ["ddp_job_batch_balance 'speed' -> 'off'"] and not plan.conflicts
