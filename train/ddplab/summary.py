"""Run summary and live progress, from the metrics JSONL records (docs/CONTRACTS.md).

Two jobs:

* **summary** (controller, after collection): ``python -m ddplab.summary build runs/<run_id>``
  reads ``<host>/metrics/*.jsonl`` (+ ``<host>/result.json``, ``events.jsonl`` and an existing
  ``summary.json``), writes ``runs/<run_id>/summary.json`` atomically and prints a short human
  summary. Fields: ``run_id, hosts, steps_completed, final_train_loss, final_val_loss, wall_s,
  world_size_timeline [{time, step, world_size}], restarts, faults, batch_policy, stragglers,
  report`` and, beyond the contract, ``max_steps, first_train_loss, per_host, sample``.
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
import math
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

Record = Mapping[str, Any]
SUMMARY_FILE = "summary.json"
TAIL_BYTES = 256 * 1024  # progress reads at most this much of the end of each metrics file


class SummaryError(Exception):
    """Bad input: the run folder does not exist or holds nothing to summarise."""


def _num(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    v = float(value)
    return v if math.isfinite(v) else None


def _int(value: Any) -> int | None:
    v = _num(value)
    return int(v) if v is not None else None


# ----------------------------------------------------------------------------- reading


def parse_jsonl(text: str) -> list[dict[str, Any]]:
    """JSON objects of a JSONL text; torn or non-object lines (a writer killed mid-line, a tail
    cut in the middle of a line) are skipped."""
    out = []
    for line in text.splitlines():
        line = line.strip()
        if not line:
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(obj, dict):
            out.append(obj)
    return out


def read_metrics_dir(
    metrics_dir: Path, host: str | None = None, tail_bytes: int | None = None
) -> list[dict[str, Any]]:
    """Records of every ``*.jsonl`` in ``metrics_dir`` (sorted by time; [] when it is missing).

    ``tail_bytes``: read only that much of the end of each file. ``host``: default for records
    without one.
    """
    out: list[dict[str, Any]] = []
    if not metrics_dir.is_dir():
        return out
    for path in sorted(metrics_dir.glob("*.jsonl")):
        with open(path, "rb") as fh:
            if tail_bytes is not None:
                fh.seek(0, os.SEEK_END)
                fh.seek(max(0, fh.tell() - tail_bytes))
            text = fh.read().decode("utf-8", errors="replace")
        for r in parse_jsonl(text):
            if host is not None:
                r.setdefault("host", host)
            out.append(r)
    out.sort(key=lambda r: _num(r.get("time")) or 0.0)
    return out


def host_dirs(run_dir: Path) -> list[Path]:
    """The per-host folders of a collected run: sub-folders holding metrics/ or journal.txt."""
    return sorted(
        p
        for p in run_dir.iterdir()
        if p.is_dir()
        and not p.name.startswith(".")
        and p.name != "plots"
        and ((p / "metrics").is_dir() or (p / "journal.txt").is_file())
    )


def load_run(run_dir: Path) -> tuple[dict[str, list[dict[str, Any]]], list[dict[str, Any]]]:
    """``({host folder: its records}, all records sorted by time)`` of a collected run."""
    per_host = {d.name: read_metrics_dir(d / "metrics", host=d.name) for d in host_dirs(run_dir)}
    records = sorted(
        (r for recs in per_host.values() for r in recs), key=lambda r: _num(r.get("time")) or 0.0
    )
    return per_host, records


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


# ----------------------------------------------------------------------------- figures


def _events(records: Iterable[Record], event: str, rank: int | None = None) -> list[Record]:
    return [r for r in records if r.get("event") == event and (rank is None or _int(r.get("rank")) == rank)]


def steps_completed(records: Iterable[Record]) -> int:
    """The largest completed step named by any record (0 when none)."""
    steps = [
        s
        for r in records
        if r.get("event") in ("end", "step", "val", "checkpoint", "failure")
        and (s := _int(r.get("step"))) is not None
    ]
    return max(steps, default=0)


def world_size_timeline(records: Sequence[Record]) -> list[dict[str, Any]]:
    """``[{time, step, world_size}]``: the first rank-0 record and every change of world size.

    ``step`` of a ``start`` record is its ``resumed_from_step``. Falls back to every rank's
    records when there are no rank-0 ones.
    """
    series = [r for r in records if r.get("event") in ("start", "step") and _int(r.get("rank")) == 0]
    if not series:
        series = [r for r in records if r.get("event") in ("start", "step")]
    series = sorted(series, key=lambda r: _num(r.get("time")) or 0.0)
    out: list[dict[str, Any]] = []
    for r in series:
        ws, t = _int(r.get("world_size")), _num(r.get("time"))
        if ws is None or t is None:
            continue
        step = _int(r.get("step") if r.get("event") == "step" else r.get("resumed_from_step"))
        if not out or out[-1]["world_size"] != ws:
            out.append({"time": round(t, 3), "step": step or 0, "world_size": ws})
    return out


def group_restarts(records: Iterable[Record]) -> int:
    """How many times the group re-formed: rank-0 ``start`` records minus one (0 when none)."""
    return max(0, len(_events(records, "start", rank=0)) - 1)


def final_losses(
    records: Sequence[Record], results: Iterable[Mapping[str, Any]] = ()
) -> tuple[float | None, float | None]:
    """``(final_train_loss, final_val_loss)``: rank-0 ``end`` record, else a result.json, else the
    newest ``val`` record."""
    ends = _events(records, "end", rank=0) or _events(records, "end")
    if ends:
        e = ends[-1]
        return _num(e.get("final_train_loss")), _num(e.get("final_val_loss"))
    for res in results:
        if _num(res.get("final_val_loss")) is not None:
            return _num(res.get("final_train_loss")), _num(res.get("final_val_loss"))
    vals = _events(records, "val")
    if vals:
        return _num(vals[-1].get("train_loss")), _num(vals[-1].get("val_loss"))
    return None, None


def wall_seconds(records: Sequence[Record]) -> float | None:
    """Rank-0 ``end`` ``wall_s``; else newest record time minus the oldest ``start`` time."""
    ends = _events(records, "end", rank=0)
    if ends and _num(ends[-1].get("wall_s")) is not None:
        return _num(ends[-1].get("wall_s"))
    starts = [t for r in _events(records, "start") if (t := _num(r.get("time"))) is not None]
    times = [t for r in records if (t := _num(r.get("time"))) is not None]
    if not starts or not times:
        return None
    return round(max(times) - min(starts), 3)


def first_train_loss(records: Sequence[Record]) -> float | None:
    """Loss of the earliest ``step`` record (by step, then time)."""
    steps = sorted(
        _events(records, "step"), key=lambda r: (_int(r.get("step")) or 0, _num(r.get("time")) or 0)
    )
    for r in steps:
        if (v := _num(r.get("loss"))) is not None:
            return v
    return None


def measure_faults(run_dir: Path, records: Sequence[Record], existing: Any) -> list[dict[str, Any]]:
    """The ``faults`` list: measured by :mod:`ddplab.faults` when events.jsonl records injections,
    else ``existing`` (the list summary.json already holds) or []."""
    from ddplab import faults as _faults

    kept = list(existing) if isinstance(existing, list) else []
    events = _faults.load_events(run_dir)
    if not any(e.get("kind") == "fault" for e in events):
        return kept
    try:
        return [m.to_dict() for m in _faults.measure_all(events, list(records))]
    except ValueError as exc:  # a malformed fault event: keep what was there, say why
        print(f"warning: {run_dir}/events.jsonl: {exc}; faults left as recorded", file=sys.stderr)
        return kept


def find_stragglers(records: Sequence[Record]) -> list[dict[str, Any]]:
    """Straggler findings of :mod:`ddplab.straggler` as dicts plus a ``text`` line each."""
    from dataclasses import asdict

    from ddplab import straggler

    return [{**asdict(f), "text": straggler.format_finding(f)} for f in straggler.detect_stragglers(records)]


def per_host_figures(host: str, records: Sequence[Record], host_dir: Path | None) -> dict[str, Any]:
    """Figures of one node: last step, restarts, world sizes seen, throughput, files brought back."""
    steps = _events(records, "step")
    tok = sorted(v for r in steps if (v := _num(r.get("tokens_per_s"))) is not None)
    out: dict[str, Any] = {
        "records": len(records),
        "last_step": steps_completed(records),
        "restart_count": max((_int(r.get("restart_count")) or 0 for r in records), default=0),
        "world_sizes": sorted({ws for r in steps if (ws := _int(r.get("world_size"))) is not None}),
        "median_tokens_per_s": round(tok[len(tok) // 2], 1) if tok else None,
        "failures": [
            {"step": _int(r.get("step")), "error": r.get("error")} for r in _events(records, "failure")
        ],
        "finished": bool(_events(records, "end")),
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

    ``hosts``: the trainers of the run (default: the host folders found). Raises SummaryError when
    ``run_dir`` is not a folder.
    """
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise SummaryError(f"{run_dir}: no such run folder (expected runs/<run_id>)")
    existing = _read_json(run_dir / SUMMARY_FILE) or {}
    per_host, records = load_run(run_dir)
    hosts = sorted(hosts) if hosts else sorted(per_host)
    results = [r for h in hosts if (r := _read_json(run_dir / h / "result.json"))]
    train_loss, val_loss = final_losses(records, results)
    starts = _events(records, "start")
    max_steps = next((m for r in reversed(starts) if (m := _int(r.get("max_steps"))) is not None), None)
    sample_host = next((h for h in hosts if (run_dir / h / "sample.txt").is_file()), None)
    summary: dict[str, Any] = {
        "run_id": existing.get("run_id")
        or next((r["run_id"] for r in starts if r.get("run_id")), run_dir.name),
        "hosts": list(hosts),
        "steps_completed": steps_completed(records),
        "max_steps": max_steps,
        "first_train_loss": first_train_loss(records),
        "final_train_loss": train_loss,
        "final_val_loss": val_loss,
        "wall_s": wall_seconds(records),
        "world_size_timeline": world_size_timeline(records),
        "restarts": group_restarts(records),
        "faults": measure_faults(run_dir, records, existing.get("faults")),
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
    data = _read_json(run_dir / SUMMARY_FILE) or {"run_id": run_dir.name}
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
    wall = _num(summary.get("wall_s"))
    lines.append(
        f"loss: train {_fmt(_num(summary.get('first_train_loss')))} -> "
        f"{_fmt(_num(summary.get('final_train_loss')))}, "
        f"val {_fmt(_num(summary.get('final_val_loss')))}; wall {_fmt(wall, '.0f')} s"
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
            f"fault {f.get('mode')} {f.get('node')}: detected {_fmt(_num(f.get('detected_s')), '.1f')} s, "
            f"recovered {_fmt(_num(f.get('recovered_s')), '.1f')} s, steps lost {f.get('steps_lost', '-')}"
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
        return "succeeded" if _events(records, "end") else "running"
    if unit.get("LoadState") == "not-found":
        return "absent"
    active, sub, result = unit.get("ActiveState"), unit.get("SubState"), unit.get("Result")
    if active == "failed" or (result not in (None, "", "success")):
        return "failed"
    if active == "active" and sub == "exited":
        return "succeeded" if unit.get("ExecMainStatus", "0") == "0" else "failed"
    if active in ("active", "activating", "reloading", "deactivating"):
        return "running"
    return "succeeded" if _events(records, "end") else "absent"


def node_progress(records: Sequence[Record]) -> dict[str, Any]:
    """The newest figures of one node from its records (any order).

    Returns ``{step, max_steps, loss, val_loss, world_size, tokens_per_s, restart_count, rank,
    age_s, finished, failure}`` (None where unknown); ``age_s``: seconds since the newest record.
    """
    recs = sorted(records, key=lambda r: _num(r.get("time")) or 0.0)
    steps = _events(recs, "step")
    last = steps[-1] if steps else {}
    starts = _events(recs, "start")
    vals = _events(recs, "val")
    fails = _events(recs, "failure")
    newest = recs[-1] if recs else {}
    failure = None
    if fails and _num(fails[-1].get("time")) == _num(newest.get("time")):
        failure = str(fails[-1].get("error"))
    tnew = _num(newest.get("time"))
    return {
        "step": next(
            (
                _int(r.get("step"))
                for r in reversed(recs)
                if r.get("event") in ("step", "val", "checkpoint", "end", "failure")
                and _int(r.get("step")) is not None
            ),
            None,
        ),
        "max_steps": _int(starts[-1].get("max_steps")) if starts else None,
        "loss": _num(last.get("loss")),
        "val_loss": _num(vals[-1].get("val_loss")) if vals else None,
        "world_size": _int(newest.get("world_size")),
        "tokens_per_s": _num(last.get("tokens_per_s")),
        "restart_count": _int(newest.get("restart_count")),
        "rank": _int(newest.get("rank")),
        "age_s": round(time.time() - tnew, 1) if tnew is not None else None,
        "finished": bool(_events(recs, "end")),
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
    records = read_metrics_dir(out_dir / "metrics", tail_bytes=TAIL_BYTES)
    u = unit_state(unit) if unit else {}
    since = unit_started_at(u)
    if since is not None:
        records = [r for r in records if (_num(r.get("time")) or 0.0) >= since - 1.0]
    state = job_state(u, records)
    p = node_progress(records)
    return {"host": host, "state": state, "unit": u, "progress": p, "line": format_progress(host, p, state)}


# ----------------------------------------------------------------------------- CLI


def main(argv: Sequence[str] | None = None) -> int:
    """CLI; exit 0 ok, 2 bad input (nothing written)."""
    ap = argparse.ArgumentParser(prog="python -m ddplab.summary", description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="write runs/<run_id>/summary.json and print the human summary")
    b.add_argument("run_dir", type=Path)
    b.add_argument("--hosts", default="", help="comma-separated trainers of the run (default: host folders)")
    b.add_argument("--json", action="store_true", help="print the summary JSON instead of the text")
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
    out = progress(a.out_dir, a.unit or None, a.host)
    print(json.dumps(out) if a.json else out["line"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
