"""The entry point at world size 1: outputs per the contract, exact resume after a failure or a
SIGTERM, and the bad-input matrix (one clear error each, no checkpoint overwritten)."""

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import REPO, read_metrics, snapshot, subprocess_env, tiny_args, wait_for_steps
from ddplab import train as train_mod
from ddplab.checkpoint import CheckpointStore
from ddplab.metrics import EVENTS

COMMON = {"event", "time", "host", "rank", "local_rank", "world_size", "restart_count"}
FIELDS = {
    "start": {"resumed_from_step", "samples_seen", "batch_policy", "per_rank_batch_size",
              "global_batch_size", "grad_accum_steps", "lr_scale", "threads", "params"},
    "step": {"step", "loss", "lr", "global_batch_size", "per_rank_batch_size", "grad_accum_steps",
             "samples_seen", "step_time_s", "compute_s", "allreduce_s", "tokens_per_s", "cpu_mhz", "temp_c"},
    "val": {"step", "val_loss", "train_loss"},
    "checkpoint": {"step", "path", "bytes", "seconds"},
    "failure": {"step", "error", "saved"},
    "end": {"step", "final_train_loss", "final_val_loss", "wall_s"},
}


def params_of(out_dir: Path) -> dict[str, torch.Tensor]:
    store = CheckpointStore(Path(out_dir) / "checkpoints")
    return store.load(store.steps()[-1])["model"]


def max_param_diff(a: Path, b: Path) -> float:
    pa, pb = params_of(a), params_of(b)
    assert pa.keys() == pb.keys()
    return max(float((pa[k] - pb[k]).abs().max()) for k in pa)


def test_tiny_run_writes_contract_outputs(tmp_path, data_path, clean_env, capsys):
    out = tmp_path / "run"
    assert train_mod.main(tiny_args(out, data_path)) == 0
    records = read_metrics(out)
    for rec in records:
        assert rec["event"] in EVENTS
        assert COMMON | FIELDS[rec["event"]] <= rec.keys(), rec["event"]
        assert rec["world_size"] == 1 and rec["rank"] == 0 and rec["restart_count"] == 0
    steps = [r for r in records if r["event"] == "step"]
    assert [r["step"] for r in steps] == list(range(1, 21))
    assert all(r["allreduce_s"] == 0.0 and r["compute_s"] == r["step_time_s"] for r in steps)
    assert [r["samples_seen"] for r in steps] == [4 * s for s in range(1, 21)]
    assert [r["step"] for r in records if r["event"] == "val"] == [10, 20]
    start = records[0]
    assert start["event"] == "start" and start["resumed_from_step"] is None
    assert start["lr_scale"] == pytest.approx(4 / 12) and start["threads"] == 1
    end = records[-1]
    assert end["event"] == "end" and end["step"] == 20 and end["final_val_loss"] < 4.2
    # warmup over 3 steps then cosine: the logged LR follows the schedule
    assert steps[0]["lr"] == pytest.approx(3e-3 * (4 / 12) / 3)
    assert CheckpointStore(out / "checkpoints").steps() == [10, 20]  # keep_checkpoints 2
    result = json.loads((out / "result.json").read_text())
    assert result["steps"] == 20
    assert result["final_val_loss"] == pytest.approx(end["final_val_loss"], abs=1e-5)
    assert result["world_size_history"][0]["world_size"] == 1
    assert len((out / "sample.txt").read_text()) >= 20
    assert "done: step 20" in capsys.readouterr().out


def test_failed_collective_saves_last_completed_step_and_resume_is_exact(
    tmp_path, data_path, clean_env, monkeypatch
):
    """A step that fails in its all-reduce (injected here) leaves the previous step saved; the
    resumed run ends with exactly the parameters of an uninterrupted one."""
    ref, broken = tmp_path / "ref", tmp_path / "broken"
    assert train_mod.main(tiny_args(ref, data_path)) == 0

    real_step = train_mod.Trainer.train_step

    def failing_step(self):
        if self.step == 13:
            raise RuntimeError("simulated gloo failure: Connection reset by peer")
        return real_step(self)

    monkeypatch.setattr(train_mod.Trainer, "train_step", failing_step)
    assert train_mod.main(tiny_args(broken, data_path)) == train_mod.EXIT_FAILED
    monkeypatch.setattr(train_mod.Trainer, "train_step", real_step)
    failure = read_metrics(broken)[-1]
    assert failure["event"] == "failure" and failure["step"] == 13 and failure["saved"] is True
    assert "Connection reset" in failure["error"]
    assert CheckpointStore(broken / "checkpoints").steps() == [10, 13]

    assert train_mod.main(tiny_args(broken, data_path)) == 0
    records = read_metrics(broken)
    starts = [r for r in records if r["event"] == "start"]
    assert [s["resumed_from_step"] for s in starts] == [None, 13]
    assert starts[1]["samples_seen"] == 13 * 4
    assert [r["step"] for r in records if r["event"] == "step"] == list(range(1, 21))
    assert max_param_diff(ref, broken) == 0.0


def test_sigterm_saves_last_completed_step(tmp_path, data_path):
    out = tmp_path / "run"
    args = tiny_args(out, data_path, max_steps=100000, warmup_steps=3, eval_interval=100000,
                     ckpt_interval=100000)
    proc = subprocess.Popen([sys.executable, "-m", "ddplab.train", *args], env=subprocess_env(),
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for_steps(proc, out, 15)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, err
    records = read_metrics(out)
    last_logged = max(r["step"] for r in records if r["event"] == "step")
    failure = records[-1]
    assert failure["event"] == "failure" and failure["saved"] is True
    assert failure["step"] == last_logged  # log_interval 1: every completed step was logged
    assert CheckpointStore(out / "checkpoints").steps() == [last_logged]
    # resume: the next step is last_logged + 1
    assert train_mod.main(tiny_args(out, data_path, max_steps=last_logged + 2, warmup_steps=3,
                                     eval_interval=100000, ckpt_interval=100000)) == 0
    steps = [r["step"] for r in read_metrics(out) if r["event"] == "step"]
    assert steps == list(range(1, last_logged + 3))


def test_check_prints_resolved_config(tmp_path, data_path, clean_env, capsys):
    assert train_mod.main([*tiny_args(tmp_path / "x", data_path), "--check"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["config"]["n_layer"] == 2 and shown["vocab_size"] == 65
    assert shown["batch_plan"]["global_batch_size"] == 4 and shown["checkpoints"] == []
    assert not (tmp_path / "x").exists()  # --check changes nothing


@pytest.fixture(scope="module")
def trained(tmp_path_factory, data_path):
    """An out_dir holding checkpoints of a short run (copied per test)."""
    out = tmp_path_factory.mktemp("trained") / "run"
    env_keep = {k: os.environ.pop(k) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK") if k in os.environ}
    try:
        assert train_mod.main(tiny_args(out, data_path, max_steps=10, ckpt_interval=5)) == 0
    finally:
        os.environ.update(env_keep)
    return out


def small_text(tmp_path: Path) -> Path:
    path = tmp_path / "small.txt"
    path.write_text("To be, or not to be, that is the question.\n" * 2)
    return path


BAD_INPUTS = {
    "zero batch": ({"per_rank_batch_size": 0}, "'per_rank_batch_size' = 0: must be a positive integer"),
    "negative batch": ({"per_rank_batch_size": -4}, "'per_rank_batch_size' = -4: must be a positive"),
    "block larger than data": ({"data_path": "SMALL", "data_sha256": "null", "block_size": 64},
                               "block_size 64 is larger than the data"),
    "wrong checksum": ({"data_sha256": "ab" * 32}, "expected abababab"),
    "model mismatch": ({"n_layer": 3}, "does not match this run (n_layer: checkpoint 2, config 3)"),
    "unknown flag": ({"learning_rate": 1}, "unrecognized arguments: --learning_rate 1"),
    "not a number": ({"base_lr": "fast"}, "'base_lr' = 'fast': must be float"),
    # integer keys beyond what torch/numpy hold: once a traceback in torch.manual_seed
    "seed above 2**63-1": ({"seed": 2**64},
                           f"'seed' = {2**64}: must be an integer in [0, 9223372036854775807]"),
    "negative seed": ({"seed": -1}, "'seed' = -1: must be an integer in [0, 9223372036854775807]"),
    "max_steps beyond int64": ({"max_steps": 10**30},
                               f"'max_steps' = {10**30}: must be at most 9223372036854775807"),
    # more than any node's memory (ddplab.memory): once an allocation traceback
    "batch beyond memory": ({"per_rank_batch_size": 10**7, "block_size": 1024},
                            "fix: lower per_rank_batch_size"),
    "model beyond memory": ({"n_embd": 2**20}, "fix: a smaller model: lower n_layer, n_embd"),
}


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_bad_input_is_one_clear_error_and_keeps_checkpoints(case, trained, tmp_path, data_path, clean_env,
                                                           capsys):
    out = tmp_path / "run"
    shutil.copytree(trained, out)
    before_ckpt, before_metrics = snapshot(out / "checkpoints"), snapshot(out / "metrics")
    overrides, message = BAD_INPUTS[case]
    overrides = {k: (str(small_text(tmp_path)) if v == "SMALL" else v) for k, v in overrides.items()}
    argv = tiny_args(out, data_path, max_steps=20, ckpt_interval=1)
    for key, value in overrides.items():
        argv += [f"--{key}", str(value)]
    assert train_mod.main(argv) == train_mod.EXIT_BAD_INPUT
    err = capsys.readouterr().err
    assert err.count("ddplab.train: error:") == 1 and message in err, err
    assert snapshot(out / "checkpoints") == before_ckpt
    assert snapshot(out / "metrics") == before_metrics


@pytest.mark.parametrize("kind", ["symlink loop", "a file"])
def test_unreadable_checkpoint_folder_is_one_clear_error(
    kind, trained, tmp_path, data_path, clean_env, capsys
):
    out = tmp_path / "run"
    shutil.copytree(trained, out)
    kept = tmp_path / "kept"
    shutil.move(out / "checkpoints", kept)
    before = snapshot(kept)
    if kind == "symlink loop":
        (out / "checkpoints").symlink_to(out / "checkpoints")
    else:
        (out / "checkpoints").write_text("not a folder")
    assert train_mod.main(tiny_args(out, data_path)) == train_mod.EXIT_BAD_INPUT
    err = capsys.readouterr().err
    assert err.count("ddplab.train: error:") == 1
    assert ("unreadable" if kind == "symlink loop" else "is not a directory") in err
    assert snapshot(kept) == before
    assert not (out / "result.json").exists() or (trained / "result.json").exists()


def test_bad_config_file_is_a_clear_error(tmp_path, clean_env, capsys):
    bad = tmp_path / "run.json"
    bad.write_text("{not json")
    assert train_mod.main(["--config", str(bad)]) == train_mod.EXIT_BAD_INPUT
    assert "is not valid JSON" in capsys.readouterr().err
    assert train_mod.main(["--config", str(tmp_path / "missing.json")]) == train_mod.EXIT_BAD_INPUT
    assert "cannot read config file" in capsys.readouterr().err
    bad.write_text(json.dumps({"n_layer": 2, "learning_rate": 0.1}))
    assert train_mod.main(["--config", str(bad)]) == train_mod.EXIT_BAD_INPUT
    assert "unknown config key(s) in config file: learning_rate" in capsys.readouterr().err
