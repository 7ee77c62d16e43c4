"""Per-node checkpoints: atomic writes, sha256 sidecars, keep-last-K, verified loads with fallback.

Layout (one folder per node, no shared filesystem)::

    <out_dir>/checkpoints/ckpt-00000100.pt          torch.save of the training state
    <out_dir>/checkpoints/ckpt-00000100.pt.sha256   "<hex>  ckpt-00000100.pt" (sha256sum format)
    <out_dir>/checkpoints/.lock                     flock: one writer per node at a time

A write goes: serialize in memory -> temp file in the same folder -> fsync -> sidecar temp ->
fsync -> ``os.replace`` the checkpoint, then the sidecar -> fsync the folder. A checkpoint counts
only when both files exist and the hash matches, so a crash at any point leaves the previous
checkpoints intact and loadable. An existing valid checkpoint is never overwritten.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ddplab.data import file_lock

_NAME = re.compile(r"^ckpt-(\d{8,})\.pt$")
_TMP_MARK = ".tmp-"


class CheckpointError(RuntimeError):
    """The checkpoint folder is unusable, or a checkpoint cannot be written or parsed."""


@dataclass
class SaveResult:
    """Outcome of :meth:`CheckpointStore.save`; ``written`` is False when a valid one existed."""

    step: int
    path: Path
    bytes: int
    seconds: float
    written: bool


@dataclass
class ScanResult:
    """Newest valid checkpoint (or None) and the newer ones rejected, as (path, reason)."""

    step: int | None
    path: Path | None
    rejected: list[tuple[Path, str]] = field(default_factory=list)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_durable(path: Path, data: bytes) -> None:
    with open(path, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())


def serialize(state: dict[str, Any]) -> bytes:
    """The bytes of ``torch.save(state)``."""
    buf = io.BytesIO()
    torch.save(state, buf)
    return buf.getvalue()


def deserialize(data: bytes) -> dict[str, Any]:
    """Inverse of :func:`serialize` (``weights_only=True``: tensors and plain containers only).

    Raises:
        CheckpointError: the bytes are not a checkpoint.
    """
    try:
        state = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises several types for garbage input
        raise CheckpointError(f"cannot parse checkpoint: {exc}") from None
    if not isinstance(state, dict) or "step" not in state:
        raise CheckpointError("checkpoint does not hold a training state dict")
    return state


class CheckpointStore:
    """The checkpoint folder of this node.

    Args:
        directory: the folder (created when missing).
        keep: how many of the newest checkpoints to keep (K >= 1).
    """

    def __init__(self, directory: str | Path, keep: int = 3) -> None:
        if keep < 1:
            raise ValueError(f"keep = {keep} must be >= 1")
        self.dir = Path(directory)
        self.keep = keep

    # --- folder -------------------------------------------------------------------------------
    def check(self, create: bool = True) -> None:
        """Make sure the folder is a readable, writable directory (create it when missing).

        Raises:
            CheckpointError: it is not a directory, cannot be listed, or cannot be created.
        """
        try:
            os.listdir(self.dir)
        except FileNotFoundError:
            if self.dir.is_symlink():
                raise CheckpointError(
                    f"checkpoint folder {self.dir} is unreadable (dangling symlink): "
                    "fix the link or set another out_dir"
                ) from None
            if not create:
                return
            try:
                self.dir.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise CheckpointError(
                    f"cannot create checkpoint folder {self.dir} ({exc.strerror or exc}): "
                    "fix the permissions of its parent or set another out_dir"
                ) from None
        except NotADirectoryError:
            raise CheckpointError(
                f"checkpoint folder {self.dir} is not a directory: move it away or set out_dir"
            ) from None
        except OSError as exc:
            raise CheckpointError(
                f"checkpoint folder {self.dir} is unreadable ({exc.strerror or exc}): "
                "fix its permissions or set another out_dir"
            ) from None
        if not os.access(self.dir, os.R_OK | os.W_OK | os.X_OK):
            raise CheckpointError(
                f"checkpoint folder {self.dir} is not readable and writable by uid {os.getuid()}: "
                "fix its owner/permissions or set another out_dir"
            )

    def path_for(self, step: int) -> Path:
        return self.dir / f"ckpt-{step:08d}.pt"

    @staticmethod
    def sidecar(path: Path) -> Path:
        return path.with_name(path.name + ".sha256")

    def steps(self) -> list[int]:
        """Steps that have a checkpoint file (valid or not), ascending.

        Raises:
            CheckpointError: the folder cannot be listed.
        """
        try:
            names = os.listdir(self.dir)
        except FileNotFoundError:
            return []
        except OSError as exc:
            raise CheckpointError(f"checkpoint folder {self.dir} is unreadable: {exc.strerror}") from None
        return sorted(int(m.group(1)) for n in names if (m := _NAME.match(n)))

    # --- verification -------------------------------------------------------------------------
    def read_verified(self, step: int) -> bytes:
        """The bytes of checkpoint ``step`` after checking them against the sidecar.

        Raises:
            CheckpointError: missing file or sidecar, unreadable, or hash mismatch.
        """
        path = self.path_for(step)
        try:
            expected = self.sidecar(path).read_text(encoding="ascii").split()[0]
        except FileNotFoundError:
            raise CheckpointError(f"{path.name}: no .sha256 sidecar (interrupted write?)") from None
        except (OSError, UnicodeDecodeError, IndexError) as exc:
            raise CheckpointError(f"{path.name}: unreadable sidecar: {exc}") from None
        try:
            data = path.read_bytes()
        except OSError as exc:
            raise CheckpointError(f"{path.name}: unreadable: {exc.strerror}") from None
        got = hashlib.sha256(data).hexdigest()
        if got != expected:
            raise CheckpointError(f"{path.name}: sha256 {got} differs from sidecar {expected}")
        return data

    def newest_valid(self) -> tuple[ScanResult, bytes | None]:
        """Scan from the newest step down; return the first checkpoint that verifies and parses.

        Returns ``(scan, data)`` where ``data`` are the verified bytes (None when none is valid).
        """
        rejected: list[tuple[Path, str]] = []
        for step in reversed(self.steps()):
            try:
                data = self.read_verified(step)
                deserialize(data)
            except CheckpointError as exc:
                rejected.append((self.path_for(step), str(exc)))
                continue
            return ScanResult(step, self.path_for(step), rejected), data
        return ScanResult(None, None, rejected), None

    def load(self, step: int) -> dict[str, Any]:
        """The verified state of checkpoint ``step``. Raises CheckpointError."""
        return deserialize(self.read_verified(step))

    # --- writing ------------------------------------------------------------------------------
    def save(self, state: dict[str, Any]) -> SaveResult:
        """Write ``state`` (which holds ``step``) atomically; see :meth:`save_bytes`."""
        return self.save_bytes(int(state["step"]), serialize(state))

    def save_bytes(self, step: int, data: bytes) -> SaveResult:
        """Write serialized checkpoint ``data`` for ``step`` atomically, then prune to K.

        Does nothing when a valid checkpoint of ``step`` already exists (never overwrites one).

        Raises:
            CheckpointError: the folder is unusable or the write fails (temp files are removed;
                existing checkpoints are untouched).
        """
        t0 = time.perf_counter()
        self.check()
        path = self.path_for(step)
        side = self.sidecar(path)
        digest = hashlib.sha256(data).hexdigest()
        tmp = path.with_name(f".{path.name}{_TMP_MARK}{os.getpid()}")
        tmp_side = side.with_name(f".{side.name}{_TMP_MARK}{os.getpid()}")
        with file_lock(self.dir / ".lock"):
            self._remove_stale_temps()
            if path.exists():
                with contextlib.suppress(CheckpointError):
                    self.read_verified(step)
                    return SaveResult(step, path, path.stat().st_size, time.perf_counter() - t0, False)
            try:
                _write_durable(tmp, data)
                _write_durable(tmp_side, f"{digest}  {path.name}\n".encode("ascii"))
                os.replace(tmp, path)
                os.replace(tmp_side, side)
                _fsync_dir(self.dir)
            except OSError as exc:
                raise CheckpointError(f"cannot write checkpoint {path}: {exc.strerror or exc}") from None
            finally:
                tmp.unlink(missing_ok=True)
                tmp_side.unlink(missing_ok=True)
            self._prune(step)
        return SaveResult(step, path, len(data), time.perf_counter() - t0, True)

    def _remove_stale_temps(self) -> None:
        # Called under the lock: no other writer of this node is active, so any temp is stale.
        for name in os.listdir(self.dir):
            if name.startswith(".ckpt-") and _TMP_MARK in name:
                with contextlib.suppress(OSError):
                    os.unlink(self.dir / name)

    def _prune(self, current: int) -> None:
        """Keep ``current`` and the K-1 newest older steps; never touch newer (stale) steps."""
        older = [s for s in self.steps() if s < current]
        drop = older[: max(0, len(older) - (self.keep - 1))]
        for step in drop:
            path = self.path_for(step)
            for victim in (self.sidecar(path), path):  # sidecar first: never a valid half-deleted one
                with contextlib.suppress(FileNotFoundError):
                    victim.unlink()
        if drop:
            _fsync_dir(self.dir)
