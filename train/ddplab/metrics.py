"""Per-rank metrics as JSON lines (schema: docs/CONTRACTS.md, "metrics JSONL records").

File: ``<out_dir>/metrics/<hostname>-local<local_rank>.jsonl``, appended across restarts, one
object a line. Every record carries ``event``, ``time`` (unix s), ``host``, ``rank``,
``local_rank``, ``world_size`` and ``restart_count``.
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import Any

from ddplab.outputs import OutputError

#: per_step: an attempt whose vote failed (``attempted_step``, ``committed: false``), never a step
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
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            self._fh = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 (lives as long as the run)
        except OSError as exc:
            raise self._error(exc) from None

    def _error(self, exc: OSError) -> OutputError:
        return OutputError(f"cannot write metrics file {self.path} ({exc.strerror or exc}): "
                           "fix the folder or set another out_dir")

    def set_common(self, **fields: Any) -> None:
        """Change common fields of the following records (per_step: ``rank`` and
        ``world_size`` are the participant rank and the participants of each step)."""
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
        try:
            self._fh.write(json.dumps(record, separators=(",", ":")) + "\n")
            self._fh.flush()
        except OSError as exc:
            raise self._error(exc) from None
        return record

    def sync(self) -> None:
        """fsync the file (at checkpoints, failures and the end). Raises OutputError."""
        try:
            self._fh.flush()
            os.fsync(self._fh.fileno())
        except OSError as exc:
            raise self._error(exc) from None

    def close(self) -> None:
        if not self._fh.closed:
            self.sync()
            self._fh.close()

