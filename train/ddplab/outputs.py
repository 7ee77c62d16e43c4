"""Can this process write its output folders? Asked before the first step, not found out after.

``--check`` asks without changing anything (``os.access`` on the folder or, when it does not
exist yet, on the nearest existing parent); a run creates the folders and writes and removes a
probe file in each, which also catches a read-only mount or an immutable folder for root.
Small result files (result.json, sample.txt, a kept quorum id) are written whole or not at all
(:func:`atomic_write_text`).
"""

from __future__ import annotations

import errno
import os
import tempfile
from pathlib import Path


class OutputError(RuntimeError):
    """An output folder or file cannot be written; the message names it and the fix."""


def fsync_dir(path: str | Path) -> None:
    """fsync the folder ``path``, so that a rename or a new file in it survives a power loss.

    Raises:
        OSError: the folder cannot be opened or synced.
    """
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _nearest_existing(path: Path) -> Path:
    probe = path
    while not os.path.lexists(probe) and probe != probe.parent:
        probe = probe.parent
    return probe


def check_writable_dir(path: str | Path, what: str, create: bool) -> None:
    """Make sure ``path`` is (or can become) a folder this process can write.

    Args:
        path: the folder.
        what: its role in the message (``output``, ``metrics``, ``checkpoint``, ``dataset``).
        create: False (``--check``): change nothing; True (a run): create it and write a probe.

    Raises:
        OutputError: one line naming the folder, the cause and the fix.
    """
    path = Path(path)

    def fail(why: str) -> OutputError:
        return OutputError(f"{what} folder {path} cannot be written ({why}): "
                           "fix the folder's owner, permissions or mount, or set another out_dir")

    existing = _nearest_existing(path)
    if existing.exists() and not existing.is_dir():
        raise fail("it is a file" if existing == path else f"{existing} is not a folder")
    if not existing.exists():  # dangling symlink or symlink loop
        raise fail(f"{existing} is a broken symlink")
    if not os.access(existing, os.W_OK | os.X_OK):
        err = errno.EROFS if _read_only_mount(existing) else errno.EACCES
        raise fail(f"{existing}: {os.strerror(err)} for uid {os.getuid()}")
    if not create:
        return
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path, prefix=".write-probe-"):
            pass
    except OSError as exc:
        raise fail(exc.strerror or str(exc)) from None


def _read_only_mount(path: Path) -> bool:
    try:
        return bool(os.statvfs(path).f_flag & os.ST_RDONLY)
    except OSError:
        return False


def atomic_write_text(path: Path, text: str) -> None:
    """Temp file, fsync, rename, fsync the folder (the rename itself survives a power cut).

    Raises:
        OutputError: the file cannot be written (the temp file is removed).
    """
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "w", encoding="utf-8") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
        fsync_dir(path.parent)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise OutputError(f"cannot write {path} ({exc.strerror or exc}): fix the folder or "
                          "set another out_dir") from None
