"""The seed's scaling table reproduced in the lab: 1 -> 2 -> 3 laptops of equal CPU quotas, and unequal
laptops beside an equal cluster of the same total CPU (issue 23 item 4; docs/lab.md "Scaling").

The benchmark is a list of configurations (``CONFIGS``), run one after the other in one invocation on
the built-in lab (``make lab-up``; provisioned, e.g. by ``make demo``):

  group     label                 quotas (CPUs)  batches
  scaling   1 node                0.6            equal
  scaling   2 nodes               0.6/0.6        equal
  scaling   3 nodes               0.6/0.6/0.6    equal
  unequal   0.6/0.6/0.3           0.6/0.6/0.3    equal
  unequal   0.6/0.6/0.3 balanced  0.6/0.6/0.3    speed  (ddp_job_batch_balance: speed, issue 23 item 2)
  unequal   0.5/0.5/0.5           0.5/0.5/0.5    equal  (the reference: the same total CPU, equal laptops)

Every configuration's links are shaped to ``--link-mbit`` (1000). The balanced row is an entry with
its own ``extra_vars`` (``ddp_job_batch_balance: speed``): the same global batch, dealt to the
laptops by their measured speed (docs/training.md, "Speed-balanced batches"). The three unequal
rows train one global batch (``keep_global``, N x ``--per-rank-batch``) with micro-batches of up
to twice the equal share (``per_rank_batch_size``), so that a fast laptop's larger share is one
pass, as it would be on a laptop that holds it.

For each configuration: its nodes get their quotas and shaped links (lab/lab.py ``apply_limits``:
applied, read back inside each node, a busy loop and a 64 MB transfer measured; recorded beside the
figures), then one run is launched with ``playbooks/train.yml`` on those nodes (``--limit``,
``--nnodes N:N``, no live report, a progress poll every ``WATCH_INTERVAL_S``) and followed to its
end and collected with ``attach.yml``. Every run trains the same number of samples (``--samples``):
``max_steps = samples / global batch``, with warmup and evaluation intervals in samples too, so that
the learning-rate schedule per sample is the same at every N (batch policy ``keep_per_rank``:
global batch = N x per-rank batch, LR scaled linearly with it, Goyal et al. 2017).

Figures, from the collected run folder (``ddplab.controller.rundir``; rank 0's records unless said):

* training time of a step: the wall time from the previous step record to its own, or the step's
  own ``step_time_s`` when an evaluation or checkpoint record lies between (those are left out);
* tokens/s: tokens of the steps after the first ``--skip`` fraction of the run over their training
  time (global batch x block size per step);
* time to val loss T (``--target``): training time from the first step to the point where the
  validation loss, linearly interpolated between evaluations, reaches T; and the samples trained
  by then;
* per rank: median step, compute and all-reduce time (``compute_s``, ``allreduce_s``: a fast rank's
  all-reduce includes its wait for the slowest), the step-time tail (90th percentile / median);
* cost model (``ddplab.bench.costmodel``): the speedup predicted from the 1-node run's compute time
  and the link goodput measured for the configuration, without and with overlap of communication;
  for unequal quotas, the ratio to the reference predicted from compute time scaling with 1/quota.

Prints two tables beside the seed's 1.0x / 1.9x / 2.7x and the issue's targets (>= 1.95x / >= 2.85x
with equal quotas; balanced batches >= 0.95 of the reference), with the load average of every run,
and writes the raw figures as JSON (``--out``) and the tables as the results file
``benchmarks/results/<name>.md`` (``ddplab.bench.results``; ``scaling`` for the full invocation, a
partial one names its own with ``--results-name scaling-<words>``). The lab's CPU quotas
and links are put back as they were at the end. Figures, not assertions: exit 0 whenever every play
ran, 2 on bad arguments or a lab that is not up, 1 when a play failed.

Usage (controller, lab up and provisioned):
  .venv/bin/python benchmarks/scaling.py [--samples 12600] [--target 2.1] [--link-mbit 1000]
      [--per-rank-batch 12] [--quota 0.6] [--preset small] [--repeat 1] [--configs "1 node,3 nodes"]
      [-e k=v ...] [--train k=v ...] [--results-name scaling]
  .venv/bin/python benchmarks/scaling.py --table runs/bench-scaling-<time>.json   # print again
  .venv/bin/python benchmarks/scaling.py --table runs/bench-scaling-<time>.json --write [--results-name N]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path[:0] = [str(HERE), str(REPO / "train"), str(REPO / "lab")]

from benchcli import HelpFormatter, add_results_dir, first_sentence  # noqa: E402  (benchmarks/benchcli.py)
from ddplab.bench import costmodel  # noqa: E402
from ddplab.bench import results as bench_results  # noqa: E402
from ddplab.config import PRESETS, build_config  # noqa: E402
from ddplab.controller.rundir import load_run  # noqa: E402
from recovery import BenchError, current_run, loadavg, play  # noqa: E402  (benchmarks/recovery.py)

#: The seed's speedups of 1 -> 2 -> 3 laptops on a gigabit switch, and the issue's targets.
SEED = {1: 1.0, 2: 1.9, 3: 2.7}
TARGET = {2: 1.95, 3: 2.85}
#: Balanced batches on 0.6/0.6/0.3 should reach this fraction of the reference's tokens/s.
BALANCED_TARGET = 0.95
#: Seconds between the progress polls of a run: the controller's Ansible shares the machine with the
#: laptops (their quotas leave it what is over), so it polls seldom.
WATCH_INTERVAL_S = 30
#: A node whose busy loop got less than this fraction of its quota did not have its share.
STARVED = 0.9
#: Unequal quotas: the largest micro-batch, in equal shares (``per_rank_batch_size`` of those runs).
UNEQUAL_MICRO_BATCH = 2
#: Events that pause training between two step records (their time is left out).
PAUSES = ("val", "checkpoint")


@dataclass(frozen=True)
class Config:
    """One configuration of the benchmark: ``cpus`` one CPU quota per node (its length is N),
    ``group`` the table it belongs to, ``reference`` the row the others of its group are compared
    with (``unequal``), ``extra_vars`` more playbook variables of its runs."""

    label: str
    group: str
    cpus: tuple[float, ...]
    batches: str = "equal"
    reference: bool = False
    extra_vars: dict[str, Any] = field(default_factory=dict)

    @property
    def nodes(self) -> int:
        return len(self.cpus)


#: The results file's title per group of configurations it holds.
TITLES = {"scaling": "1 -> 2 -> 3 laptops", "unequal": "unequal laptops"}

CONFIGS = (
    Config("1 node", "scaling", (0.6,)),
    Config("2 nodes", "scaling", (0.6, 0.6)),
    Config("3 nodes", "scaling", (0.6, 0.6, 0.6)),
    Config("0.6/0.6/0.3", "unequal", (0.6, 0.6, 0.3)),
    Config("0.6/0.6/0.3 balanced", "unequal", (0.6, 0.6, 0.3), batches="speed",
           extra_vars={"ddp_job_batch_balance": "speed"}),
    Config("0.5/0.5/0.5", "unequal", (0.5, 0.5, 0.5), reference=True),
)


# --------------------------------------------------------------------------- figures of one run


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _quantile(values: list[float], q: float) -> float | None:
    """The ``q`` quantile of ``values`` (linear between order statistics), None when empty."""
    if not values:
        return None
    xs = sorted(values)
    pos = q * (len(xs) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def training_times(records: list[dict], rank: int = 0) -> list[tuple[int, float, float]]:
    """``[(step, training time of that step in s, samples after it)]`` of one rank, by step (see the
    module docstring): the gap to the previous step record, or the step's own ``step_time_s`` for
    the first step and for a gap with an evaluation or checkpoint of that rank in it.

    Raises:
        ValueError: the rank has no step records, or they are not one per step (log_interval 1).
    """
    steps = sorted((r for r in records if r.get("event") == "step" and r.get("rank") == rank),
                   key=lambda r: r["step"])
    if not steps:
        raise ValueError(f"rank {rank} wrote no step records")
    numbers = [r["step"] for r in steps]
    if numbers != list(range(numbers[0], numbers[0] + len(numbers))):
        raise ValueError(f"rank {rank}'s step records are not one per step (log_interval 1): {numbers[:5]}")
    pauses = sorted(r["time"] for r in records if r.get("event") in PAUSES and r.get("rank") == rank)
    out, prev = [], None
    for rec in steps:
        gap = rec["step_time_s"]
        if prev is not None and not any(prev["time"] < t < rec["time"] for t in pauses):
            gap = rec["time"] - prev["time"]
        out.append((rec["step"], gap, rec["samples_seen"]))
        prev = rec
    return out


def tokens_per_s(times: list[tuple[int, float, float]], block_size: int, skip: float) -> float:
    """Tokens per second of training time over the steps after the first ``skip`` fraction."""
    window = times[int(len(times) * skip):]
    if len(window) < 1:
        raise ValueError("no steps left after the skipped fraction")
    samples = window[-1][2] - (times[len(times) - len(window) - 1][2] if len(window) < len(times) else 0)
    return samples * block_size / sum(t for _, t, _ in window)


def time_to_loss(times: list[tuple[int, float, float]], evals: list[tuple[int, float]],
                 target: float) -> tuple[float, float] | None:
    """``(training time s, samples)`` at which the validation loss reaches ``target``, the loss
    linearly interpolated between evaluations ``[(step, val_loss)]`` (and the time and samples
    linearly within the step); None when no evaluation reached it."""
    cumulative, samples = {0: 0.0}, {0: 0.0}
    total = 0.0
    for step, t, seen in times:
        total += t
        cumulative[step], samples[step] = total, seen
    prev = (0, math.inf)
    for step, loss in sorted(evals):
        if loss <= target and step in cumulative:
            s0, l0 = prev
            frac = 1.0 if not math.isfinite(l0) or l0 == loss else (l0 - target) / (l0 - loss)
            at = s0 + frac * (step - s0)
            lo, hi = math.floor(at), math.ceil(at)
            w = at - lo
            lo_t, lo_s = cumulative.get(lo, 0.0), samples.get(lo, 0.0)
            return lo_t + w * (cumulative[hi] - lo_t), lo_s + w * (samples[hi] - lo_s)
        prev = (step, loss)
    return None


def host_figures(records: list[dict], skip: float) -> dict[str, dict[str, float | None]]:
    """Per host (its rank-``rank`` worker): median step_time_s, compute_s and allreduce_s over its
    steps after the first ``skip`` fraction, and the 90th percentile of step_time_s."""
    out = {}
    for host in sorted({r["host"] for r in records if r.get("event") == "step"}):
        steps = sorted((r for r in records if r.get("event") == "step" and r.get("host") == host),
                       key=lambda r: r["step"])
        steps = steps[int(len(steps) * skip):]
        col = {k: [r[k] for r in steps if r.get(k) is not None]
               for k in ("step_time_s", "compute_s", "allreduce_s")}
        out[host] = {
            "rank": steps[-1].get("rank") if steps else None,
            "step_s": _median(col["step_time_s"]),
            "step_p90_s": _quantile(col["step_time_s"], 0.9),
            "compute_s": _median(col["compute_s"]),
            "allreduce_s": _median(col["allreduce_s"]),
        }
    return out


def run_figures(records: list[dict], block_size: int, target: float, skip: float) -> dict[str, Any]:
    """The figures of one run's records (see the module docstring)."""
    times = training_times(records)
    evals = [(r["step"], r["val_loss"]) for r in records if r.get("event") == "val" and r.get("rank") == 0]
    start = next((r for r in records if r.get("event") == "start" and r.get("rank") == 0), {})
    reached = time_to_loss(times, evals, target)
    hosts = host_figures(records, skip)
    r0 = next((v for v in hosts.values() if v["rank"] == 0), {})
    share = None
    if r0.get("step_s") and r0.get("allreduce_s") is not None:
        share = r0["allreduce_s"] / r0["step_s"]
    return {
        "tokens_per_s": tokens_per_s(times, block_size, skip),
        "time_to_target_s": None if reached is None else reached[0],
        "samples_to_target": None if reached is None else reached[1],
        "final_val_loss": sorted(evals)[-1][1] if evals else None,
        "steps": times[-1][0],
        "training_s": sum(t for _, t, _ in times),
        "params": start.get("params"),
        "threads": start.get("threads"),
        "global_batch_size": start.get("global_batch_size"),
        "hosts": hosts,
        "compute_s": r0.get("compute_s"),
        "step_s": r0.get("step_s"),
        "allreduce_share": share,
        "tail": (r0["step_p90_s"] / r0["step_s"]) if r0.get("step_s") else None,
    }


# --------------------------------------------------------------------------- tables


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b == 0 else a / b


def _x(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}x"


def _num(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def median_figure(runs: list[dict], key: str) -> float | None:
    """The median of ``key`` over the repeats ``runs`` of a configuration (None when none has it)."""
    return _median([r["figures"][key] for r in runs if r.get("figures", {}).get(key) is not None])


def model_speedups(compute_1: float | None, grad_bytes: float | None, link: dict, nodes: int
                   ) -> tuple[float | None, float | None]:
    """The cost model's speedup at ``nodes`` (no overlap, overlap) from the 1-node compute time and
    the link goodput measured for the configuration (``link``: rate_mbit, payload_mbit_s)."""
    if not compute_1 or not grad_bytes or not link.get("payload_mbit_s") or not link.get("rate_mbit"):
        return None, None
    gbps = link["rate_mbit"] / 1000
    eff = min(1.0, link["payload_mbit_s"] / link["rate_mbit"])
    out = []
    for overlap in (False, True):
        pred = costmodel.predict(grad_bytes, [nodes], gbps, eff, compute_1, overlap=overlap)[0]
        out.append(pred.speedup)
    return out[0], out[1]


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.0f}"


def _row_text(rows: list[list[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True)))
            for r in rows]


def tables(results: dict) -> str:
    """The benchmark's two tables (text) from its results (``main``'s JSON)."""
    settings = results["settings"]
    by_label: dict[str, list[dict]] = {}
    for run in results["runs"]:
        by_label.setdefault(run["config"]["label"], []).append(run)
    configs = [runs[0]["config"] for runs in by_label.values()]
    target = settings["target"]
    lines = [
        f"lab scaling: preset {settings['preset']}, {settings['per_rank_batch']} samples per rank and step, "
        f"{settings['samples']:,} samples per run, links tbf {settings['link_mbit']} Mbit/s, "
        f"val target {target:g}, tokens/s after the first {settings['skip']:.0%} of each run",
    ]
    scaling = [c for c in configs if c["group"] == "scaling"]
    if scaling:
        one = next((c for c in scaling if len(c["cpus"]) == 1), None)
        base_tok = median_figure(by_label[one["label"]], "tokens_per_s") if one else None
        base_ttl = median_figure(by_label[one["label"]], "time_to_target_s") if one else None
        compute_1 = median_figure(by_label[one["label"]], "compute_s") if one else None
        rows = [["N", "quotas", "tok/s", "speedup", "seed", "target", "model", "model/ovl",
                 f"t({target:g}) s", "speedup", "samples", "step ms", "p90/med", "all-reduce", "load"]]
        for c in scaling:
            runs = by_label[c["label"]]
            n = len(c["cpus"])
            tok, ttl = median_figure(runs, "tokens_per_s"), median_figure(runs, "time_to_target_s")
            link = runs[-1].get("limits", {}).get("link", {})
            params = median_figure(runs, "params")
            model, model_ovl = model_speedups(compute_1, 4 * params if params else None, link, n)
            step = median_figure(runs, "step_s")
            rows.append([
                str(n), "/".join(f"{q:g}" for q in c["cpus"]), _num(tok, ",.0f"), _x(_ratio(tok, base_tok)),
                f"{SEED.get(n, float('nan')):.1f}x", f">= {TARGET[n]:.2f}x" if n in TARGET else "",
                _x(model), _x(model_ovl), _num(ttl, ".1f"), _x(_ratio(base_ttl, ttl)),
                _num(median_figure(runs, "samples_to_target"), ",.0f"),
                _num(None if step is None else step * 1e3, ".0f"), _num(median_figure(runs, "tail"), ".2f"),
                _num(median_figure(runs, "allreduce_share"), ".0%"),
                "; ".join(f"{r['load_start']} -> {r['load_end']}" for r in runs),
            ])
        lines += ["", "equal quotas, 1 -> 2 -> 3 nodes (speedup vs 1 node; model: the cost model from the "
                  "1-node compute and the measured link, without / with overlap)", *_row_text(rows)]
    unequal = [c for c in configs if c["group"] == "unequal"]
    if unequal:
        ref = next((c for c in unequal if c["reference"]), None)
        ref_tok = median_figure(by_label[ref["label"]], "tokens_per_s") if ref else None
        rows = [["config", "quotas", "batches", "tok/s", "vs ref", "target", "model", "compute ms per node",
                 "all-reduce+wait ms per node", "load"]]
        ref_compute = ref_ar = None
        if ref:
            ref_hosts = list(by_label[ref["label"]][-1]["figures"]["hosts"].values())
            # CPU-seconds of one step's compute: compute time x quota (the same on every node)
            ref_compute = _median([v["compute_s"] * q for v, q in zip(ref_hosts, ref["cpus"], strict=False)
                                   if v.get("compute_s")])
            ref_ar = _median([v["allreduce_s"] for v in ref_hosts if v.get("allreduce_s") is not None])
        for c in unequal:
            runs = by_label[c["label"]]
            tok = median_figure(runs, "tokens_per_s")
            hosts = runs[-1]["figures"]["hosts"]
            model = None
            if ref_compute is not None and ref_ar is not None and c["batches"] == "equal":
                # compute time scales with 1/quota; every step waits for the slowest node
                slow, ref_slow = ref_compute / min(c["cpus"]), ref_compute / min(ref["cpus"])
                model = (ref_slow + ref_ar) / (slow + ref_ar)
            rows.append([
                c["label"], "/".join(f"{q:g}" for q in c["cpus"]), c["batches"], _num(tok, ",.0f"),
                "ref" if c["reference"] else _num(_ratio(tok, ref_tok), ".2f"),
                "" if c["reference"] or c["batches"] == "equal" else f">= {BALANCED_TARGET:.2f}",
                "" if c["reference"] else _num(model, ".2f"),
                "/".join(_ms(v["compute_s"]) for v in hosts.values()),
                "/".join(_ms(v["allreduce_s"]) for v in hosts.values()),
                "; ".join(f"{r['load_start']} -> {r['load_end']}" for r in runs),
            ])
        lines += ["", "unequal quotas: tokens/s beside an equal cluster of the same total CPU (ref; model: "
                  "compute time x 1/quota, every step waits for the slowest)", *_row_text(rows)]
    lines += ["", "in force per run (read inside the nodes before it): quota / busy-loop CPU, link payload "
              "Mbit/s"]
    for run in results["runs"]:
        lim = run.get("limits", {})
        nodes = "  ".join(f"{n} {_num(v['quota'], 'g')}/{_num(v['busy_cpu'], '.2f')}"
                          for n, v in lim.get("nodes", {}).items())
        link = lim.get("link", {})
        short = starved(lim.get("nodes", {}))
        lines.append(f"  {run['config']['label']:<12} run {run.get('run_id', '-')}: {nodes}; link "
                     f"{_num(link.get('payload_mbit_s'), '.0f')} of {link.get('rate_mbit', '-')} Mbit/s; "
                     f"threads {run.get('figures', {}).get('threads', '-')}"
                     + (f"; BELOW QUOTA: {', '.join(short)}" if short else ""))
    if any(starved(run.get("limits", {}).get("nodes", {})) for run in results["runs"]):
        lines.append(f"BELOW QUOTA: a node got less than {STARVED:.0%} of its quota in the busy loop: the "
                     "machine was busier than the quotas allow, so those figures depend on the load")
    return "\n".join(lines)


def starved(nodes: dict[str, dict]) -> list[str]:
    """The nodes whose busy loop got less than ``STARVED`` of their quota."""
    return [n for n, v in nodes.items()
            if v.get("quota") and v.get("busy_cpu") is not None and v["busy_cpu"] < STARVED * v["quota"]]


def write_results(results: dict, text: str, out: Path, results_dir: Path | None = None,
                  name: str = "scaling") -> list[Path]:
    """Write the raw figures (``out``, JSON: ``--table`` reads it) and the results file
    (:func:`write_page`)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1) + "\n")
    return [out, write_page(results, text, out, results_dir, name)]


def write_page(results: dict, text: str, out: Path, results_dir: Path | None = None,
               name: str = "scaling") -> Path:
    """Write the results file ``benchmarks/results/<name>.md`` of the raw figures ``out`` (the
    project's writer, ``ddplab.bench.results``: the tables, the invocation's command, the date,
    commit and machine it recorded as ``made``, the load average before and after), titled by the
    groups it holds."""
    nodes = sorted({n for run in results["runs"] for n in run.get("limits", {}).get("nodes", {})})
    lab = f"lab laptops {', '.join(nodes)} (podman containers)" if nodes else None
    groups = {run["config"]["group"] for run in results["runs"]} or {"scaling", "unequal"}
    title = ", ".join(TITLES[g] for g in ("scaling", "unequal") if g in groups)
    notes = [f"raw figures: {out}", "each run's own load average is in its row; the lab's CPU quotas and "
             "links as read back and measured before each run are listed under the tables"]
    made = bench_results.recorded_provenance(results)
    if made is None:
        notes.append("these raw figures did not record when, at which commit and on which machine they were "
                     "measured: the date, commit and machine above are those of this page's writing")
    md = bench_results.write(
        name, bench_results.code_block(text), title=f"Scaling on the lab: {title}",
        load_before=results["load_start"], load_after=results["load_end"], command=results["command"],
        notes=notes, out_dir=results_dir, extra_machine=lab, made=made,
    )
    return md


# --------------------------------------------------------------------------- runs on the lab


def lab_module():
    """lab/lab.py (the lab's podman plumbing), imported by name from lab/."""
    import lab

    return lab


def apply_config(lab, names: list[str], cpus: tuple[float, ...], link_mbit: int) -> dict:
    """Give ``names`` the quotas ``cpus`` and links of ``link_mbit``: what is in force, as read and
    measured inside the nodes by lab/lab.py (busy loop with all nodes spinning; first node to the
    second over the link)."""
    applied = lab.apply_limits(names, cpus, link_mbit, {n: lab.container_address(n) for n in names})
    link: dict[str, Any] = {"rate_mbit": link_mbit}
    if applied.links:
        first = applied.links[0]
        link.update(payload_mbit_s=first.payload_mbit_s, wire_bytes=first.wire_bytes,
                    payload_bytes=first.payload_bytes)
    nodes = {n: {"quota": v.cpus, "threads": v.threads, "busy_cpu": applied.cpu.get(n),
                 "link_mbit": v.link_mbit} for n, v in applied.limits.items()}
    return {"nodes": nodes, "link": link}


def results_name(text: str) -> str:
    """``--results-name``: a page of this benchmark, ``scaling`` or ``scaling-<words>``
    (``ddplab.bench.results.NAME``: lower case, digits, ``-``, ``_``; at most 100 characters)."""
    if not (bench_results.NAME.fullmatch(text) and len(text) <= 100
            and (text == "scaling" or text.startswith("scaling-"))):
        raise argparse.ArgumentTypeError(
            f"{text!r}: scaling or scaling-<words> (lower-case letters, digits, '-', '_'; no folder or .md; "
            "e.g. scaling-large-batch)")
    return text


def page_name(given: str | None, settings: dict) -> str:
    """The results page of an invocation: ``--results-name``, else the one its raw figures recorded,
    else ``scaling`` for the full invocation.

    Raises:
        ValueError: a partial invocation (``--configs``) with no name, which would replace the full
            invocation's page.
    """
    name = given or settings.get("results_name")
    if name:
        return name
    if settings.get("configs"):
        raise ValueError("--configs runs part of the benchmark: name its page with --results-name "
                         "scaling-<words> so that the full invocation's scaling.md stays")
    return "scaling"


def train_setting(text: str) -> tuple[str, Any]:
    """``KEY=VALUE`` of ``--train``: the value parsed as JSON, else kept as a string."""
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise argparse.ArgumentTypeError(f"{text!r}: give KEY=VALUE, e.g. bucket_cap_mb=1")
    try:
        return key.strip(), json.loads(value)
    except json.JSONDecodeError:
        return key.strip(), value


def train_vars(a: argparse.Namespace, config: Config) -> list[str]:
    """The playbook variables of one run of ``config`` (same samples, warmup and evaluation
    spacing in samples at every N)."""
    global_batch = a.per_rank_batch * config.nodes
    steps = max(2, round(a.samples / global_batch))
    overrides = {
        "per_rank_batch_size": a.per_rank_batch, "batch_policy": "keep_per_rank",
        "reference_batch_size": a.reference_batch, "log_interval": 1,
        "warmup_steps": min(steps - 1, max(1, round(a.warmup_samples / global_batch))),
        "eval_interval": max(1, round(a.eval_samples / global_batch)), "ckpt_interval": steps,
        "sample_chars": 0, "seed": a.seed,
    }
    if config.group == "unequal":
        # the same global batch in every row, dealt equally or by speed; a micro-batch holds up to
        # twice the equal share, so that a fast laptop's larger share is one forward/backward pass
        # (a second, small pass would cost it more than its samples)
        overrides.update(batch_policy="keep_global", global_batch_size=global_batch,
                         per_rank_batch_size=UNEQUAL_MICRO_BATCH * a.per_rank_batch)
    overrides.update(dict(a.train))
    variables = {
        "ddp_job_preset": a.preset, "ddp_job_max_steps": steps, "ddp_job_nnodes_min": config.nodes,
        "ddp_job_nnodes_max": config.nodes, "ddp_job_live_report": False, "ddp_job_watch": False,
        "ddp_job_watch_interval_s": WATCH_INTERVAL_S,
        "ddp_job_train_overrides": overrides, **config.extra_vars,
    }
    return [*a.extra, json.dumps(variables)]


def one_run(a: argparse.Namespace, lab, config: Config, names: list[str]) -> dict:
    """Apply ``config``'s limits, train one run on its nodes, collect it; its entry."""
    nodes = names[: config.nodes]
    limits = apply_config(lab, nodes, config.cpus, a.link_mbit)
    limit = ",".join([*nodes, "controller"])
    entry = {"config": asdict(config), "limits": limits, "load_start": loadavg()}
    t0 = time.monotonic()
    play(a.inventory, "playbooks/train.yml", train_vars(a, config), f"{config.label}: launch", limit=limit)
    run_id = current_run(a.runs_dir)
    play(a.inventory, "attach.yml", [*a.extra, f"run_id={run_id}", f"collect_run_id={run_id}",
                                     f"ddp_job_watch_interval_s={WATCH_INTERVAL_S}"],
         f"{config.label}: to the end", limit=limit)
    entry.update(run_id=run_id, wall_s=round(time.monotonic() - t0), load_end=loadavg())
    entry["figures"] = figures_of(a.runs_dir / run_id, a.target, a.skip)
    f = entry["figures"]
    print(f"{config.label}: run {run_id}, {f['tokens_per_s']:,.0f} tok/s, time to {a.target:g} "
          f"{_num(f['time_to_target_s'], '.1f')} s, load {entry['load_start']} -> {entry['load_end']}",
          flush=True)
    return entry


def figures_of(run_dir: Path, target: float, skip: float) -> dict:
    """:func:`run_figures` of a collected run folder (block size from its run.json)."""
    run = load_run(run_dir)
    config = next(iter(run.configs.values()), {})
    block = build_config({k: v for k, v in config.items() if k in ("preset", "block_size")}).block_size
    return run_figures(run.records, block, target, skip)


def with_quota(configs: list[Config], quota: float) -> list[Config]:
    """``configs`` with every node of the ``scaling`` group at CPU quota ``quota`` (``--quota``)."""
    return [replace(c, cpus=(quota,) * c.nodes) if c.group == "scaling" else c for c in configs]


def pick(labels: str | None) -> list[Config]:
    """``CONFIGS`` named in the comma list ``labels`` (all when None), in CONFIGS order.

    Raises:
        ValueError: a label no configuration has.
    """
    if not labels:
        return list(CONFIGS)
    wanted = [x.strip() for x in labels.split(",") if x.strip()]
    known = {c.label: c for c in CONFIGS}
    unknown = [w for w in wanted if w not in known]
    if unknown:
        raise ValueError(f"--configs: no configuration {', '.join(map(repr, unknown))}; the configurations: "
                         + ", ".join(known))
    return [c for c in CONFIGS if c.label in wanted]


def _parser() -> argparse.ArgumentParser:
    listing = "; ".join(f"{c.label} ({c.group})" for c in CONFIGS)
    p = argparse.ArgumentParser(description=first_sentence(__doc__), formatter_class=HelpFormatter,
                                epilog=f"configurations: {listing}")
    p.add_argument("-i", "--inventory", default="inventory/lab", help="the lab's inventory")
    p.add_argument("--configs", help="comma list of configuration labels (default: all)")
    p.add_argument("--repeat", type=int, default=1, help="runs per configuration, alternating (median shown)")
    p.add_argument("--samples", type=int, default=12600, help="samples every run trains (350 steps x 36)")
    p.add_argument("--target", type=float, default=2.1, help="validation loss of the time-to-loss column")
    p.add_argument("--link-mbit", type=int, default=1000, help="every node's link is shaped to this rate")
    p.add_argument("--preset", default="small", choices=tuple(PRESETS), help="the model (ddp_job_preset)")
    p.add_argument("--per-rank-batch", type=int, default=12, help="samples per rank and step")
    p.add_argument("--quota", type=float, default=0.6,
                   help="the CPU quota of every node of the 1 -> 2 -> 3 rows (0 < Q <= 1)")
    p.add_argument("--reference-batch", type=int, default=36,
                   help="global batch of the base LR (reference_batch_size: LR x global / this)")
    p.add_argument("--warmup-samples", type=int, default=1080, help="LR warmup, in samples (30 steps x 36)")
    p.add_argument("--eval-samples", type=int, default=600, help="samples between evaluations")
    p.add_argument("--skip", type=float, default=0.2, help="fraction of each run left out of tokens/s")
    p.add_argument("--seed", type=int, default=1337, help="seed of every run (ddp_job_seed)")
    p.add_argument("--runs-dir", type=Path, default=REPO / "runs", help="the controller's runs folder")
    p.add_argument("--out", type=Path, help="raw figures (JSON); default runs/bench-scaling-<time>.json")
    p.add_argument("-e", "--extra", action="append", default=[], help="extra var for every playbook")
    p.add_argument("--train", action="append", default=[], type=train_setting, metavar="KEY=VALUE",
                   help="a training setting of every run (ddp_job_train_overrides; the value as JSON, "
                        "else a string), e.g. --train bucket_cap_mb=1")
    p.add_argument("--table", type=Path, help="print the tables of an earlier run's JSON, figures read again")
    p.add_argument("--write", action="store_true",
                   help="with --table: write its results page too (the command shown is the earlier one's)")
    add_results_dir(p)
    p.add_argument("--results-name", type=results_name, metavar="NAME",
                   help="the results file is <results-dir>/NAME.md, NAME scaling or scaling-<words> (default "
                        "scaling, the full invocation's page; a partial one, --configs, must name its own; "
                        "--table --write: the name its raw figures recorded)")
    return p


def main(argv: list[str] | None = None) -> int:
    p = _parser()
    a = p.parse_args(argv)
    if a.results_dir is not None and a.results_dir.exists() and not a.results_dir.is_dir():
        p.error(f"--results-dir {a.results_dir} is a file: give a folder (it is made if missing)")
    if a.write and a.table is None:
        p.error("--write writes the page of an earlier invocation: give its raw figures with --table")
    if a.table is not None:
        try:
            results = json.loads(a.table.read_text())
            for run in results["runs"]:
                folder = a.runs_dir / run.get("run_id", "")
                if run.get("run_id") and folder.is_dir():
                    settings = results["settings"]
                    run["figures"] = figures_of(folder, settings["target"], settings["skip"])
            text = tables(results)
            bench_results.recorded_provenance(results)
            name = page_name(a.results_name, results["settings"]) if a.write else None
        except bench_results.RAW_FIGURES_ERRORS as exc:
            problem = bench_results.raw_figures_problem(a.table, exc, "runs/bench-scaling-<time>.json")
            print(f"scaling: {problem}", file=sys.stderr)
            return 2
        print(text)
        if a.write:
            print(f"wrote {write_page(results, text, a.table, a.results_dir, name)}")
        return 0
    try:
        configs = pick(a.configs)
    except ValueError as exc:
        p.error(str(exc))
    if a.repeat < 1 or a.samples < 1 or not 0 <= a.skip < 1 or a.per_rank_batch < 1 or not 0 < a.quota <= 1:
        p.error("need --repeat >= 1, --samples >= 1, 0 <= --skip < 1, --per-rank-batch >= 1, "
                "0 < --quota <= 1")
    configs = with_quota(configs, a.quota)
    try:
        a.results_name = page_name(a.results_name, vars(a))
    except ValueError as exc:
        p.error(str(exc))
    lab = lab_module()
    names = lab.lab_containers()
    need = max(c.nodes for c in configs)
    if len(names) < need or not (REPO / a.inventory / "hosts.yml").is_file():
        print(f"scaling: the lab has {len(names)} laptops and needs {need}: `make lab-up` (and `make demo` "
              "once to provision them)", file=sys.stderr)
        return 2
    try:
        before = lab.read_limits(names)
    except lab.LabError as exc:
        print(f"scaling: {exc}; fix: `make lab-down lab-up`, then `make demo` once to provision the laptops",
              file=sys.stderr)
        return 2
    skip = ("table", "write", "out", "runs_dir", "results_dir")
    results = {"settings": {k: v for k, v in vars(a).items() if k not in skip},
               "command": bench_results.command_line(), "made": bench_results.provenance(),
               "load_start": loadavg(), "runs": []}
    results["settings"]["link_mbit"] = a.link_mbit
    out = a.out or a.runs_dir / f"bench-scaling-{time.strftime('%Y%m%d-%H%M%S')}.json"
    code = 0
    try:
        for _ in range(a.repeat):
            for config in configs:
                results["runs"].append(one_run(a, lab, config, names))
    except (BenchError, lab.LabError) as exc:
        print(f"scaling: {exc}", file=sys.stderr)
        code = 1
    finally:
        restore = tuple(before[n].cpus for n in names)
        rates = {v.link_mbit for v in before.values()}
        link = int(rates.pop()) if len(rates) == 1 and None not in rates else 0
        try:
            lab.apply_limits(names, restore, link, {n: lab.container_address(n) for n in names})
        except lab.LabError as exc:
            print(f"scaling: putting the lab's limits back: {exc}", file=sys.stderr)
            code = 1
    results["load_end"] = loadavg()
    if results["runs"]:
        text = tables(results)
        print(text)
        for path in write_results(results, text, out, a.results_dir, a.results_name):
            print(f"wrote {path}")
    return code


if __name__ == "__main__":
    sys.exit(main())
