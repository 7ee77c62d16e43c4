"""Speed-balanced batches (``batch_balance: speed``) in real groups: three gloo ranks under
torchrun (the torchelastic engine) and three torchft replica groups under a lighthouse (per_step).

The ranks' measured work is replaced by a deterministic speed model (tests/fake_speed.py: a rank
of speed 4 samples/s, one of 2, one of 1), so the shares and re-plans do not depend on this
machine's load; everything else is the real program.

* the exact gradient: a balanced step of 3 ranks with uneven shares (9/4/2 of 15, rank 0's nine in
  three accumulated micro-batches) gives the update of one process on the same 15 samples;
* resume: a rank killed mid-run, after a slowdown and before its re-plan; the restarted group
  resumes from the emergency checkpoint with the recorded shares, re-plans at the same step and
  ends with the parameters of an uninterrupted run, bit for bit;
* per_step: the replicas plan the same shares, every committed step's samples partition its
  global batch; a replica killed and started again is healed with the shares and speeds, so the
  group of three is balanced again at once; the model equals one process's on the same samples.
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
import test_per_step_e2e as e2e
import torch
from conftest import REPO, VENV_BIN, read_metrics, subprocess_env, tiny_args
from ddplab import train as train_mod
from ddplab.checkpoint import CheckpointStore
from test_per_step_e2e import Replica, assert_samples_distinct, first_at, val_losses, wait_until
from test_train_distributed import by_event, max_diff, run_with_a_kill

pytestmark = pytest.mark.slow
lighthouse = e2e.lighthouse  # the fixture: a torchft lighthouse on a free port

FAKE = REPO / "tests" / "fake_speed.py"
# 15 samples a step, at most 4 a pass: shares 9/4/2 need 3 + 1 + 1 passes
# the elementwise drift of parameters from one process's, per step, by float rounding (see below)
DRIFT_PER_STEP = 5e-5
BALANCED = {"batch_balance": "speed", "batch_policy": "keep_global", "global_batch_size": 15,
            "sample_chars": 0}


def torchrun(nproc: int, args: list[str], max_restarts: int = 0) -> list[str]:
    return [str(VENV_BIN / "torchrun"), "--standalone", f"--nproc-per-node={nproc}",
            f"--max-restarts={max_restarts}", "--monitor-interval=0.1", str(FAKE), *args]


def fake_env(speeds: str, change: str = "") -> dict[str, str]:
    return subprocess_env(DDPLAB_FAKE_SPEEDS=speeds, DDPLAB_FAKE_CHANGE=change)


def shares_by_step(records: list[dict]) -> dict[int, list[int]]:
    return {r["step"]: r["batch_shares"] for r in by_event(records, "step")}


def params(out: Path, step: int) -> dict[str, torch.Tensor]:
    return CheckpointStore(out / "checkpoints").load(step)["model"]


def param_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def alone(out: Path, data: Path, stop_at: int | None = None, **args) -> None:
    """One process (torchelastic engine, world size 1) on the same samples: the global batch of
    15 in 5 accumulated passes of 3 (the evaluation's windows: eval_iters x 4, as the ranks');
    ``stop_at``: the run fails before that step (its last step is checkpointed)."""
    real = train_mod.Trainer.train_step

    def stop(self):
        if stop_at is not None and self.step == stop_at:
            raise RuntimeError("stopped by the test")
        return real(self)

    train_mod.Trainer.train_step = stop
    try:
        code = train_mod.main(tiny_args(out, data, batch_policy="keep_global", global_batch_size=15,
                                        sample_chars=0, **args))
    finally:
        train_mod.Trainer.train_step = real
    assert code == (train_mod.EXIT_OK if stop_at is None else train_mod.EXIT_FAILED)


def test_a_balanced_step_of_three_ranks_equals_one_process_on_the_same_samples(tmp_path, data_path,
                                                                                clean_env):
    """Three ranks calibrate on steps 1-3 (equal shares) and take step 4 with 9/4/2 of the 15
    samples; one process resumes their checkpoint of step 3 and takes step 4 on the same 15
    samples: the same parameters to float tolerance (the step moved them by ~1e-3)."""
    common = {"max_steps": 4, "warmup_steps": 2, "eval_interval": 4, "ckpt_interval": 3}
    three, one = tmp_path / "three", tmp_path / "one"
    res = subprocess.run(torchrun(3, tiny_args(three, data_path, **BALANCED, **common)),
                         env=fake_env("4,2,1"), capture_output=True, text=True, timeout=240, cwd=REPO)
    assert res.returncode == 0, res.stderr[-3000:]
    (one / "checkpoints").mkdir(parents=True)
    for name in ("ckpt-00000003.pt", "ckpt-00000003.pt.sha256"):
        shutil.copy(three / "checkpoints" / name, one / "checkpoints" / name)
    alone(one, data_path, **common)

    ranks = [read_metrics(three, r) for r in range(3)]
    # an equal start, the calibration after 3 steps: 9/4/2 at step 4, on every rank
    assert shares_by_step(ranks[0]) == {1: [5, 5, 5], 2: [5, 5, 5], 3: [5, 5, 5], 4: [9, 4, 2]}
    assert all(shares_by_step(r) == shares_by_step(ranks[0]) for r in ranks)
    step4 = [by_event(r, "step")[3] for r in ranks]
    assert [(s["batch_share"], s["grad_accum_steps"]) for s in step4] == [(9, 3), (4, 1), (2, 1)]
    assert [s["samples_seen"] for s in step4] == [60, 60, 60]
    assert step4[0]["batch_plan"] == "calibrated" and step4[0]["batch_speeds"] == [4.0, 2.0, 1.0]
    assert by_event(read_metrics(one), "start")[0]["resumed_from_step"] == 3
    # the update is the mean over the 15 samples: the loss and the parameters of one process
    single = by_event(read_metrics(one), "step")
    assert [r["step"] for r in single] == [4]
    assert abs(single[0]["loss"] - step4[0]["loss"]) <= 2e-6  # (records round to 6 decimals)
    moved = param_diff(params(three, 4), params(three, 3))
    diff = param_diff(params(three, 4), params(one, 4))
    print(f"\nstep 4: moved the parameters by up to {moved:.2e}; 3 balanced ranks vs one process {diff:.2e}")
    assert moved > 1e-4 and diff < 1e-6


def test_resume_with_the_recorded_shares_is_exact(tmp_path, data_path):
    """Rank 0 slows to a quarter from step 15: the shares move at step 27 (its median flips
    after 8 slow steps, then 5 more over the margin). Rank 2 is killed as it begins step 18
    (windows holding slow steps, no re-plan yet): the group restarts from the emergency
    checkpoint of step 17 with the shares and windows it recorded, re-plans at the very step the
    uninterrupted run does, and ends with the same parameters, bit for bit."""
    common = {**BALANCED, "max_steps": 40, "warmup_steps": 3, "eval_interval": 1000,
              "ckpt_interval": 1000}
    env = fake_env("4,2,1", change="0:15:0.25")
    ref, killed = tmp_path / "uninterrupted", tmp_path / "killed"
    done = subprocess.run(torchrun(3, tiny_args(ref, data_path, **common)), env=env,
                          capture_output=True, text=True, timeout=240, cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    run_with_a_kill(torchrun(3, tiny_args(killed, data_path, **common), max_restarts=1), env,
                    rank=2, at_step=18)

    records = read_metrics(killed)
    starts = by_event(records, "start")
    assert [s["restart_count"] for s in starts] == [0, 1] and starts[1]["resumed_from_step"] == 17
    resumed = starts[1]["resumed_from_step"]
    plans = {r["step"]: r.get("batch_plan") for r in by_event(read_metrics(ref), "step")}
    replan = [s for s, why in plans.items() if why == "speed"]
    assert replan and replan[0] > resumed, (plans, resumed)  # the re-plan came after the restart
    want = shares_by_step(read_metrics(ref))
    assert want[replan[0] - 1] != want[replan[0]]
    # every step, before and after the restart: the shares of the uninterrupted run
    got = shares_by_step(records)
    assert got == want
    assert max_diff(ref, killed) == 0.0


def test_per_step_replicas_balance_alike_and_a_rejoined_one_gets_the_shares(tmp_path, data_path, lighthouse,
                                                                             clean_env):
    speeds = {"node0": "4", "node1": "2", "node2": "1"}
    reps = [Replica(tmp_path, name, lighthouse, data_path, env={"DDPLAB_FAKE_SPEEDS": speed},
                    max_steps=100000, eval_interval=50, ckpt_interval=100000, warmup_steps=3,
                    ft_start_replicas=3, **BALANCED)
            for name, speed in speeds.items()]
    for rep in reps:
        rep.AGENT = [str(FAKE), "--agent"]
        rep.start()
    survivors, victim = reps[:2], reps[2]

    def balanced(group: list[Replica], since: float, participants: int):
        return [r for rep in group for r in rep.committed(since)
                if r["participants"] == participants and sorted(r["batch_shares"]) == sorted(
                    {3: [9, 4, 2], 2: [10, 5]}[participants])]

    t3 = wait_until("3 balanced participants", lambda: balanced(reps, 0.0, 3), reps, 90)[0]["time"]
    wait_until("15 steps at 3", lambda: len(victim.committed(t3)) >= 15, reps, 60)
    kill_time = time.time()
    victim.signal(signal.SIGKILL)
    victim.wait(10)
    # the survivors re-plan for their group at once, with the speeds they know (4 and 2)
    at2 = wait_until("2 balanced participants", lambda: balanced(survivors, kill_time, 2), survivors, 60)
    assert at2[0]["step"] == min(r["step"] for rep in survivors for r in rep.committed(kill_time)
                                 if r["participants"] == 2)
    victim.start()
    back = wait_until("back to 3", lambda: first_at(reps, 3, victim.started), reps, 90)
    wait_until("10 steps after the rejoin", lambda: len(victim.committed(back)) >= 10, reps, 60)
    for rep in reps:
        rep.signal(signal.SIGTERM)
    for rep in reps:
        rep.wait(30)

    # the rejoined replica was healed with the state of balancing too: its first step at 3 is
    # already balanced (its own speed, 1 sample/s, was remembered by the group)
    first = [r for r in victim.committed(victim.started)][0]
    assert first["participants"] == 3 and first["batch_shares"][first["rank"]] == 2, first
    # one plan for all: at each step every replica records the same shares, and its samples are
    # its share of the step's contiguous block
    by_step: dict[int, list[dict]] = {}
    for rep in reps:
        for r in rep.committed():
            by_step.setdefault(r["step"], []).append(r)
            assert r["samples"][1] - r["samples"][0] == r["batch_share"] == r["batch_shares"][r["rank"]]
    for step, recs in by_step.items():
        assert len({tuple(r["batch_shares"]) for r in recs}) == 1, (step, recs)
    assert assert_samples_distinct(reps, faults=2) >= 40
    # the model: the mean over each step's 15 samples, as one process on the same samples. The
    # measure is the validation loss at every evaluation (within 1e-3; a step weighted wrongly
    # moves the loss by 1e-2 at once). The parameters drift apart elementwise by float rounding
    # through Adam, about 2e-5 a step (7e-3 after 330 steps) and the test's wall time sets the
    # number of steps, so their bound grows with it: DRIFT_PER_STEP, twice the rate seen.
    last = max(r["step"] for r in survivors[0].committed())
    one = tmp_path / "one"
    alone(one, data_path, stop_at=last, max_steps=100000, eval_interval=50, ckpt_interval=100000,
          warmup_steps=3)
    diff = param_diff(params(survivors[0].out, last), params(one, last))
    val = {r["step"]: r["val_loss"] for r in by_event(read_metrics(one), "val")}
    gaps = [abs(v - val[s]) for s, v in val_losses(survivors[0]).items() if s in val]
    print(f"\nper_step balanced, {last} steps: max parameter difference to one process {diff:.2e}, "
          f"val loss at {len(gaps)} evaluations within {max(gaps):.1e}")
    assert len(gaps) >= 2 and max(gaps) < 1e-3
    assert diff < DRIFT_PER_STEP * last, (diff, last)


def test_a_balanced_per_step_step_equals_one_process_on_the_same_samples(tmp_path, data_path, lighthouse,
                                                                         clean_env):
    """As for torchelastic, under torchft's all-reduce: three replicas (speeds 4, 2, 1) take
    step 4 with 9/4/2 of 15 samples; one process resumes replica node0's checkpoint of step 3."""
    common = {"max_steps": 4, "warmup_steps": 2, "eval_interval": 4, "ckpt_interval": 3}
    reps = [Replica(tmp_path, f"node{i}", lighthouse, data_path, env={"DDPLAB_FAKE_SPEEDS": speed},
                    ft_start_replicas=3, **BALANCED, **common)
            for i, speed in enumerate("421")]
    for rep in reps:
        rep.AGENT = [str(FAKE), "--agent"]
        rep.start()
    assert [rep.wait(120) for rep in reps] == [0, 0, 0], "\n".join(rep.output() for rep in reps)
    step4 = {rep.name: rep.committed()[-1] for rep in reps}
    assert all(r["step"] == 4 and r["participants"] == 3 for r in step4.values()), step4
    assert sorted(r["batch_share"] for r in step4.values()) == [2, 4, 9]
    assert step4["node0"]["batch_share"] == 9 and step4["node0"]["grad_accum_steps"] == 3
    one, ckpt = tmp_path / "one", reps[0].out / "checkpoints"
    (one / "checkpoints").mkdir(parents=True)
    for name in ("ckpt-00000003.pt", "ckpt-00000003.pt.sha256"):
        shutil.copy(ckpt / name, one / "checkpoints" / name)
    alone(one, data_path, **common)
    moved = param_diff(params(reps[0].out, 4), params(reps[0].out, 3))
    diff = max(param_diff(params(rep.out, 4), params(one, 4)) for rep in reps)
    print(f"\nper_step step 4: moved the parameters by up to {moved:.2e}; vs one process {diff:.2e}")
    assert moved > 1e-4 and diff < 1e-6
