"""Tables, JSON results and report of a cluster bench:
``python -m ddplab.controller.bench_report runs/bench-<id>``.

bench.yml (roles/bench) fills the bench's folder on the controller::

    bench.json                 settings, shaping, nodes (CPUs, kernel boot id, load average)
    raw/<round>.jsonl          records of ddplab.bench.links (kind "links") and
                               ddplab.bench.allreduce (kind "allreduce"), as rank 0 wrote them
    rounds/<round>/<host>/...  the scaling runs of ddplab.train, collected like any run

This module reads them and writes ``links.json``, ``allreduce.json``, ``scaling.json``,
``tables.txt`` (the three tables, also printed) and ``report.html`` with ``plots/*.png``; and the
tables to the benchmarks' results file ``benchmarks/results/bench.md`` (:mod:`ddplab.bench.results`;
``--results-dir`` elsewhere), with the nodes' CPUs and load average at the bench's start.

* **links** -- the bandwidth (bytes/s, row -> column) and RTT (ms) matrices, slow links flagged.
* **all-reduce** -- per size D and world size N: median time, bus bandwidth
  (``busbw = D/t * 2(N-1)/N``, nccl-tests), the ring model ``2(N-1)/N * D/B + 2(N-1) * alpha``
  (:mod:`ddplab.bench.costmodel`) at the *measured* link: ``B`` the slowest directed link between the
  round's hosts, ``alpha`` half their median RTT; and measured/model. Without a links record the
  model uses the nominal rate of bench.json (``link_gbps`` x ``link_efficiency``).
* **scaling** -- per world size: the steady-state step (steps after the first ``skip_fraction``
  of the run; per step the slowest rank's step time, the median rank's compute and all-reduce),
  tokens/s, speedup = tokens/s(N) / tokens/s(1), efficiency = speedup / N; beside it the cost
  model at the measured link with the compute time measured at N=1 (``keep_per_rank``: speedup
  ``N*C/(C + t_ar)``), the same model with the compute time measured at that N (what is left
  when CPU contention is taken as given), and the seed's figures for real laptops.

Exit status: 0 written; 2 bad input (no such folder, unreadable bench.json), nothing written;
3 the folder holds no result at all: a page saying so is written.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ddplab.bench import costmodel, results
from ddplab.bench.allreduce import MB
from ddplab.bench.links import format_matrices
from ddplab.controller.report import html, plots
from ddplab.controller.report.data import step_series
from ddplab.controller.rundir import RunFolder, load_run
from ddplab.records import num, read_jsonl

EXIT_OK, EXIT_BAD_INPUT, EXIT_EMPTY = 0, 2, 3
#: Speedups the project seed reports for real laptops on a gigabit switch (README of the seed).
SEED_SPEEDUP = {1: 1.0, 2: 1.9, 3: 2.7}
#: Steps in the first part of a scaling run are left out (start-up, first-iteration overheads).
SKIP_FRACTION = 0.2
Record = dict[str, Any]


class BenchError(Exception):
    """Bad input: the bench folder cannot be read."""


# ---------------------------------------------------------------- input


@dataclass
class Bench:
    """Everything read from ``runs/bench-<id>/``."""

    path: Path
    bench_id: str
    settings: dict[str, Any]
    links: Record | None
    allreduce: list[Record]
    train_runs: list[RunFolder]
    notes: list[str] = field(default_factory=list)


def load_bench(path: str | Path) -> Bench:
    """Read a bench folder. Raises BenchError when it does not exist or bench.json is not a JSON object."""
    root = Path(path)
    if not root.is_dir():
        raise BenchError(f"{root}: no such bench folder (expected runs/bench-<id>/ made by bench.yml)")
    settings: dict[str, Any] = {}
    sfile = root / "bench.json"
    if sfile.exists():
        try:
            settings = json.loads(sfile.read_text(encoding="utf-8"))
        except json.JSONDecodeError as exc:
            raise BenchError(f"{sfile}: not valid JSON ({exc})") from None
        if not isinstance(settings, dict):
            raise BenchError(f"{sfile}: expected a JSON object")
    records: list[Record] = []
    for f in sorted((root / "raw").glob("*.jsonl")):
        records += read_jsonl(f)[0]
    links = [r for r in records if r.get("kind") == "links"]
    allreduce = [r for r in records if r.get("kind") == "allreduce" and num(r.get("median_s"))
                 and isinstance(r.get("world_size"), int) and num(r.get("bytes")) is not None]
    allreduce.sort(key=lambda r: (r["world_size"], r["bytes"]))
    runs = []
    for d in sorted(p for p in (root / "rounds").glob("*") if p.is_dir() and not p.is_symlink()):
        run = load_run(d)
        if run.by_event("step"):
            runs.append(run)
    bench_id = str(settings.get("bench_id") or root.resolve().name.removeprefix("bench-"))
    return Bench(root, bench_id, settings, links[-1] if links else None, allreduce, runs)


# ---------------------------------------------------------------- links


@dataclass(frozen=True)
class Link:
    """The link a ring over ``hosts`` runs at: goodput (bytes/s), per-message latency (s), source."""

    bytes_per_s: float
    latency_s: float
    source: str


def link_for(bench: Bench, hosts: Sequence[str]) -> Link:
    """The link a ring over ``hosts`` runs at, from the links record: the median of the directed
    links between them, or the slowest one when it is flagged slow (below half the median: a
    100 Mb/s cable, a WiFi fallback -- a ring runs at the pace of its slowest link); latency: half
    the median RTT between them. Without a links record: the nominal link of bench.json.

    The median, not the minimum, because one pair's figure can be low by chance (the links are
    measured one pair at a time, a few transfers each); a link that is really slow is flagged.
    """
    rec = bench.links
    if rec and len(hosts) >= 2:
        idx = {h: i for i, h in enumerate(rec.get("hosts") or [])}
        ids = [idx[h] for h in hosts if h in idx]
        bw = rec.get("bandwidth_bytes_per_s") or []
        rtt = rec.get("rtt_ms") or []
        rates = [v for i in ids for j in ids if i != j and (v := num(_cell(bw, i, j))) and v > 0]
        rtts = [v for i in ids for j in ids if i < j and (v := num(_cell(rtt, i, j))) is not None]
        if len(ids) == len(hosts) and rates:
            lat = statistics.median(rtts) / 2 / 1e3 if rtts else 0.0
            flagged = [num(s.get("bytes_per_s")) for s in rec.get("slow_links") or []
                       if s.get("src") in hosts and s.get("dst") in hosts and num(s.get("bytes_per_s"))]
            if flagged:
                return Link(min(flagged), lat, "the slow link measured")
            return Link(statistics.median(rates), lat, "the median measured link")
    gbps = num(bench.settings.get("link_gbps")) or costmodel.DEFAULT_LINK_GBPS
    eff = num(bench.settings.get("link_efficiency")) or costmodel.DEFAULT_LINK_EFFICIENCY
    return Link(costmodel.link_bytes_per_s(gbps, eff), 0.0, f"nominal {gbps:g} Gb/s x {eff:g}")


def _cell(matrix: Any, i: int, j: int) -> Any:
    try:
        return matrix[i][j]
    except (IndexError, TypeError):
        return None


# ---------------------------------------------------------------- all-reduce


def allreduce_rows(bench: Bench) -> list[Record]:
    """One row per (N, size): the measured record's figures plus the model at the measured link."""
    rows = []
    for r in bench.allreduce:
        n, d, med = r["world_size"], float(r["bytes"]), float(r["median_s"])
        link = link_for(bench, r.get("hosts") or [])
        model = costmodel.ring_allreduce_time(d, n, link.bytes_per_s, link.latency_s)
        _, busbw = costmodel.bus_bandwidth(d, med, n)
        rows.append({
            "bytes": int(d), "world_size": n, "hosts": r.get("hosts") or [], "repeats": r.get("repeats"),
            "median_s": med, "min_s": num(r.get("min_s")), "busbw_bytes_per_s": busbw,
            "link_bytes_per_s": link.bytes_per_s, "latency_s": link.latency_s, "link_source": link.source,
            "model_s": model, "measured_over_model": med / model if model > 0 else None,
            "nominal_model_s": num(r.get("model_s")),
            "nominal_link": f"{r.get('link_gbps')} Gb/s x {r.get('link_efficiency')}",
        })
    return rows


def format_allreduce(rows: Sequence[Record]) -> str:
    """The all-reduce table, then measured/model of the largest size at each N."""
    if not rows:
        return "(no all-reduce records)"
    head = (f"{'size':>8}  {'N':>2}  {'median':>10}  {'min':>10}  {'busbw':>11}  {'link B':>10}  "
            f"{'model':>10}  {'measured/model':>14}")
    lines = [head, "-" * len(head)]
    for r in rows:
        ratio = r["measured_over_model"]
        lines.append(
            f"{r['bytes'] / MB:>6.0f}MB  {r['world_size']:>2}  {_ms(r['median_s']):>10}  "
            f"{_ms(r['min_s']):>10}  "
            f"{r['busbw_bytes_per_s'] / MB:>6.1f}MB/s  {r['link_bytes_per_s'] / MB:>5.0f}MB/s  "
            f"{_ms(r['model_s']):>10}  {'-' if ratio is None else f'{ratio:.2f}':>14}")
    lines.append("model: ring 2(N-1)/N * D/B + 2(N-1) * alpha; B = the median measured link between the "
                 "round's hosts (the slow one if one is flagged), alpha = RTT/2 (Patarasuk & Yuan 2009)")
    for n in sorted({r["world_size"] for r in rows}):
        big = max((r for r in rows if r["world_size"] == n), key=lambda r: r["bytes"])
        lines.append(f"largest at N={n}: {big['bytes'] / MB:.0f} MB in {_s(big['median_s'])}, model "
                     f"{_s(big['model_s'])} -> measured/model {big['measured_over_model']:.2f}")
    return "\n".join(lines)


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1e3:.1f} ms" if v < 10 else f"{v:.1f} s"


def _s(v: float | None) -> str:
    return "-" if v is None else f"{v:.3f} s" if v < 10 else f"{v:.1f} s"


# ---------------------------------------------------------------- scaling


@dataclass
class ScalingRow:
    """Steady-state figures of one scaling run and the model beside them. Times in s, rates per s."""

    world_size: int
    hosts: list[str]
    run_id: str
    steps: int
    params: float | None
    grad_bytes: float | None
    per_rank_batch_size: int | None
    step_s: float
    compute_s: float | None
    allreduce_s: float | None
    tokens_per_s: float
    speedup: float | None = None
    efficiency: float | None = None
    link_bytes_per_s: float | None = None
    model_allreduce_s: float | None = None
    model_step_s: float | None = None
    model_speedup: float | None = None
    model_efficiency: float | None = None
    model_here_speedup: float | None = None
    seed_speedup: float | None = None


def steady_state(run: RunFolder, skip_fraction: float = SKIP_FRACTION) -> ScalingRow | None:
    """Median step figures of a scaling run after its first ``skip_fraction`` of steps.

    Per step: the slowest rank's step time and the lowest tokens/s (every rank waits for the
    slowest), the median over ranks of compute and all-reduce time. None without step records.
    Raises ValueError when the run changed world size (a node dropped out: not a scaling figure).
    """
    series = step_series(run)
    by_step: dict[int, list[Record]] = {}
    for recs in series.values():
        for r in recs:
            by_step.setdefault(r["step"], []).append(r)
    if not by_step:
        return None
    sizes = {r.get("world_size") for recs in by_step.values() for r in recs}
    if len(sizes) != 1:
        raise ValueError(f"{run.path}: world size changed during the run ({sorted(map(str, sizes))})")
    ws = int(next(iter(sizes)))
    last = max(by_step)
    keep = [s for s in sorted(by_step) if s > skip_fraction * last] or sorted(by_step)

    def med(values: list[float | None]) -> float | None:
        vals = [v for v in values if v is not None]
        return statistics.median(vals) if vals else None

    step_s, comp, ar, tok = [], [], [], []
    for s in keep:
        recs = by_step[s]
        st = [v for r in recs if (v := num(r.get("step_time_s"))) is not None]
        tk = [v for r in recs if (v := num(r.get("tokens_per_s"))) is not None]
        if not st or not tk:
            continue
        step_s.append(max(st))
        tok.append(min(tk))
        comp.append(med([num(r.get("compute_s")) for r in recs]))
        ar.append(med([num(r.get("allreduce_s")) for r in recs]))
    if not step_s:
        return None
    start = next(iter(run.by_event("start")), {})
    params = num(start.get("params"))
    hosts = sorted({str(h) for (h, _lr) in series})
    prb = start.get("per_rank_batch_size")
    return ScalingRow(ws, hosts, run.run_id, len(step_s), params,
                      costmodel.grad_bytes_from_params(params) if params else None,
                      prb if isinstance(prb, int) else None,
                      statistics.median(step_s), med(comp), med(ar), statistics.median(tok))


def scaling_rows(bench: Bench) -> list[ScalingRow]:
    """The scaling table: one row per world size (the newest run of each), speedups, model, seed."""
    rows: dict[int, ScalingRow] = {}
    for run in bench.train_runs:
        try:
            row = steady_state(run)
        except ValueError as exc:
            bench.notes.append(f"scaling run left out: {exc}")
            continue
        if row is not None:
            rows[row.world_size] = row
    out = [rows[n] for n in sorted(rows)]
    base = rows.get(1)
    for r in out:
        r.seed_speedup = SEED_SPEEDUP.get(r.world_size)
        if base is not None:
            r.speedup = r.tokens_per_s / base.tokens_per_s
            r.efficiency = r.speedup / r.world_size
        c1 = base.compute_s if base is not None else None
        if r.grad_bytes is None or c1 is None or c1 <= 0:
            continue
        link = link_for(bench, r.hosts)
        r.link_bytes_per_s = link.bytes_per_s if r.world_size > 1 else None
        (p,) = costmodel.predict(r.grad_bytes, [r.world_size], link.bytes_per_s * 8 / 1e9, 1.0, c1,
                                 latency_s=link.latency_s)
        r.model_allreduce_s, r.model_step_s = p.allreduce_s, p.step_s
        r.model_speedup, r.model_efficiency = p.speedup, p.efficiency
        if r.compute_s:
            r.model_here_speedup = r.world_size * c1 / costmodel.step_time(r.compute_s, p.allreduce_s)
    return out


def format_scaling(rows: Sequence[ScalingRow]) -> str:
    """The scaling table: measured | model (compute of N=1) | model (compute of this N) | seed."""
    if not rows:
        return "(no scaling runs)"
    head = (f"{'N':>2}  {'step':>9}  {'compute':>9}  {'all-red.':>9}  {'tokens/s':>9}  {'speedup':>7}  "
            f"{'eff':>5}  |  {'model a-r':>9}  {'step':>9}  {'speedup':>7}  {'eff':>5}  |  "
            f"{'model*':>6}  |  {'seed':>5}")
    lines = [f"{'measured':^66}|{'cost model (compute of N=1)':^47}|{'':^10}|", head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r.world_size:>2}  {_ms(r.step_s):>9}  {_ms(r.compute_s):>9}  {_ms(r.allreduce_s):>9}  "
            f"{r.tokens_per_s:>9,.0f}  {_x(r.speedup):>7}  {_pct(r.efficiency):>5}  |  "
            f"{_ms(r.model_allreduce_s):>9}  {_ms(r.model_step_s):>9}  {_x(r.model_speedup):>7}  "
            f"{_pct(r.model_efficiency):>5}  |  {_x(r.model_here_speedup):>6}  |  {_x(r.seed_speedup, 1):>5}")
    r0 = rows[-1]
    lines.append(f"work: per-rank batch {r0.per_rank_batch_size}, "
                 f"{(r0.params or 0) / 1e6:.2f} M params -> D = {(r0.grad_bytes or 0) / MB:.1f} MB of fp32 "
                 "gradients all-reduced per step; steady state = steps after the first 20 %")
    lines.append("model* = the same model with the compute time measured at that N (CPU contention "
                 "taken as given); seed = real laptops on a gigabit switch")
    return "\n".join(lines)


def _x(v: float | None, digits: int = 2) -> str:
    return "-" if v is None else f"{v:.{digits}f}x"


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{v:.0%}"


# ---------------------------------------------------------------- notes


def count_cpus(node: dict[str, Any]) -> int | None:
    """CPUs of a bench.json node: ``cpus``, else the kernel's online list ``cpus_online`` ("0-3,6")."""
    if isinstance(node.get("cpus"), int) and node["cpus"] > 0:
        return node["cpus"]
    text = str(node.get("cpus_online") or "")
    try:
        n = 0
        for part in filter(None, text.split(",")):
            lo, _, hi = part.partition("-")
            n += int(hi or lo) - int(lo) + 1
    except ValueError:
        return None
    return n or None


def environment_notes(bench: Bench, rows: Sequence[ScalingRow]) -> list[str]:
    """What distorts the figures: nodes sharing one machine's cores, load, shaping."""
    notes = []
    s = bench.settings
    nodes = s.get("nodes") if isinstance(s.get("nodes"), dict) else {}
    rate = s.get("shape_rate_mbit")
    if rate:
        burst = num(s.get("shape_burst_bytes"))
        notes.append(f"Links shaped to {rate} Mbit/s: tbf on every node's egress (lab option "
                     "bench_shape_rate_mbit), removed after the bench."
                     + (f" A transfer within the tbf bucket ({burst / MB:.1f} MB) passes at the veth's own "
                        "speed, so the smallest all-reduces can beat the link." if burst else ""))
    boots = {str(v.get("boot_id")) for v in nodes.values() if isinstance(v, dict) and v.get("boot_id")}
    if len(nodes) > 1 and len(boots) == 1:
        cpus = max((count_cpus(v) or 0 for v in nodes.values() if isinstance(v, dict)), default=0)
        threads = {v.get("threads") for v in nodes.values() if isinstance(v, dict)}
        thr = next(iter(threads)) if len(threads) == 1 and None not in threads else "?"
        text = (f"{', '.join(sorted(nodes))} run on one machine (same kernel boot id) with {cpus} CPU "
                f"core(s): they share those cores (workers use {thr} thread(s) each).")
        base = next((r for r in rows if r.world_size == 1 and r.compute_s), None)
        worst = [(r.world_size, r.compute_s / base.compute_s) for r in rows
                 if base and r.compute_s and r.world_size > 1]
        if worst:
            n, ratio = max(worst, key=lambda t: t[1])
            text += (f" Compute per step at N={n} is {ratio:.2f}x the 1-node figure, so the measured "
                     "speedup there is bounded by the shared CPU, not by the network; compare "
                     "model* (the model with that compute) rather than the model.")
        notes.append(text)
    superlinear = [r for r in rows if r.efficiency is not None and r.efficiency > 1.05]
    if superlinear:
        r = superlinear[0]
        notes.append(f"Efficiency above 100 % at N={r.world_size} ({r.efficiency:.0%}): the 1-node run was "
                     "slower per rank than this one, so something other than N changed between the runs "
                     "(they run minutes apart: other load on the machine, CPU clock); these speedups are "
                     "not comparable. Run the bench again on an idle cluster.")
    loads = [(h, v["loadavg"][0], count_cpus(v) or 1) for h, v in nodes.items()
             if isinstance(v, dict) and isinstance(v.get("loadavg"), list) and v["loadavg"]]
    if loads:
        h, load, cpus = max(loads, key=lambda t: t[1] / t[2])
        if load > 0.5 * cpus:
            notes.append(f"Load average {load:.1f} on {cpus} CPU(s) ({h}) when the bench started: other "
                         "processes competed for the CPU, so compute-bound figures are noisy. "
                         "Run the bench on an idle cluster for clean numbers.")
    return notes


# ---------------------------------------------------------------- plots


def plot_allreduce(rows: Sequence[Record], out: Path) -> None:
    plt = plots.pyplot()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 3.8))
    colors = {n: c for n, c in zip(sorted({r["world_size"] for r in rows}),
                                   ["tab:blue", "tab:orange", "tab:green", "tab:red"] * 4, strict=False)}
    for n, col in colors.items():
        rs = [r for r in rows if r["world_size"] == n]
        x = [r["bytes"] / MB for r in rs]
        ax1.plot(x, [r["median_s"] for r in rs], "o-", color=col, label=f"measured N={n}")
        ax1.plot(x, [r["model_s"] for r in rs], "--", color=col, alpha=0.8, label=f"ring model N={n}")
        ax2.plot(x, [r["busbw_bytes_per_s"] / MB for r in rs], "o-", color=col, label=f"bus bandwidth N={n}")
    links = sorted({r["link_bytes_per_s"] for r in rows})
    for b in links[:1]:
        ax2.axhline(b / MB, color="gray", ls=":", label=f"measured link B {b / MB:.0f} MB/s")
    sizes = sorted({r["bytes"] / MB for r in rows})
    for ax in (ax1, ax2):
        ax.set_xscale("log")
        ax.set_xticks(sizes, [f"{v:g}" for v in sizes])
        ax.minorticks_off()
        ax.set_xlabel("all-reduce size D, MB")
        ax.legend(fontsize=8, loc="upper left" if ax is ax1 else "best")
    ax1.set_yscale("log")
    ax1.set_ylabel("seconds (median)")
    ax1.set_title("All-reduce time: measured vs ring model", loc="left")
    ax2.set_ylabel("MB/s")
    ax2.set_ylim(0, max([r["busbw_bytes_per_s"] / MB for r in rows] + [b / MB for b in links] + [1]) * 1.25)
    ax2.set_title("Bus bandwidth (what each link carried)", loc="left")
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)


def plot_scaling(rows: Sequence[ScalingRow], out: Path) -> None:
    plt = plots.pyplot()
    fig, ax = plt.subplots(figsize=(7.5, 4.2))
    ns = [r.world_size for r in rows]
    top = max(ns)
    ax.plot([1, top], [1, top], color="lightgray", lw=1.5, label="ideal (N x)")

    def line(vals, style, color, label, offset=None):
        pts = [(n, v) for n, v in zip(ns, vals, strict=True) if v is not None]
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], style, color=color, label=label, ms=7)
            for n, v in pts if offset else []:
                if n > 1:
                    ax.annotate(f"{v:.2f}x", (n, v), textcoords="offset points", xytext=offset, fontsize=9,
                                color=color, fontweight="bold", ha="left" if offset[0] > 0 else "right",
                                bbox={"boxstyle": "round,pad=0.15", "fc": "white", "ec": "none",
                                      "alpha": 0.85})

    line([r.seed_speedup for r in rows], "d-.", "tab:green", "seed: real laptops")
    line([r.model_here_speedup for r in rows], "^:", "tab:purple", "model* (compute measured at N)")
    line([r.model_speedup for r in rows], "s--", "tab:orange", "cost model (compute of N=1)", (-8, 4))
    line([r.speedup for r in rows], "o-", "tab:blue", "measured", (8, -12))
    ax.set_xticks(ns)
    ax.set_xlim(0.8, top + 0.35)
    ax.set_xlabel("nodes N")
    ax.set_ylabel("speedup (tokens/s vs 1 node)")
    ax.set_ylim(0, top * 1.1)
    ax.set_title("Scaling: same per-rank work at N nodes", loc="left")
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)


# ---------------------------------------------------------------- output


def _links_view(rec: Record | None) -> dict[str, Any] | None:
    if not rec:
        return None
    hosts = [str(h) for h in rec.get("hosts") or []]
    bw = [[None if (v := num(c)) is None else f"{v / MB:.0f} MB/s ({v * 8 / 1e9:.2f} Gb/s)" for c in row]
          for row in rec.get("bandwidth_bytes_per_s") or []]
    rtt = [[None if (v := num(c)) is None else f"{v:.3f}" for c in row] for row in rec.get("rtt_ms") or []]
    slow = {(s.get("src"), s.get("dst")) for s in rec.get("slow_links") or []}
    flags = [[(hosts[i], hosts[j]) in slow for j in range(len(hosts))] for i in range(len(hosts))]
    return {"hosts": hosts, "bw": bw, "rtt": rtt, "slow": flags,
            "slow_text": [f"{s['src']} -> {s['dst']}: {s['bytes_per_s'] * 8 / 1e9:.2f} Gb/s "
                          f"(median link {s['median_bytes_per_s'] * 8 / 1e9:.2f} Gb/s)"
                          for s in rec.get("slow_links") or []],
            "mb": num(rec.get("bytes")) and rec["bytes"] / MB}


def _write_json(path: Path, data: Any) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
    tmp.replace(path)


def build(bench_dir: str | Path) -> tuple[Path, str, bool]:
    """Write the JSON results, tables.txt and report.html of a bench folder.

    Returns (report path, the tables as text, whether any result was found). Raises BenchError on
    a missing folder or an unreadable bench.json.
    """
    bench = load_bench(bench_dir)
    ar = allreduce_rows(bench)
    sc = scaling_rows(bench)
    notes = bench.notes + environment_notes(bench, sc)
    has_any = bool(bench.links or ar or sc)
    s = bench.settings
    shaped = f", links shaped to {s['shape_rate_mbit']} Mbit/s" if s.get("shape_rate_mbit") else ""
    parts = [f"bench {bench.bench_id}: {', '.join(s.get('hosts') or [])}{shaped}"]
    parts += ["", "== links: bandwidth and RTT between every pair (gloo send/recv, one pair at a time) =="]
    parts.append(format_matrices(bench.links) if bench.links else "(no links record)")
    parts += ["", "== all-reduce: gloo all_reduce of float32, time = slowest rank, median of repeats ==",
              format_allreduce(ar)]
    parts += ["", "== scaling: python -m ddplab.train at N nodes, same per-rank work ==", format_scaling(sc)]
    if notes:
        parts += [""] + [f"note: {n}" for n in notes]
    tables = "\n".join(parts)

    root = bench.path
    if bench.links:
        _write_json(root / "links.json", bench.links)
    _write_json(root / "allreduce.json", ar)
    _write_json(root / "scaling.json", [asdict(r) for r in sc])
    (root / "tables.txt").write_text(tables + "\n", encoding="utf-8")
    plots = {}
    if ar or sc:
        (root / "plots").mkdir(exist_ok=True)
    if ar:
        plot_allreduce(ar, root / "plots" / "allreduce.png")
        plots["allreduce"] = "plots/allreduce.png"
    if sc:
        plot_scaling(sc, root / "plots" / "scaling.png")
        plots["scaling"] = "plots/scaling.png"

    largest = []
    for n in sorted({r["world_size"] for r in ar}):
        big = max((r for r in ar if r["world_size"] == n), key=lambda r: r["bytes"])
        largest.append({"n": n, "mb": f"{big['bytes'] / MB:.0f}", "measured": _s(big["median_s"]),
                        "model": _s(big["model_s"]), "ratio": f"{big['measured_over_model']:.2f}"})
    ar_view = [{"mb": f"{r['bytes'] / MB:.0f}", "n": r["world_size"], "median": _ms(r["median_s"]),
                "min": _ms(r["min_s"]), "busbw": f"{r['busbw_bytes_per_s'] / MB:.1f}",
                "link": f"{r['link_bytes_per_s'] / MB:.0f}", "model": _ms(r["model_s"]),
                "ratio": "-" if r["measured_over_model"] is None else f"{r['measured_over_model']:.2f}"}
               for r in ar]
    sc_view = [{"n": r.world_size, "hosts": ", ".join(r.hosts), "step": _ms(r.step_s),
                "compute": _ms(r.compute_s), "allreduce": _ms(r.allreduce_s),
                "tokens": f"{r.tokens_per_s:,.0f}", "speedup": _x(r.speedup), "eff": _pct(r.efficiency),
                "m_ar": _ms(r.model_allreduce_s), "m_step": _ms(r.model_step_s),
                "m_speedup": _x(r.model_speedup),
                "m_eff": _pct(r.model_efficiency), "m_here": _x(r.model_here_speedup),
                "seed": _x(r.seed_speedup, 1)} for r in sc]
    hosts = s.get("hosts") or []
    rate = s.get("shape_rate_mbit")
    cards = [("nodes", str(len(hosts)) if hosts else "—", ", ".join(hosts)),
             ("links", f"{rate} Mbit/s" if rate else "as they are", "shaped (tbf)" if rate else "")]
    if bench.links:
        slowest = link_for(bench, bench.links.get("hosts") or [])
        slow = bench.links.get("slow_links") or []
        cards.append(("link (model's B)", f"{slowest.bytes_per_s * 8 / 1e9:.2f} Gb/s",
                      f"{len(slow)} slow link(s)" if slow else "no slow link"))
    for big in largest:
        cards.append((f"all-reduce {big['mb']} MB, N={big['n']}", big["measured"],
                      f"{big['ratio']}x the model ({big['model']})"))
    for r in sc:
        if r.world_size > 1 and r.speedup is not None:
            cards.append((f"speedup N={r.world_size}", _x(r.speedup),
                          f"model {_x(r.model_speedup)}, seed {_x(r.seed_speedup, 1)}"))
    page = html.environment().get_template("bench.html.j2").render(
        bench_id=bench.bench_id, subtitle=f"started {s.get('started', '?')} · folder {root}",
        notes=notes, has_any=has_any, cards=cards, links=_links_view(bench.links), allreduce=ar_view,
        largest=largest, scaling=sc_view, plots=plots, settings=json.dumps(s.get("settings", {}), indent=1),
        link_source=ar[0]["link_source"] if ar else "", path=str(root),
        made=time.strftime("%Y-%m-%d %H:%M:%S"))
    out = root / "report.html"
    tmp = out.with_suffix(".html.tmp")
    tmp.write_text(page, encoding="utf-8")
    tmp.replace(out)
    return out, tables, has_any


def write_results(bench_dir: str | Path, tables: str, out_dir: str | Path | None = None) -> Path:
    """The bench's tables as the results file ``bench.md`` (:func:`ddplab.bench.results.write`):
    the command is bench.yml's (the ``ansible-playbook`` this runs under) or this one's; the load
    before is each node's at the bench's start (bench.json), the load after the controller's now;
    the machine line adds each node's CPUs. Raises BenchError as :func:`load_bench`,
    ResultsError/OSError as the writer."""
    bench = load_bench(bench_dir)
    s = bench.settings
    nodes = {h: v for h, v in sorted((s.get("nodes") or {}).items()) if isinstance(v, dict)}
    loads = "; ".join(f"{h} {results.load_text(v['loadavg'][:3])}" for h, v in nodes.items()
                      if isinstance(v.get("loadavg"), list) and v["loadavg"])
    cpus = ", ".join(f"{h} {count_cpus(v) or '?'} CPUs" for h, v in nodes.items())
    return results.write(
        "bench", results.code_block(tables), title="Cluster bench: links, all-reduce and scaling",
        load_before=f"{loads} (nodes, at the bench's start)" if loads else None,
        load_after=f"{results.load_text(results.loadavg())} (controller, when the tables were written)",
        command=results.ancestor_command("ansible-playbook") or results.command_line(),
        notes=[f"bench folder: {bench.path} (started {s.get('started', '?')})"], out_dir=out_dir,
        extra_machine=f"nodes: {cpus}" if cpus else None)


def main(argv: Sequence[str] | None = None) -> int:
    """CLI: print the tables and the report's path, write the results file. Exit 0 written, 2 bad
    input, 3 no results (no results file then)."""
    ap = argparse.ArgumentParser(prog="python -m ddplab.controller.bench_report",
                                 description="Tables, JSON results and report.html of a bench folder.")
    ap.add_argument("bench_dir", help="the bench's folder, runs/bench-<id>")
    ap.add_argument("--results-dir", default=None,
                    help="folder of the results file bench.md (unset: $DDPLAB_RESULTS_DIR, else the "
                    "checkout's benchmarks/results)")
    args = ap.parse_args(argv)
    try:
        out, tables, has_any = build(args.bench_dir)
    except BenchError as exc:
        print(f"bench_report: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    print(tables)
    if not has_any:
        print(f"\nreport: {out}")
        print(f"bench_report: {args.bench_dir}: no links, all-reduce or scaling result; "
              "wrote a page saying so (no results file)", file=sys.stderr)
        return EXIT_EMPTY
    try:
        written = write_results(args.bench_dir, tables, args.results_dir)
    except (results.ResultsError, OSError) as exc:
        print(f"\nreport: {out}")
        print(f"bench_report: results file not written: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    print(f"\nresults: {written}")
    print(f"report: {out}")
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
