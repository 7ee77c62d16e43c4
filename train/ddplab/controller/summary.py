"""Run summary and live progress, from the metrics JSONL records (docs/CONTRACTS.md).

Three jobs (this module is the only writer of ``summary.json``; the run folder is read by
:mod:`ddplab.rundir`):

* **summary** (controller, after collection): ``python -m ddplab.summary build runs/<run_id>``
  reads ``<host>/metrics/*.jsonl`` (+ ``<host>/result.json``, ``events.jsonl`` and an existing
  ``summary.json``), writes ``runs/<run_id>/summary.json`` atomically and prints a short human
  summary. Fields: ``run_id, hosts, steps_completed, final_train_loss, final_val_loss, wall_s,
  world_size_timeline [{time, step, world_size}], restarts, faults, batch_policy, stragglers,
  report`` and, beyond the contract, ``max_steps, first_train_loss, per_host, sample``.
* **faults** (controller, during and after a fault run): ``python -m ddplab.summary faults
  runs/<run_id> [--metrics DIR] [--json] [--last] [--no-write]`` measures every injection of
  ``events.jsonl`` with :mod:`ddplab.faults`, stores the list as ``faults`` in summary.json and
  prints a table; ``--rank-of R`` prints the host holding global rank R now.
* **progress** (each node, during training): ``python -m ddplab.summary progress --out-dir DIR
  [--unit ddp-lab-agent] [--json]`` prints one line for the node: step, loss, world size,
  tokens/s, restarts and the agent unit's state; ``--json`` adds the machine-readable fields the
  watch loop decides on (``state``: running | succeeded | failed | absent).

Definitions (all times unix seconds, from the nodes' clocks):

``steps_completed``
    the largest ``step`` of any ``end``/``step``/``val``/``checkpoint``/``failure`` record.
``final_train_loss`` / ``final_val_loss``
    of the rank-0 ``end`` record (the trainer's final evaluation); without one, the newest ``val``
    record's ``train_loss``/``val_loss``; ``None`` when there is neither.
``wall_s``
    the ``wall_s`` of the rank-0 ``end`` record (first start to end, restarts included); without
    one, newest record time minus oldest ``start`` time.
``world_size_timeline``
    from the rank-0 ``start`` and ``step`` records in time order (rank 0 exists in every group
    generation, so its records are one clean series): an entry at the first record and whenever
    ``world_size`` changes.
``restarts``
    how many times the group re-formed: rank-0 ``start`` records minus one.
``faults``
    measured by :mod:`ddplab.faults` from the ``kind: fault`` records of ``events.jsonl`` (the
    hook :func:`measure_faults`); when there are none, the list already in ``summary.json`` is kept.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from ddplab import faults, straggler
from ddplab.records import Record, as_int, events_of, num, read_metrics_dir
from ddplab.rundir import (
    SUMMARY_FILE,
    RunFolder,
    RunFolderError,
    group_restarts,
    load_run,
    read_json,
    world_size_timeline,
)

TAIL_BYTES = 256 * 1024  # progress reads at most this much of the end of each metrics file
SummaryError = RunFolderError  # bad input: the run folder does not exist


# ----------------------------------------------------------------------------- figures


def steps_completed(records: Iterable[Record]) -> int:
    """The largest completed step named by any record (0 when none)."""
    steps = [
        s
        for r in records
        if r.get("event") in ("end", "step", "val", "checkpoint", "failure")
        and (s := as_int(r.get("step"))) is not None
    ]
    return max(steps, default=0)


def final_losses(
    records: Sequence[Record], results: Iterable[Mapping[str, Any]] = ()
) -> tuple[float | None, float | None]:
    """``(final_train_loss, final_val_loss)``: rank-0 ``end`` record, else a result.json, else the
    newest ``val`` record."""
    ends = events_of(records, "end", rank=0) or events_of(records, "end")
    if ends:
        e = ends[-1]
        return num(e.get("final_train_loss")), num(e.get("final_val_loss"))
    for res in results:
        if num(res.get("final_val_loss")) is not None:
            return num(res.get("final_train_loss")), num(res.get("final_val_loss"))
    vals = events_of(records, "val")
    if vals:
        return num(vals[-1].get("train_loss")), num(vals[-1].get("val_loss"))
    return None, None


def wall_seconds(records: Sequence[Record]) -> float | None:
    """Rank-0 ``end`` ``wall_s``; else newest record time minus the oldest ``start`` time."""
    ends = events_of(records, "end", rank=0)
    if ends and num(ends[-1].get("wall_s")) is not None:
        return num(ends[-1].get("wall_s"))
    starts = [t for r in events_of(records, "start") if (t := num(r.get("time"))) is not None]
    times = [t for r in records if (t := num(r.get("time"))) is not None]
    if not starts or not times:
        return None
    return round(max(times) - min(starts), 3)


def first_train_loss(records: Sequence[Record]) -> float | None:
    """Loss of the earliest ``step`` record (by step, then time)."""
    steps = sorted(
        events_of(records, "step"), key=lambda r: (as_int(r.get("step")) or 0, num(r.get("time")) or 0)
    )
    for r in steps:
        if (v := num(r.get("loss"))) is not None:
            return v
    return None


def measure_faults(run: RunFolder) -> list[dict[str, Any]]:
    """The ``faults`` list: measured by :mod:`ddplab.faults` when events.jsonl records injections,
    else the list summary.json already holds (or [])."""
    existing = run.summary.get("faults")
    kept = list(existing) if isinstance(existing, list) else []
    if not any(e.get("kind") == "fault" for e in run.events):
        return kept
    try:
        return [m.to_dict() for m in faults.measure_all(run.events, run.records)]
    except ValueError as exc:  # a malformed fault event: keep what was there, say why
        print(f"warning: {run.path}/events.jsonl: {exc}; faults left as recorded", file=sys.stderr)
        return kept


def find_stragglers(records: Sequence[Record]) -> list[dict[str, Any]]:
    """Straggler findings of :mod:`ddplab.straggler` as dicts plus a ``text`` line each."""
    return [{**asdict(f), "text": straggler.format_finding(f)} for f in straggler.detect_stragglers(records)]


def per_host_figures(host: str, records: Sequence[Record], host_dir: Path | None) -> dict[str, Any]:
    """Figures of one node: last step, restarts, world sizes seen, throughput, files brought back."""
    steps = events_of(records, "step")
    tok = sorted(v for r in steps if (v := num(r.get("tokens_per_s"))) is not None)
    out: dict[str, Any] = {
        "records": len(records),
        "last_step": steps_completed(records),
        "restart_count": max((as_int(r.get("restart_count")) or 0 for r in records), default=0),
        "world_sizes": sorted({ws for r in steps if (ws := as_int(r.get("world_size"))) is not None}),
        "median_tokens_per_s": round(tok[len(tok) // 2], 1) if tok else None,
        "failures": [
            {"step": as_int(r.get("step")), "error": r.get("error")} for r in events_of(records, "failure")
        ],
        "finished": bool(events_of(records, "end")),
    }
    if host_dir is not None:
        ckpts = (
            sorted((host_dir / "checkpoints").glob("ckpt-*.pt"))
            if (host_dir / "checkpoints").is_dir()
            else []
        )
        out["checkpoint"] = str(ckpts[-1].relative_to(host_dir.parent)) if ckpts else None
        out["sample"] = (host_dir / "sample.txt").is_file()
        out["journal"] = (host_dir / "journal.txt").is_file()
    return out


def build_summary(run_dir: str | Path, hosts: Sequence[str] | None = None) -> dict[str, Any]:
    """The summary dict of a collected run folder (see the module docstring).

    ``hosts``: the trainers of the run (default: the host folders found). Raises RunFolderError
    (alias SummaryError) when ``run_dir`` is not a folder.
    """
    run = load_run(run_dir)
    run_dir, existing, per_host, records = run.path, run.summary, run.per_host, run.records
    hosts = sorted(hosts) if hosts else run.hosts
    results = [run.results[h] for h in hosts if h in run.results]
    train_loss, val_loss = final_losses(records, results)
    starts = events_of(records, "start")
    # a run whose workers never started: max_steps of the run's configuration
    max_steps = next(
        (m for r in [*reversed(starts), *run.configs.values()]
         if (m := as_int(r.get("max_steps"))) is not None),
        None,
    )
    sample_host = next((h for h in hosts if (run_dir / h / "sample.txt").is_file()), None)
    summary: dict[str, Any] = {
        "run_id": run.run_id,
        "hosts": list(hosts),
        "steps_completed": steps_completed(records),
        "max_steps": max_steps,
        "first_train_loss": first_train_loss(records),
        "final_train_loss": train_loss,
        "final_val_loss": val_loss,
        "wall_s": wall_seconds(records),
        "world_size_timeline": world_size_timeline(records),
        "restarts": group_restarts(records),
        "faults": measure_faults(run),
        "batch_policy": next(
            (r.get("batch_policy") for r in reversed(starts) if r.get("batch_policy")), None
        ),
        "stragglers": find_stragglers(records),
        "report": "report.html" if (run_dir / "report.html").is_file() else existing.get("report"),
        "per_host": {h: per_host_figures(h, per_host.get(h, []), run_dir / h) for h in hosts},
        "sample": f"{sample_host}/sample.txt" if sample_host else None,
    }
    # keep what other tools added (e.g. fields written through update_summary)
    return {**{k: v for k, v in existing.items() if k not in summary}, **summary}


def write_summary(run_dir: str | Path, summary: Mapping[str, Any]) -> Path:
    """Write ``run_dir/summary.json`` atomically (temp file, fsync, os.replace). Returns its path."""
    path = Path(run_dir) / SUMMARY_FILE
    tmp = path.with_name(f".{SUMMARY_FILE}.{os.getpid()}.tmp")
    with open(tmp, "w", encoding="utf-8") as fh:
        fh.write(json.dumps(summary, indent=2) + "\n")
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    return path


def update_summary(run_dir: str | Path, **fields: Any) -> Path:
    """Merge ``fields`` into ``run_dir/summary.json`` (creating a minimal one with ``run_id`` when
    absent) and write it atomically; the hook other tools (ddplab.faults) write through."""
    run_dir = Path(run_dir)
    data = read_json(run_dir / SUMMARY_FILE) or {"run_id": run_dir.name}
    data.update(fields)
    return write_summary(run_dir, data)


def _fmt(v: float | None, spec: str = ".3f", none: str = "-") -> str:
    return none if v is None else format(v, spec)


def human_summary(summary: Mapping[str, Any], run_dir: str | Path | None = None) -> str:
    """A few lines for people: outcome, losses, world sizes, restarts, faults, where things are."""
    lines = []
    steps, max_steps = summary.get("steps_completed"), summary.get("max_steps")
    done = max_steps is not None and steps is not None and steps >= max_steps
    hosts = summary.get("hosts") or []
    lines.append(
        f"run {summary.get('run_id')}: {steps}/{max_steps if max_steps is not None else '?'} steps "
        f"on {len(hosts)} node(s) ({', '.join(hosts)}) - {'finished' if done else 'NOT finished'}"
    )
    wall = num(summary.get("wall_s"))
    lines.append(
        f"loss: train {_fmt(num(summary.get('first_train_loss')))} -> "
        f"{_fmt(num(summary.get('final_train_loss')))}, "
        f"val {_fmt(num(summary.get('final_val_loss')))}; wall {_fmt(wall, '.0f')} s"
    )
    tl = summary.get("world_size_timeline") or []
    if tl:
        lines.append(
            "world size: "
            + " -> ".join(f"{e['world_size']} (step {e['step']})" for e in tl)
            + f"; group restarts: {summary.get('restarts', 0)}"
        )
    for f in summary.get("faults") or []:
        lines.append(
            f"fault {f.get('mode')} {f.get('node')}: detected {_fmt(num(f.get('detected_s')), '.1f')} s, "
            f"recovered {_fmt(num(f.get('recovered_s')), '.1f')} s, steps lost {f.get('steps_lost', '-')}"
        )
    for s in (summary.get("stragglers") or [])[:3]:
        lines.append(s.get("text", str(s)))
    for h, fig in (summary.get("per_host") or {}).items():
        missing = [k for k in ("checkpoint", "sample", "journal") if not fig.get(k)]
        lines.append(
            f"  {h}: step {fig.get('last_step')}, {_fmt(fig.get('median_tokens_per_s'), '.0f')} tok/s, "
            f"restarts {fig.get('restart_count')}"
            + (f", failures {len(fig['failures'])}" if fig.get("failures") else "")
            + (
                f", missing: {', '.join(m for m in missing if m != 'sample')}"
                if [m for m in missing if m != "sample"]
                else ""
            )
        )
    if run_dir is not None:
        lines.append(
            f"folder: {run_dir}" + (f" (sample: {summary['sample']})" if summary.get("sample") else "")
        )
    return "\n".join(lines)


# ----------------------------------------------------------------------------- live progress


def unit_state(unit: str) -> dict[str, str]:
    """``systemctl show`` of a unit: LoadState, ActiveState, SubState, Result, ExecMainStatus,
    InvocationID ({} when systemctl is not available)."""
    props = (
        "LoadState,ActiveState,SubState,Result,ExecMainStatus,ExecMainCode,InvocationID,"
        "ExecMainStartTimestampMonotonic"
    )
    try:
        out = subprocess.run(
            ["systemctl", "show", unit, "-p", props], capture_output=True, text=True, timeout=20, check=False
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        return {}
    return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)


def job_state(unit: Mapping[str, str], records: Sequence[Record]) -> str:
    """``running`` | ``succeeded`` | ``failed`` | ``absent`` for one node's agent.

    The unit is started with RemainAfterExit=yes, so a finished agent stays ``active/exited`` with
    its Result. Without unit information (no systemd) the records decide: an ``end`` record ->
    succeeded, else running.
    """
    if not unit:
        return "succeeded" if events_of(records, "end") else "running"
    if unit.get("LoadState") == "not-found":
        return "absent"
    active, sub, result = unit.get("ActiveState"), unit.get("SubState"), unit.get("Result")
    if active == "failed" or (result not in (None, "", "success")):
        return "failed"
    if active == "active" and sub == "exited":
        return "succeeded" if unit.get("ExecMainStatus", "0") == "0" else "failed"
    if active in ("active", "activating", "reloading", "deactivating"):
        return "running"
    return "succeeded" if events_of(records, "end") else "absent"


def node_progress(records: Sequence[Record]) -> dict[str, Any]:
    """The newest figures of one node from its records (any order).

    Returns ``{step, max_steps, loss, val_loss, world_size, tokens_per_s, restart_count, rank,
    age_s, finished, failure}`` (None where unknown); ``age_s``: seconds since the newest record.
    """
    recs = sorted(records, key=lambda r: num(r.get("time")) or 0.0)
    steps = events_of(recs, "step")
    last = steps[-1] if steps else {}
    starts = events_of(recs, "start")
    vals = events_of(recs, "val")
    fails = events_of(recs, "failure")
    newest = recs[-1] if recs else {}
    failure = None
    if fails and num(fails[-1].get("time")) == num(newest.get("time")):
        failure = str(fails[-1].get("error"))
    tnew = num(newest.get("time"))
    return {
        "step": next(
            (
                as_int(r.get("step"))
                for r in reversed(recs)
                if r.get("event") in ("step", "val", "checkpoint", "end", "failure")
                and as_int(r.get("step")) is not None
            ),
            None,
        ),
        "max_steps": as_int(starts[-1].get("max_steps")) if starts else None,
        "loss": num(last.get("loss")),
        "val_loss": num(vals[-1].get("val_loss")) if vals else None,
        "world_size": as_int(newest.get("world_size")),
        "tokens_per_s": num(last.get("tokens_per_s")),
        "restart_count": as_int(newest.get("restart_count")),
        "rank": as_int(newest.get("rank")),
        "age_s": round(time.time() - tnew, 1) if tnew is not None else None,
        "finished": bool(events_of(recs, "end")),
        "failure": failure,
    }


def format_progress(host: str, p: Mapping[str, Any], state: str | None = None) -> str:
    """One progress line, e.g.
    ``laptop-a  step  120/1500  loss 2.314  val 2.410  ws 3  rank 0  12.3k tok/s  restarts 0  running``.
    """

    def tok(v: float | None) -> str:
        if v is None:
            return "- tok/s"
        return f"{v / 1000:.1f}k tok/s" if v >= 1000 else f"{v:.0f} tok/s"

    if p.get("step") is None:
        body = "no metrics yet (starting: rendezvous, data, model)"
    else:

        def val(key: str) -> Any:
            return "-" if p.get(key) is None else p[key]

        total = "?" if p.get("max_steps") is None else p["max_steps"]
        body = (
            f"step {p['step']:>5}/{total}  loss {_fmt(p.get('loss'))}  val {_fmt(p.get('val_loss'))}"
            f"  ws {val('world_size')}  rank {val('rank')}  {tok(p.get('tokens_per_s'))}"
            f"  restarts {val('restart_count')}"
        )
        if p.get("age_s") is not None and p["age_s"] > 30 and not p.get("finished"):
            body += f"  (last record {p['age_s']:.0f} s ago)"
        if p.get("failure"):
            body += f"  last failure: {p['failure'][:120]}"
    return f"{host:<12} {body}" + (f"  [{state}]" if state else "")


def unit_started_at(unit: Mapping[str, str]) -> float | None:
    """Unix time the unit's main process started (from ExecMainStartTimestampMonotonic, which is
    CLOCK_MONOTONIC in microseconds, like time.monotonic()); None when unknown."""
    try:
        mono_us = int(unit.get("ExecMainStartTimestampMonotonic", "0"))
    except ValueError:
        return None
    if mono_us <= 0:
        return None
    return time.time() - (time.monotonic() - mono_us / 1e6)


def progress(out_dir: Path, unit: str | None, host: str | None = None) -> dict[str, Any]:
    """The progress of this node: ``{host, state, unit, progress, line}`` (see :func:`job_state`).

    Only records written since the unit's current start count (a resumed run's folder holds the
    records of earlier launches too).
    """
    host = host or socket.gethostname()
    records, _skipped = read_metrics_dir(out_dir / "metrics", tail_bytes=TAIL_BYTES)
    u = unit_state(unit) if unit else {}
    since = unit_started_at(u)
    if since is not None:
        records = [r for r in records if (num(r.get("time")) or 0.0) >= since - 1.0]
    state = job_state(u, records)
    p = node_progress(records)
    return {"host": host, "state": state, "unit": u, "progress": p, "line": format_progress(host, p, state)}


# ----------------------------------------------------------------------------- CLI


def faults_cli(a: argparse.Namespace) -> int:
    """``summary faults``: exit 0 measured (and stored unless --no-write), 2 bad input, 3 --rank-of
    names a rank no worker holds."""
    try:
        run = load_run(a.run_dir, a.metrics)
        if a.rank_of is not None:
            host = faults.node_of_rank(run.records, a.rank_of)
            if host is None:
                print(f"no worker holds rank {a.rank_of} in the metrics under {a.metrics or a.run_dir}",
                      file=sys.stderr)
                return 3
            print(host)
            return 0
        measures = faults.measure_all(run.events, run.records)
    except (OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if not a.no_write:
        update_summary(a.run_dir, faults=[m.to_dict() for m in measures])
    shown = measures[-1:] if a.last else measures
    if a.json:
        print(json.dumps([m.to_dict() for m in shown], indent=2))
    elif shown:
        print(faults.format_table(shown))
    else:
        print(f"no fault injections in {a.run_dir / 'events.jsonl'}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """CLI; exit 0 ok, 2 bad input (nothing written)."""
    ap = argparse.ArgumentParser(prog="python -m ddplab.summary", description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="write runs/<run_id>/summary.json and print the human summary")
    b.add_argument("run_dir", type=Path)
    b.add_argument("--hosts", default="", help="comma-separated trainers of the run (default: host folders)")
    b.add_argument("--json", action="store_true", help="print the summary JSON instead of the text")
    f = sub.add_parser("faults", help="measure the injections of events.jsonl into summary.json")
    f.add_argument("run_dir", type=Path, help="runs/<run_id> on the controller (holds events.jsonl)")
    f.add_argument("--metrics", type=Path, default=None,
                   help="folder of <host>/metrics/*.jsonl to read instead of the run folder (live fetch)")
    f.add_argument("--json", action="store_true", help="print JSON instead of the table")
    f.add_argument("--last", action="store_true", help="only the newest injection")
    f.add_argument("--no-write", action="store_true", help="do not update summary.json")
    f.add_argument("--rank-of", type=int, default=None, metavar="R",
                   help="print the host holding global rank R in the newest metrics, and exit")
    p = sub.add_parser("progress", help="one progress line for this node")
    p.add_argument("--out-dir", type=Path, required=True, help="the run's folder on this node")
    p.add_argument("--unit", default="ddp-lab-agent", help="the agent's systemd unit ('' = none)")
    p.add_argument("--host", default=None, help="name to show (default: hostname)")
    p.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    if a.cmd == "build":
        try:
            summary = build_summary(a.run_dir, [h for h in a.hosts.split(",") if h] or None)
        except SummaryError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        write_summary(a.run_dir, summary)
        print(json.dumps(summary, indent=2) if a.json else human_summary(summary, a.run_dir))
        return 0
    if a.cmd == "faults":
        return faults_cli(a)
    out = progress(a.out_dir, a.unit or None, a.host)
    print(json.dumps(out) if a.json else out["line"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
