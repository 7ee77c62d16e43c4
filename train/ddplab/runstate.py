"""The run-state model: what state a job is in on a node, how a collected run ended, and the words
people see for both (docs/CONTRACTS.md "Run state").

Standard library only (with :mod:`ddplab.records`): it ships to the nodes with the node runtime
(:mod:`ddplab.status`) and is imported by the controller (:mod:`ddplab.controller.rundir`,
``summary``, ``report``) and by the Ansible plugins (collection ddp_lab.cluster). Nothing else
decides these states.

A node's job (:func:`job_state`, :func:`past_run_state`, :func:`node_state`): one of
:data:`NODE_STATES`. A collected run's newest launch (:func:`run_outcome`): one of
:data:`OUTCOMES`. The words: :data:`WORDS` and :data:`OUTCOME_WORDS`.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence
from typing import Any

from ddplab.engines import replica_groups
from ddplab.records import Record, events_of, group_finished, newest_start_time, num

#: events.jsonl kinds after which a run's records belong to a new launch (site.yml / resume), with
#: what each did for a reader (the report's no-training band labels)
LAUNCH_WORDS = {"launch": "launched", "resume": "resumed"}
LAUNCH_KINDS = tuple(LAUNCH_WORDS)
#: events.jsonl kind that stop.yml writes before it stops the running agents
STOP_KIND = "stop"

#: the agent unit's state on a node, whichever run it belongs to (:func:`job_state`)
JOB_STATES = ("running", "succeeded", "failed", "absent")
#: how a run whose agent no longer runs for it ended, by its records (:func:`past_run_state`)
PAST_STATES = ("succeeded", "failed", "interrupted")
#: every state of a run looked at on a node (:func:`node_state`): the above, ``stopped`` (stop.yml
#: stopped its agent), ``cut_off`` (per_step: the replica ended cut off from a group that finished
#: the run) and the two of a node that could not be read (``unreachable``, ``error``)
NODE_STATES = ("running", "succeeded", "failed", "absent", "interrupted", "stopped", "cut_off",
               "unreachable", "error")
#: the word a person sees for each node state (status.yml's table, attach.yml, kill-node.yml)
WORDS = {"running": "running", "succeeded": "ended", "failed": "failed", "absent": "no job",
         "interrupted": "interrupted", "stopped": "stopped", "cut_off": "cut off",
         "unreachable": "unreachable", "error": "error"}
#: node states that make status.yml exit non-zero
BAD_STATES = ("failed", "unreachable", "error")

#: how a collected run's newest launch ended (:func:`run_outcome`); ``running``: collect took a
#: snapshot of a run that still ran (summary.json only)
OUTCOMES = ("finished", "stopped", "failed", "incomplete", "no metrics", "running")
#: outcome -> (the words a person sees: summary line, report badge; the badge's class ok|warn|bad)
OUTCOME_WORDS = {"finished": ("finished", "ok"), "stopped": ("stopped by stop.yml", "warn"),
                 "failed": ("NOT finished (failed)", "bad"),
                 "incomplete": ("NOT finished (no end record)", "warn"),
                 "no metrics": ("NOT finished (no step metrics)", "bad"), "running": ("running", "ok")}


def job_state(unit: Mapping[str, str], records: Sequence[Record]) -> str:
    """``running`` | ``succeeded`` | ``failed`` | ``absent`` for one node's agent unit (``systemctl
    show`` properties; {} without systemd) and the node's records since its newest start.

    The unit is started with RemainAfterExit=yes, so a finished agent stays ``active/exited`` with
    its Result. Without unit information the records decide: the group finished since the node's
    newest start (:func:`ddplab.records.group_finished`) -> succeeded, else running.
    """
    finished = group_finished(records, newest_start_time(records))
    if not unit:
        return "succeeded" if finished else "running"
    if unit.get("LoadState") == "not-found":
        return "absent"
    active, sub, result = unit.get("ActiveState"), unit.get("SubState"), unit.get("Result")
    if active == "failed" or (result not in (None, "", "success")):
        return "failed"
    if active == "active" and sub == "exited":
        return "succeeded" if unit.get("ExecMainStatus", "0") == "0" else "failed"
    if active in ("active", "activating", "reloading", "deactivating"):
        return "running"
    return "succeeded" if finished else "absent"


def past_run_state(records: Sequence[Record]) -> str:
    """How a run whose agent no longer runs for it ended, from its records alone (one of
    :data:`PAST_STATES`): ``succeeded`` (the group finished since its newest ``start``),
    ``failed`` (a ``failure`` record after it and no end), else ``interrupted`` (the agent ended
    without either: SIGKILL, power loss, or another run's launch replaced it). A resumed run's
    earlier launches do not count."""
    since = newest_start_time(records)
    if group_finished(records, since):
        return "succeeded"
    newer = [r for r in records if (num(r.get("time")) or since) >= since]
    return "failed" if events_of(newer, "failure") else "interrupted"


def stop_event(events_text: Any) -> dict[str, Any]:
    """The ``kind: stop`` event stop.yml wrote for the run's newest launch, or {}.

    ``events_text``: the text of ``runs/<run_id>/events.jsonl`` (one JSON object per line; '' or
    None when the file is missing). A stop counts when it comes after the newest launch or resume
    line (:data:`LAUNCH_KINDS`) in file order; torn or foreign lines are skipped.
    """
    found: dict[str, Any] = {}
    for line in str(events_text or "").splitlines():
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if not isinstance(event, dict):
            continue
        if event.get("kind") in LAUNCH_KINDS:
            found = {}
        elif event.get("kind") == STOP_KIND:
            found = event
    return found


def stopped_at(stop: Mapping[str, Any] | None) -> str:
    """How a run that stop.yml stopped reads: ``stopped by stop.yml at HH:MM:SS``, the local time of
    its ``kind: stop`` event (:func:`stop_event`: ``time``, unix s)."""
    when = time.strftime("%H:%M:%S", time.localtime(float((stop or {}).get("time") or 0)))
    return f"stopped by stop.yml at {when}"


def node_state(res: Mapping[str, Any] | None, host: str, stop: Mapping[str, Any] | None = None) -> str:
    """The state of the run looked at on one node (one of :data:`NODE_STATES` but ``cut_off``, which
    needs every node: :func:`cut_off_hosts`), from its status read (``res``: ddplab.status's
    document as the ``node_status`` action returns it; None or skipped: nothing read) and the run's
    stop event (:func:`stop_event`).

    The agent unit's state while the unit holds the run; when the unit is another run's or gone,
    the run's own by its records (``run_state``: :func:`past_run_state`); ``stopped`` for a node
    the stop event names whose agent failed, ended without a record, was dropped (stop.yml's
    SIGTERM fails the unit, or ends it cleanly and systemd drops it) or does not run.
    """
    res = res or {}
    state = "absent" if res.get("skipped") or not res.get("state") else str(res["state"])
    if state not in ("unreachable", "error") and res.get("run_state") and (
            res.get("unit_holds_run") is False or state == "absent"):
        state = str(res["run_state"])
    agent = res.get("agent") or {}
    # "running" with an agent that does not run: no unit was read, the records guessed (job_state)
    guessed = state == "running" and bool(agent) and not agent.get("running")
    ended = state in ("failed", "absent", "interrupted") or guessed
    if ended and host in ((stop or {}).get("hosts") or []):
        state = "stopped"
    return state


def cut_off_hosts(results: Mapping[str, Any]) -> list[str]:
    """per_step: the hosts whose replica ended cut off from a group that finished the run: its
    newest failure has cause ``cut_off`` (``progress.stop_cause``) and another host's
    ``progress.finished`` says the group finished the run. Such a replica trained nothing alone: it
    is ``cut_off``, not ``failed``. ``results``: host -> a status read (None: nothing read)."""
    progress = {h: ((r if isinstance(r, Mapping) else {}).get("progress") or {}) for h, r in results.items()}
    if not any(p.get("finished") for p in progress.values()):
        return []
    return [str(h) for h, p in progress.items() if p.get("stop_cause") == "cut_off" and not p.get("finished")]


def node_states(results: Mapping[str, Any], stop: Mapping[str, Any] | None = None) -> dict[str, str]:
    """Host -> :func:`node_state` of each host of ``results`` (host -> status read); a replica of
    :func:`cut_off_hosts` is ``cut_off`` unless stop.yml stopped it (its records say it trains no
    more, whatever its unit says)."""
    cut = set(cut_off_hosts(results))
    states = {str(h): node_state(r, str(h), stop) for h, r in results.items()}
    return {h: "cut_off" if h in cut and s != "stopped" else s for h, s in states.items()}


def unit_tells_run(res: Mapping[str, Any] | None) -> bool:
    """Whether a node's agent unit speaks of the run looked at (it holds the run, or may: not
    known), so that following it follows this run: not when the unit is another run's, gone, or
    the node could not be read."""
    res = res or {}
    return (res.get("state") not in (None, "absent", "unreachable", "error")
            and res.get("unit_holds_run") is not False and not res.get("skipped"))


def launch_since(records: Sequence[Record], events: Sequence[Record]) -> float:
    """When the run's newest launch began (unix s): the newest ``start`` record; under a
    replica-group engine (per_step, diloco: ddplab.engines.replica_groups), where a replica's
    worker can start (a torchrun restart, a rejoin) after its peers finished, the newest
    launch/resume event (:data:`LAUNCH_KINDS`), and without such events the oldest ``start``
    record (every launch's records count, so a rejoined or restarted worker's start never hides
    its peers' ``end`` records). -inf when there is no ``start`` record."""
    starts = [r for r in records if r.get("event") == "start" and num(r.get("time")) is not None]
    newest = max(starts, key=lambda r: num(r.get("time")), default=None)
    if newest is None:
        return float("-inf")
    if not replica_groups(newest.get("engine")):
        return num(newest.get("time"))
    launches = [t for e in events if e.get("kind") in LAUNCH_KINDS and (t := num(e.get("time"))) is not None]
    return max(launches) if launches else min(num(r.get("time")) for r in starts)


def run_outcome(records: Sequence[Record], events: Sequence[Record]) -> str:
    """How the run's newest launch ended, from every node's records and the run's events (one of
    :data:`OUTCOMES` but ``running``).

    ``no metrics``: no ``step`` record; ``finished``: the group finished since the newest launch
    (:func:`launch_since`; under per_step a replica that reached ``max_steps`` finished the run,
    whatever a replica cut off from the group did after it); ``stopped``: a stop event at or after
    the newest launch; ``failed``: a ``failure`` record after it; ``incomplete``: none of these
    (still running, or the agents vanished without a record). Earlier launches do not count.
    """
    if not any(r.get("event") == "step" for r in records):
        return "no metrics"
    since = launch_since(records, events)
    if group_finished(records, since):
        return "finished"
    stops = [t for e in events if e.get("kind") == STOP_KIND and (t := num(e.get("time"))) is not None]
    if any(t >= since - 1.0 for t in stops):
        return "stopped"
    failed = any(r.get("event") == "failure" and (num(r.get("time")) or since) >= since for r in records)
    return "failed" if failed else "incomplete"
