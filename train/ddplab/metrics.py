"""Per-rank metrics as JSON lines (schema: docs/CONTRACTS.md, "metrics JSONL records").

File: ``<out_dir>/metrics/<hostname>-local<local_rank>.jsonl``, appended across restarts, one
object a line. Every record carries ``event``, ``time`` (unix s), ``host``, ``rank``,
``local_rank``, ``world_size`` and ``restart_count``.

Records stay whole: each is one ``write`` to an ``O_APPEND`` descriptor; a write that fails part
way (disk full, file size limit) is cut back to the record before it, and a file that ends in a
torn line (a crash mid-write) gets a newline before the next record, so that record is never
joined onto the torn one.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import time
from pathlib import Path
from typing import Any

from ddplab.outputs import OutputError

#: An attempt the engine did not commit (``attempted_step``, ``committed: false``), never a step
UNCOMMITTED_EVENT = "uncommitted"
EVENTS = ("start", "step", UNCOMMITTED_EVENT, "val", "checkpoint", "failure", "end")


def _clean(value: Any) -> Any:
    # JSON has no NaN/Infinity: write null so every reader can parse the line.
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_clean(v) for v in value]
    return value


class MetricsWriter:
    """Append-only JSONL writer of one rank.

    Args:
        directory: ``<out_dir>/metrics``; created when missing.
        host, rank, local_rank, world_size, restart_count: the common fields of every record.
    """

    def __init__(
        self, directory: str | Path, host: str, rank: int, local_rank: int, world_size: int,
        restart_count: int,
    ) -> None:
        self.dir = Path(directory)
        self.path = self.dir / f"{host}-local{local_rank}.jsonl"
        self.common = {"host": host, "rank": rank, "local_rank": local_rank,
                       "world_size": world_size, "restart_count": restart_count}
        self._fd: int | None = None
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            self._end_torn_line()
        except OSError as exc:
            raise self._error(exc) from None

    def _end_torn_line(self) -> None:
        """Write a newline when the file does not end with one (its last record was torn)."""
        size = os.fstat(self._fd).st_size
        if size == 0:
            return
        with open(self.path, "rb") as fh:
            fh.seek(size - 1)
            last = fh.read(1)
        if last != b"\n":
            self._append(b"\n")

    def _append(self, data: bytes) -> None:
        """Append ``data`` whole, or cut the file back to its size before (raises OSError)."""
        before = os.fstat(self._fd).st_size
        done = 0
        try:
            while done < len(data):
                done += os.write(self._fd, data[done:])
        except OSError:
            if done:  # when the cut fails too, the next writer ends the torn line
                with contextlib.suppress(OSError):
                    os.ftruncate(self._fd, before)
            raise

    def _error(self, exc: OSError) -> OutputError:
        return OutputError(f"cannot write metrics file {self.path} ({exc.strerror or exc}): "
                           "fix the folder or set another out_dir")

    def set_common(self, **fields: Any) -> None:
        """Change common fields of the following records (the core sets ``rank`` and
        ``world_size`` to each step's group: they change with a group formed anew per step)."""
        self.common.update(fields)

    def write(self, event: str, **fields: Any) -> dict[str, Any]:
        """Append one record and flush it; return the record.

        Raises:
            ValueError: an unknown event name.
            OutputError: the file cannot be written (one line).
        """
        if event not in EVENTS:
            raise ValueError(f"unknown metrics event {event!r}; expected one of {EVENTS}")
        record = {"event": event, "time": round(time.time(), 6), **self.common, **_clean(fields)}
        line = (json.dumps(record, separators=(",", ":")) + "\n").encode("utf-8")
        try:
            self._append(line)
        except OSError as exc:
            raise self._error(exc) from None
        return record

    def sync(self) -> None:
        """fsync the file (at checkpoints, failures and the end). Raises OutputError."""
        try:
            os.fsync(self._fd)
        except OSError as exc:
            raise self._error(exc) from None

    def close(self) -> None:
        if self._fd is not None:
            try:
                self.sync()
            finally:
                os.close(self._fd)
                self._fd = None

