"""Recovery figures of both engines on one cluster, side by side: how fast a node loss is survived,
how many steps and processes it costs (issue 13 item 5; docs/faults.md).

For each recovery engine (``ddp_job_fault_tolerance``: torchelastic, per_step) and each repeat:
launch a run (playbooks/train.yml, no watch, a step record every step), wait until the group trains
at full size, run the fault matrix with ``kill-node.yml`` (after a fault that takes the node out,
kill-agent or poweroff, a ``rejoin`` of the same node, measured as its own row), wait for full size
again after each, then stop the job, collect the run and take ``summary.json``'s ``faults``
(:mod:`ddplab.faults`: detected_s, recovered_s = injection -> first completed/committed step at the
new world size / participant count, steps_lost, stall_s, restarts = worker processes started).
Prints one table, a row per fault, the median of the repeats for each engine beside each other,
with the load average at the start and end of every run, and writes the raw figures as JSON.
Figures, not assertions: the exit status is 0 whenever every play ran, whatever the figures.
The table goes to ``benchmarks/results/recovery.md`` too (:mod:`ddplab.bench.results`).

Usage (controller, lab up and provisioned):
  .venv/bin/python benchmarks/recovery.py [-i inventory/lab] [--engines torchelastic,per_step]
      [--plan kill-agent@rank0,poweroff@rank0,freeze@rank0:30,partition@rank0:30] [--repeat 3]
      [--preset small] [--out runs/bench-recovery.json] [-e key=value ...]
``--plan``: comma-separated ``<mode>@<target>[:<duration s>]``, mode kill-agent | poweroff |
kill-worker | freeze | partition | throttle; target ``rank<R>`` (the node holding global rank R at
that moment) or an inventory host. Extra ``-e`` values go to every playbook.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO / "train"), str(REPO / "benchmarks")]

from benchcli import add_results_dir, first_sentence  # noqa: E402  (benchmarks/benchcli.py)
from ddplab import faults, runstate  # noqa: E402
from ddplab.bench import results  # noqa: E402
from ddplab.config import PRESETS  # noqa: E402
from ddplab.controller.rundir import load_events, load_run  # noqa: E402

BIN = Path(sys.executable).parent
ENGINES = ("torchelastic", "per_step")
MODES = ("kill-agent", "poweroff", "kill-worker", "freeze", "partition", "throttle")
LOST_AFTER = ("kill-agent", "poweroff")  # modes that take the node out: a rejoin follows
FIELDS = ("detected_s", "recovered_s", "steps_lost", "stall_s", "restarts")


class BenchError(Exception):
    """A playbook failed: the figures would be meaningless."""


class PlanError(BenchError):
    """A fault of the plan could not be injected (or the group did not come back to full size
    before the next one), typically because the run ended first: the plan does not fit the run."""


def _tool(name: str) -> str:
    path = shutil.which(name, path=str(BIN)) or shutil.which(name)
    if path is None:
        raise BenchError(f"{name} not found: run `make venv` and use .venv/bin/python")
    return path


def _env() -> dict[str, str]:
    env = dict(os.environ, ANSIBLE_CONFIG=str(REPO / "ansible.cfg"))
    env["PATH"] = f"{BIN}:{env.get('PATH', '')}"
    conf = REPO / "lab/.state/containers.conf"
    if conf.is_file():
        env.setdefault("CONTAINERS_CONF", str(conf))
    return env


def loadavg() -> str:
    """The 1/5/15-minute load averages of the controller (/proc/loadavg), e.g. ``4.1 3.9 3.5``."""
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def play(inventory: str, playbook: str, extra: list[str], label: str, limit: str | None = None) -> float:
    """Run one playbook (on the hosts of ``limit`` only, when given: ansible-playbook --limit);
    return its wall time (s). Raises BenchError naming the play on failure."""
    args = [_tool("ansible-playbook"), "-i", inventory, str(REPO / playbook)]
    if limit:
        args += ["--limit", limit]
    for e in extra:
        args += ["-e", e]
    t0 = time.monotonic()
    where = f" --limit {limit}" if limit else ""
    print(f"--- {label}: ansible-playbook {playbook}{where} {' '.join('-e ' + e for e in extra)}", flush=True)
    proc = subprocess.run(args, env=_env(), cwd=REPO, capture_output=True, text=True)
    took = time.monotonic() - t0
    if proc.returncode != 0:
        raise BenchError(f"{label} failed (exit {proc.returncode}) after {took:.0f} s:\n"
                         f"{failure_lines(proc.stdout + proc.stderr)}")
    return took


def failure_lines(output: str, most: int = 12) -> str:
    """What an ansible-playbook run that failed said of its failure: its ``fatal:``/``failed:``/
    ``ERROR!`` lines and what follows each (up to ``most`` lines), else its last 25 lines (the
    task timing recap printed last would hide the failure)."""
    lines = output.splitlines()
    marks = [i for i, line in enumerate(lines)
             if line.lstrip().startswith(("fatal:", "failed:", "ERROR!", "[ERROR]"))]
    if not marks:
        return "\n".join(lines[-25:])
    picked: list[str] = []
    for i in marks:
        picked += lines[i:i + 3]
    return "\n".join(picked[:most])


def await_full_size(inventory: str, run_id: str, nodes: int, extra: list[str], timeout_s: float) -> None:
    """Wait until every trainer trains at world size / participants ``nodes`` (roles/fault
    tasks_from await: each node's newest record a completed step at that size). BenchError after
    ``timeout_s``."""
    book = Path(os.environ.get("TMPDIR", "/tmp")) / "ddplab-bench-await.yml"
    book.write_text(
        "- name: Bench | wait for full size\n  hosts: trainers\n  gather_facts: false\n  tasks:\n"
        "    - name: Wait until every trainer trains at full size\n"
        "      ansible.builtin.include_role:\n        name: fault\n        tasks_from: await\n"
    )
    args = [
        _tool("ansible-playbook"),
        "-i",
        inventory,
        str(book),
        "-e",
        f"fault_run_id={run_id}",
        "-e",
        f"fault_await_world_size={nodes}",
        "-e",
        f"fault_await_timeout_s={int(timeout_s)}",
    ]
    for e in extra:
        args += ["-e", e]
    proc = subprocess.run(args, env=_env(), cwd=REPO, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-15:])
        raise BenchError(f"the run did not train at full size ({nodes}) within {timeout_s:.0f} s:\n{tail}")


def current_run(runs: Path) -> str:
    link = runs / "current"
    if not link.is_symlink():
        raise BenchError("runs/current does not exist after the launch: did it fail?")
    return Path(os.readlink(link)).name


def parse_plan(text: str) -> list[tuple[str, str, float | None]]:
    """``mode@target[:duration]`` items -> [(mode, target, duration_s)]; ValueError on a bad item."""
    plan = []
    for item in filter(None, text.split(",")):
        mode, _, rest = item.partition("@")
        target, _, dur = rest.partition(":")
        if mode not in MODES or not target or (dur and not dur.replace(".", "", 1).isdigit()):
            raise ValueError(
                f"--plan item {item!r}: expected <mode>@<rank R|host>[:<seconds>], mode one of "
                f"{', '.join(MODES)}"
            )
        plan.append((mode, target, float(dur) if dur else None))
    return plan


Plan = list[tuple[str, str, float | None]]


def plan_item(mode: str, target: str, duration: float | None) -> str:
    """One plan entry written back in ``--plan`` form, e.g. ``freeze@rank0:15``."""
    return f"{mode}@{target}" + (f":{duration:g}" if duration else "")


def inject_plan(
    a: argparse.Namespace, extra: list[str], run_id: str, plan: Plan, await_last: bool = True
) -> None:
    """Inject each fault of ``plan`` into the running ``run_id`` with ``kill-node.yml``; after a fault
    that takes the node out (kill-agent, poweroff) a ``rejoin`` of that node; after each, wait until
    every trainer trains at full size (``a.nodes``) again, within 300 s. ``await_last=False`` skips
    that wait after the last fault (a caller that follows the run to its end anyway, e.g. with
    attach.yml, must not fail when the run ends during it).

    Raises PlanError naming the fault (``i/n mode@target``) when its play, its rejoin or the wait
    before the next fault fails, e.g. because the run ended before the whole plan was injected."""
    for i, (mode, target, duration) in enumerate(plan, 1):
        item = f"fault {i}/{len(plan)} {plan_item(mode, target, duration)}"
        tgt = f"rank={target[4:]}" if target.startswith("rank") else f"node={target}"
        args = [*extra, f"fault={mode}", tgt, f"run_id={run_id}"]
        try:
            play(a.inventory, "kill-node.yml", args + ([f"duration={duration:g}"] if duration else []), mode)
            if mode in LOST_AFTER:
                node = faults.injections(load_events(a.runs_dir / run_id))[-1].node
                play(
                    a.inventory,
                    "kill-node.yml",
                    [*extra, "fault=rejoin", f"node={node}", f"run_id={run_id}"],
                    f"rejoin after {mode}",
                )
            if await_last or i < len(plan):
                await_full_size(a.inventory, run_id, a.nodes, extra, 300)
        except BenchError as exc:
            raise PlanError(
                f"{item} of the plan did not complete in run {run_id}; if the run ended first, the plan "
                f"does not fit it: raise ddp_job_max_steps (-e) or shorten --plan. Cause: {exc}"
            ) from exc


def run_engine(a: argparse.Namespace, engine: str, plan: list[tuple[str, str, float | None]]) -> dict:
    """One run of ``engine`` through ``plan``: {run_id, engine, load_start, load_end, faults}."""
    extra = [*a.extra, f"ddp_job_fault_tolerance={engine}"]
    overrides = json.dumps(
        {
            "ddp_job_train_overrides": {
                "log_interval": 1,
                "eval_interval": 10**6,
                "ckpt_interval": 50,
                "warmup_steps": 5,
            }
        }
    )
    load_start = loadavg()
    took = play(
        a.inventory,
        a.launch,
        [
            *extra,
            "ddp_job_watch=false",
            f"ddp_job_preset={a.preset}",
            f"ddp_job_max_steps={a.steps}",
            overrides,
        ],
        f"launch ({engine})",
    )
    run_id = current_run(a.runs_dir)
    print(f"run {run_id} ({engine}) launched in {took:.0f} s, load {load_start}", flush=True)
    try:
        await_full_size(a.inventory, run_id, a.nodes, extra, 600)
        inject_plan(a, extra, run_id, plan)
    finally:
        # the measurement window of the last fault ends here, not when stop.yml records its stop
        # after the agents have gone (their restarts while stopping are no recovery)
        with open(a.runs_dir / run_id / "events.jsonl", "a", encoding="utf-8") as fh:
            fh.write(
                json.dumps(
                    {"time": round(time.time(), 3), "kind": runstate.STOP_KIND,
                     "by": "benchmarks/recovery.py"}
                )
                + "\n"
            )
        play(a.inventory, "stop.yml", extra, "stop")
        play(a.inventory, "playbooks/collect.yml", [*extra, f"collect_run_id={run_id}"], "collect")
    out = {
        "run_id": run_id,
        "engine": engine,
        "load_start": load_start,
        "load_end": loadavg(),
        "faults": load_run(a.runs_dir / run_id).summary.get("faults", []),
    }
    print(f"run {run_id} ({engine}) done, load {out['load_end']}", flush=True)
    return out


def remeasure(run_dir: Path) -> dict:
    """A collected run's entry for :func:`table`, its faults measured again from its folder
    (:func:`ddplab.faults.measure_all`); engine and run id from the folder, no load average."""
    run = load_run(run_dir)
    measures = faults.measure_all(load_events(run_dir), run.records)
    engine = "per_step" if faults.is_per_step(run.records) else "torchelastic"
    return {
        "run_id": run.run_id,
        "engine": engine,
        "load_start": "?",
        "load_end": "?",
        "faults": [m.to_dict() for m in measures],
    }


def rows_of(run: dict) -> dict[str, dict]:
    """The run's fault entries by row label (``rejoin after <mode>`` for a rejoin)."""
    rows, prev = {}, None
    for f in run["faults"]:
        label = f"rejoin after {prev}" if f["mode"] == "rejoin" else f["mode"]
        dur = f.get("duration_s")
        rows[label + (f" {dur:g}s" if dur else "")] = f
        prev = f["mode"]
    return rows


def median(values: list) -> float | None:
    """Median of the values that are not None (None when none is)."""
    vals = [v for v in values if v is not None]
    return statistics.median(vals) if vals else None


def table(runs: list[dict], engines: list[str]) -> str:
    """The side-by-side table (text): one line per fault, per engine the median of its runs of
    detected_s, recovered_s, steps_lost, stall_s, restarts (processes started) and n; then each
    run's load averages."""
    per = {e: [rows_of(r) for r in runs if r["engine"] == e] for e in engines}
    labels: list[str] = []
    for e in engines:
        for rows in per[e]:
            labels += [k for k in rows if k not in labels]
    short = {
        "detected_s": "det",
        "recovered_s": "rec",
        "steps_lost": "lost",
        "stall_s": "stall",
        "restarts": "restarts",
        "n": "n",
    }
    head = ["fault"] + [f"{e}:{short[k]}" for e in engines for k in (*FIELDS, "n")]
    lines = [head]
    for label in labels:
        cells = [label]
        for e in engines:
            got = [rows[label] for rows in per[e] if label in rows]
            for k in FIELDS:
                v = median([g.get(k) for g in got])
                cells.append("-" if v is None else (f"{v:.1f}" if k.endswith("_s") else f"{v:g}"))
            cells.append(str(len(got)))
        lines.append(cells)
    widths = [max(len(r[i]) for r in lines) for i in range(len(head))]
    text = [
        "  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True)))
        for r in lines
    ]
    text.append("")
    text += [
        f"{r['engine']:<13} run {r['run_id']}: load average {r['load_start']} -> {r['load_end']}"
        for r in runs
    ]
    return "\n".join(text)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=first_sentence(__doc__))
    p.add_argument("-i", "--inventory", default="inventory/lab", help="the cluster (default: %(default)s)")
    p.add_argument("--engines", default=",".join(ENGINES), help="comma-separated, in table order")
    p.add_argument(
        "--plan",
        default="kill-agent@rank0,poweroff@rank0,freeze@rank0:30,partition@rank0:30",
        help=f"the faults of every run, in order: comma-separated <mode>@<target>[:<seconds>]; mode one of"
        f" {', '.join(MODES)}; target rank<R> (the node holding global rank R at that moment) or an"
        " inventory host; seconds: how long freeze, partition, throttle last (default: %(default)s)",
    )
    p.add_argument("--repeat", type=int, default=1, help="runs per engine (the table shows the median)")
    p.add_argument(
        "--steps",
        type=int,
        default=100000,
        help="max_steps of a run: more than the plan needs (the run is stopped at the end)",
    )
    p.add_argument(
        "--preset",
        default="small",
        choices=tuple(PRESETS),
        help="model and batch size of the runs (ddplab.config.PRESETS; ddp_job_preset; default: %(default)s)",
    )
    p.add_argument(
        "--launch",
        default="playbooks/train.yml",
        help="playbook that launches a run (site.yml to validate and provision first)",
    )
    p.add_argument("--nodes", type=int, default=3, help="trainers of the inventory")
    p.add_argument(
        "--runs-dir",
        type=Path,
        default=REPO / "runs",
        help="the controller's runs folder (ddp_job_runs_dir), default runs/",
    )
    p.add_argument(
        "--out", type=Path, default=None, help="raw figures (JSON); default runs/bench-recovery-<time>.json"
    )
    p.add_argument("-e", "--extra", action="append", default=[], help="extra var for every playbook")
    p.add_argument(
        "--table",
        type=Path,
        default=None,
        help="print the table of an earlier run's JSON, each run's faults measured again from its folder",
    )
    add_results_dir(p)
    a = p.parse_args(argv)
    engines = [e for e in a.engines.split(",") if e]
    if a.table is not None:
        old = json.loads(a.table.read_text())["runs"]
        again = [
            {**remeasure(a.runs_dir / r["run_id"]), "load_start": r["load_start"], "load_end": r["load_end"]}
            for r in old
        ]
        print(table(again, [e for e in engines if any(r["engine"] == e for r in again)]))
        return 0
    if not engines or any(e not in ENGINES for e in engines):
        p.error(f"--engines {a.engines!r}: a comma-separated list of {', '.join(ENGINES)}")
    try:
        plan = parse_plan(a.plan)
    except ValueError as exc:
        p.error(str(exc))
    if a.repeat < 1:
        p.error("--repeat must be >= 1")
    out = a.out or a.runs_dir / f"bench-recovery-{time.strftime('%Y%m%d-%H%M%S')}.json"
    load_before = loadavg()
    runs: list[dict] = []
    try:
        for i in range(a.repeat):  # engines interleaved, so that a change of load hits both alike
            for engine in engines:
                runs.append(run_engine(a, engine, plan))
                out.write_text(
                    json.dumps({"plan": a.plan, "preset": a.preset, "runs": runs}, indent=1) + "\n"
                )
                print(f"repeat {i + 1}/{a.repeat} {engine}: figures in {out}", flush=True)
    except BenchError as exc:
        print(f"error: {exc}", file=sys.stderr)
        if runs:
            print(table(runs, engines))
        return 2
    heading = (
        f"recovery, median of n runs per engine (preset {a.preset}; seconds; restarts = worker processes "
        f"started after the fault; '-' = did not happen, e.g. a freeze ridden out)"
    )
    text = table(runs, engines)
    print(f"\n{heading}\n{text}\n\nraw figures: {out}")
    path = results.write(
        "recovery", f"{heading}; plan `{a.plan}`, {a.nodes} nodes\n\n{results.code_block(text)}",
        title="Recovery of the engines from node faults, side by side", load_before=load_before,
        notes=[f"raw figures (JSON, on the machine that ran it): {out}"], out_dir=a.results_dir)
    print(f"results: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
