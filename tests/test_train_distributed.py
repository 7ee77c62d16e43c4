"""Multi-process runs on one machine under ``torchrun --standalone`` (gloo over loopback).

* three workers train; one is SIGKILLed mid-run; the restarted group (``--max-restarts 1``)
  resumes with no step lost and ends with the parameters of an uninterrupted run;
* a resume at another world size re-applies the batch policy (keep_per_rank rescales the LR,
  keep_global switches gradient accumulation) and continues the global sample count;
* a frozen peer: the agent's SIGTERM or the process-group timeout still gets the last step saved;
* three agents with their own folders (three "laptops"): the group agrees on the newest valid
  checkpoint, its holder broadcasts it, nodes that lack it write their own copy.
"""

import contextlib
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest
import torch
from conftest import REPO, read_metrics, run_torchrun, snapshot, subprocess_env, tiny_args, torchrun_cmd
from ddplab import train as train_mod
from ddplab.checkpoint import CheckpointStore
from labharness import free_port

pytestmark = pytest.mark.slow


def final_params(out_dir: Path) -> dict[str, torch.Tensor]:
    store = CheckpointStore(out_dir / "checkpoints")
    return store.load(store.steps()[-1])["model"]


def max_diff(a: Path, b: Path) -> float:
    pa, pb = final_params(a), final_params(b)
    return max(float((pa[k] - pb[k]).abs().max()) for k in pa)


def by_event(records, event):
    return [r for r in records if r["event"] == event]


def kill_tree(proc: subprocess.Popen, known: list[psutil.Process] = ()) -> None:
    """SIGKILL torchrun and every worker (workers may sit in their own process groups);
    ``known`` are workers collected earlier, in case the agent is already gone."""
    family = list(known)
    with contextlib.suppress(psutil.NoSuchProcess):
        family += psutil.Process(proc.pid).children(recursive=True)
        if proc.poll() is None:
            family.append(psutil.Process(proc.pid))
    for p in family:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()
    proc.wait()


def kill_rank_when(
    proc: subprocess.Popen, out_dir: Path, rank: int, at_step: int, timeout: float = 180,
    sig: int = signal.SIGKILL,
) -> int:
    """Signal (SIGKILL) the worker with RANK=``rank`` once rank 0 has logged ``at_step``."""
    metrics = out_dir / "metrics" / f"{os.uname().nodename}-local0.jsonl"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        if metrics.exists():
            steps = [int(line.split('"step":')[1].split(",")[0]) for line in metrics.read_text().splitlines()
                     if '"event":"step"' in line]
            if steps and max(steps) >= at_step:
                for child in psutil.Process(proc.pid).children():
                    if child.environ().get("RANK") == str(rank):
                        child.send_signal(sig)
                        return child.pid
        time.sleep(0.01)
    raise AssertionError(f"rank 0 never reached step {at_step} (torchrun exit {proc.poll()})")


STEP_KILL = REPO / "tests" / "step_kill.py"


def run_with_a_kill(cmd: list[str], env: dict[str, str], rank: int, at_step: int) -> str:
    """Run torchrun ``cmd`` (workers: tests/step_kill.py or a harness that installs it) whose
    worker ``rank`` SIGKILLs itself as it begins step ``at_step`` in the first life (the group
    restarts: ``--max-restarts``); return the output once it ended with exit 0."""
    env = {**env, "DDPLAB_KILL_AT": f"{rank}:{at_step}"}
    proc = subprocess.Popen(cmd, env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            kill_tree(proc)
    assert proc.returncode == 0, output[-3000:]
    return output


def test_killed_worker_costs_no_step_and_resume_is_exact(tmp_path, data_path):
    args = {"max_steps": 120, "warmup_steps": 10, "eval_interval": 1000, "ckpt_interval": 1000,
            "sample_chars": 0}
    ref, killed = tmp_path / "uninterrupted", tmp_path / "killed"

    done = run_torchrun(3, tiny_args(ref, data_path, **args))
    assert done.returncode == 0, done.stderr[-3000:]

    run_with_a_kill(torchrun_cmd(3, tiny_args(killed, data_path, **args), max_restarts=1, script=STEP_KILL),
                    subprocess_env(), rank=2, at_step=31)

    records = read_metrics(killed, local_rank=0)
    starts = by_event(records, "start")
    assert [(s["restart_count"], s["world_size"]) for s in starts] == [(0, 3), (1, 3)]
    before = [r["step"] for r in records if r["event"] == "step" and r["restart_count"] == 0]
    after = [r["step"] for r in records if r["event"] == "step" and r["restart_count"] == 1]
    assert before[0] == 1 and before[-1] == 30
    # zero steps lost: the restarted group resumes from the last step completed before the kill
    assert starts[1]["resumed_from_step"] == before[-1]
    assert starts[1]["samples_seen"] == before[-1] * 12
    assert before + after == list(range(1, 121))  # strictly consecutive, none lost, none repeated
    # the survivors wrote the emergency checkpoint (no periodic one existed before the kill)
    survivors = [read_metrics(killed, local_rank=r) for r in (0, 1)]
    failures = [f for recs in survivors for f in by_event(recs, "failure")]
    # both survivors were SIGTERM'd in step 31's all-reduce: each records step 30, the last completed
    assert len(failures) == 2 and all(f["step"] == before[-1] for f in failures), failures
    assert any(f["saved"] and f["step"] == before[-1] for f in failures), failures
    assert any(c.get("reason") == "emergency" and c["step"] == before[-1]
               for recs in survivors for c in by_event(recs, "checkpoint"))
    # same parameters as the uninterrupted run
    assert max_diff(ref, killed) <= 1e-6
    ref_end, killed_end = by_event(read_metrics(ref), "end")[-1], by_event(records, "end")[-1]
    assert killed_end["final_val_loss"] == pytest.approx(ref_end["final_val_loss"], abs=1e-5)


def test_world_size_change_keep_per_rank_rescales_lr(tmp_path, data_path):
    out = tmp_path / "run"
    first = run_torchrun(3, tiny_args(out, data_path, max_steps=10, warmup_steps=2, sample_chars=0))
    assert first.returncode == 0, first.stderr[-3000:]
    second = run_torchrun(2, tiny_args(out, data_path, max_steps=16, warmup_steps=2, sample_chars=0))
    assert second.returncode == 0, second.stderr[-3000:]
    records = read_metrics(out)
    starts = by_event(records, "start")
    assert [(s["world_size"], s["global_batch_size"]) for s in starts] == [(3, 12), (2, 8)]
    assert starts[1]["resumed_from_step"] == 10 and starts[1]["samples_seen"] == 120
    assert starts[0]["lr_scale"] == pytest.approx(1.0) and starts[1]["lr_scale"] == pytest.approx(8 / 12)
    steps = by_event(records, "step")
    assert [r["step"] for r in steps] == list(range(1, 17))
    assert [r["samples_seen"] for r in steps[10:]] == [120 + 8 * k for k in range(1, 7)]
    assert all(r["allreduce_s"] > 0 and r["compute_s"] > 0 for r in steps)
    hist = CheckpointStore(out / "checkpoints").load(16)["world_size_history"]
    assert [(h["world_size"], h["step"]) for h in hist] == [(3, 0), (2, 10)]
    # the LR scale ramps from 3 ranks' to 2 ranks' over lr_ramp_steps (= warmup_steps 2)
    assert [r["lr_scale"] for r in steps[9:13]] == pytest.approx([1.0, 1 - (1 / 3) / 2, 8 / 12, 8 / 12])


def test_divergence_stops_every_rank_and_keeps_the_checkpoints(tmp_path, data_path, clean_env):
    """Resumed at 2 ranks with base_lr 50: all ranks agree to stop (exit 3), none hangs, and the
    checkpoints of the good run stay as they were."""
    out = tmp_path / "run"
    args = {"max_steps": 20, "warmup_steps": 3, "sample_chars": 0}
    assert train_mod.main(tiny_args(out, data_path, **args)) == 0
    before = snapshot(out / "checkpoints")
    args.update(max_steps=200, base_lr=50)
    done = run_torchrun(2, tiny_args(out, data_path, **args), timeout=180)
    assert done.returncode != 0
    assert done.stderr.count("exitcode  : 3") + done.stderr.count("exitcode: 3") >= 1, done.stderr[-3000:]
    assert snapshot(out / "checkpoints") == before
    for local_rank in (0, 1):
        failure = read_metrics(out, local_rank)[-1]
        assert failure["event"] == "failure" and failure["cause"] == "divergence", failure
        assert failure["saved"] is False and failure["world_size"] == 2
    assert read_metrics(out, 0)[-1]["failed_step"] == read_metrics(out, 1)[-1]["failed_step"]


def test_keep_global_same_trajectory_at_world_sizes_1_and_3(tmp_path, data_path, clean_env):
    """keep_global with a global batch of 12: world size 1 (3 accumulated micro-batches) and
    world size 3 read the same samples and take the same steps, up to float rounding; a run that
    switches from 1 to 3 mid-way (accumulation 3 -> 1) stays on that trajectory."""
    common = {"batch_policy": "keep_global", "global_batch_size": 12, "max_steps": 12, "warmup_steps": 2,
              "eval_interval": 6, "ckpt_interval": 6, "sample_chars": 0}
    alone, trio, mixed = tmp_path / "ws1", tmp_path / "ws3", tmp_path / "ws1to3"
    assert train_mod.main(tiny_args(alone, data_path, **common)) == 0
    res = run_torchrun(3, tiny_args(trio, data_path, **common))
    assert res.returncode == 0, res.stderr[-3000:]

    # mixed: world size 1 up to step 6 (stopped by SIGTERM-free means: a failure injected at 6)
    real_step = train_mod.Trainer.train_step

    def stop_at_6(self):
        if self.step == 6:
            raise RuntimeError("simulated node loss")
        return real_step(self)

    train_mod.Trainer.train_step = stop_at_6
    try:
        assert train_mod.main(tiny_args(mixed, data_path, **common)) == train_mod.EXIT_FAILED
    finally:
        train_mod.Trainer.train_step = real_step
    res = run_torchrun(3, tiny_args(mixed, data_path, **common))
    assert res.returncode == 0, res.stderr[-3000:]

    starts = by_event(read_metrics(mixed), "start")
    assert [(s["world_size"], s["per_rank_batch_size"], s["grad_accum_steps"], s["global_batch_size"])
            for s in starts] == [(1, 4, 3, 12), (3, 4, 1, 12)]
    assert starts[0]["lr_scale"] == starts[1]["lr_scale"] == 1.0
    assert max_diff(alone, trio) < 1e-4
    assert max_diff(alone, mixed) < 1e-4
    val = [by_event(read_metrics(d), "val")[-1]["val_loss"] for d in (alone, trio, mixed)]
    assert max(val) - min(val) < 1e-3


@pytest.mark.parametrize("mode", ["agent SIGTERM", "process-group timeout"])
def test_frozen_peer_still_costs_no_step(mode, tmp_path, data_path):
    """A peer freezes (SIGSTOP: no TCP reset, the all-reduce just waits). Either the agent's
    SIGTERM reaches the waiting worker within seconds (long before the process-group timeout),
    or the gloo timeout (``pg_timeout_s``) fails the collective; both ways the worker saves the
    last completed step before it exits."""
    out = tmp_path / "run"
    timeout_s = 300 if mode == "agent SIGTERM" else 5
    args = tiny_args(out, data_path, max_steps=100000, eval_interval=100000, ckpt_interval=100000,
                     pg_timeout_s=timeout_s)
    proc = subprocess.Popen(torchrun_cmd(2, args), env=subprocess_env(), cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    workers: list[psutil.Process] = []
    try:
        kill_rank_when(proc, out, rank=1, at_step=10, sig=signal.SIGSTOP)
        workers = psutil.Process(proc.pid).children(recursive=True)
        rank0 = next(c for c in workers if c.environ().get("RANK") == "0")
        t_freeze = time.monotonic()
        if mode == "agent SIGTERM":
            time.sleep(1.0)  # rank 0 is now blocked in the gradient all-reduce
            rank0.send_signal(signal.SIGTERM)
        rank0.wait(timeout=60)
        reaction = time.monotonic() - t_freeze
    finally:
        kill_tree(proc, workers)
    records = read_metrics(out)
    failure = records[-1]
    assert failure["event"] == "failure" and failure["saved"] is True
    if mode == "agent SIGTERM":
        assert reaction < 10 and "SIGTERM" in failure["error"]
    else:
        assert timeout_s <= reaction < timeout_s + 15 and "Timed out" in failure["error"]
    last_logged = max(r["step"] for r in records if r["event"] == "step")
    assert failure["step"] == last_logged
    assert CheckpointStore(out / "checkpoints").load(last_logged)["step"] == last_logged


def run_three_nodes(outs: list[Path], data_path: Path, **overrides) -> list[dict]:
    """Three torchrun agents (one worker each, own out_dir = own "laptop" disk) joined by a c10d
    rendezvous on loopback; returns each node's last start record."""
    port = free_port()
    procs = []
    for i, out in enumerate(outs):
        cmd = [torchrun_cmd(1, [])[0], "--nnodes=3", "--nproc-per-node=1", "--rdzv-backend=c10d",
               f"--rdzv-endpoint=127.0.0.1:{port}", f"--rdzv-id=nodes-{port}",
               f"--rdzv-conf=is_host={'true' if i == 0 else 'false'}", "--max-restarts=0",
               "-m", "ddplab.train", *tiny_args(out, data_path, **overrides)]
        procs.append(subprocess.Popen(cmd, env=subprocess_env(), cwd=REPO, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True, start_new_session=True))
    try:
        outputs = [p.communicate(timeout=240)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                kill_tree(p)
    for p, text in zip(procs, outputs, strict=True):
        assert p.returncode == 0, text[-3000:]
    return [by_event(read_metrics(out), "start")[-1] for out in outs]


def test_nodes_agree_on_newest_valid_checkpoint_and_empty_node_catches_up(tmp_path, data_path):
    """Node A's newest checkpoint is corrupt, node B's is fine, node C lost its disk: the group
    resumes from B's step, B broadcasts it, A and C write their own copies."""
    outs = [tmp_path / name for name in ("node-a", "node-b", "node-c")]
    common = {"ckpt_interval": 5, "eval_interval": 5, "sample_chars": 0, "warmup_steps": 2}
    run_three_nodes(outs, data_path, max_steps=10, **common)
    for out in outs:
        assert CheckpointStore(out / "checkpoints").steps() == [5, 10]
    newest_a = outs[0] / "checkpoints" / "ckpt-00000010.pt"
    newest_a.write_bytes(newest_a.read_bytes()[:-100])  # truncated: fails its sha256
    shutil.rmtree(outs[2] / "checkpoints")

    starts = run_three_nodes(outs, data_path, max_steps=20, **common)
    assert all(s["resumed_from_step"] == 10 and s["samples_seen"] == 120 for s in starts)
    assert {s["checkpoint_holder_rank"] for s in starts} == {starts[1]["rank"]}  # B sent the state
    for out, caught_up in zip(outs, (True, False, True), strict=True):
        reasons = [(c["step"], c.get("reason")) for c in by_event(read_metrics(out), "checkpoint")]
        assert ((10, "catch-up") in reasons) is caught_up, (out.name, reasons)
        assert CheckpointStore(out / "checkpoints").steps() == [15, 20]
    finals = [final_params(out) for out in outs]
    for other in finals[1:]:
        assert all(torch.equal(finals[0][k], other[k]) for k in finals[0])
