"""Training over a shaped LAN: fp32 / fp16 / bf16 / PowerSGD DDP and DiLoCo at two H, side by side.

One run per mode and link rate on the lab (or any inventory), one after the other, each launched with
``playbooks/train.yml`` (watched to its end) and collected with ``playbooks/collect.yml``; every
figure is read from the collected run folder (ddplab.controller.rundir.load_run):

  fp32, fp16, bf16, powersgd   ddp_job_fault_tolerance torchelastic, ddp_job_grad_compression
  diloco-H                     ddp_job_fault_tolerance diloco, ddp_job_sync_every H (``--sync-every``)
  noise seeds                  fp32 at seeds S+1..S+K (``--noise-seeds``) at the first link rate:
                               the seed-noise band of fault-free runs' final val loss
  gpt2                         ``--gpt2-steps`` steps of the gpt2 preset (124M parameters, the seed's
                               496 MB exchange) for the DDP modes at the first link rate (0: none;
                               at the slower rates the fp32 exchange alone takes about a minute)

Links: before each link rate of ``--links`` (Mbit/s) the lab's own limits are applied
(``lab/lab.py up --link-mbit R --cpus C``: tbf on every laptop's egress, a CPU quota per laptop; docs/lab.md);
``--no-shape`` leaves the links as they are (real laptops: shape them yourself) and the table says so.

Per run the table shows: bytes per step per node that the gloo interface sent (NIC, psutil: headers
and all) and the ring model's 2(N-1)/N x D (means over the steps after the first, every step
recorded: a DiLoCo run's mean spreads its syncs over its rounds; PowerSGD's from its start step
on), the median step time, tokens/s (global: the run's tokens over the wall time between its first
and last step), the communication share of the step (the sum of allreduce_s over the sum of
step_time_s: DDP's all-reduce with the wait for the slowest rank, DiLoCo's syncs), the final val
loss (every run trains the same tokens: steps x global batch x block), whether it lies inside the
noise band, and the 1-minute load average at the run's start and end. Figures, not assertions:
exit 0 when every play ran, 2 otherwise (with the table so far).

Usage (controller, lab up and provisioned, e.g. after ``make demo``):
  .venv/bin/python benchmarks/lowcomm.py [-i inventory/lab] [--links 1000,100] [--steps 500]
      [--sync-every 50,100] [--noise-seeds 2] [--gpt2-steps 4] [--cpus 0.6] [-e k=v ...]
  .venv/bin/python benchmarks/lowcomm.py --table runs/bench-lowcomm-<time>.json   # print again
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO / "train"), str(REPO / "benchmarks")]

from benchcli import add_results_dir, first_sentence  # noqa: E402  (benchmarks/benchcli.py)
from ddplab.bench import results  # noqa: E402
from ddplab.controller.report.html import fmt_bytes  # noqa: E402
from ddplab.controller.rundir import load_run  # noqa: E402
from recovery import BenchError, current_run, loadavg, play  # noqa: E402  (benchmarks/recovery.py)

DDP_MODES = ("fp32", "fp16", "bf16", "powersgd")
COMPRESSION = {"fp32": "none", "fp16": "fp16", "bf16": "bf16", "powersgd": "powersgd"}
POWERSGD_START = 10  # plain fp32 steps before PowerSGD compresses (small preset runs)
GPT2_POWERSGD_START = 2


def powersgd_start(preset: str) -> int:
    return GPT2_POWERSGD_START if preset == "gpt2" else POWERSGD_START


def mode_vars(mode: str, steps: int, seed: int, preset: str) -> list[str]:
    """The ``-e`` values of one run: the mode's engine and compression (``diloco-<H>``: sync every H),
    the preset, the steps, one step record per step and a single evaluation at the end (a multiple
    of every H), no periodic checkpoint (collect brings none: a gpt2 checkpoint is 1.5 GB)."""
    overrides: dict[str, Any] = {
        "log_interval": 1,
        "eval_interval": steps,
        "ckpt_interval": 10 * steps,
        "seed": seed,
        "sample_chars": 0,
    }
    extra = [f"ddp_job_preset={preset}", f"ddp_job_max_steps={steps}", "collect_checkpoints=0"]
    if preset == "gpt2":
        overrides.update(eval_iters=1, warmup_steps=1)
    if mode.startswith("diloco-"):
        extra += ["ddp_job_fault_tolerance=diloco", f"ddp_job_sync_every={int(mode.split('-', 1)[1])}"]
    else:
        extra += ["ddp_job_fault_tolerance=torchelastic", f"ddp_job_grad_compression={COMPRESSION[mode]}"]
        if mode == "powersgd":
            extra.append(f"ddp_job_powersgd_start_step={powersgd_start(preset)}")
    return [*extra, json.dumps({"ddp_job_train_overrides": overrides})]


def figures(run_dir: Path, start: int) -> dict[str, Any]:
    """The row of one collected run (see the module doc); None where a figure is missing. The
    means and medians are over the steps after ``start`` (1; PowerSGD: its start step)."""
    run = load_run(run_dir)
    steps = {
        h: sorted(
            (r for r in recs if r.get("event") == "step" and r.get("local_rank", 0) == 0),
            key=lambda r: r["step"],
        )
        for h, recs in run.per_host.items()
    }
    steps = {h: s for h, s in steps.items() if s}
    steady = {h: [r for r in s if r["step"] > start] for h, s in steps.items()}

    def mean_of(key: str) -> float | None:
        vals = [r[key] for s in steady.values() for r in s if isinstance(r.get(key), int | float)]
        return statistics.fmean(vals) if vals else None

    step_s = [r["step_time_s"] for s in steady.values() for r in s if r.get("step_time_s")]
    comm = [
        sum(r.get("allreduce_s") or 0 for r in s) / sum(r["step_time_s"] for r in s)
        for s in steady.values()
        if s and sum(r["step_time_s"] for r in s) > 0
    ]
    tokens = None
    first_host = sorted(steps)[0] if steps else None
    if first_host:
        s = steps[first_host]
        block = (run.configs.get(first_host) or {}).get("block_size") or (
            next(iter(run.results.values()), {}).get("config", {}).get("block_size")
        )
        if len(s) > 1 and block:
            span = s[-1]["time"] - s[0]["time"]
            trained = sum(r["global_batch_size"] for r in s[1:]) * block
            tokens = trained / span if span > 0 else None
    vals = [r["val_loss"] for r in run.by_event("val") if isinstance(r.get("val_loss"), int | float)]
    final_step = max((r["step"] for r in run.by_event("val")), default=None)
    final_val = [r["val_loss"] for r in run.by_event("val") if r["step"] == final_step]
    return {
        "nic_sent": mean_of("nic_sent_bytes"),
        "nic_recv": mean_of("nic_recv_bytes"),
        "model": mean_of("wire_model_bytes"),
        "step_s": statistics.median(step_s) if step_s else None,
        "tokens_per_s": tokens,
        "comm_share": statistics.fmean(comm) if comm else None,
        "val": statistics.fmean(final_val) if final_val else (vals[-1] if vals else None),
        "val_step": final_step,
        "rss_mb": max((r.get("max_rss_mb") or 0 for s in steps.values() for r in s), default=None),
        "nodes": len(steps),
    }


def one_run(a: argparse.Namespace, link: str, mode: str, preset: str, steps: int, seed: int) -> dict:
    """Launch, watch, collect one run; return its row (figures, run id, load at start and end)."""
    label = f"{link} Mbit/s {preset} {mode} seed {seed}"
    load_start = loadavg()
    play(a.inventory, "playbooks/train.yml", [*a.extra, *mode_vars(mode, steps, seed, preset)], label)
    run_id = current_run(a.runs_dir)
    play(
        a.inventory,
        "playbooks/collect.yml",
        [*a.extra, f"collect_run_id={run_id}", "collect_checkpoints=0"],
        f"collect {run_id}",
    )
    row = {
        "link_mbit": link,
        "mode": mode,
        "preset": preset,
        "steps": steps,
        "seed": seed,
        "run_id": run_id,
        "load_start": load_start,
        "load_end": loadavg(),
        **figures(a.runs_dir / run_id, powersgd_start(preset) if mode == "powersgd" else 1),
    }
    print(
        f"{label}: run {run_id}, {json.dumps({k: row[k] for k in ('nic_sent', 'model', 'step_s', 'val')})}",
        flush=True,
    )
    return row


def shape(a: argparse.Namespace, link: str) -> str:
    """Apply the lab's limits for ``link`` (Mbit/s; ``off`` removes the shaping); return how."""
    if a.no_shape:
        return "links as they are (--no-shape)"
    argv = [sys.executable, str(REPO / "lab/lab.py"), "up", "--link-mbit", link, "--cpus", a.cpus]
    proc = subprocess.run(argv, cwd=REPO, capture_output=True, text=True)
    if proc.returncode != 0:
        raise BenchError(
            f"lab/lab.py up --link-mbit {link} --cpus {a.cpus} failed: "
            f"{''.join((proc.stderr or proc.stdout).strip().splitlines()[-1:])}"
        )
    egress = "not shaped" if link == "off" else f"tbf {link} Mbit/s"
    return f"lab limits: every laptop's egress {egress}, CPU quota {a.cpus}"


def unshape(a: argparse.Namespace, notes: list[str]) -> bool:
    """Take the lab's link shaping off after the benchmark (its note added); False, with one line on
    stderr, when that failed (the lab is left as the failure left it)."""
    if a.no_shape:
        return True
    try:
        notes.append(f"after the benchmark: {shape(a, 'off')}")
    except BenchError as exc:
        print(f"error: after the benchmark: {exc}", file=sys.stderr)
        return False
    return True


def band(rows: list[dict], link: str) -> tuple[float, float] | None:
    """min..max of the final val loss of the fp32 runs (every seed) of the small preset at ``link``."""
    vals = [
        r["val"]
        for r in rows
        if r["mode"] == "fp32" and r["preset"] != "gpt2" and r["link_mbit"] == link and r["val"] is not None
    ]
    return (min(vals), max(vals)) if len(vals) > 1 else None


def cell(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def table(rows: list[dict]) -> str:
    """The side-by-side table (one line per run; the noise band per link rate under it)."""
    head = (
        f"{'link':>5} {'preset':<6} {'mode':<10} {'seed':>5} {'NIC sent/step':>13} {'model/step':>11} "
        f"{'fp32/this':>9} {'step s':>7} {'tok/s':>8} {'comm':>6} {'val':>7} {'band':>6} {'load':>11}"
    )
    out = [head, "-" * len(head)]
    for r in rows:
        fp32 = next(
            (
                x
                for x in rows
                if x["mode"] == "fp32"
                and x["preset"] == r["preset"]
                and x["link_mbit"] == r["link_mbit"]
                and x["nic_sent"]
            ),
            None,
        )
        ratio = fp32["nic_sent"] / r["nic_sent"] if fp32 and r["nic_sent"] else None
        b = band(rows, r["link_mbit"])
        if b is None or r["val"] is None or r["preset"] == "gpt2":
            inside = "-"
        elif b[0] <= r["val"] <= b[1]:
            inside = "in"
        else:
            inside = f"{r['val'] - (b[1] if r['val'] > b[1] else b[0]):+.3f}"
        load = f"{r['load_start'].split()[0]}->{r['load_end'].split()[0]}"
        out.append(
            f"{r['link_mbit']:>5} {r['preset']:<6} {r['mode']:<10} {r['seed']:>5} "
            f"{fmt_bytes(r['nic_sent'], none='-'):>13} {fmt_bytes(r['model'], none='-'):>11} "
            f"{cell(ratio, '.1f') + ('x' if ratio else ''):>9} "
            f"{cell(r['step_s'], '.3f'):>7} {cell(r['tokens_per_s'], ',.0f'):>8} "
            f"{cell(r['comm_share'], '.1%'):>6} {cell(r['val'], '.4f'):>7} {inside:>6} {load:>11}"
        )
    for link in dict.fromkeys(r["link_mbit"] for r in rows):
        b = band(rows, link)
        if b:
            seeds = sum(
                1 for r in rows if r["mode"] == "fp32" and r["preset"] != "gpt2" and r["link_mbit"] == link
            )
            out.append(f"noise band at {link} Mbit/s (fp32, {seeds} seeds): val {b[0]:.4f} .. {b[1]:.4f}")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=first_sentence(__doc__))
    p.add_argument("-i", "--inventory", default="inventory/lab", help="the cluster (default: %(default)s)")
    p.add_argument(
        "--links", default="1000,100", help="link rates, Mbit/s, one stage each (default: %(default)s)"
    )
    p.add_argument(
        "--cpus", default="0.6", help="the lab's CPU quota per laptop (lab/lab.py --cpus; %(default)s)"
    )
    p.add_argument("--no-shape", action="store_true", help="leave the links and CPUs as they are")
    p.add_argument("--steps", type=int, default=500, help="steps of a small-preset run (%(default)s)")
    p.add_argument("--sync-every", default="50,100", help="the two H of the DiLoCo rows (%(default)s)")
    p.add_argument(
        "--modes", default="", help="comma list of the modes (default: fp32,fp16,bf16,powersgd,diloco-H...)"
    )
    p.add_argument("--seed", type=int, default=1337, help="the runs' seed (%(default)s)")
    p.add_argument(
        "--noise-seeds", type=int, default=2, help="fp32 runs at seeds S+1..S+K for the band (%(default)s)"
    )
    p.add_argument("--gpt2-steps", type=int, default=4, help="steps of the gpt2 rows (0: none; %(default)s)")
    p.add_argument("--runs-dir", type=Path, default=REPO / "runs", help="the controller's runs folder")
    p.add_argument(
        "--out", type=Path, default=None, help="raw figures (JSON); default runs/bench-lowcomm-<time>.json"
    )
    p.add_argument("--table", type=Path, default=None, help="print the table of an earlier run's JSON")
    p.add_argument("--write", action="store_true", help="with --table: write the results page from it too")
    p.add_argument("-e", "--extra", action="append", default=[], help="extra var for every playbook")
    add_results_dir(p)
    a = p.parse_args(argv)
    if a.table is not None:
        try:
            raw = json.loads(a.table.read_text())
            text, made = table(raw["runs"]), results.recorded_provenance(raw)
        except results.RAW_FIGURES_ERRORS as exc:
            problem = results.raw_figures_problem(a.table, exc, "runs/bench-lowcomm-<time>.json")
            print(f"error: {problem}", file=sys.stderr)
            return 2
        print(text)
        if a.write:
            notes = [*raw.get("notes", []), f"raw figures: {a.table} (runs an earlier invocation finished)"]
            if made is None:
                notes.append("these raw figures did not record their command, date, commit and machine: "
                             "those above are of this page's writing")
            page = write_results(raw["runs"], notes, a, command=raw.get("command"), made=made)
            print(f"results: {page}")
        return 0
    hs = [h for h in a.sync_every.split(",") if h]
    modes = [m for m in a.modes.split(",") if m] or [*DDP_MODES, *(f"diloco-{h}" for h in hs)]
    bad = [m for m in modes if m not in DDP_MODES and not (m.startswith("diloco-") and m[7:].isdigit())]
    if bad or any(a.steps % int(m[7:]) for m in modes if m.startswith("diloco-")):
        p.error(
            f"--modes/--sync-every {','.join(modes)}: modes are {', '.join(DDP_MODES)} and diloco-H with H "
            f"dividing --steps {a.steps}"
        )
    out = a.out or a.runs_dir / f"bench-lowcomm-{time.strftime('%Y%m%d-%H%M%S')}.json"
    load_before = results.loadavg()
    origin = {"command": results.command_line(), "made": results.provenance()}
    rows: list[dict] = []
    notes: list[str] = []
    try:
        for i, link in enumerate(rate for rate in a.links.split(",") if rate):
            notes.append(f"{link} Mbit/s: {shape(a, link)}")
            plan = [("small", m, a.steps, a.seed) for m in modes]
            if i == 0:
                plan += [("small", "fp32", a.steps, a.seed + k) for k in range(1, a.noise_seeds + 1)]
            if a.gpt2_steps and i == 0:
                plan += [("gpt2", m, a.gpt2_steps, a.seed) for m in modes if m in DDP_MODES]
            for preset, mode, steps, seed in plan:
                rows.append(one_run(a, link, mode, preset, steps, seed))
                out.write_text(json.dumps({"runs": rows, "notes": notes, **origin}, indent=1) + "\n")
    except BenchError as exc:
        print(f"error: {exc}", file=sys.stderr)
        if rows:
            print(table(rows))
        return 2
    finally:
        unshaped = unshape(a, notes)
    print(f"\n{table(rows)}\n\nraw figures: {out}")
    print(f"results: {write_results(rows, [*notes, f'raw figures: {out}'], a, load_before, **origin)}")
    return 0 if unshaped else 2


def write_results(rows: list[dict], notes: list[str], a: argparse.Namespace, load_before: Any = None,
                  command: str | None = None, made: dict | None = None) -> Path:
    """benchmarks/results/lowcomm.md: the table of ``rows`` (the runs' steps read from the rows).
    ``load_before`` None (``--table --write``: the figures of an earlier invocation's JSON, e.g. one
    that was interrupted, its finished runs only): each row's own load column stands for it.
    ``command`` and ``made``: the invocation's command line and ``ddplab.bench.results.provenance``
    as its raw figures recorded them (None: this process's, now)."""
    steps = {p: sorted({r["steps"] for r in rows if r["preset"] == p}) for p in ("small", "gpt2")}
    heading = (
        "bytes on the wire, step time, tokens/s, communication share and final val loss per mode "
        f"(3 laptops; small preset {'/'.join(map(str, steps['small'])) or '-'} steps, "
        f"gpt2 {'/'.join(map(str, steps['gpt2'])) or '0'} steps)"
    )
    return results.write(
        "lowcomm",
        f"{heading}\n\n{results.code_block(table(rows))}",
        title="Compressed gradients and DiLoCo over shaped links, side by side",
        load_before=load_before if load_before is not None else "per run: the table's load column",
        load_after=None if load_before is not None else "per run: the table's load column",
        notes=notes,
        out_dir=a.results_dir,
        command=command,
        made=made,
    )


if __name__ == "__main__":
    raise SystemExit(main())
