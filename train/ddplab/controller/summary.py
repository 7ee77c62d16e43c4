"""Run summary and fault measurement of a collected run folder (docs/CONTRACTS.md).

The only writer of ``summary.json``; the folder is read by :mod:`ddplab.controller.rundir` (a
node's live progress is :mod:`ddplab.status`). Two commands:

* **build** (after collection): ``python -m ddplab.controller.summary build runs/<run_id>``
  reads ``<host>/metrics/*.jsonl`` (+ ``<host>/result.json``, ``events.jsonl`` and an existing
  ``summary.json``), writes ``runs/<run_id>/summary.json`` atomically and prints a short human
  summary. Fields: ``run_id, hosts, steps_completed, final_train_loss, final_val_loss, wall_s,
  world_size_timeline [{time, step, world_size}], restarts, faults, batch_policy, stragglers,
  report`` and, beyond the contract, ``outcome, max_steps, first_train_loss, final_step_loss,
  per_host, sample``.
* **faults** (during and after a fault run): ``python -m ddplab.controller.summary faults
  runs/<run_id> [--metrics DIR] [--json] [--last] [--no-write]`` measures every injection of
  ``events.jsonl`` with :mod:`ddplab.faults`, stores the list as ``faults`` in
  summary.json and prints a table; ``--rank-of R`` prints the host holding global rank R now.

Definitions (all times unix seconds, from the nodes' clocks):

``steps_completed``
    the largest ``step`` of any ``end``/``step``/``val``/``checkpoint``/``failure`` record.
``outcome``
    :func:`ddplab.runstate.run_outcome`: finished | stopped (stop.yml recorded a
    ``kind: stop`` event after the newest start) | failed | incomplete | no metrics; ``running``
    for a snapshot collect took while the job ran (``build --running HOSTS``).
``running_on``
    the trainers whose agent still ran the job when a snapshot was collected ([] otherwise).
``partial`` / ``unread``
    whether collect could not read some trainer (powered off, unreachable: ``build --unread
    HOSTS``), and which: their figures are an earlier collect's, or none (``per_host.<host>.read``
    false; ``last_step`` None without a record: unknown, not 0); a later collect that reads them
    rebuilds the summary whole.
``final_train_loss`` / ``final_val_loss``
    of the rank-0 ``end`` record (the trainer's final evaluation: the mean loss over fixed
    windows of the train and val splits); without one, the newest ``val`` record's
    ``train_loss``/``val_loss``; ``None`` when there is neither.
``final_step_loss`` / ``first_train_loss``
    the training loss of the newest / earliest ``step`` record (the last minibatch's loss, mean
    over the ranks: what the progress lines and the loss plot show).
``wall_s``
    the ``wall_s`` of the rank-0 ``end`` record (first start to end, restarts included); without
    one, newest record time minus oldest ``start`` time.
``world_size_timeline``
    from the rank-0 ``start`` and ``step`` records in time order (rank 0 exists in every group
    generation, so its records are one clean series): an entry at the first record and whenever
    ``world_size`` changes.
``restarts``
    :func:`restarts_within_launches`: how many times training was started again within a launch,
    the launches themselves (site.yml, resume.yml) not counted. torchelastic: the group re-formed
    (rank-0 ``start`` records beyond the first of each launch; an interim group a fault's recovery
    passed through counts); per_step (no group restart): a replica's worker started again
    (``start`` records beyond each worker's first of each launch). Not the per-laptop
    ``restart_count`` that status.yml shows (torchrun's count for one agent; ``per_host``).
``launches``
    the kinds of the run's ``launch``/``resume`` events in time order (``["launch"]`` when a run
    with start records has none).
``engine``
    the recovery engine of the newest ``start`` record: torchelastic (also when none names one) or
    per_step; under per_step ``world_size`` in the timeline is the participants of each committed step.
``cut_off``
    per_step: the nodes whose replica ended cut off from the group in the newest launch
    (:func:`ddplab.controller.rundir.cut_off_nodes`: host, step, quorum ids, error); the run is
    still ``finished`` when a replica reached ``max_steps``: a cut-off one trained nothing alone.
``faults``
    measured by :mod:`ddplab.faults` from the ``kind: fault`` records of ``events.jsonl`` (the
    hook :func:`measure_faults`); when there are none, the list already in ``summary.json`` is kept.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from ddplab import faults
from ddplab.controller import straggler
from ddplab.controller.rundir import (
    SUMMARY_FILE,
    RunFolder,
    RunFolderError,
    cut_off_nodes,
    group_restarts,
    launch_of,
    load_run,
    read_json,
    world_size_timeline,
)
from ddplab.engines import replica_groups
from ddplab.records import Record, as_int, events_of, num
from ddplab.runstate import LAUNCH_KINDS, OUTCOME_WORDS, run_outcome
from ddplab.status import fmt

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


def final_evaluation(
    records: Sequence[Record], results: Iterable[Mapping[str, Any]] = ()
) -> tuple[float | None, float | None, int | None]:
    """``(train loss, val loss, step)`` of the trainer's newest evaluation (the mean loss over fixed
    windows of each split): the rank-0 ``end`` record, else a result.json, else the newest ``val``
    record (``records`` in time order). The one rule of summary.json's final losses and the report's
    evaluation figures."""
    ends = events_of(records, "end", rank=0) or events_of(records, "end")
    if ends:
        e = ends[-1]
        return num(e.get("final_train_loss")), num(e.get("final_val_loss")), as_int(e.get("step"))
    for res in results:
        if num(res.get("final_val_loss")) is not None:
            return num(res.get("final_train_loss")), num(res.get("final_val_loss")), as_int(res.get("steps"))
    vals = events_of(records, "val")
    if vals:
        return num(vals[-1].get("train_loss")), num(vals[-1].get("val_loss")), as_int(vals[-1].get("step"))
    return None, None, None


def final_losses(
    records: Sequence[Record], results: Iterable[Mapping[str, Any]] = ()
) -> tuple[float | None, float | None]:
    """``(final_train_loss, final_val_loss)`` of :func:`final_evaluation`."""
    train, val, _ = final_evaluation(records, results)
    return train, val


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


def _step_losses(records: Sequence[Record]) -> list[float]:
    steps = sorted(
        events_of(records, "step"), key=lambda r: (as_int(r.get("step")) or 0, num(r.get("time")) or 0)
    )
    return [v for r in steps if (v := num(r.get("loss"))) is not None]


def first_train_loss(records: Sequence[Record]) -> float | None:
    """Loss of the earliest ``step`` record (by step, then time)."""
    return next(iter(_step_losses(records)), None)


def final_step_loss(records: Sequence[Record]) -> float | None:
    """Loss of the newest ``step`` record (by step, then time): the last minibatch's loss."""
    losses = _step_losses(records)
    return losses[-1] if losses else None


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


def run_engine(records: Iterable[Record]) -> str:
    """The recovery engine of the newest ``start`` record (``torchelastic`` when none names one)."""
    starts = sorted(events_of(records, "start"), key=lambda r: num(r.get("time")) or 0.0)
    return str(starts[-1].get("engine") or "torchelastic") if starts else "torchelastic"


def launches(events: Iterable[Record], records: Iterable[Record] = ()) -> list[str]:
    """The kinds (``launch``, ``resume``) of the run's launch events in time order; ``["launch"]``
    when there is none but a ``start`` record (a run folder without events.jsonl); [] else."""
    kinds = [str(e["kind"]) for e in sorted((e for e in events if e.get("kind") in LAUNCH_KINDS
                                              and num(e.get("time")) is not None), key=lambda e: e["time"])]
    return kinds or (["launch"] if events_of(records, "start") else [])


def restarts_within_launches(records: Sequence[Record], events: Iterable[Record]) -> int:
    """The run's ``restarts`` (module docstring): training started again within a launch, a launch
    or resume not counted. The records of one launch are those from its ``launch``/``resume``
    event (:func:`ddplab.controller.rundir.launch_of`) to the next; records before the first event
    (or all, without events) are one launch. torchelastic: rank-0 ``start`` records beyond the
    first of each launch (:func:`ddplab.controller.rundir.group_restarts`); per_step:
    ``start`` records beyond the first of each worker (host, local_rank) in each launch. Under
    per_step this equals the sum of the faults' ``restarts`` when every restart followed a fault."""
    events = list(events)
    if not replica_groups(run_engine(records)):
        return group_restarts(records, events)
    which = launch_of(events)
    keys = [(which(t), r.get("host"), as_int(r.get("local_rank")) or 0)
            for r in events_of(records, "start") if (t := num(r.get("time"))) is not None]
    return len(keys) - len(set(keys))


def find_stragglers(records: Sequence[Record]) -> list[dict[str, Any]]:
    """Straggler findings of :mod:`ddplab.controller.straggler` as dicts plus a ``text`` line each."""
    return [{**asdict(f), "text": straggler.format_finding(f)} for f in straggler.detect_stragglers(records)]


def per_host_figures(host: str, records: Sequence[Record], host_dir: Path | None,
                     read: bool = True) -> dict[str, Any]:
    """Figures of one node: last step, restarts (``restart_count``: the most any of its agents
    reached in the run; ``agent_restarts``: its newest agent's, :func:`ddplab.faults.agent_restarts`),
    world sizes seen, throughput, files brought back. ``read``: False when this collect could not
    read the node (``unread``): its figures are those of the records an earlier collect brought
    (``records_to``: the newest one's time), and ``last_step`` is None without any (unknown, not 0)."""
    steps = events_of(records, "step")
    tok = sorted(v for r in steps if (v := num(r.get("tokens_per_s"))) is not None)
    out: dict[str, Any] = {
        "read": read,
        "records": len(records),
        "records_to": max((t for r in records if (t := num(r.get("time"))) is not None), default=None),
        "last_step": steps_completed(records) if records or read else None,
        "restart_count": max((as_int(r.get("restart_count")) or 0 for r in records), default=0),
        "agent_restarts": faults.agent_restarts(records),
        "world_sizes": sorted({ws for r in steps if (ws := as_int(r.get("world_size"))) is not None}),
        "median_tokens_per_s": round(tok[len(tok) // 2], 1) if tok else None,
        "failures": [  # cause: divergence | signal | output | error (ddplab.train), None before
            {"step": as_int(r.get("step")), "error": r.get("error"), "cause": r.get("cause")}
            for r in events_of(records, "failure")
        ],
        "fresh_starts": [
            r["fresh_start_reason"] for r in events_of(records, "start") if r.get("fresh_start_reason")
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


def build_summary(run_dir: str | Path, hosts: Sequence[str] | None = None,
                  running: Sequence[str] = (), unread: Sequence[str] = ()) -> dict[str, Any]:
    """The summary dict of a collected run folder (see the module docstring).

    ``hosts``: the trainers of the run (default: the host folders found). ``running``: the trainers
    whose agent still runs the job (a snapshot): the outcome is then ``running``. ``unread``: the
    trainers this collect could not read (powered off, unreachable): the summary is ``partial``,
    their figures are an earlier collect's or none, and a later collect completes it. Raises
    RunFolderError (alias SummaryError) when ``run_dir`` is not a folder.
    """
    run = load_run(run_dir)
    run_dir, existing, per_host, records = run.path, run.summary, run.per_host, run.records
    hosts = sorted(hosts) if hosts else run.hosts
    results = [run.results[h] for h in hosts if h in run.results]
    train_loss, val_loss = final_losses(records, results)
    starts = events_of(records, "start")
    engine = run_engine(records)
    # a run whose workers never started: max_steps of the run's configuration
    max_steps = next(
        (m for r in [*reversed(starts), *run.configs.values()]
         if (m := as_int(r.get("max_steps"))) is not None),
        None,
    )
    sample_host = next((h for h in hosts if (run_dir / h / "sample.txt").is_file()), None)
    summary: dict[str, Any] = {
        "run_id": run.run_id,
        "outcome": "running" if running else run_outcome(records, run.events),
        "running_on": sorted(running),
        "partial": bool(unread),
        "unread": sorted(unread),
        "hosts": list(hosts),
        "steps_completed": steps_completed(records),
        "max_steps": max_steps,
        "first_train_loss": first_train_loss(records),
        "final_train_loss": train_loss,
        "final_val_loss": val_loss,
        "final_step_loss": final_step_loss(records),
        "wall_s": wall_seconds(records),
        "world_size_timeline": world_size_timeline(records),
        "engine": engine,
        "restarts": restarts_within_launches(records, run.events),
        "launches": launches(run.events, records),
        "faults": measure_faults(run),
        "cut_off": cut_off_nodes(per_host, run.events),
        "batch_policy": next(
            (r.get("batch_policy") for r in reversed(starts) if r.get("batch_policy")), None
        ),
        "stragglers": find_stragglers(records),
        "report": "report.html" if (run_dir / "report.html").is_file() else existing.get("report"),
        "per_host": {h: per_host_figures(h, per_host.get(h, []), run_dir / h, read=h not in unread)
                     for h in hosts},
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


def cut_off_line(node: Mapping[str, Any]) -> str:
    """One line for a node of :func:`ddplab.controller.rundir.cut_off_nodes`."""
    last, qid = node.get("last_group_quorum_id"), node.get("quorum_id")
    since = ", never in a group quorum" if last is None else f" after quorum {last}"
    how = (f"cut off from quorum {last} to quorum {qid}" if qid is not None and last is not None
           else f"in quorum {qid}{since}" if qid is not None
           else f"no quorum for {fmt(num(node.get('unreachable_s')), '.0f')} s{since}")
    return (f"{node.get('host')}: cut off from the group at step {node.get('step')} ({how}); "
            "nothing trained alone, its state and checkpoints kept (not the run's result)")


def fault_line(f: Mapping[str, Any], size: str = "world size") -> str:
    """One line for a ``faults`` entry: its world sizes, detected/recovered s, steps lost, outcome
    (with the cause when not recovered, and its notes); ``-`` for every figure it lacks."""
    via = faults.interim_text(f)
    why = [str(f["cause"])] if f.get("outcome") == "not_recovered" and f.get("cause") else []
    why += [str(n) for n in f.get("notes") or [] if n]
    return (
        f"fault {f.get('mode')} {f.get('node')}: {size} {faults.path_text(f)}, "
        f"detected {fmt(num(f.get('detected_s')), '.1f')} s, "
        f"recovered {fmt(num(f.get('recovered_s')), '.1f')} s, steps lost "
        f"{fmt(as_int(f.get('steps_lost')), 'd')}"
        + (f" ({via})" if via else "")
        + f" - {str(f.get('outcome') or 'not measured').replace('_', ' ')}"
        + (f": {'; '.join(why)}" if why else "")
    )


def partial_line(unread: Sequence[str]) -> str:
    """The line that says a summary is partial (``unread``: the trainers collect could not read) and
    how to complete it; the human summary and the report print it."""
    names = ", ".join(unread)
    return (f"PARTIAL: {names} not read by this collect (unreachable): its figures are an earlier"
            f" collect's, or none; fix: bring {names} back and run playbooks/collect.yml again")


def human_summary(summary: Mapping[str, Any], run_dir: str | Path | None = None) -> str:
    """A few lines for people: outcome, losses, world sizes, restarts, faults, where things are."""
    lines = []
    steps, max_steps = summary.get("steps_completed"), summary.get("max_steps")
    done = max_steps is not None and steps is not None and steps >= max_steps
    hosts = summary.get("hosts") or []
    outcome = summary.get("outcome")
    if outcome == "running":
        outcome = f"RUNNING (a snapshot; it goes on on {', '.join(summary.get('running_on') or [])})"
    else:
        outcome = OUTCOME_WORDS.get(outcome, ("finished" if done else "NOT finished", ""))[0]
    lines.append(
        f"run {summary.get('run_id')}: {steps}/{max_steps if max_steps is not None else '?'} steps "
        f"on {len(hosts)} node(s) ({', '.join(hosts)}) - {outcome}"
        + (" - PARTIAL" if summary.get("unread") else "")
    )
    if summary.get("unread"):
        lines.append(partial_line(summary["unread"]))
    wall = num(summary.get("wall_s"))
    lines.append(
        f"train loss (last minibatch): {fmt(num(summary.get('first_train_loss')))} -> "
        f"{fmt(num(summary.get('final_step_loss')))}; evaluation estimate: "
        f"train {fmt(num(summary.get('final_train_loss')))}, "
        f"val {fmt(num(summary.get('final_val_loss')))}; wall {fmt(wall, '.0f')} s"
    )
    tl = summary.get("world_size_timeline") or []
    if tl:
        lines.append(
            ("participants: " if replica_groups(summary.get("engine")) else "world size: ")
            + " -> ".join(f"{e['world_size']} (step {e['step']})" for e in tl)
            + (f"; processes restarted: {summary.get('restarts', 0)} (engine {summary.get('engine')})"
               if replica_groups(summary.get("engine"))
               else f"; group restarts: {summary.get('restarts', 0)}")
            + " within launches"
            + (f" ({', '.join(summary['launches'])})" if len(summary.get("launches") or []) > 1 else "")
        )
    size = "participants" if replica_groups(summary.get("engine")) else "world size"
    for f in summary.get("faults") or []:
        lines.append(fault_line(f, size))
    for c in summary.get("cut_off") or []:
        lines.append(cut_off_line(c))
    for s in (summary.get("stragglers") or [])[:3]:
        lines.append(s.get("text", str(s)))
    for h, fig in (summary.get("per_host") or {}).items():
        if fig.get("read") is False and not fig.get("records"):
            lines.append(f"  {h}: NOT READ by this collect; no record of it here: the step it reached"
                         " is unknown")
            continue
        missing = [k for k in ("checkpoint", "sample", "journal") if not fig.get(k)]
        lines.append(
            f"  {h}: "
            + (f"NOT READ by this collect; an earlier collect's copy to "
               f"{time.strftime('%H:%M:%S', time.localtime(num(fig.get('records_to')) or 0))}: "
               if fig.get("read") is False else "")
            + f"step {fig.get('last_step')}, {fmt(fig.get('median_tokens_per_s'), '.0f')} tok/s, "
            f"restarts {fig.get('restart_count')} in the run"
            + (f" ({fig['agent_restarts']} of its newest agent, as status.yml shows)"
               if fig.get("agent_restarts") not in (None, fig.get("restart_count")) else "")
            + (f", failures {len(fig['failures'])}" if fig.get("failures") else "")
            + "".join(f" ({c})" for c in sorted({f.get("cause") for f in fig.get("failures") or []} - {None}))
            + (f", fresh start: {fig['fresh_starts'][-1][:100]}" if fig.get("fresh_starts") else "")
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
    down = [h for h in a.down.split(",") if h]
    newest = {h: max((t for r in recs if (t := num(r.get("time"))) is not None), default=None)
              for h, recs in run.per_host.items()}
    if a.json:
        print(json.dumps([m.to_dict() for m in shown], indent=2))
    elif shown:
        print(faults.format_table(shown))
        print(faults.inputs_line(newest, down))
    else:
        print(f"no fault injections in {a.run_dir / 'events.jsonl'}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """CLI; exit 0 ok, 2 bad input (nothing written)."""
    ap = argparse.ArgumentParser(prog="python -m ddplab.controller.summary",
                                 description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="write runs/<run_id>/summary.json and print the human summary")
    b.add_argument("run_dir", type=Path)
    b.add_argument("--hosts", default="", help="comma-separated trainers of the run (default: host folders)")
    b.add_argument("--json", action="store_true", help="print the summary JSON instead of the text")
    b.add_argument("--running", default="", metavar="HOSTS",
                   help="comma-separated trainers still running the job (a snapshot: outcome running)")
    b.add_argument("--unread", default="", metavar="HOSTS",
                   help="comma-separated trainers this collect could not read (the summary is partial)")
    f = sub.add_parser("faults", help="measure the injections of events.jsonl into summary.json")
    f.add_argument("run_dir", type=Path, help="runs/<run_id> on the controller (holds events.jsonl)")
    f.add_argument("--metrics", type=Path, default=None,
                   help="folder of <host>/metrics/*.jsonl to read instead of the run folder (live fetch)")
    f.add_argument("--json", action="store_true", help="print JSON instead of the table")
    f.add_argument("--last", action="store_true", help="only the newest injection")
    f.add_argument("--no-write", action="store_true", help="do not update summary.json")
    f.add_argument("--down", default="", metavar="HOSTS",
                   help="comma-separated trainers down when the metrics were fetched (said in the output)")
    f.add_argument("--rank-of", type=int, default=None, metavar="R",
                   help="print the host holding global rank R in the newest metrics, and exit")
    a = ap.parse_args(argv)
    if a.cmd == "build":
        try:
            summary = build_summary(a.run_dir, [h for h in a.hosts.split(",") if h] or None,
                                    [h for h in a.running.split(",") if h],
                                    [h for h in a.unread.split(",") if h])
        except SummaryError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        write_summary(a.run_dir, summary)
        print(json.dumps(summary, indent=2) if a.json else human_summary(summary, a.run_dir))
        return 0
    return faults_cli(a)


if __name__ == "__main__":
    sys.exit(main())
