"""Reading metrics records: the one JSONL parser and number helpers of ddplab (node and controller).

The records are those of docs/CONTRACTS.md ("metrics JSONL records"): one JSON object a line,
each with ``event``, ``time`` (unix s), ``host``, ``rank``, ``local_rank``, ``world_size`` and
``restart_count``. A file read while a worker appends to it (or the tail of a file cut at an
arbitrary byte) can hold torn lines: they are skipped and counted, never fatal.

Standard library only: this module runs on the nodes (``ddplab.status``) and on the controller
(``ddplab.controller.rundir``).
"""

from __future__ import annotations

import json
import math
import mmap
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

Record = Mapping[str, Any]


def num(value: Any) -> float | None:
    """``value`` as a finite float; None for a bool, a non-number, NaN or an infinity."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    v = float(value)
    return v if math.isfinite(v) else None


def as_int(value: Any) -> int | None:
    """``value`` as an int (a float is truncated); None where :func:`num` gives None."""
    v = num(value)
    return int(v) if v is not None else None


def record_time(record: Record) -> float:
    """Sort key: the record's ``time`` (unix s), 0.0 when it has none."""
    return num(record.get("time")) or 0.0


def by_time(records: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """``records`` sorted by ``time`` (stable: records without a time first, in their order)."""
    return sorted(records, key=record_time)


def events_of(records: Iterable[Record], event: str, rank: int | None = None) -> list[Record]:
    """The records of one ``event`` (and, when given, of global rank ``rank``), in their order."""
    return [r for r in records if r.get("event") == event and (rank is None or as_int(r.get("rank")) == rank)]


def newest_start_time(records: Iterable[Record]) -> float:
    """The ``time`` of the newest ``start`` record (unix s): when this node's newest launch (or
    torchrun restart) began; -inf without one."""
    return max((num(r.get("time")) or 0.0 for r in records if r.get("event") == "start"),
               default=float("-inf"))


def group_finished(records: Iterable[Record], since: float = float("-inf")) -> bool:
    """Whether the group finished the run in the launch that began at ``since`` (unix s): an
    ``end`` record (ddplab.train writes it when the run reached max_steps; under a replica-group
    engine a replica that reached it finished the run for its group) at or after ``since``; a record
    without a time counts. Records of earlier launches of a resumed run do not.

    The one home of "did the group finish": ddplab.runstate (run_outcome: the collected run,
    ``since`` its launch; job_state without systemd and past_run_state: ``since`` the node's newest
    start), ddplab.status (a node's ``finished``) and, through the nodes' ``finished``, the
    status table's cut-off rows."""
    return any(r.get("event") == "end" and (num(r.get("time")) or since) >= since for r in records)


def parse_jsonl(text: str) -> tuple[list[dict[str, Any]], int]:
    """``(JSON objects of a JSONL text, number of lines skipped)``.

    Blank lines are ignored; a line that is not JSON (torn by a killed writer or a cut tail) or
    not an object is skipped and counted.
    """
    out: list[dict[str, Any]] = []
    bad = 0
    for line in text.splitlines():
        line = line.strip()
        if not line:
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError:
            bad += 1
            continue
        if isinstance(obj, dict):
            out.append(obj)
        else:
            bad += 1
    return out, bad


def read_jsonl(path: str | Path, tail_bytes: int | None = None) -> tuple[list[dict[str, Any]], int]:
    """``(records, lines skipped)`` of one JSONL file (see :func:`parse_jsonl`).

    ``tail_bytes``: read only that much of the end of the file (its first line is then usually
    cut, and skipped). Raises OSError when the file cannot be read.
    """
    with open(path, "rb") as fh:
        if tail_bytes is not None:
            fh.seek(0, os.SEEK_END)
            fh.seek(max(0, fh.tell() - tail_bytes))
        text = fh.read().decode("utf-8", errors="replace")
    return parse_jsonl(text)


def read_new_lines(path: str | Path, offset: int, limit: int) -> tuple[str, int, int]:
    """``(text, start, end)``: the complete lines of ``path`` from byte ``offset`` on, at most ``limit``
    bytes (UTF-8, bad bytes replaced), for a reader that follows a growing file.

    ``start`` is ``offset``, or 0 when the file is now shorter than ``offset`` (it was replaced: read
    again from the start); ``end`` is the offset after the last newline returned (a line still being
    written stays for the next call). Raises OSError when the file cannot be read.
    """
    with open(path, "rb") as fh:
        fh.seek(0, os.SEEK_END)
        start = offset if 0 <= offset <= fh.tell() else 0
        fh.seek(start)
        data = fh.read(max(0, limit))
    data = data[: data.rfind(b"\n") + 1]
    return data.decode("utf-8", errors="replace"), start, start + len(data)


# How a start record begins (ddplab.metrics.MetricsWriter: compact JSON, ``event`` first; the
# spaced form of json.dumps' default separators too): found by a byte search, not by parsing.
START_MARKS = (b'"event":"start"', b'"event": "start"')


def newest_start_record(path: str | Path, end: int) -> dict[str, Any] | None:
    """The newest ``start`` record of the metrics file ``path`` whose line begins before byte
    ``end`` (the run id, max_steps and engine of a launch: they are written once, at its start), or
    None when there is none.

    A backward byte search for :data:`START_MARKS` over the file mapped in memory (mmap), then one
    line parsed: a 50 MB file costs milliseconds (docs/running.md). Raises OSError when the file
    cannot be read.
    """
    with open(path, "rb") as fh:
        size = min(end, fh.seek(0, 2))
        if size <= 0:
            return None
        with mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            stop = size
            while stop > 0:
                pos = max(mm.rfind(mark, 0, stop + len(mark)) for mark in START_MARKS)
                if pos < 0:
                    return None
                first = mm.rfind(b"\n", 0, pos) + 1
                last = mm.find(b"\n", pos)
                line = mm[first:last if last >= 0 else len(mm)]
                try:
                    rec = json.loads(line.decode("utf-8", errors="replace"))
                except json.JSONDecodeError:
                    rec = None  # a torn line
                if isinstance(rec, dict) and rec.get("event") == "start":
                    return rec
                stop = first - 1  # the mark was inside another kind of line: look before it
    return None


def read_metrics_file(path: str | Path, tail_bytes: int | None = None,
                      keep_start: bool = False) -> tuple[list[dict[str, Any]], int]:
    """``(records, lines skipped)`` of one metrics file, in file order: all of it, or its last
    ``tail_bytes`` (:func:`read_jsonl`). ``keep_start``: of a file longer than ``tail_bytes`` whose
    tail holds no ``start`` record, also the newest one before the tail (:func:`newest_start_record`,
    appended), so a reader of the tail keeps the run id, max_steps and engine; a file whose tail
    has its start is not searched. Raises OSError when the file cannot be read."""
    recs, bad = read_jsonl(path, tail_bytes)
    if keep_start and tail_bytes is not None and not events_of(recs, "start"):
        size = Path(path).stat().st_size
        if size > tail_bytes and (start := newest_start_record(path, size - tail_bytes)) is not None:
            recs.append(start)
    return recs, bad


def read_metrics_dir(
    metrics_dir: str | Path, host: str | None = None, tail_bytes: int | None = None,
    keep_start: bool = False,
) -> tuple[list[dict[str, Any]], int]:
    """``(records of every *.jsonl in metrics_dir sorted by time, lines skipped)``; ``([], 0)`` when
    the folder is missing. Each file is read by :func:`read_metrics_file`.

    ``host``: set on records without one (the host folder a collected file came from).
    ``tail_bytes``, ``keep_start``: see :func:`read_metrics_file` (the node's status reads tails
    and keeps each file's start: ddplab.status.read_node_metrics). Raises OSError when a file
    cannot be read.
    """
    metrics_dir = Path(metrics_dir)
    out: list[dict[str, Any]] = []
    skipped = 0
    if not metrics_dir.is_dir():
        return out, skipped
    for path in sorted(metrics_dir.glob("*.jsonl")):
        recs, bad = read_metrics_file(path, tail_bytes, keep_start)
        skipped += bad
        for r in recs:
            if host is not None:
                r.setdefault("host", host)
            out.append(r)
    return by_time(out), skipped
