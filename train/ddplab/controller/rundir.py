"""The one reader of a run folder on the controller (docs/CONTRACTS.md, "Run record").

``runs/<run_id>/`` holds ``<host>/metrics/*.jsonl`` (every worker's records), ``<host>/run.json``
and ``<host>/result.json`` (the run's configuration and rank 0's result, as collected),
``events.jsonl`` (fault injections and play events) and ``summary.json`` (written by
:mod:`ddplab.controller.summary`). :func:`load_run` reads all of it into a :class:`RunFolder`; the summary,
the fault measurement, the report, the straggler finder and the bench report work on that, never
on the files.

The group-level facts every tool shows are defined here once: :func:`group_starts` (the group's
(re)starts, hence the restart count) and :func:`world_size_timeline`.
"""

from __future__ import annotations

import bisect
import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ddplab.engines import replica_groups
from ddplab.records import (
    Record,
    as_int,
    by_time,
    events_of,
    num,
    read_jsonl,
    read_metrics_dir,
)
from ddplab.runstate import LAUNCH_KINDS, launch_since

SUMMARY_FILE = "summary.json"
EVENTS_FILE = "events.jsonl"
SAMPLE_FILE = "sample.txt"  # rank 0's generated text at the end of a run (ddplab.train)
SAMPLE_MAX_CHARS = 4000  # read at most this much of a sample.txt


class RunFolderError(ValueError):
    """Bad input: the run folder (or the metrics folder given instead) does not exist."""


def read_json(path: Path) -> dict[str, Any] | None:
    """The JSON object in ``path``; None when it is missing, unreadable, not JSON or not an object."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def host_dirs(root: Path) -> list[Path]:
    """The per-host folders under ``root``: visible sub-folders holding ``metrics/`` or ``journal.txt``
    (``plots/`` is the report's)."""
    if not root.is_dir():
        return []
    return sorted(
        p
        for p in root.iterdir()
        if p.is_dir()
        and not p.name.startswith(".")
        and p.name != "plots"
        and ((p / "metrics").is_dir() or (p / "journal.txt").is_file())
    )


def load_events(run_dir: Path) -> list[dict[str, Any]]:
    """The records of ``run_dir/events.jsonl`` in file order ([] when the file does not exist)."""
    path = Path(run_dir) / EVENTS_FILE
    return read_jsonl(path)[0] if path.is_file() else []


@dataclass
class RunFolder:
    """Everything read from ``runs/<run_id>/``.

    ``per_host``: host folder -> its metrics records by time (every host folder, [] without
    metrics); ``records``: all of them by time; ``metrics_files``: the files read; ``events``: the
    events.jsonl records; ``configs`` / ``results``: host -> its run.json / result.json;
    ``summary``: the existing summary.json ({} when missing or unreadable, ``summary_error`` says
    why when it is there but unreadable); ``skipped_lines``: torn JSONL lines skipped;
    ``samples``: host -> the text of its ``sample.txt`` (at most ``SAMPLE_MAX_CHARS``);
    ``derived``: figures computed once from these records for every reader of this load (the
    report's measured faults, ddplab.controller.report.data.faults).
    """

    path: Path
    run_id: str
    per_host: dict[str, list[dict[str, Any]]]
    records: list[dict[str, Any]]
    metrics_files: list[Path]
    events: list[dict[str, Any]]
    configs: dict[str, dict[str, Any]]
    results: dict[str, dict[str, Any]]
    summary: dict[str, Any]
    summary_error: str | None = None
    skipped_lines: int = 0
    notes: list[str] = field(default_factory=list)
    samples: dict[str, str] = field(default_factory=dict)
    derived: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @property
    def hosts(self) -> list[str]:
        """The host folders of the run, sorted."""
        return sorted(self.per_host)

    def by_event(self, event: str, rank: int | None = None) -> list[dict[str, Any]]:
        """The metrics records of one ``event`` (and global ``rank`` when given), by time."""
        return events_of(self.records, event, rank)  # type: ignore[return-value]


def read_sample(path: Path, limit: int = SAMPLE_MAX_CHARS) -> str | None:
    """The first ``limit`` characters of a ``sample.txt`` (UTF-8, bad bytes replaced); None when it
    is missing, unreadable or empty."""
    try:
        with open(path, encoding="utf-8", errors="replace") as fh:
            text = fh.read(limit)
    except OSError:
        return None
    return text if text.strip() else None


def _summary_file(path: Path) -> tuple[dict[str, Any], str | None]:
    if not path.exists():
        return {}, None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        return {}, f"{path}: not valid JSON ({exc})"
    if not isinstance(data, dict):
        return {}, f"{path}: expected a JSON object"
    return data, None


def load_run(path: str | Path, metrics_dir: str | Path | None = None) -> RunFolder:
    """Read a run folder; the metrics from ``<metrics_dir>/<host>/metrics/*.jsonl`` when given (the
    live copies kill-node.yml fetches into ``runs/<run_id>/.live``), else from the run folder.

    A record without ``host`` gets its host folder's name. Raises RunFolderError when ``path`` (or
    ``metrics_dir``) is not a folder; OSError when a file cannot be read.
    """
    root = Path(path)
    if not root.is_dir():
        raise RunFolderError(f"{root}: no such run folder (expected runs/<run_id>/ made by collect.yml)")
    mroot = Path(metrics_dir) if metrics_dir is not None else root
    if not mroot.is_dir():
        raise RunFolderError(f"{mroot}: no such metrics folder (expected <dir>/<host>/metrics/*.jsonl)")
    notes: list[str] = []
    if metrics_dir is not None:
        notes.append(
            f"metrics read from {metrics_dir} (copies taken while the run went on: "
            "collect.yml brings the final ones)"
        )
    per_host: dict[str, list[dict[str, Any]]] = {}
    files: list[Path] = []
    skipped = 0
    for d in host_dirs(mroot):
        per_host[d.name], bad = read_metrics_dir(d / "metrics", host=d.name)
        files += sorted((d / "metrics").glob("*.jsonl"))
        skipped += bad
    summary, summary_error = _summary_file(root / SUMMARY_FILE)
    configs = {d.name: c for d in host_dirs(root) if (c := read_json(d / "run.json"))}
    results = {d.name: r for d in host_dirs(root) if (r := read_json(d / "result.json"))}
    samples = {d.name: t for d in host_dirs(root) if (t := read_sample(d / SAMPLE_FILE))}
    records = by_time(r for recs in per_host.values() for r in recs)
    run_id = str(
        summary.get("run_id")
        or next((r["run_id"] for r in records if r.get("event") == "start" and r.get("run_id")), None)
        or next((c["run_id"] for c in configs.values() if c.get("run_id")), None)
        or root.resolve().name
    )
    return RunFolder(
        root, run_id, per_host, records, files, load_events(root), configs, results, summary,
        summary_error, skipped, notes, samples,
    )


# ----------------------------------------------------------------------------- group facts


@dataclass(frozen=True)
class GroupStart:
    """One (re)start of the training group: ``time`` (unix s) of its rank-0 ``start`` record, the
    step it resumed from, its world size, and whether it is the first start of the records."""

    time: float
    step: int
    world_size: int
    initial: bool


def _rank0_or_all(records: Iterable[Record], events: Sequence[str]) -> list[Record]:
    """Rank 0's records of ``events`` by time (rank 0 exists in every group generation, so its
    records are one clean series); every rank's when there are none of rank 0."""
    chosen = [r for r in records if r.get("event") in events]
    rank0 = [r for r in chosen if as_int(r.get("rank")) == 0]
    return by_time(rank0 or chosen)  # type: ignore[arg-type]


def group_starts(records: Iterable[Record]) -> list[GroupStart]:
    """The group's starts: one per rank-0 ``start`` record, by time (``step``: its
    ``resumed_from_step``). The restarts among them: :func:`group_restarts`."""
    out: list[GroupStart] = []
    for r in by_time(r for r in records if r.get("event") == "start" and as_int(r.get("rank")) == 0):  # type: ignore[misc]
        t = num(r.get("time"))
        if t is None:
            continue
        out.append(
            GroupStart(t, as_int(r.get("resumed_from_step")) or 0, as_int(r.get("world_size")) or 0, not out)
        )
    return out


def launch_of(events: Iterable[Record]) -> Callable[[float], int]:
    """Which launch a record at unix time ``t`` belongs to: the number of ``launch``/``resume``
    events (:data:`ddplab.runstate.LAUNCH_KINDS`) at or before ``t`` (0: before any, or no events)."""
    marks = sorted(t for e in events
                   if e.get("kind") in LAUNCH_KINDS and (t := num(e.get("time"))) is not None)
    return lambda t: bisect.bisect_right(marks, t)


def group_restarts(records: Iterable[Record], events: Iterable[Record] = ()) -> int:
    """How many times the group re-formed within a launch: rank-0 ``start`` records beyond the
    first of each launch (:func:`launch_of` ``events``; a launch or resume is no restart); without
    events, rank-0 ``start`` records minus one (0 when none)."""
    which = launch_of(events)
    launches = [which(g.time) for g in group_starts(records)]
    return len(launches) - len(set(launches))


def world_size_timeline(records: Iterable[Record]) -> list[dict[str, Any]]:
    """``[{time, step, world_size}]``: the first rank-0 ``start``/``step`` record and every change of
    world size after it, in time order (every rank's records when there are no rank-0 ones).

    ``step`` of a ``start`` record is its ``resumed_from_step``. Under the per_step engine only
    committed steps count (``world_size`` = participants; a replica's ``start`` record has the size
    of its own torchrun group, 1) and no uncommitted step does under either engine.
    """
    out: list[dict[str, Any]] = []
    for r in _rank0_or_all(records, ("start", "step")):
        ws, t = as_int(r.get("world_size")), num(r.get("time"))
        if ws is None or t is None or r.get("committed") is False:
            continue
        if replica_groups(r.get("engine")) and r.get("event") == "start":
            continue
        step = as_int(r.get("step") if r.get("event") == "step" else r.get("resumed_from_step"))
        if not out or out[-1]["world_size"] != ws:
            out.append({"time": round(t, 3), "step": step or 0, "world_size": ws})
    return out


def world_size_at(timeline: Sequence[dict[str, Any]], t: float) -> int | None:
    """The world size in force at unix time ``t`` by a :func:`world_size_timeline` (None before it)."""
    ws = None
    for e in timeline:
        if e["time"] > t + 5e-4:  # the timeline's times are rounded to ms
            break
        ws = e["world_size"]
    return ws


# ----------------------------------------------------------------------------- outcome
# The run's outcome and its newest launch: the run-state model's (ddplab.runstate).


def cut_off_nodes(per_host: Mapping[str, Sequence[Record]], events: Sequence[Record]) -> list[dict[str, Any]]:
    """per_step: the nodes whose replica ended cut off from the group in the newest launch (its
    last record a ``failure`` with cause ``cut_off``, ddplab.train): ``[{host, step, time,
    last_group_quorum_id, quorum_id, unreachable_s, error}]`` by host; ``quorum_id`` is None
    when no quorum came at all (``unreachable_s`` seconds without one)."""
    records = [r for recs in per_host.values() for r in recs]
    since = launch_since(records, events)
    out = []
    for host, recs in sorted(per_host.items()):
        timed = sorted((r for r in recs if r.get("event") in ("start", "end", "failure")
                        and (num(r.get("time")) or since) >= since), key=lambda r: num(r.get("time")) or 0.0)
        last = timed[-1] if timed else {}
        if last.get("event") == "failure" and last.get("cause") == "cut_off":
            out.append({"host": host, "time": num(last.get("time")), "error": last.get("error"),
                        **{k: last.get(k) for k in ("step", "last_group_quorum_id", "quorum_id",
                                                    "unreachable_s")}})
    return out
