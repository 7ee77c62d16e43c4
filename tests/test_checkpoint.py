"""Atomic per-node checkpoints: round trip, keep-K, no overwrite, crash mid-write, corruption."""

import hashlib
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch
from conftest import TRAIN_DIR
from ddplab.checkpoint import CheckpointError, CheckpointStore
from ddplab.distributed import agree_on_checkpoint


def state(step: int, size: int = 10) -> dict:
    return {"step": step, "samples_seen": step * 12, "model": {"w": torch.full((size,), float(step))}}


def test_roundtrip_and_sha256sum_sidecar(tmp_path):
    store = CheckpointStore(tmp_path / "ck", keep=3)
    result = store.save(state(5))
    assert result.written and result.path.name == "ckpt-00000005.pt"
    side = (tmp_path / "ck" / "ckpt-00000005.pt.sha256").read_text()
    assert side == f"{hashlib.sha256(result.path.read_bytes()).hexdigest()}  ckpt-00000005.pt\n"
    loaded = store.load(5)
    assert loaded["step"] == 5 and torch.equal(loaded["model"]["w"], torch.full((10,), 5.0))


def test_keeps_last_k(tmp_path):
    store = CheckpointStore(tmp_path, keep=2)
    for step in (10, 20, 30, 40):
        store.save(state(step))
    assert store.steps() == [30, 40]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        ".lock", "ckpt-00000030.pt", "ckpt-00000030.pt.sha256", "ckpt-00000040.pt", "ckpt-00000040.pt.sha256"
    ]


def test_never_overwrites_a_valid_checkpoint(tmp_path):
    store = CheckpointStore(tmp_path, keep=3)
    store.save(state(7))
    before = (tmp_path / "ckpt-00000007.pt").read_bytes()
    again = store.save({"step": 7, "samples_seen": 0, "model": {"w": torch.zeros(3)}})
    assert not again.written
    assert (tmp_path / "ckpt-00000007.pt").read_bytes() == before


def test_corrupt_newest_falls_back_to_previous(tmp_path):
    store = CheckpointStore(tmp_path, keep=3)
    for step in (1, 2, 3):
        store.save(state(step))
    newest = tmp_path / "ckpt-00000003.pt"
    data = bytearray(newest.read_bytes())
    data[len(data) // 2] ^= 0xFF
    newest.write_bytes(bytes(data))
    scan, blob = store.newest_valid()
    assert scan.step == 2
    rejected = [(p.name, "differs from sidecar" in why) for p, why in scan.rejected]
    assert rejected == [("ckpt-00000003.pt", True)]
    assert store.load(2)["step"] == 2
    with pytest.raises(CheckpointError, match="sha256"):
        store.load(3)
    # the group agreement (alone: no process group) picks the same fallback
    agreement = agree_on_checkpoint(store)
    assert agreement.step == 2 and agreement.holder == 0 and agreement.data == blob


def test_missing_sidecar_or_garbage_is_skipped(tmp_path):
    store = CheckpointStore(tmp_path, keep=5)
    store.save(state(1))
    (tmp_path / "ckpt-00000002.pt").write_bytes(b"half a checkpoint")  # no sidecar: interrupted
    garbage = b"not a torch file"
    (tmp_path / "ckpt-00000003.pt").write_bytes(garbage)
    (tmp_path / "ckpt-00000003.pt.sha256").write_text(
        f"{hashlib.sha256(garbage).hexdigest()}  ckpt-00000003.pt\n")
    scan, _ = store.newest_valid()
    assert scan.step == 1
    reasons = dict((p.name, why) for p, why in scan.rejected)
    assert "cannot parse" in reasons["ckpt-00000003.pt"]
    assert "no .sha256 sidecar" in reasons["ckpt-00000002.pt"]
    # an invalid file of the same step is replaced by a real save; newer stale ones are kept
    store.save(state(2))
    assert store.load(2)["step"] == 2


def test_failure_between_write_and_replace_keeps_previous(tmp_path, monkeypatch):
    store = CheckpointStore(tmp_path, keep=3)
    store.save(state(1))
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}

    def broken_replace(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", broken_replace)
    with pytest.raises(CheckpointError, match="cannot write checkpoint .*No space left"):
        store.save(state(2))
    monkeypatch.undo()
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before  # no temp left, nothing new
    assert store.newest_valid()[0].step == 1


WRITER = textwrap.dedent("""
    import sys, torch
    sys.path.insert(0, sys.argv[2])
    from ddplab.checkpoint import CheckpointStore
    store = CheckpointStore(sys.argv[1], keep=3)
    store.save({"step": 1, "samples_seen": 12, "model": {"w": torch.ones(4)}})
    print("ready", flush=True)
    payload = b"x" * (256 << 20)
    step = 2
    while True:
        store.save_bytes(step, payload)
        step += 1
""")


def test_kill_during_checkpoint_write_leaves_previous_loadable(tmp_path):
    """A real process is SIGKILLed while its temp file is being written."""
    folder = tmp_path / "ck"
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(folder), str(TRAIN_DIR)],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if any(".tmp-" in name for name in os.listdir(folder)):
                break
            time.sleep(0.001)
        else:
            pytest.fail("the writer never started a checkpoint write")
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    names = os.listdir(folder)
    assert any(".tmp-" in n for n in names), names  # killed mid-write: the temp file is still there
    store = CheckpointStore(folder, keep=3)
    scan, _ = store.newest_valid()
    assert scan.step == 1
    assert torch.equal(store.load(1)["model"]["w"], torch.ones(4))
    assert not (folder / "ckpt-00000002.pt.sha256").exists() or scan.rejected
    # the next writer cleans the stale temp file up
    store.save({"step": 9, "samples_seen": 0, "model": {}})
    assert not any(".tmp-" in n for n in os.listdir(folder))


def test_unusable_folder_is_a_clear_error(tmp_path):
    not_dir = tmp_path / "ck"
    not_dir.write_text("I am a file")
    with pytest.raises(CheckpointError, match="is not a directory"):
        CheckpointStore(not_dir).check()
    loop = tmp_path / "loop"
    loop.symlink_to(loop)
    with pytest.raises(CheckpointError, match="unreadable"):
        CheckpointStore(loop).check()
    with pytest.raises(CheckpointError, match="unreadable"):
        CheckpointStore(loop).steps()


def test_missing_folder_is_created_only_on_request(tmp_path):
    store = CheckpointStore(tmp_path / "a" / "b")
    store.check(create=False)
    assert not (tmp_path / "a").exists()
    store.check()
    assert (tmp_path / "a" / "b").is_dir()
    assert store.newest_valid()[0].step is None
