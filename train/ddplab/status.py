"""The state of the training job on this node: ``python -m ddplab.status --out-dir DIR``.

Runs on a node (node runtime: shipped in the wheel), read-only: the tail of the run's metrics
files (``DIR/metrics/*.jsonl``, at most ``TAIL_BYTES`` of each, plus the newest ``start`` record of
a file whose tail holds none: :func:`read_node_metrics`) and ``systemctl show`` of the agent unit.
Prints one progress line, e.g.
``laptop-a  step  120/1500  loss 2.314  val 2.410  ws 3  rank 0  12.3k tok/s  restarts 0  [running]``,
or with ``--json`` ``{host, state, unit, progress, line}``: ``state`` is ``running | succeeded |
failed | absent`` (:func:`ddplab.runstate.job_state`), ``progress`` the newest figures (:func:`node_progress`:
run id, step/max_steps, losses, world size, rank, restarts, seconds since the newest record, the
last failure), ``agent`` ``{state, substate, running, pid}``, ``workers`` (the newest record of
every worker: who holds which rank) and, with ``--since T`` (a fault injected at T), ``phase`` and
``measure`` (:mod:`ddplab.faults`); with ``--chunks-from OFFSETS`` also ``chunks``, the metrics
lines written since those byte offsets (:func:`metrics_chunks`: the watch copies them to the
controller for the live report). The ``node_status`` action plugin (collection ddp_lab.cluster)
polls it; the states are those of :mod:`ddplab.runstate`.

Exit status: 0 (the state is in the output, also when there is no job); 2 bad arguments.
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ddplab import faults, units
from ddplab.engines import replica_groups
from ddplab.records import (
    Record,
    as_int,
    events_of,
    group_finished,
    newest_start_record,  # noqa: F401 - part of this module's API (tests, docs)
    newest_start_time,
    num,
    read_metrics_dir,
    read_new_lines,
)
from ddplab.runstate import job_state, past_run_state

TAIL_BYTES = 256 * 1024  # read at most this much of the end of each metrics file
CHUNK_BYTES = 1024 * 1024  # --chunks-from: at most this much of each metrics file per call


def fmt(v: float | None, spec: str = ".3f", none: str = "-") -> str:
    """``v`` formatted with ``spec``; ``none`` for None."""
    return none if v is None else format(v, spec)


# The agent unit's properties the job state is read from (:func:`unit_state`). Their one home: the
# node_status action plugin imports them when it asks systemd directly because ddplab.status
# cannot run on the node.
UNIT_PROPS = ("LoadState", "ActiveState", "SubState", "Result", "ExecMainStatus", "ExecMainCode",
              "InvocationID", "MainPID", "ExecMainStartTimestampMonotonic", "ExecStart")


def unit_state(unit: str) -> dict[str, str]:
    """``systemctl show`` of a unit: the :data:`UNIT_PROPS` (LoadState, ActiveState, SubState,
    Result, ExecMainStatus, ...) as strings ({} when systemctl is not available)."""
    try:
        out = subprocess.run(
            ["systemctl", "show", unit, "-p", ",".join(UNIT_PROPS)], capture_output=True, text=True,
            timeout=20, check=False,
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        return {}
    return units.show_props(out)


def _read_text(path: Path) -> str | None:
    try:
        return path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None


def unit_holds_run(out_dir: Path, unit: Mapping[str, str]) -> bool | None:
    """Whether the agent unit's current invocation is a launch of the run of ``out_dir``
    (``<base>/runs/<run id>``): its InvocationID is among the run's ``invocations`` (the launch
    records each, roles/ddp_job tasks/launch.yml), or, in the seconds before the launch records it,
    the node's ``<base>/current_run`` (written before the launch) names the run. False: the unit
    belongs to another run (a later launch), so its state says nothing of this one. None: not known
    (no unit, no invocation id, neither file)."""
    inv = unit.get("InvocationID") if unit else None
    if not inv:
        return None
    ids = set((_read_text(out_dir / "invocations") or "").split())
    if inv in ids:
        return True
    current = _read_text(out_dir.parent.parent / "current_run")
    if current is None or not current.strip():
        return False if ids else None
    return current.strip() == out_dir.name


def run_endpoints(out_dir: Path, unit: Mapping[str, str], holds: bool | None) -> dict[str, str | None]:
    """Where the run's controller services are, as its launch recorded them on this node:
    ``lighthouse``, the torchft lighthouse of the per_step and diloco engines (``ft_lighthouse`` of the run's
    run.json, e.g. ``http://10.89.0.1:29510``), and ``store``, torchelastic's c10d store (the
    ``--rdzv-endpoint`` of the agent unit's command line (:mod:`ddplab.units`), ``host:port``, read
    only while the unit holds the run: :func:`unit_holds_run`). None where not known. status.yml
    compares them with the store and lighthouse it read on the controller."""
    try:
        config = json.loads(_read_text(out_dir / "run.json") or "{}")
    except ValueError:
        config = {}
    per_step = isinstance(config, dict) and replica_groups(config.get("fault_tolerance"))
    lighthouse = str(config["ft_lighthouse"]) if per_step and config.get("ft_lighthouse") else None
    argv = units.exec_start_argv(unit.get("ExecStart") or "") if holds is not False and not per_step else []
    return {"store": units.option_value(argv, "--rdzv-endpoint"), "lighthouse": lighthouse}


def read_node_metrics(metrics_dir: str | Path,
                      tail_bytes: int = TAIL_BYTES) -> tuple[list[dict[str, Any]], int]:
    """``(records, lines skipped)`` of every ``metrics_dir/*.jsonl`` for the node's state, sorted
    by time: the last ``tail_bytes`` of each file and, of a longer file whose tail holds no
    ``start`` record, the newest one before that tail (:func:`ddplab.records.read_metrics_dir`
    with ``keep_start``: one per-file reader for the node and the controller), so a long run keeps
    its run id, max_steps and engine whatever the file's length. ``([], 0)`` without the folder;
    raises OSError when a file cannot be read."""
    return read_metrics_dir(metrics_dir, tail_bytes=tail_bytes, keep_start=True)


def node_progress(records: Sequence[Record]) -> dict[str, Any]:
    """The newest figures of one node from its records (any order).

    Returns ``{step, run_id, max_steps, loss, val_loss, world_size, tokens_per_s, restart_count, rank,
    age_s, step_age_s, finished, failure, stop_cause, engine}`` (None where unknown); ``finished``:
    the group finished the run since the node's newest start (:func:`ddplab.records.group_finished`);
    ``engine``: the
    recovery engine of the newest start record (torchelastic when it names none); ``age_s``: seconds since
    the newest record; ``step_age_s``: seconds since the newest ``step`` record; ``stop_cause``: the
    ``cause`` of a newest ``failure`` record (divergence, signal, ...).
    """
    recs = sorted(records, key=lambda r: num(r.get("time")) or 0.0)
    steps = events_of(recs, "step")
    last = steps[-1] if steps else {}
    starts = events_of(recs, "start")
    vals = events_of(recs, "val")
    fails = events_of(recs, "failure")
    newest = recs[-1] if recs else {}
    failure = stop_cause = None
    if fails and num(fails[-1].get("time")) == num(newest.get("time")):
        stop_cause = fails[-1].get("cause")  # divergence | signal | output | error (train.py)
        failure = (f"{stop_cause}: " if stop_cause else "") + str(fails[-1].get("error"))
    tnew = num(newest.get("time"))
    tstep = num(last.get("time"))
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
        "run_id": next((str(r["run_id"]) for r in reversed(starts) if r.get("run_id")), None),
        "max_steps": as_int(starts[-1].get("max_steps")) if starts else None,
        "loss": num(last.get("loss")),
        "val_loss": num(vals[-1].get("val_loss")) if vals else None,
        "world_size": as_int(newest.get("world_size")),
        "tokens_per_s": num(last.get("tokens_per_s")),
        "restart_count": as_int(newest.get("restart_count")),
        "rank": as_int(newest.get("rank")),
        "age_s": round(time.time() - tnew, 1) if tnew is not None else None,
        "step_age_s": round(time.time() - tstep, 1) if tstep is not None else None,
        "finished": group_finished(recs, newest_start_time(recs)),
        "failure": failure,
        "stop_cause": stop_cause,
        "engine": (str(starts[-1].get("engine") or "torchelastic")) if starts else None,
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
            f"step {p['step']:>5}/{total}  loss {fmt(p.get('loss'))}  val {fmt(p.get('val_loss'))}"
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


def agent(unit: Mapping[str, str]) -> dict[str, Any]:
    """``{state, substate, running, pid}`` of the agent unit (``unknown`` without systemd).

    ``running``: a process of the unit runs (the unit is kept ``active/exited`` after its process
    ends: RemainAfterExit=yes). ``pid``: its main process, 0 when none.
    """
    state, sub = unit.get("ActiveState") or "unknown", unit.get("SubState") or "unknown"
    pid = unit.get("MainPID", "0")
    running = state in ("active", "activating", "reloading") and sub not in ("exited", "dead", "failed")
    return {"state": state, "substate": sub, "running": running, "pid": int(pid) if pid.isdigit() else 0}


def progress(out_dir: Path, unit: str | None, host: str | None = None,
             injection: faults.Injection | None = None) -> dict[str, Any]:
    """The state of the job on this node: ``{host, state, unit, agent, progress, line, workers,
    records, skipped_lines, run_dir, unit_holds_run, run_state, current_run,
    endpoints}`` (see
    :func:`job_state`, :func:`agent`, :func:`node_progress`; ``workers``:
    :func:`ddplab.faults.newest_per_worker`; ``run_dir``: whether ``out_dir`` exists, i.e. whether
    this node holds the run: the launch makes it before the agent starts).

    ``state`` is the agent unit's, whichever run it belongs to (the launch's preflight and stop.yml
    act on the unit); ``run_state`` is the run's own: the same while the unit holds the run
    (:func:`unit_holds_run`), else, when the unit belongs to another run or is gone, how the run
    ended by its records (:func:`past_run_state`). ``current_run``: the node's current_run (the
    run its newest launch shipped), None when it has none. ``endpoints``: :func:`run_endpoints`.

    Without ``injection``, only the tail of each metrics file and its newest start record are read
    (:func:`read_node_metrics`) and only the records written since the unit's current start count
    (a resumed run's folder holds the records of earlier launches too). With ``injection`` (a fault
    the fault role waits on), every record counts and ``phase`` and ``measure`` say where the group
    stands after it (:func:`ddplab.faults.measure`, :func:`ddplab.faults.progress_phase`).
    """
    host = host or socket.gethostname()
    if injection is None:
        records, skipped = read_node_metrics(out_dir / "metrics")
    else:
        records, skipped = read_metrics_dir(out_dir / "metrics")
    u = unit_state(unit) if unit else {}
    holds = unit_holds_run(out_dir, u) if injection is None else None
    since = unit_started_at(u)
    if since is not None and injection is None and holds is not False:
        records = [r for r in records if (num(r.get("time")) or 0.0) >= since - 1.0]
    state = job_state(u, records)
    # the run's own state: the unit's, unless the unit is another run's or gone (then its records')
    run_state = state
    if holds is False or (state == "absent" and records):
        run_state = past_run_state(records)
    p = node_progress(records)
    current = _read_text(out_dir.parent.parent / "current_run")
    out = {"host": host, "state": state, "unit": u, "agent": agent(u), "progress": p,
           "line": format_progress(host, p, state), "workers": faults.newest_per_worker(records),
           "records": len(records), "skipped_lines": skipped, "run_dir": out_dir.is_dir(),
           "unit_holds_run": holds, "run_state": run_state,
           "current_run": (current or "").strip() or None,
           "endpoints": run_endpoints(out_dir, u, holds)}
    if injection is not None:
        m = faults.measure(injection, records)
        out["phase"] = faults.progress_phase(m, out["agent"]["running"])
        out["measure"] = m.to_dict()
    return out


def metrics_chunks(metrics_dir: Path, offsets: Mapping[str, int],
                   limit: int = CHUNK_BYTES) -> dict[str, dict[str, Any]]:
    """The lines of every ``metrics_dir/*.jsonl`` written since ``offsets`` (file name -> byte offset;
    0 for a file not named): ``{name: {from, to, text}}`` (:func:`ddplab.records.read_new_lines`:
    complete lines only, at most ``limit`` bytes a file; ``from`` 0 again when a file was replaced).
    A reader appends ``text`` to its copy at ``from`` and passes ``to`` next time. {} without the
    folder; a file that cannot be read is left out.
    """
    out: dict[str, dict[str, Any]] = {}
    if not metrics_dir.is_dir():
        return out
    for path in sorted(metrics_dir.glob("*.jsonl")):
        try:
            text, start, end = read_new_lines(path, int(offsets.get(path.name, 0)), limit)
        except OSError:
            continue
        out[path.name] = {"from": start, "to": end, "text": text}
    return out


def _offsets(text: str) -> dict[str, int]:
    """``--chunks-from``'s JSON object (file name -> byte offset); argparse reports a ValueError."""
    data = json.loads(text)
    if not isinstance(data, dict) or not all(isinstance(v, int) and v >= 0 for v in data.values()):
        raise ValueError("expected a JSON object of file name -> byte offset")
    return data


def main(argv: Sequence[str] | None = None) -> int:
    """CLI (see the module docstring); exit 2 on a bad ``--mode`` or ``--chunks-from``."""
    ap = argparse.ArgumentParser(prog="python -m ddplab.status", description=__doc__.split("\n")[0])
    ap.add_argument("--out-dir", type=Path, required=True, help="the run's folder on this node")
    ap.add_argument("--unit", default="ddp-lab-agent", help="the agent's systemd unit ('' = none)")
    ap.add_argument("--host", default=None, help="name to show (default: hostname)")
    ap.add_argument("--json", action="store_true", help="print the whole state as JSON")
    ap.add_argument("--chunks-from", type=_offsets, default=None, metavar="OFFSETS",
                    help='also the metrics lines since these byte offsets, e.g. {"a.jsonl": 1024} ({} = all)')
    f = ap.add_argument_group("after a fault (the fault role's wait)")
    f.add_argument("--since", type=float, default=None, metavar="T",
                   help="unix time of an injection: measure it from this node's records (phase, measure)")
    f.add_argument("--mode", choices=faults.MODES, default="kill-agent", help="the fault's mode")
    f.add_argument("--node", default="?", help="the node the fault was aimed at")
    f.add_argument("--duration-s", type=float, default=None, help="how long the fault lasts, s")
    a = ap.parse_args(argv)
    inj = None
    if a.since is not None:
        inj = faults.Injection(time=a.since, mode=a.mode, node=a.node or "?", duration_s=a.duration_s or None)
    out = progress(a.out_dir, a.unit or None, a.host, inj)
    if a.chunks_from is not None:
        out["chunks"] = metrics_chunks(a.out_dir / "metrics", a.chunks_from)
    print(json.dumps(out) if a.json else out["line"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
