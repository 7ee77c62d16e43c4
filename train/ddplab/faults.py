"""Measured elastic recovery: one entry per fault injection of a run (docs/CONTRACTS.md).

Pure (records in, measures out) and part of the node runtime: the controller measures a collected
run with it (``python -m ddplab.controller.summary faults|build``), a node measures the injection
from its own records while the fault role waits (``python -m ddplab.status --since T``).

Inputs are what a run leaves on the controller:

* ``runs/<run_id>/events.jsonl`` -- one JSON object a line. The fault injections are the records
  with ``kind == "fault"``: ``{time, kind, mode, node, rank, duration_s, ...}`` (``time`` in unix
  seconds, the moment the fault was applied). Other kinds (play events) are ignored.
* the collected metrics, ``runs/<run_id>/<host>/metrics/*.jsonl``: the ``start``, ``step``,
  ``failure`` and ``end`` records of every worker (``event``, ``time``, ``host``, ``local_rank``,
  ``world_size``, ``restart_count``, ...).

For an injection at time ``T`` (records up to the next injection count for it), with a
*generation* meaning the records of one worker process, from its ``start`` record on:

``detected_s``
    ``T`` to the first sign that the group noticed: a ``failure`` record, a ``start`` record (a
    worker started again, by a restart or a membership change), or any record whose
    ``restart_count`` is above the one its worker had before ``T``. For a fault after which the
    target is gone (:data:`GONE_MODES`: kill-agent, poweroff) only the records of the other nodes
    count: the target's own (a powered-off node's SIGTERM failure record) say that it was told to
    go, not that the group noticed, and a node that is off cannot be read while the fault role
    measures, so the figure would otherwise depend on when it was measured.
``recovered_s``
    ``T`` to the first ``step`` record of the recovering group (:func:`_recovering_gens`): the
    first group started after ``T`` that completed a step, or, when a LARGER group that completed
    a step started within :data:`INTERIM_MAX_S` s (or :data:`INTERIM_MAX_STEP_TIMES` step times,
    whichever is longer) of it, that one (a latecomer joined: 3 -> 1 -> 2, the smaller group is
    interim). Training going again, at ``world_size_after``. A restart that does not change the
    world size (kill-worker) counts, since the step was completed by the new group; a later
    change of group size (an agent dying on its own minutes later) is not the recovery.
``last_step_before``
    the step the ORIGINAL group had completed when it stopped for the fault: :func:`step_at` the
    ``start`` of the first generation after ``T`` (``recovered``: an interim group's or the
    recovering one's; the old group's steps in flight after ``T`` and its ``failure`` records,
    which name the last step whose update finished, come before it), else :func:`step_at` ``T``.
    :func:`step_at` reads the newest ``step`` (committed), ``val``, ``checkpoint``, ``failure`` or
    ``end`` record (with ``log_interval N`` the step records alone lag by up to N-1 steps); the
    report's "at step" of a fault is this field.
``interim_groups`` / ``world_size_path``
    torchelastic: the groups that formed after ``T`` and were restarted before the recovering one
    (:func:`_interim_groups`: ``--nnodes MIN:MAX`` closes a rendezvous round with whoever joined
    by its last call, so a survivor slower than that can leave a smaller group to train alone
    until it joins), and the world sizes the recovery went through: ``world_size_before``, each
    interim group's, ``world_size_after`` (``[3, 1, 2]``).
``steps_lost``
    steps trained and redone on the way (:func:`_steps_lost_on_the_path`): for each group that
    stopped (the original at ``last_step_before``, each interim group at its ``last_step``) its
    last step minus the step the next group resumed from, never below 0, summed; without interim
    groups ``last_step_before - resumed_from_step``. ``resumed_from_step`` in a ``start`` record is
    the number of the last completed step the loaded state contains (0: from scratch), so resuming
    from an emergency checkpoint of the last completed step loses 0 steps.
``cause``
    the newest ``failure`` record of the original group (after ``T``, before the first new
    generation: an interim group's teardown is not the fault's cause); without one, or not
    recovered, the newest ``failure`` record after ``T``.
``world_size_before`` / ``world_size_after``
    of the newest step record before ``T`` / of the recovery step.
``outcome``
    ``recovered`` (a new generation completed a step); ``continued`` (a fault with a duration, no
    worker restarted, and the group completed steps after the fault had ended: a short freeze or
    partition the group rode out, a throttle; or, when the fault's window closed before its
    duration was over -- the next injection, stop or launch came first -- steps completed in the
    window after the one in flight at ``T``: the group trained through it, said in ``notes``);
    ``finished`` (an ``end`` record, no restart); ``not_recovered`` (no restarted group completed a
    step: still recovering, or the job ended -- ``cause`` then names the failing host and error,
    or, without a failure record, what its records show); ``no_data`` (no record after ``T``).
``stall_s``
    the longest time between consecutive completed steps (any host) from the last step before
    ``T`` to the first step of the recovery (or, without a restart, the first one after the fault
    ended): how long training stood still.
``step_time_ratio``
    for faults with a duration: median ``step_time_s`` of the steps completed during
    ``[T, T + duration_s]`` / median of those completed in the same length of time before ``T``
    (a throttled node makes the group slower: > 1).

Under the ``per_step`` engine (torchft: step records carry ``engine: per_step``, ``participants``,
``quorum_id``, ``committed``, with ``world_size`` = participants) the survivors are not restarted,
so the same fields mean:

``detected_s``
    ``T`` to the first uncommitted attempt (an ``uncommitted`` record: the vote failed), a committed step
    at another participant count, or a ``failure``/``start`` record.
``recovered_s``
    ``T`` to the first committed step at a participant count other than the one before ``T``
    (``world_size_after``): N-1 after a crash, power-off, freeze or partition, N after a rejoin.
``steps_lost``
    ``last_step_before + 1 - the recovery step``, never below 0 (0 when the survivors go on with
    the next step); ``last_step_before`` is :func:`step_at` ``T`` (no group restarted).
``restarts``
    worker processes started after ``T`` (the rejoining one, a local restart; never a survivor).

Uncommitted steps are never counted as steps, under either engine.

Resolution: step records are written every ``log_interval`` steps, so ``recovered_s`` can be late
by up to ``log_interval - 1`` step times; fault runs should use ``log_interval 1``. Times come
from the controller (injections) and the nodes (metrics): their clocks must agree (NTP; the lab
shares the host clock).
"""

from __future__ import annotations

import math
import statistics
import time
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from ddplab.engines import replica_groups
from ddplab.metrics import UNCOMMITTED_EVENT
from ddplab.records import Record, as_int, num
from ddplab.runstate import LAUNCH_KINDS, STOP_KIND

WorkerKey = tuple[str, int]  # (host, local_rank)

MODES = ("kill-worker", "kill-agent", "poweroff", "freeze", "partition", "throttle", "rejoin")
#: faults after which the target is gone until a rejoin: its own records do not count for detection
GONE_MODES = ("kill-agent", "poweroff")
#: faults that take their target out of the group (until a rejoin, the end of the duration)
LEAVING_MODES = (*GONE_MODES, "freeze", "partition")
#: records that name a completed step in their ``step`` field (:func:`step_at`)
STEP_EVENTS = ("step", "val", "checkpoint", "failure", "end")


@dataclass(frozen=True)
class Injection:
    """One fault applied to a run. ``time``: unix s; ``duration_s``: None for instant faults."""

    time: float
    mode: str
    node: str
    rank: int | None = None
    duration_s: float | None = None

    @classmethod
    def from_event(cls, event: Record) -> Injection:
        """Build from an events.jsonl record. Raises ValueError naming the missing/bad field."""
        t = num(event.get("time"))
        if t is None:
            raise ValueError(f"fault event without a numeric 'time': {dict(event)}")
        mode = event.get("mode")
        if mode not in MODES:
            raise ValueError(f"fault event with unknown mode {mode!r} (expected one of {', '.join(MODES)})")
        node = event.get("node")
        if not isinstance(node, str) or not node:
            raise ValueError(f"fault event without a 'node': {dict(event)}")
        rank = event.get("rank")
        rank = int(rank) if isinstance(rank, int | float) and not isinstance(rank, bool) else None
        return cls(time=t, mode=mode, node=node, rank=rank, duration_s=num(event.get("duration_s")))


@dataclass
class FaultMeasure:
    """The measured outcome of one injection: the ``faults`` entries of summary.json.

    Times are seconds after ``injected_at`` (unix s); None when it did not happen (yet).
    """

    mode: str
    node: str
    rank: int | None
    injected_at: float
    duration_s: float | None
    detected_s: float | None
    recovered_s: float | None
    steps_lost: int | None
    world_size_before: int | None
    world_size_after: int | None
    outcome: str
    last_step_before: int | None = None
    resumed_from_step: int | None = None
    stall_s: float | None = None
    step_time_ratio: float | None = None
    restarts: int = 0
    cause: str | None = None
    detected_by: str | None = None
    notes: list[str] = field(default_factory=list)
    world_size_path: list[int] = field(default_factory=list)
    interim_groups: list[dict[str, Any]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict, times rounded to ms."""
        d = asdict(self)
        for k in ("injected_at", "detected_s", "recovered_s", "stall_s"):
            if d[k] is not None:
                d[k] = round(d[k], 3)
        if d["step_time_ratio"] is not None:
            d["step_time_ratio"] = round(d["step_time_ratio"], 3)
        for g in d["interim_groups"]:
            for k in ("started_s", "stopped_s"):
                g[k] = round(g[k], 3)
        return d

    def path_text(self, arrow: str = "->") -> str:
        """The world sizes the recovery went through: :func:`path_text` of this measure."""
        return path_text(self.to_dict(), arrow)

    def interim_text(self, arrow: str = "->") -> str:
        """The interim groups in words: :func:`interim_text` of this measure."""
        return interim_text(self.to_dict(), arrow)


def world_size_path(fault: Mapping[str, Any]) -> list[Any]:
    """A ``faults`` entry's world sizes in order, e.g. ``[3, 1, 2]``: its ``world_size_path`` (an
    entry written before that field existed: ``[world_size_before, world_size_after]``); None for
    an unknown size."""
    path = fault.get("world_size_path") or [fault.get("world_size_before"), fault.get("world_size_after")]
    return list(path)


def path_text(fault: Mapping[str, Any], arrow: str = "->") -> str:
    """:func:`world_size_path` of a ``faults`` entry as text, e.g. ``3->1->2``; ``-`` for an
    unknown size."""
    return arrow.join(_fmt(w) for w in world_size_path(fault))


def interim_text(fault: Mapping[str, Any], arrow: str = "->") -> str:
    """A ``faults`` entry's interim groups in words, ``via a group of 1 (laptop-c) that trained
    steps 101->106, then stopped``, joined by ``; ``; empty without one."""
    return "; ".join(f"via a group of {_fmt(g.get('world_size'))} ({', '.join(g.get('hosts') or [])}) that "
                     f"trained steps {_fmt(g.get('resumed_from_step'))}{arrow}{_fmt(g.get('last_step'))}, "
                     "then stopped"
                     for g in fault.get("interim_groups") or [] if isinstance(g, Mapping))


def injections(events: Iterable[Record]) -> list[Injection]:
    """The fault injections among ``events``, oldest first. Raises ValueError on a malformed one."""
    return sorted((Injection.from_event(e) for e in events if e.get("kind") == "fault"),
                  key=lambda i: i.time)


# ----------------------------------------------------------------------------- measuring

@dataclass
class _Gen:
    """One worker generation: its start record and what it wrote after."""

    key: WorkerKey
    start: Record | None
    start_time: float
    records: list[Record] = field(default_factory=list)


def _generations(records: Iterable[Record]) -> list[_Gen]:
    """Split each worker's records (sorted by time) into generations at its ``start`` records."""
    per_worker: dict[WorkerKey, list[Record]] = defaultdict(list)
    for r in records:
        t = num(r.get("time"))
        if t is None or not isinstance(r.get("host"), str):
            continue
        per_worker[(r["host"], as_int(r.get("local_rank")) or 0)].append(r)
    gens: list[_Gen] = []
    for key, recs in per_worker.items():
        recs.sort(key=lambda r: r["time"])
        cur: _Gen | None = None
        for r in recs:
            if r.get("event") == "start" or cur is None:
                is_start = r.get("event") == "start"
                cur = _Gen(key, r if is_start else None, r["time"] if is_start else -math.inf)
                gens.append(cur)
                if is_start:
                    continue
            cur.records.append(r)
    return gens


def _steps(records: Iterable[Record]) -> list[Record]:
    """The completed steps: ``step`` records with a step number, not marked ``committed: false``."""
    return [r for r in records if r.get("event") == "step" and as_int(r.get("step")) is not None
            and r.get("committed") is not False]


def is_per_step(records: Iterable[Record]) -> bool:
    """True when the records come from a replica-group engine: ``per_step``, or ``diloco`` whose
    replica groups meet at its syncs (a record names one: ddplab.engines.replica_groups). Their
    faults are measured alike: no group restart, participants per committed step."""
    return any(replica_groups(r.get("engine")) for r in records)


def step_at(records: Iterable[Record], t: float) -> int | None:
    """The step the run had completed at unix time ``t``: the ``step`` of the newest record at or
    before ``t`` among committed ``step`` records and ``val``, ``checkpoint``, ``failure`` and
    ``end`` records (the largest among records of that same time); None when none is that old.

    The newest, not the largest: after a restart the group resumes from an older step and redoes
    the steps after it. A fault's ``last_step_before`` (module docstring) and the report's "at step".
    """
    best: tuple[float, int] | None = None
    for r in records:
        rt, s = num(r.get("time")), as_int(r.get("step"))
        if rt is None or s is None or rt > t or r.get("event") not in STEP_EVENTS:
            continue
        if r.get("event") == "step" and r.get("committed") is False:
            continue
        if best is None or (rt, s) > best:
            best = (rt, s)
    return best[1] if best else None


def _median_step_time(steps: Sequence[Record]) -> float | None:
    vals = [v for r in steps if (v := num(r.get("step_time_s"))) is not None]
    return statistics.median(vals) if vals else None


def _max_gap(times: Sequence[float]) -> float | None:
    ts = sorted(set(times))
    return max((b - a for a, b in zip(ts, ts[1:], strict=False)), default=None) if len(ts) > 1 else None


def measure(inj: Injection, records: Sequence[Record], until: float | None = None,
            closed_by: str | None = None) -> FaultMeasure:
    """Measure one injection from the run's metrics ``records`` (any order).

    ``until``: ignore records at or after this time (the next injection, stop or launch), so that
    one injection's recovery is not credited to another; ``closed_by`` names that event in the
    words of the notes and causes (``kill-agent of laptop-a``). See the module docstring for the
    definitions. Pure: reads nothing, raises nothing on odd records (they are skipped).
    """
    t0 = inj.time
    end = until if until is not None else math.inf
    recs = [r for r in records if (t := num(r.get("time"))) is not None and t < end]
    before = [r for r in recs if r["time"] <= t0]
    after = [r for r in recs if r["time"] > t0]
    steps_before = _steps(before)
    last_before = max(steps_before, key=lambda r: r["time"], default=None)

    m = FaultMeasure(
        mode=inj.mode, node=inj.node, rank=inj.rank, injected_at=t0, duration_s=inj.duration_s,
        detected_s=None, recovered_s=None, steps_lost=None,
        world_size_before=as_int(last_before.get("world_size")) if last_before else None,
        world_size_after=None, outcome="no_data", last_step_before=step_at(before, t0),
    )
    if not after:
        return m

    # detection
    rc_before: dict[WorkerKey, int] = {}
    for r in before:
        rc = as_int(r.get("restart_count"))
        if rc is not None:
            rc_before[(r["host"], as_int(r.get("local_rank")) or 0)] = rc
    per_step = is_per_step(recs)
    others = inj.mode in GONE_MODES
    for r in after:
        if others and r.get("host") == inj.node:
            continue  # the target's own reaction is no sign that the group noticed
        key = (r.get("host"), as_int(r.get("local_rank")) or 0)
        rc = as_int(r.get("restart_count"))
        ev = r.get("event")
        quorum_changed = per_step and (ev == UNCOMMITTED_EVENT or ev == "step" and (
            r.get("committed") is False or as_int(r.get("world_size")) != m.world_size_before))
        if (ev in ("failure", "start") or quorum_changed
                or (rc is not None and key in rc_before and rc > rc_before[key])):
            m.detected_s = r["time"] - t0
            m.detected_by = f"{'uncommitted step' if r.get('committed') is False else ev} on {r.get('host')}"
            break

    gens = _generations(recs)
    new_gens = [g for g in gens if g.start_time > t0]
    m.restarts = len(new_gens)
    failures_after = [r for r in after if r.get("event") == "failure"]
    if failures_after:
        f = failures_after[-1]
        m.cause = f"{f.get('host')} (rank {f.get('rank')}): {f.get('error')}"
    if per_step:
        return _per_step(m, inj, recs, last_before, until, closed_by)

    recovery: tuple[float, Record, _Gen] | None = None
    step_time = _median_step_time(sorted(steps_before, key=lambda r: r["time"])[-50:]) or 0.0
    for g in _recovering_gens(new_gens, inj.node if inj.mode in LEAVING_MODES else None,
                              max(INTERIM_MAX_S, INTERIM_MAX_STEP_TIMES * step_time)):
        st = _steps(g.records)
        if st:
            first = min(st, key=lambda r: r["time"])
            if recovery is None or first["time"] < recovery[0]:
                recovery = (first["time"], first, g)

    if recovery is not None:
        t_rec, step_rec, gen = recovery
        m.outcome = "recovered"
        m.recovered_s = t_rec - t0
        m.world_size_after = as_int(step_rec.get("world_size"))
        # the ORIGINAL group stopped when the first generation after T started (an interim group's,
        # or the recovering one's): its steps in flight after T and its failure records (the last
        # step whose update finished) come before that
        first_start = min(g.start_time for g in new_gens)
        m.last_step_before = step_at([r for r in recs if r["time"] < first_start], first_start)
        original_failures = [r for r in failures_after if r["time"] < first_start]
        if original_failures:  # the interim groups' teardown is no cause of the fault
            f = original_failures[-1]
            m.cause = f"{f.get('host')} (rank {f.get('rank')}): {f.get('error')}"
        m.interim_groups = _interim_groups(new_gens, gen, t0)
        resumed = as_int(gen.start.get("resumed_from_step")) if gen.start else None
        m.resumed_from_step = resumed
        m.steps_lost = _steps_lost_on_the_path(m.last_step_before, m.interim_groups, resumed)
        if resumed is None:
            m.notes.append("start record without resumed_from_step: steps_lost unknown")
        first_after_any = t_rec
    else:
        steps_after = _steps(after)
        first_after_any = _without_restart(m, inj, steps_after, any(r.get("event") == "end" for r in after),
                                           until, closed_by)
        if m.outcome == "not_recovered" and m.cause is None:
            m.cause = _no_step_text(inj, steps_after, until, closed_by) + " and no failure record was written"

    return _stall_and_slowdown(m, inj, recs, last_before, first_after_any)


def _trained_on(inj: Injection, steps_after: Sequence[Record],
                until: float | None) -> tuple[list[Record], bool]:
    """The completed steps after ``inj`` that show the group trained on through it without a
    restart, and whether its window closed before the fault's duration was over.

    An instant fault: none (steps completed right after it are the old group's last ones in
    flight). A timed fault: the steps completed after ``T + duration_s``; when ``until`` (the next
    injection, stop or launch) comes before that, the steps completed in the window after the one in
    flight at the injection (step numbers above the first completed after ``T``): the group trained
    while the fault held (a throttle), and nothing later belongs to this fault.
    """
    if not inj.duration_s:
        return [], False
    ended_at = inj.time + inj.duration_s
    if until is None or until >= ended_at:
        return [r for r in steps_after if r["time"] > ended_at], False
    first = min(steps_after, key=lambda r: r["time"], default=None)
    if first is None:
        return [], True
    in_flight = as_int(first.get("step"))
    return [r for r in steps_after if (as_int(r.get("step")) or 0) > (in_flight or 0)], True


def _cut_short_text(inj: Injection, until: float, closed_by: str | None) -> str:
    """``its window closed at +20.0 s by kill-agent of laptop-a, before its 90 s were over``."""
    return (f"its window closed at +{until - inj.time:.1f} s by {closed_by or 'the next event'}, "
            f"before its {inj.duration_s:g} s were over")


def _no_step_text(inj: Injection, steps_after: Sequence[Record], until: float | None,
                  closed_by: str | None) -> str:
    """Why a fault without a restart counts as not recovered, in words true to its records."""
    if not inj.duration_s:
        return "no step completed after the fault"
    _, cut = _trained_on(inj, steps_after, until)
    if cut:
        return ("no step completed in its window after the one in flight; "
                + _cut_short_text(inj, until, closed_by))
    during = {as_int(r.get("step")) for r in steps_after if r["time"] <= inj.time + inj.duration_s}
    return (f"no step completed after the fault's {inj.duration_s:g} s were over"
            + (f" ({len(during)} step(s) completed during it)" if during else ""))


def _without_restart(m: FaultMeasure, inj: Injection, steps_after: Sequence[Record], ended: bool,
                     until: float | None, closed_by: str | None) -> float | None:
    """Set ``outcome`` (``continued``, ``finished`` or ``not_recovered``), ``steps_lost``,
    ``world_size_after`` and notes of ``m`` for a fault no restarted group recovered from
    (:func:`_trained_on`); returns the time of the first step that shows training went on, or None."""
    went_on, cut = _trained_on(inj, steps_after, until)
    if went_on:
        m.outcome, m.steps_lost = "continued", 0
        first = min(went_on, key=lambda r: r["time"])
        m.world_size_after = as_int(first.get("world_size"))
        if cut and until is not None:
            steps = [as_int(r.get("step")) or 0 for r in went_on]
            m.notes.append(f"trained on through it, steps {min(steps)}->{max(steps)}; "
                           f"{_cut_short_text(inj, until, closed_by)}")
        return first["time"]
    if ended:
        m.outcome, m.steps_lost = "finished", 0
    else:
        m.outcome = "not_recovered"
    return None


def _round_of(gen: _Gen, rounds: Sequence[_Gen]) -> _Gen | None:
    """The group (re)start ``gen`` belongs to: among ``rounds`` (the generations of rank 0, one per
    group formed by a rendezvous round), the one of the same world size that started nearest in
    time (the workers of one round start within a second of each other)."""
    ws = as_int(gen.start.get("world_size")) if gen.start else None
    same = [r for r in rounds if r.start and as_int(r.start.get("world_size")) == ws]
    return min(same, key=lambda r: abs(r.start_time - gen.start_time), default=None)


#: a smaller group that trained after a fault is an interim one only when a larger group (a
#: latecomer joining) starts within this many seconds of it, or within
#: :data:`INTERIM_MAX_STEP_TIMES` step times when steps are slower: torchelastic's rendezvous
#: ``join_timeout`` (ddp_job_rdzv_conf, 120 s) bounds how long a survivor's agent takes to join
#: the round after a fault. A larger group later than that is a later change (an agent
#: restarted on its own), not the fault's recovery.
INTERIM_MAX_S = 120.0
INTERIM_MAX_STEP_TIMES = 10


def _rounds(new_gens: Sequence[_Gen]) -> tuple[list[_Gen], dict[int, list[_Gen]]]:
    """The groups among ``new_gens``: the generations of rank 0 (one per group a rendezvous round
    formed), oldest first, and their members by ``id`` of the round (:func:`_round_of`)."""
    rounds = sorted((g for g in new_gens if g.start and as_int(g.start.get("rank")) == 0),
                    key=lambda g: g.start_time)
    members: dict[int, list[_Gen]] = defaultdict(list)
    for g in new_gens:
        if (r := _round_of(g, rounds)) is not None:
            members[id(r)].append(g)
    return rounds, members


def _recovering_gens(new_gens: Sequence[_Gen], target: str | None = None,
                     interim_max_s: float = INTERIM_MAX_S) -> list[_Gen]:
    """The generations after ``T`` whose first completed step can be the recovery: those of the
    group the fault led to. Groups are the rounds of rank-0 generations (:func:`_rounds`); the
    recovering group is the first one that completed a step, unless a LARGER group that completed
    a step started within ``interim_max_s`` seconds of it (a latecomer joining: 3 -> 1 -> 2), which
    then takes its place (repeated; groups of the same size in between are restarts of it). A
    smaller group after the recovery (an agent dying on its own minutes later: 3 -> 2, then 1) or
    a larger one later than ``interim_max_s`` is a later change, not this recovery. ``target``: the
    node a fault of :data:`LEAVING_MODES` took away; a group with it again is the target back (a
    freeze's thaw), not the recovery from its leaving. Every generation when no rank-0 ``start``
    record is among them."""
    all_rounds, members = _rounds(new_gens)
    rounds = [r for r in all_rounds if target not in {g.key[0] for g in members[id(r)]}]
    stepped = [r for r in rounds if any(_steps(g.records) for g in members[id(r)])]
    if not stepped:
        return list(new_gens)

    def ws(r: _Gen) -> int:
        w = as_int(r.start.get("world_size")) if r.start else None
        return -1 if w is None else w

    cur = stepped[0]
    for nxt in stepped[1:]:
        if ws(nxt) < ws(cur) or (ws(nxt) > ws(cur) and nxt.start_time - cur.start_time > interim_max_s):
            break
        if ws(nxt) > ws(cur):
            cur = nxt
    return members[id(cur)]


def _interim_groups(new_gens: Sequence[_Gen], recovering: _Gen, t0: float) -> list[dict[str, Any]]:
    """The groups formed after the injection at ``t0`` and stopped before the one that recovered
    (``recovering``: the generation of the recovery step): ``[{world_size, hosts, started_s,
    stopped_s, resumed_from_step, last_step, steps_trained}]`` in time order, times in s after
    ``t0``. torchelastic's ``--nnodes=MIN:MAX`` closes a rendezvous round with whoever joined by
    its last call, so after a fault a group smaller than the final one can form, train, and be
    restarted when the next node joins. ``last_step``: :func:`step_at` over the group's own records
    (its SIGTERM ``failure``/``checkpoint`` records name it; ``resumed_from_step`` when it wrote
    none); ``steps_trained`` = ``last_step - resumed_from_step``."""
    rounds, members = _rounds(new_gens)
    final = _round_of(recovering, rounds)
    if final is None:
        return []
    out = []
    for r in (r for r in rounds if r.start_time < final.start_time and r is not final):
        gens = members[id(r)]
        own = [x for g in gens for x in g.records]
        resumed = as_int(r.start.get("resumed_from_step")) if r.start else None
        last = step_at(own, math.inf)
        last = resumed if last is None else last
        out.append({
            "world_size": as_int(r.start.get("world_size")) if r.start else None,
            "hosts": sorted({g.key[0] for g in gens}),
            "started_s": min(g.start_time for g in gens) - t0,
            "stopped_s": max([x["time"] for x in own] + [r.start_time]) - t0,
            "resumed_from_step": resumed, "last_step": last,
            "steps_trained": max(0, last - resumed) if last is not None and resumed is not None else None,
        })
    return out


def _steps_lost_on_the_path(last_step_before: int | None, interim: Sequence[Mapping[str, Any]],
                            resumed: int | None) -> int | None:
    """Steps trained and then redone over a recovery's path: for every group that stopped (the
    original one at ``last_step_before``, then each interim group at its ``last_step``), its last
    step minus the step the next group resumed from (never below 0), summed; None when a step is
    unknown. Without interim groups: ``last_step_before - resumed_from_step``."""
    stops = [last_step_before, *(g["last_step"] for g in interim)]
    starts = [*(g["resumed_from_step"] for g in interim), resumed]
    if any(x is None for x in (*stops, *starts)):
        return None
    return sum(max(0, a - b) for a, b in zip(stops, starts, strict=True))


def _stall_and_slowdown(m: FaultMeasure, inj: Injection, recs: Sequence[Record], last_before: Record | None,
                        first_after_any: float | None) -> FaultMeasure:
    """Fill ``stall_s`` (longest gap between completed steps from the last one before the fault to
    ``first_after_any``), ``step_time_ratio`` (faults with a duration) and ``world_size_path`` of
    ``m``; returns it."""
    t0 = inj.time
    m.world_size_path = [m.world_size_before, *(g["world_size"] for g in m.interim_groups),
                         m.world_size_after]
    if last_before is not None and first_after_any is not None:
        times = [r["time"] for r in _steps(recs) if last_before["time"] <= r["time"] <= first_after_any]
        m.stall_s = _max_gap(times)
    if inj.duration_s:
        d = inj.duration_s
        during = [r for r in _steps(recs) if t0 < r["time"] <= t0 + d]
        ref = [r for r in _steps(recs) if t0 - d <= r["time"] <= t0]
        a, b = _median_step_time(during), _median_step_time(ref)
        if a is not None and b:
            m.step_time_ratio = a / b
    return m


def _per_step(m: FaultMeasure, inj: Injection, recs: Sequence[Record], last_before: Record | None,
              until: float | None = None, closed_by: str | None = None) -> FaultMeasure:
    """The per_step engine's recovery (module docstring): the first committed step after the fault
    at another participant count; without one, the fault was ridden out or the job finished/ended."""
    t0 = inj.time
    after = _steps(r for r in recs if r["time"] > t0)
    changed = [r for r in after if as_int(r.get("world_size")) != m.world_size_before]
    first_after_any: float | None = None
    if changed:
        rec = min(changed, key=lambda r: r["time"])
        m.outcome = "recovered"
        m.recovered_s = rec["time"] - t0
        m.world_size_after = as_int(rec.get("world_size"))
        m.resumed_from_step = as_int(rec.get("step"))
        if m.last_step_before is not None and m.resumed_from_step is not None:
            m.steps_lost = max(0, m.last_step_before + 1 - m.resumed_from_step)
        first_after_any = rec["time"]
    else:
        first_after_any = _without_restart(m, inj, after, any(r.get("event") == "end" and r["time"] > t0
                                                              for r in recs), until, closed_by)
        if m.outcome == "not_recovered" and m.cause is None:
            m.cause = (f"no step committed at another participant count after the fault; "
                       f"{_no_step_text(inj, after, until, closed_by)}")
    return _stall_and_slowdown(m, inj, recs, last_before, first_after_any)


def measure_all(events: Iterable[Record], records: Sequence[Record]) -> list[FaultMeasure]:
    """One :class:`FaultMeasure` per fault injection in ``events``, oldest first; each sees the
    records up to the next injection, ``kind: stop`` event (the restarts a stop causes are no
    recovery from the fault) or ``launch``/``resume`` event (a new launch's starts are neither).
    Raises ValueError on a malformed fault event."""
    events = list(events)
    injs = injections(events)
    stops = [(t, f"the {e['kind']}") for e in events if e.get("kind") in (STOP_KIND, *LAUNCH_KINDS)
             and (t := num(e.get("time"))) is not None]
    ends = sorted([(i.time, f"{i.mode} of {i.node}") for i in injs] + stops)
    out = []
    for inj in injs:
        until, closed_by = next(((t, what) for t, what in ends if t > inj.time), (None, None))
        out.append(measure(inj, records, until, closed_by))
    return out


def agent_restarts(records: Iterable[Record]) -> int | None:
    """The restarts of one node's newest agent: the ``restart_count`` of the node's newest record
    (torchrun counts the times it restarted its workers; a new agent, after a rejoin or a resume,
    counts from 0). What status.yml shows per laptop; summary.json's ``per_host`` gives it beside
    ``restart_count``, the most any agent of the node reached in the run. None without records."""
    timed = [r for r in records if num(r.get("time")) is not None]
    newest = max(timed, key=lambda r: r["time"], default=None)
    return None if newest is None else as_int(newest.get("restart_count"))


def node_of_rank(records: Iterable[Record], rank: int) -> str | None:
    """The host whose newest record carries global rank ``rank``.

    Ranks can move between nodes after a restart, so only each worker's newest record counts;
    among those, the newest wins. None when no worker holds it now.
    """
    holders = [w for w in newest_per_worker(records) if w["rank"] == rank]
    return holders[-1]["host"] if holders else None


def newest_per_worker(records: Iterable[Record]) -> list[dict[str, Any]]:
    """The newest record of every worker (host, local_rank), oldest worker first: who holds which
    rank now, at which world size and step. Fields: host, local_rank, time, event, rank,
    world_size, restart_count, step (None when the record has none)."""
    newest: dict[WorkerKey, Record] = {}
    for r in records:
        t = num(r.get("time"))
        if t is None or not isinstance(r.get("host"), str):
            continue
        key = (r["host"], as_int(r.get("local_rank")) or 0)
        if key not in newest or t >= newest[key]["time"]:
            newest[key] = r
    out = [{"host": k[0], "local_rank": k[1], "time": r["time"], "event": r.get("event"),
            "rank": as_int(r.get("rank")), "world_size": as_int(r.get("world_size")),
            "restart_count": as_int(r.get("restart_count")), "step": as_int(r.get("step"))}
           for k, r in newest.items()]
    return sorted(out, key=lambda w: w["time"])


PHASES = ("waiting", "recovered", "continued", "finished", "ended")


def progress_phase(m: FaultMeasure, agent_active: bool) -> str:
    """Where the group stands after an injection, seen from one node: a play waits while it is
    ``waiting``.

    ``recovered``: a restarted group completed a step. ``finished``: the job wrote its ``end``
    record. ``continued``: no restart, and a step completed after the fault's duration was over
    (the group rode it out). ``ended``: none of those and the node's agent is no longer running
    (restarts ran out, or the job was stopped). ``m``: :func:`measure` of the node's own records
    for the injection (with its ``duration_s``).
    """
    if m.outcome in ("recovered", "finished", "continued"):
        return m.outcome
    return "waiting" if agent_active else "ended"


# ----------------------------------------------------------------------------- output

_COLUMNS = ("mode", "node", "rank", "world", "detected_s", "recovered_s", "steps_lost", "stall_s", "outcome")


def _fmt(v: Any, digits: int = 1) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.{digits}f}"
    return str(v)


def inputs_line(newest: Mapping[str, float | None], down: Iterable[str] = ()) -> str:
    """Which records a measurement read: ``newest`` maps each host whose metrics were read to the
    time (unix s) of its newest record (None: no record); ``down`` names the hosts that were not
    reachable when they were fetched (their records, if any, are an older copy). The summary
    measures again with the same function from every node's collected records, so a figure can
    differ only where a host was down; the line says so.
    """
    def clock(t: float | None) -> str:
        return "no record" if t is None else time.strftime("%H:%M:%S", time.localtime(t))

    down = sorted(set(down))
    read = [f"{h} (to {clock(t)})" for h, t in sorted(newest.items()) if h not in down]
    line = f"measured from the records of {', '.join(read) or 'no node'}"
    if down:
        old = [f"{h} ({'an older copy to ' + clock(newest[h]) if newest.get(h) is not None else 'none'})"
               for h in down]
        line += (f"; down, not read now: {', '.join(old)}. summary.json is measured again from every node's "
                 "records when the run is collected (collect.yml), with the same rules")
    return line


def format_table(measures: Sequence[FaultMeasure]) -> str:
    """A fixed-width text table, one line per injection, then a cause line per failed one."""
    rows = [list(_COLUMNS)]
    for m in measures:
        world = m.path_text()
        rows.append([m.mode, m.node, _fmt(m.rank), world, _fmt(m.detected_s), _fmt(m.recovered_s),
                     _fmt(m.steps_lost), _fmt(m.stall_s), m.outcome])
    widths = [max(len(r[i]) for r in rows) for i in range(len(_COLUMNS))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    for m in measures:
        if m.step_time_ratio is not None and m.mode == "throttle":
            lines.append(f"{m.mode} {m.node}: steps {m.step_time_ratio:.2f}x slower while throttled")
        if m.interim_groups:
            lines.append(f"{m.mode} {m.node}: {m.interim_text()}")
        if m.outcome == "not_recovered":
            lines.append(f"{m.mode} {m.node}: not recovered - {m.cause}")
    return "\n".join(lines)
