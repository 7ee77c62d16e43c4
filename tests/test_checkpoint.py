"""Atomic per-node checkpoints: round trip, keep-K, no overwrite, crash mid-write, corruption."""

import hashlib
import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
import torch
from conftest import subprocess_env
from ddplab.checkpoint import CheckpointError, CheckpointStore, serialize
from ddplab.distributed import agree_on_checkpoint


def state(step: int, size: int = 10) -> dict:
    return {"step": step, "samples_seen": step * 12, "model": {"w": torch.full((size,), float(step))}}


def test_roundtrip_and_sha256sum_sidecar(tmp_path):
    store = CheckpointStore(tmp_path / "ck", keep=3)
    result = store.save(state(5))
    assert result.written and result.path.name == "ckpt-00000005.pt"
    side = (tmp_path / "ck" / "ckpt-00000005.pt.sha256").read_text().splitlines()
    assert side[0] == f"{hashlib.sha256(result.path.read_bytes()).hexdigest()}  ckpt-00000005.pt"
    assert side[1] == '# ddplab {"finite": true, "loss": null, "step": 5}'  # sha256sum -c skips it
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
    assert (tmp_path / "ckpt-00000003.pt.corrupt").exists()  # moved aside, not deleted
    with pytest.raises(CheckpointError, match="unreadable"):
        store.load(3)
    # the group agreement (alone: no process group) picks the same fallback
    agreement = agree_on_checkpoint(store)
    assert agreement.step == 2 and agreement.holder == 0 and agreement.data == blob


def test_garbage_is_moved_aside_and_replaced(tmp_path):
    store = CheckpointStore(tmp_path, keep=5)
    store.save(state(1))
    (tmp_path / "ckpt-00000002.pt").write_bytes(b"half a checkpoint")  # no sidecar
    garbage = b"not a torch file"
    (tmp_path / "ckpt-00000003.pt").write_bytes(garbage)
    (tmp_path / "ckpt-00000003.pt.sha256").write_text(
        f"{hashlib.sha256(garbage).hexdigest()}  ckpt-00000003.pt\n")
    scan, _ = store.newest_valid()
    assert scan.step == 1
    reasons = dict((p.name, why) for p, why in scan.rejected)
    assert "cannot parse" in reasons["ckpt-00000003.pt"]
    assert "cannot parse" in reasons["ckpt-00000002.pt"]
    assert store.steps() == [1]
    assert [p.name for p in scan.set_aside] == ["ckpt-00000002.pt.corrupt", "ckpt-00000003.pt.corrupt"]
    assert (tmp_path / "ckpt-00000003.pt.sha256.corrupt").exists()
    # the next save of that step writes a real checkpoint
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
    from ddplab.checkpoint import CheckpointStore, serialize
    store = CheckpointStore(sys.argv[1], keep=3)
    store.save({"step": 1, "samples_seen": 12, "model": {"w": torch.ones(4)}})
    print("ready", flush=True)
    payload = serialize({"step": 2, "samples_seen": 0, "model": {"w": torch.zeros(64 << 20)}})
    step = 2
    while True:
        store.save_bytes(step, payload)
        step += 1
""")


def test_kill_during_checkpoint_write_leaves_previous_loadable(tmp_path):
    """A real process is SIGKILLed while its temp file is being written."""
    folder = tmp_path / "ck"
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(folder)], stdout=subprocess.PIPE, text=True,
                            env=subprocess_env())
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


def test_loadable_checkpoint_without_sidecar_is_adopted(tmp_path):
    """Issue 15 case 2: a complete file whose sidecar is gone is resumed from, not discarded."""
    store = CheckpointStore(tmp_path, keep=3)
    store.save(state(10))
    store.save(state(20))
    for name in ("ckpt-00000010.pt", "ckpt-00000010.pt.sha256", "ckpt-00000020.pt.sha256"):
        (tmp_path / name).unlink()
    before = (tmp_path / "ckpt-00000020.pt").read_bytes()
    scan, data = store.newest_valid()
    assert scan.step == 20 and data == before and scan.rejected == []
    side = (tmp_path / "ckpt-00000020.pt.sha256").read_text().splitlines()[0]
    assert side == f"{hashlib.sha256(before).hexdigest()}  ckpt-00000020.pt"
    assert not store.save(state(20)).written  # valid now: a save of step 20 keeps it
    assert (tmp_path / "ckpt-00000020.pt").read_bytes() == before


def unloadable_state(step: int) -> dict:
    """Matches its sidecar but fails torch.load(weights_only=True): it holds a numpy scalar."""
    return {**state(step), "extra": np.float64(1.5)}


def test_unloadable_checkpoint_is_set_aside_replaced_and_never_counted(tmp_path):
    """Issue 15 case 3: a file that matches its sidecar but does not load with weights_only."""
    store = CheckpointStore(tmp_path, keep=2)
    store.save(state(10))
    with pytest.raises(CheckpointError, match="cannot parse"):
        store.save(unloadable_state(20))  # the store itself refuses to write one
    data = serialize(unloadable_state(20))
    (tmp_path / "ckpt-00000020.pt").write_bytes(data)
    (tmp_path / "ckpt-00000020.pt.sha256").write_text(
        f"{hashlib.sha256(data).hexdigest()}  ckpt-00000020.pt\n")
    scan, _ = store.newest_valid()
    assert scan.step == 10 and "cannot parse" in scan.rejected[0][1]
    assert (tmp_path / "ckpt-00000020.pt.corrupt").exists() and store.steps() == [10]
    assert store.save(state(20)).written  # training reaches step 20 again: a real checkpoint
    assert store.load(20)["step"] == 20
    # a corrupt file is not one of the K: saving 30 keeps 20 and 30 (K = 2), drops 10
    (tmp_path / "ckpt-00000025.pt").write_bytes(b"garbage")
    store.save(state(30))
    assert store.steps() == [20, 30]
    assert (tmp_path / "ckpt-00000025.pt.corrupt").exists()


def test_unloadable_sidecar_match_when_saving_same_step_is_replaced(tmp_path):
    store = CheckpointStore(tmp_path, keep=3)
    data = serialize(unloadable_state(7))
    (tmp_path / "ckpt-00000007.pt").write_bytes(data)
    (tmp_path / "ckpt-00000007.pt.sha256").write_text(
        f"{hashlib.sha256(data).hexdigest()}  ckpt-00000007.pt\n")
    assert store.save(state(7)).written
    assert store.newest_valid()[0].step == 7


def test_non_finite_checkpoint_never_evicts_a_finite_one(tmp_path):
    store = CheckpointStore(tmp_path, keep=2)
    store.save(state(10))
    store.save(state(20))
    nan = {"step": 30, "samples_seen": 0, "model": {"w": torch.full((4,), float("nan"))}}
    assert store.save(nan).written
    assert store.steps() == [10, 20, 30]  # nothing pruned for it
    side = (tmp_path / "ckpt-00000030.pt.sha256").read_text()
    assert '"finite": false' in side
    scan, _ = store.newest_valid()
    assert scan.step == 20 and "non-finite" in scan.rejected[0][1]
    store.save(state(40))  # a finite one counts 20 and 40; the non-finite 30 is neither counted nor deleted
    assert store.steps() == [20, 30, 40]


def test_accept_is_part_of_validity_for_load_scan_and_agreement(tmp_path):
    store = CheckpointStore(tmp_path, keep=3)
    store.save(state(1))
    store.save({**state(2), "model": {"w": torch.zeros(3)}})
    picky = CheckpointStore(tmp_path, keep=3,
                            accept=lambda s: None if s["model"]["w"].numel() == 10 else "another shape")
    scan, _ = picky.newest_valid()
    assert scan.step == 1 and "another shape" in scan.rejected[0][1]
    assert agree_on_checkpoint(picky).step == 1
    with pytest.raises(CheckpointError, match="another shape"):
        picky.load(2)
    assert picky.steps() == [1, 2]  # not corrupt: left in place


def test_found_unusable_when_only_corrupt_files_remain(tmp_path):
    store = CheckpointStore(tmp_path, keep=3)
    (tmp_path / "ckpt-00000005.pt").write_bytes(b"junk")
    scan, _ = store.newest_valid()
    assert scan.step is None and scan.found_unusable
    again, _ = store.newest_valid()  # a later start still knows something was there
    assert again.rejected == [] and again.found_unusable
    assert not CheckpointStore(tmp_path / "empty").newest_valid()[0].found_unusable


def test_a_full_disk_during_torch_save_is_a_checkpoint_error_and_nothing_changes(tmp_path, monkeypatch):
    """torch.save turns the OSError of a write into a RuntimeError of its own: the store still says
    the disk is full (CheckpointError, the one error its callers handle), leaving no temp file."""
    import builtins
    import errno

    import ddplab.checkpoint as ck

    store = CheckpointStore(tmp_path, keep=3)
    store.save(state(1))
    before = sorted(p.name for p in tmp_path.iterdir())

    class Full:
        def __init__(self, fh):
            self.fh, self.written = fh, 0

        def write(self, data):  # the disk fills up after the first MiB
            self.written += len(data)
            if self.written > 1 << 20:
                raise OSError(errno.ENOSPC, "No space left on device")
            return self.fh.write(data)

        def __getattr__(self, name):
            return getattr(self.fh, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return self.fh.__exit__(*exc)

    def full_open(path, mode="r", *args, **kw):
        fh = builtins.open(path, mode, *args, **kw)  # noqa: SIM115  (handed to the caller, who closes it)
        return Full(fh) if "w" in mode and ".tmp-" in str(path) else fh

    monkeypatch.setattr(ck, "open", full_open, raising=False)
    big = {"step": 2, "samples_seen": 0, "model": {"w": torch.ones(1 << 20)}}
    with pytest.raises(CheckpointError, match="cannot write checkpoint .*No space left on device"):
        store.save(big)
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == before
    assert store.newest_valid()[0].step == 1


def test_a_save_that_fails_leaves_a_corrupt_file_of_its_step_where_it_was(tmp_path):
    """The new state is checked before anything in the folder moves: a refused one leaves the torn
    file of that step as it was (a valid save moves it aside to *.corrupt, as before)."""
    store = CheckpointStore(tmp_path, keep=3)
    (tmp_path / "ckpt-00000002.pt").write_bytes(b"torn write")
    with pytest.raises(CheckpointError, match="cannot parse"):
        store.save(unloadable_state(2))
    assert sorted(p.name for p in tmp_path.iterdir() if p.name != ".lock") == ["ckpt-00000002.pt"]
    assert store.save(state(2)).written
    assert (tmp_path / "ckpt-00000002.pt.corrupt").read_bytes() == b"torn write"


def test_a_checkpoint_in_torchs_legacy_format_is_valid_to_save_as_to_load(tmp_path):
    """One validity definition: bytes of torch's legacy (non-zip) format, which inspect() accepts,
    are written by save_bytes (they cannot be memory-mapped; they are read)."""
    import io

    buf = io.BytesIO()
    torch.save(state(4), buf, _use_new_zipfile_serialization=False)
    store = CheckpointStore(tmp_path, keep=3)
    assert store.save_bytes(4, buf.getvalue()).written
    assert store.load(4)["step"] == 4
