"""Issue 15 at world size 1: a run never loses a good checkpoint, never starts over silently,
ramps the LR after a world-size change, ``--check`` is a real check, the emergency path is
signal-safe. Each test reproduces one case of the issue through ``ddplab.train.main``."""

import contextlib
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import REPO, read_metrics, snapshot, subprocess_env, tiny_args, wait_for_steps
from ddplab import outputs
from ddplab import train as train_mod
from ddplab.checkpoint import CheckpointStore, serialize
from ddplab.model import GPT

EXIT_DIVERGED = 3


@pytest.fixture(scope="module")
def finished(tmp_path_factory, data_path):
    """A finished tiny run: 60 steps, checkpoints every 20, keep 2 (so 40 and 60 remain)."""
    out = tmp_path_factory.mktemp("finished") / "run"
    env_keep = {k: os.environ.pop(k) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK") if k in os.environ}
    try:
        assert train_mod.main(run_args(out, data_path, max_steps=60)) == 0
    finally:
        os.environ.update(env_keep)
    return out


def run_args(out: Path, data_path: Path, **overrides) -> list[str]:
    values = {"max_steps": 60, "warmup_steps": 5, "eval_interval": 20, "ckpt_interval": 20,
              "keep_checkpoints": 2, **overrides}
    return tiny_args(out, data_path, **values)


def copy_of(finished: Path, tmp_path: Path) -> Path:
    out = tmp_path / "run"
    shutil.copytree(finished, out)
    return out


def by_event(records, event):
    return [r for r in records if r["event"] == event]


# --- 1. divergence guard ------------------------------------------------------------------------
def test_diverging_lr_stops_before_the_step_and_keeps_the_good_checkpoints(
    finished, tmp_path, data_path, clean_env, capsys
):
    """``--base-lr 50`` on the tiny preset: finite losses far above uniform guessing."""
    out = copy_of(finished, tmp_path)
    before = snapshot(out / "checkpoints")
    code = train_mod.main(run_args(out, data_path, max_steps=200, base_lr=50))
    assert code == EXIT_DIVERGED
    assert snapshot(out / "checkpoints") == before  # 40 and 60 intact, nothing pruned, none added
    failure = read_metrics(out)[-1]
    assert failure["event"] == "failure" and failure["cause"] == "divergence"
    assert failure["step"] >= 60 and failure["failed_step"] == failure["step"] + 1
    assert failure["saved"] is False and failure["loss"] > math.log(65) + 3
    assert f"training diverged at step {failure['failed_step']}: loss" in failure["error"]
    assert "above uniform guessing ln(65) + 3" in capsys.readouterr().err
    records = read_metrics(out)
    last_start = max(i for i, r in enumerate(records) if r["event"] == "start")
    assert not by_event(records[last_start:], "end")


def poison_forward(monkeypatch, from_step: int, what: str) -> None:
    """From optimizer step ``from_step`` on, the model's loss (``loss``) or only its gradients
    (``grad``: finite loss, 0 * inf in the backward pass) become non-finite."""
    real_forward, real_step = GPT.forward, train_mod.Trainer.train_step
    state = {"step": 0}

    def train_step(self):
        state["step"] = self.step
        return real_step(self)

    def forward(self, idx, targets=None):
        logits, loss = real_forward(self, idx, targets)
        if loss is not None and state["step"] >= from_step:
            if what == "loss":
                loss = loss * float("nan")
            else:
                loss = loss + 0.0 * torch.sqrt(self.pos_emb.weight.sum() * 0.0)
        return logits, loss

    monkeypatch.setattr(GPT, "forward", forward)
    monkeypatch.setattr(train_mod.Trainer, "train_step", train_step)


@pytest.mark.parametrize(("what", "reason"), [("loss", "non-finite loss"),
                                             ("grad", "non-finite gradient norm")])
def test_non_finite_step_is_never_applied_nor_saved(what, reason, finished, tmp_path, data_path,
                                                    clean_env):
    out = copy_of(finished, tmp_path)
    before = snapshot(out / "checkpoints")
    poison_forward(clean_env, 75, what)
    assert train_mod.main(run_args(out, data_path, max_steps=120)) == EXIT_DIVERGED
    failure = read_metrics(out)[-1]
    assert failure["cause"] == "divergence" and reason in failure["error"]
    assert failure["step"] == 75 and failure["saved"] is False
    after = snapshot(out / "checkpoints")
    assert {k: v for k, v in after.items() if k in before} == before
    # the periodic checkpoints written before it (80 is never reached) are finite
    store = CheckpointStore(out / "checkpoints")
    assert store.steps() == [40, 60]
    assert all(torch.isfinite(t).all() for t in store.load(60)["model"].values())


# --- 2. checkpoint validity, no silent fresh start ----------------------------------------------
def test_checkpoint_without_sidecar_is_resumed_not_overwritten(finished, tmp_path, data_path, clean_env):
    """Issue case 2: delete ckpt-40 and ckpt-60's sidecar: the run resumes from 60."""
    out = copy_of(finished, tmp_path)
    ck = out / "checkpoints"
    for name in ("ckpt-00000040.pt", "ckpt-00000040.pt.sha256", "ckpt-00000060.pt.sha256"):
        (ck / name).unlink()
    kept = (ck / "ckpt-00000060.pt").read_bytes()
    assert train_mod.main(run_args(out, data_path, max_steps=80)) == 0
    start = by_event(read_metrics(out), "start")[-1]
    assert start["resumed_from_step"] == 60 and start["fresh_start_reason"] is None
    assert (ck / "ckpt-00000060.pt").read_bytes() == kept
    assert CheckpointStore(ck).steps() == [60, 80]


def test_unloadable_checkpoint_is_set_aside_and_replaced(finished, tmp_path, data_path, clean_env):
    """Issue case 3: ckpt-60 matches its sidecar but fails weights_only (a numpy scalar)."""
    out = copy_of(finished, tmp_path)
    ck = out / "checkpoints"
    store = CheckpointStore(ck)
    bad = serialize({**store.load(60), "loss_np": np.float64(1.0)})
    (ck / "ckpt-00000060.pt").write_bytes(bad)
    (ck / "ckpt-00000060.pt.sha256").write_text(
        f"{__import__('hashlib').sha256(bad).hexdigest()}  ckpt-00000060.pt\n")
    assert train_mod.main(run_args(out, data_path, max_steps=80)) == 0
    assert by_event(read_metrics(out), "start")[-1]["resumed_from_step"] == 40
    assert (ck / "ckpt-00000060.pt.corrupt").read_bytes() == bad
    assert store.load(60)["step"] == 60  # rewritten when training reached step 60 again
    assert store.steps() == [60, 80]  # keep 2 valid ones; the corrupt file is not one of them
    assert train_mod.main(run_args(out, data_path, max_steps=90)) == 0
    assert by_event(read_metrics(out), "start")[-1]["resumed_from_step"] == 80


def test_no_usable_checkpoint_stops_unless_fresh_start_allowed(
    finished, tmp_path, data_path, clean_env, capsys
):
    out = copy_of(finished, tmp_path)
    ck = out / "checkpoints"
    for step in (40, 60):
        (ck / f"ckpt-{step:08d}.pt").write_bytes(b"disk error")
    metrics_before = snapshot(out / "metrics")
    assert train_mod.main(run_args(out, data_path, max_steps=80)) == train_mod.EXIT_BAD_INPUT
    err = capsys.readouterr().err
    line = [e for e in err.splitlines() if e.startswith("ddplab.train: error:")]
    assert len(line) == 1 and "none is usable" in line[0] and "allow_fresh_start" in line[0]
    assert "ckpt-00000060.pt: sha256" in line[0]
    assert snapshot(out / "metrics") == metrics_before  # no step was run
    assert sorted(p.name for p in ck.glob("*.corrupt")) == [
        "ckpt-00000040.pt.corrupt", "ckpt-00000040.pt.sha256.corrupt",
        "ckpt-00000060.pt.corrupt", "ckpt-00000060.pt.sha256.corrupt"]
    # a second try finds only the files set aside: still no silent fresh start
    assert train_mod.main(run_args(out, data_path, max_steps=80)) == train_mod.EXIT_BAD_INPUT
    assert "set aside earlier" in capsys.readouterr().err
    assert train_mod.main([*run_args(out, data_path, max_steps=20), "--allow-fresh-start"]) == 0
    start = by_event(read_metrics(out), "start")[-1]
    assert start["resumed_from_step"] is None and "none is usable" in start["fresh_start_reason"]
    assert "fresh start (allow_fresh_start: found checkpoints" in capsys.readouterr().out


# --- 3. LR ramp after a world-size change -------------------------------------------------------
def test_lr_ramps_after_the_global_batch_changes(tmp_path, data_path, clean_env):
    """A checkpoint of global batch 8 resumed at global batch 4 (the LR scale a world-size change
    2 -> 1 gives under keep_per_rank): the LR moves there over lr_ramp_steps, logged per step."""
    out = tmp_path / "run"
    assert train_mod.main(run_args(out, data_path, max_steps=20, per_rank_batch_size=8)) == 0
    assert train_mod.main(run_args(out, data_path, max_steps=40, lr_ramp_steps=10)) == 0
    steps = {r["step"]: r for r in by_event(read_metrics(out), "step")}
    old, new = 8 / 12, 4 / 12
    assert steps[20]["lr_scale"] == pytest.approx(old)
    for k in range(1, 11):
        assert steps[20 + k]["lr_scale"] == pytest.approx(old + (new - old) * k / 10)
    assert steps[40]["lr_scale"] == pytest.approx(new)


# --- 4. --check and output folders --------------------------------------------------------------
@contextlib.contextmanager
def immutable(folder: Path):
    """chattr +i: not writable even for root (root ignores mode bits)."""
    subprocess.run(["chattr", "+i", str(folder)], check=True)
    try:
        yield folder
    finally:
        subprocess.run(["chattr", "-i", str(folder)], check=True)


def one_error_line(capsys) -> str:
    err = capsys.readouterr().err
    lines = [e for e in err.splitlines() if e.strip()]
    assert len(lines) == 1 and lines[0].startswith("ddplab.train: error:"), err
    return lines[0]


def test_check_fails_on_an_output_folder_that_cannot_be_created(tmp_path, data_path, clean_env, capsys):
    (tmp_path / "file").write_text("not a folder")
    argv = [*tiny_args(tmp_path / "file" / "run", data_path), "--check"]
    assert train_mod.main(argv) == train_mod.EXIT_BAD_INPUT
    assert "folder" in one_error_line(capsys)
    parent = tmp_path / "locked"
    parent.mkdir()
    with immutable(parent):
        assert train_mod.main([*tiny_args(parent / "run", data_path), "--check"]) == 2
        assert "output folder" in one_error_line(capsys)
    assert list(parent.iterdir()) == []


@pytest.mark.parametrize("sub", ["checkpoints", "metrics"])
def test_check_and_run_fail_on_a_folder_that_cannot_be_written(
    sub, finished, tmp_path, data_path, clean_env, capsys
):
    out = copy_of(finished, tmp_path)
    before = snapshot(out / "metrics")
    with immutable(out / sub):
        assert train_mod.main([*run_args(out, data_path, max_steps=80), "--check"]) == 2
        assert f"{sub[:-1] if sub == 'checkpoints' else sub} folder" in one_error_line(capsys)
        assert train_mod.main(run_args(out, data_path, max_steps=80)) == 2
        line = one_error_line(capsys)
        assert f"{sub[:5]}" in line and "folder" in line and "writ" in line
    assert snapshot(out / "metrics") == before  # stopped before the first step


def test_read_only_output_folder_is_found_before_the_first_step(tmp_path, data_path, clean_env, capsys):
    out = tmp_path / "run"
    out.mkdir()
    with immutable(out):
        assert train_mod.main(run_args(out, data_path, max_steps=20)) == 2
        assert "output folder" in one_error_line(capsys)
    assert list(out.iterdir()) == []


def test_metrics_path_that_is_a_file_is_one_line(tmp_path, data_path, clean_env, capsys):
    out = tmp_path / "run"
    out.mkdir()
    (out / "metrics").write_text("a file")
    assert train_mod.main(run_args(out, data_path, max_steps=20)) == 2
    assert "metrics folder" in one_error_line(capsys)
    assert not (out / "checkpoints").exists() or not list((out / "checkpoints").iterdir())


def test_check_changes_nothing_for_a_missing_dataset(tmp_path, clean_env, capsys):
    data = tmp_path / "data" / "tiny" / "input.txt"
    argv = [*tiny_args(tmp_path / "run", data), "--data-url", "http://127.0.0.1:9/input.txt", "--check"]
    assert train_mod.main(argv) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["dataset"].startswith("missing: a run downloads http://127.0.0.1:9/")
    assert shown["vocab_size"] is None
    assert list(tmp_path.iterdir()) == []  # no folder, no lock file, no download
    assert train_mod.main([*tiny_args(tmp_path / "run", data), "--check"]) == 2  # no data_url
    assert "does not exist and no data_url is set" in one_error_line(capsys)
    assert list(tmp_path.iterdir()) == []


# --- 5. emergency path --------------------------------------------------------------------------
SLOW_DISK = textwrap.dedent("""
    import sys, time
    from ddplab import checkpoint, metrics, train
    real_save, real_write = checkpoint.CheckpointStore.save_bytes, metrics.MetricsWriter.write
    def save_bytes(self, step, data):
        result = real_save(self, step, data)
        time.sleep(0.3)  # a slow disk: the agent's SIGTERMs keep coming meanwhile
        return result
    def write(self, event, **fields):
        if event in ("checkpoint", "failure"):
            time.sleep(0.2)
        return real_write(self, event, **fields)
    checkpoint.CheckpointStore.save_bytes = save_bytes
    metrics.MetricsWriter.write = write
    sys.exit(train.main(sys.argv[1:]))
""")


def test_repeated_sigterm_during_the_emergency_path_loses_no_record(tmp_path, data_path):
    out = tmp_path / "run"
    args = tiny_args(out, data_path, max_steps=100000, eval_interval=100000, ckpt_interval=100000)
    proc = subprocess.Popen([sys.executable, "-c", SLOW_DISK, *args], env=subprocess_env(),
                            cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        wait_for_steps(proc, out, 10)
        end = time.monotonic() + 5
        while proc.poll() is None and time.monotonic() < end:  # SIGTERM every 5 ms until it exits
            proc.send_signal(signal.SIGTERM)
            time.sleep(0.005)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode in (128 + signal.SIGTERM, -signal.SIGTERM), err
    records = read_metrics(out)
    last_logged = max(r["step"] for r in by_event(records, "step"))
    assert [r["reason"] for r in by_event(records, "checkpoint")] == ["emergency"]
    failure = records[-1]
    assert failure["event"] == "failure" and failure["saved"] is True and failure["cause"] == "signal"
    assert failure["step"] == last_logged
    assert CheckpointStore(out / "checkpoints").steps() == [last_logged]


def test_result_json_is_fsynced_with_its_folder(tmp_path, monkeypatch):
    synced: list[str] = []
    real_fsync = os.fsync

    def fsync(fd):
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        return real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    outputs.atomic_write_text(tmp_path / "result.json", "{}\n")
    assert str(tmp_path) in synced  # the folder, after the rename
    assert (tmp_path / "result.json").read_text() == "{}\n"
