"""Static HTML report of one run: ``python -m ddplab.report runs/<run_id>``.

Reads the run record on the controller (docs/CONTRACTS.md): ``summary.json`` (optional: figures
are derived from the metrics when it is missing), ``events.jsonl`` (optional) and
``<host>/metrics/*.jsonl``. Writes ``report.html`` (no scripts, no CDN, inline CSS; opens
offline) and ``plots/*.png`` (matplotlib, Agg), referenced by relative paths:

* ``loss.png``       train loss per step, val loss, restart and fault markers
* ``step_time.png``  compute time per rank, the step time, and the straggler tail
                     (slowest rank's compute / median, per step) with the findings shaded
* ``world_size.png`` world size over time, fault injections, the gaps without training
* ``cpu.png``        CPU clock and temperature per node ("no sensor" when all null)
* ``share.png``      compute vs all-reduce share of the step, per step

Tables: key figures, recoveries (mode, node, detection, recovery, steps lost), straggler findings
(:mod:`ddplab.straggler`), figures per world size, events.

Exit status: 0 report written; 2 bad input (no such run folder), nothing written; 3 the run has
no step metrics: a page saying so (with what was found) is written, so a printed link still works.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jinja2

from ddplab import straggler
from ddplab.metrics import read_jsonl

EXIT_OK, EXIT_BAD_INPUT, EXIT_NO_METRICS = 0, 2, 3
RESTART_GAP_S = 20.0  # start records closer than this belong to one (re)start of the group
Record = dict[str, Any]


class ReportError(Exception):
    """Bad input: the run folder cannot be read."""


@dataclass
class Run:
    """Everything read from ``runs/<run_id>/``. ``metrics``: all records of every host, by time."""

    path: Path
    run_id: str
    summary: dict[str, Any]
    events: list[Record]
    metrics: list[Record]
    metrics_files: list[Path]
    notes: list[str] = field(default_factory=list)

    def by_event(self, event: str) -> list[Record]:
        return [r for r in self.metrics if r.get("event") == event]


def _first_set(*values: Any) -> Any:
    """The first value that is not None (None when all are)."""
    return next((v for v in values if v is not None), None)


def _num(v: Any) -> float | None:
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
        return None
    return float(v)


def load_run(path: str | Path, metrics_dir: str | Path | None = None) -> Run:
    """Read a run folder; the metrics from ``<metrics_dir>/<host>/metrics/*.jsonl`` (default: the run
    folder; kill-node.yml passes the live copies it fetched, ``runs/<run_id>/.live``).

    Raises ReportError when the folder does not exist or summary.json is not JSON.
    """
    root = Path(path)
    if not root.is_dir():
        raise ReportError(f"{root}: no such run folder (expected runs/<run_id>/ made by collect.yml)")
    notes: list[str] = []
    summary: dict[str, Any] = {}
    sfile = root / "summary.json"
    if sfile.exists():
        try:
            summary = json.loads(sfile.read_text(encoding="utf-8"))
        except json.JSONDecodeError as exc:
            raise ReportError(f"{sfile}: not valid JSON ({exc}); re-run collect.yml") from None
        if not isinstance(summary, dict):
            raise ReportError(f"{sfile}: expected a JSON object")
    else:
        notes.append("summary.json is missing: key figures derived from the metrics")
    events = read_jsonl(root / "events.jsonl") if (root / "events.jsonl").exists() else []
    files = sorted(Path(metrics_dir or root).glob("*/metrics/*.jsonl"))
    if metrics_dir:
        notes.append(f"metrics read from {metrics_dir} (copies taken while the run went on: "
                     "collect.yml brings the final ones)")
    metrics: list[Record] = []
    for f in files:
        host_dir = f.parent.parent.name
        for r in read_jsonl(f):
            if isinstance(r, dict):
                r.setdefault("host", host_dir)
                metrics.append(r)
    metrics.sort(key=lambda r: _num(r.get("time")) or 0.0)
    run_id = str(summary.get("run_id") or root.resolve().name)
    return Run(root, run_id, summary, [e for e in events if isinstance(e, dict)], metrics, files, notes)


# ---------------------------------------------------------------- derived series


def step_series(run: Run) -> dict[straggler.WorkerKey, list[Record]]:
    """Step records per (host, local_rank), one per step (newest), sorted by step."""
    return straggler.step_records(run.metrics)


def loss_per_step(run: Run) -> list[tuple[int, float]]:
    """(step, train loss): per step, the lowest rank's loss from the newest time that step was run.

    A step redone after a restart counts once (its newest run); records of one run of a step are
    within RESTART_GAP_S of each other.
    """
    recs: dict[int, list[Record]] = defaultdict(list)
    for r in run.by_event("step"):
        ok = _num(r.get("loss")) is not None and _num(r.get("time")) is not None
        if isinstance(r.get("step"), int) and ok:
            recs[r["step"]].append(r)
    out = []
    for s in sorted(recs):
        newest = max(r["time"] for r in recs[s])
        last_run = [r for r in recs[s] if r["time"] >= newest - RESTART_GAP_S]
        best = min(last_run, key=lambda r: r.get("rank") if isinstance(r.get("rank"), int) else 1 << 30)
        out.append((s, float(best["loss"])))
    return out


def val_points(run: Run) -> list[tuple[int, float]]:
    """(step, val loss), one per step."""
    pts = {r["step"]: float(r["val_loss"]) for r in run.by_event("val")
           if isinstance(r.get("step"), int) and _num(r.get("val_loss")) is not None}
    return sorted(pts.items())


@dataclass(frozen=True)
class Restart:
    """One (re)start of the group: time (unix s), resumed step, world size, initial launch or not."""

    time: float
    step: int
    world_size: int
    initial: bool


def restarts(run: Run) -> list[Restart]:
    """Cluster the ``start`` records (one per rank and start) into starts of the group."""
    starts = sorted((r for r in run.by_event("start") if _num(r.get("time")) is not None),
                    key=lambda r: r["time"])
    groups: list[list[Record]] = []
    for r in starts:
        if groups and r["time"] - groups[-1][-1]["time"] <= RESTART_GAP_S:
            groups[-1].append(r)
        else:
            groups.append([r])
    out = []
    for i, g in enumerate(groups):
        step = max(int(r.get("resumed_from_step") or 0) for r in g)
        ws = max(int(r.get("world_size") or len(g)) for r in g)
        out.append(Restart(g[0]["time"], step, ws, initial=(i == 0)))
    return out


@dataclass(frozen=True)
class Fault:
    """A fault injection, from summary.json ``faults`` or from events.jsonl (records with a mode)."""

    mode: str
    node: str
    rank: Any
    time: float | None
    detected_s: float | None = None
    recovered_s: float | None = None
    steps_lost: Any = None
    world_size_before: Any = None
    world_size_after: Any = None
    outcome: str = ""


_SOURCE_REF = re.compile(r"\[[^\]\s]*/[^\]\s]*:\d+\]\s*")


def short_cause(text: str, limit: int = 160) -> str:
    """A failure message cut to what a reader needs in a table cell.

    Drops source references such as ``[/__w/pytorch/.../pair.cc:553]`` and gloo's boilerplate advice
    ("This is typically caused by ..."), keeps characters of the Basic Multilingual Plane only (the
    report's fonts have no emoji), and ends with "…" past ``limit`` characters.
    """
    t = _SOURCE_REF.sub("", str(text))
    t = re.split(r"\.\s+This is typically caused", t, maxsplit=1)[0]
    t = "".join(ch for ch in t if ord(ch) <= 0xFFFF)
    t = " ".join(t.split())
    return t if len(t) <= limit else t[: limit - 1].rstrip() + "…"


def _outcome(f: dict[str, Any]) -> str:
    parts = [str(f["outcome"])] if f.get("outcome") else []
    if f.get("cause"):
        parts.append(f"cause: {short_cause(f['cause'])}")
    notes = f.get("notes")
    if isinstance(notes, list):
        parts += [str(n) for n in notes]
    return "; ".join(parts)


def faults(run: Run) -> list[Fault]:
    """summary.json faults (as measured by ddplab.faults) when present, else events.jsonl ``kind: fault``."""
    src = run.summary.get("faults")
    if isinstance(src, list) and src:
        return [Fault(str(f.get("mode", "?")), str(f.get("node", "?")), f.get("rank"),
                      _num(f.get("injected_at")), _num(f.get("detected_s")), _num(f.get("recovered_s")),
                      f.get("steps_lost"), f.get("world_size_before"), f.get("world_size_after"), _outcome(f))
                for f in src if isinstance(f, dict)]
    return [Fault(str(e.get("mode")), str(e.get("node", "?")), e.get("rank"), _num(e.get("time")),
                  outcome="not measured (no summary.json faults)")
            for e in run.events if e.get("kind") == "fault"]


def step_at(run: Run, t: float | None) -> int | None:
    """The last step completed (any rank) at unix time ``t``."""
    if t is None:
        return None
    done = [r["step"] for r in run.by_event("step") if isinstance(r.get("step"), int)
            and (_num(r.get("time")) or math.inf) <= t]
    return max(done) if done else None


def world_size_timeline(run: Run) -> list[tuple[float, int]]:
    """(unix time, world size) at every step record of the lowest rank, in time order."""
    pts: dict[float, int] = {}
    for r in run.by_event("step"):
        t, ws = _num(r.get("time")), r.get("world_size")
        if t is not None and isinstance(ws, int) and r.get("rank") == 0:
            pts[t] = ws
    return sorted(pts.items())


def idle_gaps(times: Sequence[float], min_gap_s: float = 5.0) -> list[tuple[float, float]]:
    """Intervals between consecutive step times longer than max(min_gap_s, 5 x median interval)."""
    if len(times) < 3:
        return []
    deltas = [b - a for a, b in zip(times, times[1:], strict=False)]
    limit = max(min_gap_s, 5 * statistics.median(deltas))
    return [(a, b) for a, b in zip(times, times[1:], strict=False) if b - a > limit]


@dataclass
class WorldSizeRow:
    world_size: int
    steps: int
    step_s: float | None
    compute_share: float | None
    allreduce_share: float | None
    tokens_per_s: float | None


def per_world_size(run: Run) -> list[WorldSizeRow]:
    """Median figures of rank-0 step records grouped by world size."""
    groups: dict[int, list[Record]] = defaultdict(list)
    for recs in step_series(run).values():
        for r in recs:
            if r.get("rank") == 0 and isinstance(r.get("world_size"), int):
                groups[r["world_size"]].append(r)
    rows = []
    for ws in sorted(groups):
        g = groups[ws]

        def med(key: str, g=g) -> float | None:
            vals = [v for r in g if (v := _num(r.get(key))) is not None]
            return statistics.median(vals) if vals else None

        c, a, s = med("compute_s"), med("allreduce_s"), med("step_time_s")
        tot = (c or 0) + (a or 0)
        rows.append(WorldSizeRow(ws, len(g), s, c / tot if c is not None and tot else None,
                                 a / tot if a is not None and tot else None, med("tokens_per_s")))
    return rows


# ---------------------------------------------------------------- plots


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.rcParams.update({"figure.dpi": 100, "font.size": 10, "axes.grid": True, "grid.alpha": 0.3,
                         "axes.spines.top": False, "axes.spines.right": False})
    return plt


def _worker_colors(workers: Iterable[straggler.WorkerKey]) -> dict[straggler.WorkerKey, Any]:
    """A distinct colour per (host, local_rank), stable across plots."""
    plt = _plt()
    cmap = plt.get_cmap("tab10")
    return {w: cmap(i % 10) for i, w in enumerate(sorted(set(workers)))}


@dataclass(frozen=True)
class TimeAxis:
    """Maps unix time to the x axis: seconds since t0 for runs under 3 minutes, else minutes."""

    t0: float
    scale: float
    label: str

    @classmethod
    def for_span(cls, t0: float, t1: float) -> TimeAxis:
        if t1 - t0 < 180:
            return cls(t0, 1.0, "seconds since start")
        return cls(t0, 60.0, "minutes since start")

    def __call__(self, t: float) -> float:
        return (t - self.t0) / self.scale


def label_levels(xs: Sequence[float], widths: Sequence[float], levels: int = 3) -> list[int]:
    """A text row (0 = top) for each marker label starting at ``xs`` and ``widths`` wide (both in data
    units): the first row where the label does not run into the previous label of that row, else the
    row whose previous label ends first. Returns one int per x, in the order given.
    """
    ends: list[float | None] = [None] * levels
    out = [0] * len(xs)
    for i in sorted(range(len(xs)), key=lambda k: xs[k]):
        x = xs[i]
        free = [lv for lv in range(levels) if ends[lv] is None or x >= ends[lv]]
        lv = free[0] if free else min(range(levels), key=lambda k: ends[k])
        out[i] = lv
        ends[lv] = x + widths[i]
    return out


# width of one character of the marker labels, as a share of the axes' width (8.5 pt on an 11 in figure)
_CHAR_SHARE = 0.008


def _marker_labels(ax, marks: list[tuple[float, str, str, float]], span: float, y_top: float = 0.98,
                   row: float = 0.085, first_row: int = 0, levels: int = 3) -> None:
    """Vertical markers with labels staggered over rows so that neighbours do not overlap.

    ``marks``: (x, text, colour, line width); ``span``: the x range shown, in data units; labels use
    rows ``first_row`` .. ``first_row + levels - 1`` below ``y_top`` (axes fraction, ``row`` apart).
    """
    span = max(span, 1e-9)
    rows = label_levels([m[0] for m in marks], [(len(m[1]) + 2) * _CHAR_SHARE * span for m in marks], levels)
    for (x, text, colour, lw), lv in zip(marks, rows, strict=True):
        ax.axvline(x, color=colour, lw=lw, ls="-" if colour == "crimson" else "--", alpha=0.85)
        ax.text(x, y_top - (first_row + lv) * row, f" {text}", color=colour,
                transform=ax.get_xaxis_transform(), va="top", ha="left", fontsize=8.5,
                fontweight="bold" if colour == "crimson" else "normal",
                bbox={"facecolor": "white", "edgecolor": "none", "alpha": 0.7, "pad": 0.5})


def _mark_faults_steps(ax, run: Run, fl: list[Fault], rs: list[Restart], span: float) -> None:
    faults_at = [(s, f"{f.mode} {f.node}", "crimson", 1.5)
                 for f in fl if (s := step_at(run, f.time)) is not None]
    _marker_labels(ax, faults_at, span, levels=2)
    restarts = [(r.step, f"N={r.world_size}", "darkorange", 1.2) for r in rs if not r.initial]
    _marker_labels(ax, restarts, span, first_row=2, levels=2)


def plot_loss(run: Run, fl: list[Fault], rs: list[Restart], out: Path) -> None:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(11, 3.8))
    tr = loss_per_step(run)
    ax.plot([s for s, _ in tr], [v for _, v in tr], color="tab:blue", lw=1.2, label="train loss")
    va = val_points(run)
    if va:
        ax.plot([s for s, _ in va], [v for _, v in va], "o-", color="tab:green", ms=5, label="val loss")
    _mark_faults_steps(ax, run, fl, rs, span=max([s for s, _ in tr] + [1]))
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title("Loss per step (red: fault injected, orange: group restarted)", loc="left")
    # above the axes, right: never over the fault/restart labels at the top of the plot
    ax.legend(loc="lower right", bbox_to_anchor=(1.0, 1.0), ncols=2, frameon=False)
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)


def _break_gaps(pts: list[tuple[int, float]], factor: float = 5.0) -> tuple[list[float], list[float]]:
    """x and y lists of (step, value) points with a NaN where the steps jump by more than ``factor``
    times the usual spacing (a rank that was away), so that a plotted line does not bridge the gap."""
    if len(pts) < 3:
        return [float(s) for s, _ in pts], [v for _, v in pts]
    usual = statistics.median(b[0] - a[0] for a, b in zip(pts, pts[1:], strict=False))
    xs: list[float] = [float(pts[0][0])]
    ys: list[float] = [pts[0][1]]
    for (s0, _), (s1, v1) in zip(pts, pts[1:], strict=False):
        if s1 - s0 > factor * max(usual, 1):
            xs.append(math.nan)
            ys.append(math.nan)
        xs.append(float(s1))
        ys.append(v1)
    return xs, ys


def plot_step_time(run: Run, findings: list[straggler.StragglerFinding], margin: float, out: Path) -> None:
    plt = _plt()
    series = step_series(run)
    colors = _worker_colors(series)
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(11, 6), sharex=True, height_ratios=[3, 2])
    step_t: dict[int, float] = {}
    for (host, lr), recs in sorted(series.items()):
        pts = [(r["step"], c) for r in recs if (c := _num(r.get("compute_s"))) is not None]
        label = host + (f"/local{lr}" if lr else "")
        xs, ys = _break_gaps(pts)
        ax1.plot(xs, ys, lw=1, color=colors[(host, lr)], label=f"{label} compute")
        for r in recs:
            if (st := _num(r.get("step_time_s"))) is not None:
                step_t[r["step"]] = max(step_t.get(r["step"], 0.0), st)
    if step_t:
        ks = sorted(step_t)
        ax1.plot(ks, [step_t[k] for k in ks], color="black", lw=1.6, label="step time (all wait for slowest)")
    ax1.set_ylabel("seconds")
    ax1.set_ylim(0, max([*step_t.values(), 0.001]) * 1.3)  # headroom for the legend
    ax1.set_title("Step time and compute time per rank", loc="left")
    ax1.legend(loc="upper left", fontsize=8, ncols=4)
    tail = straggler.tail_by_step(run.metrics)
    tail = [t for t in tail if t.workers >= 2]
    ax2.plot([t.step for t in tail], [t.ratio for t in tail], color="tab:purple", lw=1.2,
             label="slowest rank's compute / median")
    ax2.axhline(1 + margin, color="gray", ls=":", label=f"straggler threshold {1 + margin:.2f}x")
    for f in findings:
        if f.kind == "slow_compute":
            col = colors.get((f.host, f.local_rank), "red")
            ax2.axvspan(f.from_step, f.to_step, color=col, alpha=0.2)
            ax2.text((f.from_step + f.to_step) / 2, 0.95, f.host, transform=ax2.get_xaxis_transform(),
                     ha="center", va="top", fontsize=9, fontweight="bold", color=col)
    ratios = [1.0, 1 + margin] + [t.ratio for t in tail]
    ax2.set_ylim(min(ratios) * 0.97, max(ratios) * 1.15)
    ax2.set_ylabel("max / median")
    ax2.set_xlabel("step")
    ax2.set_title("Straggler tail (shaded: flagged straggler windows)", loc="left")
    ax2.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)


def plot_world_size(run: Run, fl: list[Fault], rs: list[Restart], tx: TimeAxis, out: Path) -> None:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(11, 3.2))
    tl = world_size_timeline(run)
    if tl:
        gaps = idle_gaps([t for t, _ in tl])
        # one line per stretch of training: the line stops where the steps stop
        starts = [tl[0][0]] + [b for _, b in gaps]
        for i, t_start in enumerate(starts):
            t_end = gaps[i][0] if i < len(gaps) else tl[-1][0]
            seg = [(t, w) for t, w in tl if t_start <= t <= t_end]
            ax.step([tx(t) for t, _ in seg], [w for _, w in seg], where="post", color="tab:blue", lw=2)
        mids = [(tx(a) + tx(b)) / 2 for a, b in gaps]
        gap_label_w = 14 * _CHAR_SHARE * max(tx(tl[-1][0]) - tx(tl[0][0]), 1e-9)
        rows = label_levels([m - gap_label_w / 2 for m in mids], [gap_label_w] * len(mids), levels=2)
        for (a, b), mid, lv in zip(gaps, mids, rows, strict=True):
            ax.axvspan(tx(a), tx(b), color="gray", alpha=0.25)
            ax.text(mid, 0.45 - 0.2 * lv, f"no training\nfor {b - a:.0f} s", fontsize=8.5,
                    transform=ax.get_xaxis_transform(), ha="center", va="center", color="dimgray")
    t_lo, t_hi = (tl[0][0], tl[-1][0]) if tl else (tx.t0, tx.t0)
    for e in run.events:
        t = _num(e.get("time"))
        if e.get("kind") in ("launch", "resume", "rejoin") and t is not None and t_lo <= t <= t_hi:
            ax.axvline(tx(t), color="dimgray", lw=1, ls=":")
            ax.text(tx(t), 0.98, f" {e['kind']}", color="dimgray", va="top", fontsize=9,
                    transform=ax.get_xaxis_transform())
    _marker_labels(ax, [(tx(f.time), f"{f.mode} {f.node}", "crimson", 1.5) for f in fl if f.time is not None],
                   span=tx(t_hi) - tx(t_lo))
    for r in rs:
        if not r.initial:
            ax.axvline(tx(r.time), color="darkorange", lw=1.2, ls="--")
    top = max([w for _, w in tl] + [1])
    # room above the highest world size for three rows of fault labels
    ax.set_ylim(0, top + 1.4)
    ax.set_yticks(range(0, top + 1))
    ax.set_xlabel(tx.label)
    ax.set_ylabel("world size")
    ax.set_title("World size over time (red: fault, orange: restart, gray: no training)", loc="left")
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)


def plot_cpu(run: Run, tx: TimeAxis, out: Path) -> tuple[bool, bool]:
    """Returns (has clock readings, has temperature readings)."""
    plt = _plt()
    series = step_series(run)
    colors = _worker_colors(series)
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.4))
    have = []
    for ax, key, title, unit in ((axes[0], "cpu_mhz", "CPU clock per node", "MHz"),
                                 (axes[1], "temp_c", "CPU temperature per node", "deg C")):
        any_val, silent = False, []
        for (host, lr), recs in sorted(series.items()):
            if lr:
                continue  # one line per node
            pts = [(tx(r["time"]), v) for r in recs
                   if (v := _num(r.get(key))) is not None and _num(r.get("time")) is not None]
            if pts:
                any_val = True
                ax.plot([p[0] for p in pts], [p[1] for p in pts], lw=1.2, color=colors[(host, lr)],
                        label=host)
            else:
                silent.append(host)
        if any_val:
            ax.legend(fontsize=8, loc="best")
            if silent:
                ax.text(0.99, 0.02, "no sensor: " + ", ".join(silent), transform=ax.transAxes, ha="right",
                        va="bottom", fontsize=8, color="dimgray")
        else:
            ax.text(0.5, 0.5, "no sensor", transform=ax.transAxes, ha="center", va="center", fontsize=16,
                    color="gray")
            ax.set_yticks([])
        ax.set_title(title, loc="left")
        ax.set_xlabel(tx.label)
        ax.set_ylabel(unit)
        have.append(any_val)
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)
    return have[0], have[1]


def plot_share(run: Run, rs: list[Restart], out: Path) -> None:
    plt = _plt()
    per_step: dict[int, list[tuple[float, float]]] = defaultdict(list)
    for recs in step_series(run).values():
        for r in recs:
            c, a = _num(r.get("compute_s")), _num(r.get("allreduce_s"))
            if c is not None and a is not None:
                per_step[r["step"]].append((c, a))
    steps = sorted(per_step)
    comp = [statistics.median(c for c, _ in per_step[s]) for s in steps]
    ar = [statistics.median(a for _, a in per_step[s]) for s in steps]
    fig, ax = plt.subplots(figsize=(11, 3.2))
    ax.stackplot(steps, comp, ar, labels=["compute (median over ranks)", "all-reduce incl. waiting"],
                 colors=["tab:blue", "tab:orange"], alpha=0.8)
    for r in rs:
        if not r.initial:
            ax.axvline(r.step, color="darkorange", lw=1.2, ls="--")
    ax.set_xlabel("step")
    ax.set_ylabel("seconds per step")
    ax.set_ylim(0, max([c + a for c, a in zip(comp, ar, strict=True)] + [0.001]) * 1.3)
    ax.set_title("Where a step's time goes: compute vs all-reduce", loc="left")
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)


# ---------------------------------------------------------------- page


TEMPLATE_DIR = Path(__file__).resolve().parent / "templates"


def _template() -> jinja2.Template:
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(TEMPLATE_DIR), autoescape=True,
                             undefined=jinja2.StrictUndefined, trim_blocks=True, lstrip_blocks=True)
    return env.get_template("report.html.j2")


def _fmt_s(v: float | None, digits: int = 1) -> str:
    return "—" if v is None else f"{v:.{digits}f} s"


def _fmt_clock(t: float | None, t0: float) -> str:
    if t is None:
        return "—"
    d = t - t0
    return f"{'-' if d < 0 else ''}{int(abs(d)) // 60}:{int(abs(d)) % 60:02d}"


def _fmt_wall(s: float | None) -> str:
    if s is None:
        return "—"
    s = int(round(s))
    return f"{s // 3600}h {s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m {s % 60:02d}s"


def _fmt_params(n: float | None) -> str:
    if not n:
        return "—"
    return f"{n / 1e6:.2f} M params" if n >= 1e6 else f"{n / 1e3:.1f} k params"


def _fmt_loss(v: Any) -> str:
    x = _num(v)
    return "—" if x is None else f"{x:.3f}"


def key_figures(run: Run, rs: list[Restart], fl: list[Fault], findings: list[straggler.StragglerFinding],
                t0: float, t1: float) -> list[tuple[str, str]]:
    """The figures shown as cards: summary.json values, else derived from the metrics."""
    s = run.summary
    steps = [r["step"] for r in run.by_event("step") if isinstance(r.get("step"), int)]
    ends = run.by_event("end")
    vals = val_points(run)
    hosts = s.get("hosts") or sorted({str(r["host"]) for r in run.metrics if r.get("host")})
    if isinstance(hosts, dict):
        hosts = sorted(hosts)
    tr = loss_per_step(run)
    end = ends[-1] if ends else {}
    # summary.json holds null for a run that ended without its final evaluation: show the last seen
    final_train = _first_set(s.get("final_train_loss"), end.get("final_train_loss"),
                             tr[-1][1] if tr else None)
    final_val = _first_set(s.get("final_val_loss"), end.get("final_val_loss"), vals[-1][1] if vals else None)
    start = next(iter(run.by_event("start")), {})
    tok = [w.tokens_per_s for w in per_world_size(run) if w.tokens_per_s is not None]
    params = _num(start.get("params"))
    if "steps_completed" in s:
        done = ("steps completed", str(s["steps_completed"]))
    else:
        done = ("last step", str(max(steps)) if steps else "—")
    figures = [
        done,
        ("final train loss", _fmt_loss(final_train)),
        ("final val loss", _fmt_loss(final_val)),
        ("wall time", _fmt_wall(_num(s.get("wall_s")) or (t1 - t0 if steps else None))),
        ("nodes", f"{len(hosts)}: {', '.join(map(str, hosts))}" if hosts else "—"),
        ("world sizes", " → ".join(str(w) for w in _ws_sequence(run)) or "—"),
        ("restarts", str(s.get("restarts", sum(1 for r in rs if not r.initial)))),
        ("faults injected", str(len(fl))),
        ("batch policy", str(s.get("batch_policy") or start.get("batch_policy") or "—")),
        ("model", _fmt_params(params)),
        ("tokens/s (max N)", f"{tok[-1]:,.0f}" if tok else "—"),
        ("stragglers", ", ".join(sorted({f.host for f in findings})) or "none"),
    ]
    return figures


def _ws_sequence(run: Run) -> list[int]:
    seq: list[int] = []
    for _, w in world_size_timeline(run):
        if not seq or seq[-1] != w:
            seq.append(w)
    return seq


def build_report(run_dir: str | Path, margin: float = straggler.DEFAULT_MARGIN,
                 window: int = straggler.DEFAULT_WINDOW,
                 clock_drop: float = straggler.DEFAULT_CLOCK_DROP,
                 metrics_dir: str | Path | None = None) -> tuple[Path, bool]:
    """Write ``report.html`` and ``plots/*.png`` into ``run_dir`` (metrics: see :func:`load_run`).

    Returns (path of report.html, whether the run had step metrics). Raises ReportError on a
    missing or unreadable run folder, ValueError on bad straggler parameters.
    """
    run = load_run(run_dir, metrics_dir)
    findings = straggler.detect_stragglers(run.metrics, margin, window, clock_drop)
    steps = run.by_event("step")
    times = [t for r in run.metrics if (t := _num(r.get("time"))) is not None]
    ev_times = [t for e in run.events if (t := _num(e.get("time"))) is not None]
    t0 = min(times) if times else (min(ev_times) if ev_times else time.time())
    t1 = max(times) if times else t0
    rs, fl = restarts(run), faults(run)
    plots_dir = run.path / "plots"
    plots: dict[str, str] = {}
    cpu_has = (False, False)
    if steps:
        plots_dir.mkdir(exist_ok=True)
        for name in ("loss", "step_time", "world_size", "cpu", "share"):
            plots[name] = f"plots/{name}.png"
        plot_loss(run, fl, rs, plots_dir / "loss.png")
        plot_step_time(run, findings, margin, plots_dir / "step_time.png")
        tx = TimeAxis.for_span(t0, t1)
        plot_world_size(run, fl, rs, tx, plots_dir / "world_size.png")
        cpu_has = plot_cpu(run, tx, plots_dir / "cpu.png")
        plot_share(run, rs, plots_dir / "share.png")

    recoveries = []
    for f in fl:
        ws = "—"
        if f.world_size_before is not None or f.world_size_after is not None:
            ws = f"{f.world_size_before if f.world_size_before is not None else '?'} → " \
                 f"{f.world_size_after if f.world_size_after is not None else '?'}"
        recoveries.append({
            "mode": f.mode, "node": f.node, "rank": "—" if f.rank is None else f.rank,
            "injected": _fmt_clock(f.time, t0), "step": step_at(run, f.time) if f.time else "—",
            "detected": _fmt_s(f.detected_s), "recovered": _fmt_s(f.recovered_s),
            "steps_lost": "—" if f.steps_lost is None else f.steps_lost, "ws": ws, "outcome": f.outcome,
        })
    status, status_class = "finished", "ok"
    if not steps:
        status, status_class = "no metrics", "bad"
    elif run.by_event("failure") and not run.by_event("end"):
        status, status_class = "failed", "bad"
    elif not run.by_event("end"):
        status, status_class = "incomplete (no end record)", "warn"
    elif fl:
        status, status_class = f"finished, {len(fl)} fault(s) survived", "ok"
    if findings:
        status_class = "warn" if status_class == "ok" else status_class
    known = {"time", "kind", "mode", "node"}
    events = [{"t": _fmt_clock(_num(e.get("time")), t0),
               "clock": time.strftime("%H:%M:%S", time.localtime(_num(e.get("time")) or 0))
               if _num(e.get("time")) is not None else "—", "kind": e.get("kind") or "",
               "mode": e.get("mode") or "", "node": e.get("node") or "",
               "rest": ", ".join(f"{k}={v}" for k, v in e.items() if k not in known and v is not None)}
              for e in run.events]
    per_ws = [{"world_size": w.world_size, "steps": w.steps, "step": _fmt_s(w.step_s, 3),
               "compute": "—" if w.compute_share is None else f"{w.compute_share:.0%}",
               "allreduce": "—" if w.allreduce_share is None else f"{w.allreduce_share:.0%}",
               "tokens": "—" if w.tokens_per_s is None else f"{w.tokens_per_s:,.0f}"}
              for w in per_world_size(run)]
    start_txt = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t0))
    page = _template().render(
        run_id=run.run_id, status=status, status_class=status_class,
        subtitle=f"started {start_txt} · {len(run.metrics_files)} metrics file(s) · folder {run.path}",
        notes=run.notes, no_metrics=not steps, path=str(run.path), metrics_files=run.metrics_files,
        n_records=len(run.metrics), key_figures=key_figures(run, rs, fl, findings, t0, t1), plots=plots,
        recoveries=recoveries,
        restarts=[f"{_fmt_clock(r.time, t0)} N={r.world_size} from step {r.step}"
                  + (" (launch)" if r.initial else "") for r in rs],
        findings=[{"kind": f.kind.replace("_", " "), "host": f.host, "rank": f.rank,
                   "steps": f"{f.from_step}–{f.to_step}", "ratio": f"{f.ratio:.2f} ({f.worst_ratio:.2f})",
                   "text": straggler.format_finding(f)} for f in findings],
        margin_pct=f"{margin:.0%}", window=window, clock_pct=f"{clock_drop:.0%}",
        per_ws=per_ws, cpu_has=cpu_has, events=events, made=time.strftime("%Y-%m-%d %H:%M:%S"),
    )
    out = run.path / "report.html"
    tmp = out.with_suffix(".html.tmp")
    tmp.write_text(page, encoding="utf-8")
    tmp.replace(out)
    return out, bool(steps)


def main(argv: Sequence[str] | None = None) -> int:
    """CLI. Exit 0 written, 2 bad input (nothing written), 3 no step metrics (a page says so)."""
    ap = argparse.ArgumentParser(prog="python -m ddplab.report",
                                 description="Write report.html and plots/*.png for a collected run.")
    ap.add_argument("run_dir", help="the run folder, e.g. runs/<run_id> (runs/current works)")
    ap.add_argument("--margin", type=float, default=straggler.DEFAULT_MARGIN,
                    help="straggler: compute above the others' median by this fraction (default 0.2)")
    ap.add_argument("--window", type=int, default=straggler.DEFAULT_WINDOW,
                    help="straggler: for at least this many step records (default 10)")
    ap.add_argument("--clock-drop", type=float, default=straggler.DEFAULT_CLOCK_DROP,
                    help="straggler: CPU clock below this fraction of its nominal clock (default 0.8)")
    ap.add_argument("--metrics", metavar="DIR",
                    help="read <DIR>/<host>/metrics/*.jsonl instead of the run folder's "
                         "(e.g. runs/<id>/.live)")
    args = ap.parse_args(argv)
    if args.metrics and not Path(args.metrics).is_dir():
        print(f"report: --metrics {args.metrics}: no such folder", file=sys.stderr)
        return EXIT_BAD_INPUT
    try:
        out, has_metrics = build_report(args.run_dir, args.margin, args.window, args.clock_drop, args.metrics)
    except (ReportError, ValueError) as exc:
        print(f"report: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    if not has_metrics:
        print(f"report: {args.run_dir}: no step metrics in */metrics/*.jsonl; wrote a page saying so: {out}",
              file=sys.stderr)
        return EXIT_NO_METRICS
    print(out)
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())

