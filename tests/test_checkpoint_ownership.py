"""A run never replaces, or prunes around, a checkpoint it did not write (issue 27 items 1, 2).

Two kinds of "not ours": a file the training user cannot read (another owner, mode 0600; the
trainer runs without root's file-permission bypass here), and a file written by
another run (same model shape and seed, another run id, lr and batch). Both are refused by
``--check`` and by a run in one line, before anything is written; ``adopt_run_id`` continues
from another run's checkpoint on purpose.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
import torch
from conftest import REPO, read_metrics, snapshot, subprocess_env, tiny_args
from ddplab import train as train_mod
from ddplab.checkpoint import CheckpointError, CheckpointStore

OTHER_UID = 1234
#: root without the capabilities that bypass file permissions: it reads what a laptop's training
#: user would read (util-linux setpriv; as root, every file is readable)
WITHOUT_DAC = ["setpriv", "--inh-caps=-dac_override,-dac_read_search",
               "--bounding-set=-dac_override,-dac_read_search"]


def error_lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("ddplab.train: error:")]


def train_without_dac(args: list[str]) -> subprocess.CompletedProcess:
    """``python -m ddplab.train ARGS``, unable to read files of another owner (mode 0600)."""
    return subprocess.run([*WITHOUT_DAC, sys.executable, "-m", "ddplab.train", *args],
                          env=subprocess_env(), capture_output=True, text=True, timeout=300, cwd=REPO)


@pytest.mark.skipif(os.getuid() != 0 or not shutil.which("setpriv"),
                    reason="needs root and util-linux setpriv to drop the file-permission bypass")
def test_an_unreadable_newest_checkpoint_is_refused_never_replaced(data_path, tmp_path, clean_env):
    out = tmp_path / "run"
    assert train_mod.main(tiny_args(out, data_path, max_steps=20, ckpt_interval=10)) == 0
    ck = out / "checkpoints"
    newest = ck / "ckpt-00000020.pt"
    os.chown(newest, OTHER_UID, OTHER_UID)  # another owner, readable by it alone
    newest.chmod(0o600)
    before = snapshot(ck)

    check = train_without_dac([*tiny_args(out, data_path, max_steps=40, ckpt_interval=10), "--check"])
    assert check.returncode == train_mod.EXIT_BAD_INPUT, check.stdout + check.stderr
    line = error_lines(check.stderr)
    assert len(line) == 1 and "ckpt-00000020.pt: unreadable by uid 0" in line[0], check.stderr
    assert f"owner uid {OTHER_UID}, mode 0600" in line[0] and "Traceback" not in check.stderr

    run = train_without_dac(tiny_args(out, data_path, max_steps=40, ckpt_interval=10))
    assert run.returncode == train_mod.EXIT_BAD_INPUT, run.stderr
    assert len(error_lines(run.stderr)) == 1 and "never overwrites" in run.stderr
    assert snapshot(ck) == before  # the unreadable newest one and the older one, as they were
    assert os.stat(newest).st_uid == OTHER_UID


def test_a_checkpoint_of_another_run_is_refused_unless_adopted(data_path, tmp_path, clean_env, capsys):
    out = tmp_path / "run"
    assert train_mod.main(tiny_args(out, data_path, run_id="run-a", max_steps=20)) == 0
    ck = out / "checkpoints"
    before, metrics_before = snapshot(ck), snapshot(out / "metrics")
    other = tiny_args(out, data_path, run_id="run-b", max_steps=30, base_lr=1e-3, per_rank_batch_size=6)
    capsys.readouterr()

    assert train_mod.main([*other, "--check"]) == train_mod.EXIT_BAD_INPUT
    line = error_lines(capsys.readouterr().err)
    assert len(line) == 1 and "written by run 'run-a', not this run 'run-b'" in line[0]
    assert "adopt_run_id 'run-a'" in line[0]
    assert train_mod.main(other) == train_mod.EXIT_BAD_INPUT
    assert len(error_lines(capsys.readouterr().err)) == 1
    assert snapshot(ck) == before and snapshot(out / "metrics") == metrics_before

    assert train_mod.main([*other, "--adopt-run-id", "run-a"]) == 0
    start = [r for r in read_metrics(out) if r["event"] == "start"][-1]
    assert start["resumed_from_step"] == 20 and start["run_id"] == "run-b"


def test_save_never_replaces_a_file_that_is_not_ours(tmp_path):
    state = {"format": 1, "step": 5, "model": {"w": torch.ones(3)}, "config": {"run_id": "a"}}
    CheckpointStore(tmp_path).save(state)
    before = snapshot(tmp_path)
    picky = CheckpointStore(
        tmp_path, accept=lambda s: None if s["config"]["run_id"] == "b" else "another run")
    with pytest.raises(CheckpointError, match="another run"):
        picky.refuse_not_ours()
    with pytest.raises(CheckpointError, match="not replacing checkpoint .*another run"):
        picky.save({**state, "config": {"run_id": "b"}})
    assert snapshot(tmp_path) == before
