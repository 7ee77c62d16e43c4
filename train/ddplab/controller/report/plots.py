"""The report's plots (matplotlib, Agg backend): PNG files drawn from :mod:`ddplab.controller.report.data`."""

from __future__ import annotations

import math
import os
import statistics
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ddplab.controller import straggler
from ddplab.controller.report.data import (
    Band,
    Fault,
    ReplicaStart,
    Restart,
    engine,
    fault_step,
    faults,
    interim_segments,
    loss_per_step,
    no_training_bands,
    restarts,
    step_series,
    time_span,
    train_estimate_points,
    val_points,
    world_size_points,
)
from ddplab.controller.rundir import RunFolder
from ddplab.engines import replica_groups
from ddplab.records import num


def pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.rcParams.update({"figure.dpi": 100, "font.size": 10, "axes.grid": True, "grid.alpha": 0.3,
                         "axes.spines.top": False, "axes.spines.right": False})
    return plt


def save(fig, out: Path) -> None:
    """Write ``fig`` as PNG to ``out`` atomically (a temporary file, then os.replace): a browser
    reloading the live report never reads a half-written plot."""
    tmp = out.with_name(f".{out.name}.tmp")
    fig.savefig(tmp, format="png")
    os.replace(tmp, out)


def _worker_colors(workers: Iterable[straggler.WorkerKey]) -> dict[straggler.WorkerKey, Any]:
    """A distinct colour per (host, local_rank), stable across plots."""
    plt = pyplot()
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


def _mark_faults_steps(ax, run: RunFolder, fl: list[Fault], rs: list[Restart], span: float) -> None:
    faults_at = [(s, f"{f.mode} {f.node}", "crimson", 1.5)
                 for f in fl if (s := fault_step(run, f)) is not None]
    _marker_labels(ax, faults_at, span, levels=2)
    # under per_step: where a restarted replica committed again (none: no marker)
    restarts = [(r.step, f"{r.host} back" if isinstance(r, ReplicaStart) else f"N={r.world_size}",
                 "darkorange", 1.2) for r in rs
                if not r.initial and (r.step or not isinstance(r, ReplicaStart))]
    _marker_labels(ax, restarts, span, first_row=2, levels=2)


def plot_loss(run: RunFolder, fl: list[Fault], rs: list[Restart], out: Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(11, 4.2))
    tr = loss_per_step(run)
    ax.plot([s for s, _ in tr], [v for _, v in tr], color="tab:blue", lw=1.2,
            marker="o" if len(tr) < 30 else None, ms=3,  # a live page's first points stay visible
            label="train loss (minibatch, mean over ranks)")
    te = train_estimate_points(run)
    if te:
        ax.plot([s for s, _ in te], [v for _, v in te], "s--", color="tab:purple", ms=4, lw=1,
                label="train loss (evaluation estimate)")
    va = val_points(run)
    if va:
        ax.plot([s for s, _ in va], [v for _, v in va], "o-", color="tab:green", ms=5,
                label="val loss (evaluation)")
    _mark_faults_steps(ax, run, fl, rs, span=max([s for s, _ in tr] + [1]))
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title("Loss per step (red: fault injected, orange: group restarted)", loc="left")
    # below the axes: never over the title or the fault/restart labels at the top of the plot
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.16), ncols=3, frameon=False)
    fig.tight_layout()
    save(fig, out)
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


def plot_step_time(run: RunFolder, findings: list[straggler.StragglerFinding], margin: float,
                   out: Path, fault_marks: Sequence[tuple[int, str]] = ()) -> None:
    """Compute per rank and the step time, the straggler tail and, when the step records carry
    ``batch_share``, each rank's share of the batch per step under it (re-plans dotted, faults
    ``fault_marks`` (step, label) in red)."""
    plt = pyplot()
    series = step_series(run)
    colors = _worker_colors(series)
    shares = {k: [(r["step"], n) for r in recs if (n := num(r.get("batch_share"))) is not None]
              for k, recs in series.items()}
    if any(shares.values()):
        fig, (ax1, ax2, ax3) = plt.subplots(3, 1, figsize=(11, 8.2), sharex=True, height_ratios=[3, 2, 2])
    else:
        fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(11, 6), sharex=True, height_ratios=[3, 2])
        ax3 = None
    step_t: dict[int, float] = {}
    for (host, lr), recs in sorted(series.items()):
        pts = [(r["step"], c) for r in recs if (c := num(r.get("compute_s"))) is not None]
        label = host + (f"/local{lr}" if lr else "")
        xs, ys = _break_gaps(pts)
        ax1.plot(xs, ys, lw=1, color=colors[(host, lr)], label=f"{label} compute")
        for r in recs:
            if (st := num(r.get("step_time_s"))) is not None:
                step_t[r["step"]] = max(step_t.get(r["step"], 0.0), st)
    if step_t:
        ks = sorted(step_t)
        ax1.plot(ks, [step_t[k] for k in ks], color="black", lw=1.6, label="step time (all wait for slowest)")
    ax1.set_ylabel("seconds")
    ax1.set_ylim(0, max([*step_t.values(), 0.001]) * 1.3)  # headroom for the legend
    ax1.set_title("Step time and compute time per rank", loc="left")
    ax1.legend(loc="upper left", fontsize=8, ncols=4)
    tail = straggler.tail_by_step(run.records)
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
    if ax3 is None:
        ax2.set_xlabel("step")
    ax2.set_title("Straggler tail (shaded: flagged straggler windows)", loc="left")
    ax2.legend(loc="upper right", fontsize=8)
    if ax3 is not None:
        plot_shares(ax3, series, shares, colors, fault_marks)
    fig.tight_layout()
    save(fig, out)
    plt.close(fig)


def plot_shares(ax, series: dict[straggler.WorkerKey, list[dict]],
                shares: dict[straggler.WorkerKey, list[tuple[int, float]]], colors: dict,
                fault_marks: Sequence[tuple[int, str]]) -> None:
    """Each rank's ``batch_share`` per step (a step line), the steps a new batch plan began
    (``batch_plan``: dotted, labelled) and the faults (red)."""
    for (host, lr), pts in sorted(shares.items()):
        xs, ys = _break_gaps(pts)
        ax.step(xs, ys, where="post", lw=1.4, color=colors[(host, lr)],
                label=host + (f"/local{lr}" if lr else ""))
    plans = sorted({(r["step"], str(r["batch_plan"])) for recs in series.values() for r in recs
                    if r.get("batch_plan") and r.get("batch_plan") != "start"})
    for step, why in plans:
        ax.axvline(step, color="gray", ls=":", lw=1)
        ax.text(step, 0.04, f" {why}", color="dimgray", fontsize=8, transform=ax.get_xaxis_transform())
    for step, label in fault_marks:
        ax.axvline(step, color="crimson", lw=1.5)
        ax.text(step, 0.96, f" {label}", color="crimson", fontsize=8.5, va="top",
                transform=ax.get_xaxis_transform())
    top = max((v for pts in shares.values() for _, v in pts), default=1)
    ax.set_ylim(0, top * 1.25)
    ax.set_ylabel("samples per step")
    ax.set_xlabel("step")
    balanced = any(isinstance(r.get("batch_shares"), list) for recs in series.values() for r in recs)
    ax.set_title("Batch share per rank (" + ("balanced by speed: batch_balance speed; dotted: a new plan"
                                             if balanced else "equal: batch_balance off") + ")", loc="left")
    ax.legend(loc="upper right", fontsize=8, ncols=4)


#: band colour per cause (data.BAND_CAUSES)
BAND_COLORS = {"fault": "crimson", "stop": "gray", "restart": "darkorange", "checkpoint save": "tab:blue",
               "eval": "tab:green", "start-up": "tab:cyan", "slow steps": "tab:olive",
               "unknown": "tab:purple"}


def _band_texts(bands: Sequence[Band]) -> list[str]:
    """The text over each band: its length and cause (a fault's mode and node on a second line)."""
    out = []
    for b in bands:
        cause = b.label.removeprefix("fault: ").replace(" + ", "\n+ ")
        out.append(f"{b.seconds:.0f} s {'fault' if b.cause == 'fault' else ''}\n{cause}".replace(" \n", "\n"))
    return out


def plot_world_size(run: RunFolder, fl: list[Fault], rs: list[Restart], tx: TimeAxis, out: Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(11, 3.6))
    tl = world_size_points(run)
    if tl:
        bands = no_training_bands(run)
        # one line per stretch of training: the line stops where the steps stop
        starts = [tl[0][0]] + [b.end for b in bands]
        for i, t_start in enumerate(starts):
            t_end = bands[i].start if i < len(bands) else tl[-1][0]
            seg = [(t, w) for t, w in tl if t_start <= t <= t_end]
            ax.step([tx(t) for t, _ in seg], [w for _, w in seg], where="post", color="tab:blue", lw=2)
        texts = _band_texts(bands)
        mids = [(tx(b.start) + tx(b.end)) / 2 for b in bands]
        span = max(tx(tl[-1][0]) - tx(tl[0][0]), 1e-9)
        widths = [(max(len(x) for x in t.split("\n")) + 1) * _CHAR_SHARE * span for t in texts]
        rows = label_levels([m - w / 2 for m, w in zip(mids, widths, strict=True)], widths, levels=3)
        for b, text, mid, lv in zip(bands, texts, mids, rows, strict=True):
            colour = BAND_COLORS.get(b.cause, "gray")
            ax.axvspan(tx(b.start), tx(b.end), color=colour, alpha=0.18, lw=0)
            ax.text(mid, 0.55 - 0.22 * lv, text, fontsize=8, transform=ax.get_xaxis_transform(), ha="center",
                    va="center", color=colour, bbox={"facecolor": "white", "edgecolor": "none", "alpha": 0.75,
                                                     "pad": 0.5})
    for g in interim_segments(run):  # a group formed and stopped on the way to a fault's recovery
        ax.plot([tx(g.start), tx(g.end)], [g.world_size, g.world_size], color="tab:blue", lw=2, ls="--",
                marker="o", ms=4)  # seconds long on a run of minutes: the markers keep it visible
        steps = f"steps {g.from_step}→{g.to_step}" if g.from_step is not None else "no step"
        ax.text(tx(g.end), g.world_size, f" N={g.world_size} ({', '.join(g.hosts)}): {steps}", fontsize=8,
                va="bottom", ha="left", color="tab:blue",
                bbox={"facecolor": "white", "edgecolor": "none", "alpha": 0.75, "pad": 0.5})
    t_lo, t_hi = (tl[0][0], tl[-1][0]) if tl else (tx.t0, tx.t0)
    for e in run.events:
        t = num(e.get("time"))
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
    per_step = replica_groups(engine(run))  # participants of each committed step, no group restart
    ax.set_ylabel("participants" if per_step else "world size")
    ax.set_title(f"{'Participants' if per_step else 'World size'} over time, engine {engine(run)} "
                 f"(red line: fault, orange: {'process started' if per_step else 'restart'}; "
                 "bands: no training, by cause)", loc="left")
    fig.tight_layout()
    save(fig, out)
    plt.close(fig)


def plot_cpu(run: RunFolder, tx: TimeAxis, out: Path) -> tuple[bool, bool]:
    """Returns (has clock readings, has temperature readings)."""
    plt = pyplot()
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
                   if (v := num(r.get(key))) is not None and num(r.get("time")) is not None]
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
    save(fig, out)
    plt.close(fig)
    return have[0], have[1]


def plot_share(run: RunFolder, rs: list[Restart], out: Path) -> None:
    plt = pyplot()
    per_step: dict[int, list[tuple[float, float]]] = defaultdict(list)
    for recs in step_series(run).values():
        for r in recs:
            c, a = num(r.get("compute_s")), num(r.get("allreduce_s"))
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
    save(fig, out)
    plt.close(fig)



def draw_all(run: RunFolder, findings: list[straggler.StragglerFinding], margin: float,
             plots_dir: Path) -> tuple[dict[str, str], tuple[bool, bool]]:
    """Draw every plot of a run with step records into ``plots_dir`` (created).

    Returns ({plot name: path relative to the run folder}, (has CPU clock readings, has
    temperature readings)); ({}, (False, False)) without step records (nothing drawn).
    """
    if not run.by_event("step"):
        return {}, (False, False)
    plots_dir.mkdir(exist_ok=True)
    t0, t1 = time_span(run)
    rs, fl = restarts(run), faults(run)
    plot_loss(run, fl, rs, plots_dir / "loss.png")
    marks = [(s, f"{f.mode} {f.node}") for f in fl if (s := fault_step(run, f)) is not None]
    plot_step_time(run, findings, margin, plots_dir / "step_time.png", marks)
    tx = TimeAxis.for_span(t0, t1)
    plot_world_size(run, fl, rs, tx, plots_dir / "world_size.png")
    cpu_has = plot_cpu(run, tx, plots_dir / "cpu.png")
    plot_share(run, rs, plots_dir / "share.png")
    names = ("loss", "step_time", "world_size", "cpu", "share")
    return {name: f"{plots_dir.name}/{name}.png" for name in names}, cpu_has
