"""The report's figures, derived from a :class:`ddplab.controller.rundir.RunFolder` (no files, no drawing).

Every function takes the run folder as :func:`ddplab.controller.rundir.load_run` read it and
returns plain series and rows; :mod:`.plots` draws them and :mod:`.html` lays them out.
"""

from __future__ import annotations

import bisect
import math
import re
import statistics
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ddplab.controller import straggler
from ddplab.controller.rundir import (
    GroupStart,
    RunFolder,
    cut_off_nodes,
    group_starts,
    world_size_at,
    world_size_timeline,
)
from ddplab.controller.summary import cut_off_line, final_evaluation, measure_faults
from ddplab.engines import replica_groups
from ddplab.faults import interim_text, is_per_step, path_text, world_size_path
from ddplab.faults import step_at as fault_step_at
from ddplab.records import as_int, by_time, num
from ddplab.runstate import LAUNCH_WORDS, OUTCOME_WORDS, STOP_KIND, run_outcome

RESTART_GAP_S = 20.0  # step records of one run of a step are closer than this
Record = dict[str, Any]


def engine(run: RunFolder) -> str:
    """The run's recovery engine: the one its records name (the newest ``start`` record's
    ``engine``; a replica-group engine's records: :func:`ddplab.faults.is_per_step`), else
    ``torchelastic``."""
    named = [r.get("engine") for r in run.by_event("start") if r.get("engine")]
    if named:
        return str(named[-1])
    return "per_step" if is_per_step(run.records) else "torchelastic"


def first_set(*values: Any) -> Any:
    """The first value that is not None (None when all are)."""
    return next((v for v in values if v is not None), None)


def step_series(run: RunFolder) -> dict[straggler.WorkerKey, list[Record]]:
    """Step records per (host, local_rank), one per step (newest), sorted by step."""
    return straggler.step_records(run.records)


def loss_per_step(run: RunFolder) -> list[tuple[int, float]]:
    """(step, train loss): per step, the lowest rank's loss from the newest time that step was run.

    A step redone after a restart counts once (its newest run); records of one run of a step are
    within RESTART_GAP_S of each other.
    """
    recs: dict[int, list[Record]] = defaultdict(list)
    for r in run.by_event("step"):
        ok = num(r.get("loss")) is not None and num(r.get("time")) is not None
        if isinstance(r.get("step"), int) and ok:
            recs[r["step"]].append(r)
    out = []
    for s in sorted(recs):
        newest = max(r["time"] for r in recs[s])
        last_run = [r for r in recs[s] if r["time"] >= newest - RESTART_GAP_S]
        best = min(last_run, key=lambda r: r.get("rank") if isinstance(r.get("rank"), int) else 1 << 30)
        out.append((s, float(best["loss"])))
    return out


def val_points(run: RunFolder) -> list[tuple[int, float]]:
    """(step, val loss), one per step."""
    pts = {r["step"]: float(r["val_loss"]) for r in run.by_event("val")
           if isinstance(r.get("step"), int) and num(r.get("val_loss")) is not None}
    return sorted(pts.items())


Restart = GroupStart  # one (re)start of the group: time, resumed step, world size, initial


@dataclass(frozen=True)
class ReplicaStart(GroupStart):
    """per_step: one start of a replica's worker on ``host``. ``step`` is the first step it
    committed after that start (0: none) and ``world_size`` that step's participants: a replica
    takes a live peer's state at its first quorum, so its checkpoint's step says little.
    ``initial``: the host's first start."""

    host: str = ""


def restarts(run: RunFolder) -> list[Restart]:
    """The group's (re)starts (:func:`ddplab.controller.rundir.group_starts`: one per rank-0
    ``start`` record); under per_step each replica's worker starts (:class:`ReplicaStart`: every
    replica is rank 0 of its own group of 1, so its launch is no group restart)."""
    if not replica_groups(engine(run)):
        return group_starts(run.records)
    out: list[Restart] = []
    seen: set[str] = set()
    for r in by_time(run.by_event("start")):
        host, t = str(r.get("host")), num(r.get("time"))
        if t is None:
            continue
        first = next((s for s in by_time(run.by_event("step")) if s.get("host") == host
                      and s.get("committed") and (num(s.get("time")) or 0.0) >= t), {})
        out.append(ReplicaStart(t, as_int(first.get("step")) or 0, as_int(first.get("participants")) or 0,
                                host not in seen, host))
        seen.add(host)
    return out


def start_line(r: Restart, clock: str) -> str:
    """One entry of the report's list of (re)starts, ``clock`` its time since the first record."""
    if isinstance(r, ReplicaStart):
        what = f"{clock} {r.host} {'launch' if r.initial else 'restarted'}"
        return what + (f", first commit step {r.step} at {r.world_size} participants" if r.step else
                       ", no step committed")
    return f"{clock} N={r.world_size} from step {r.step}" + (" (launch)" if r.initial else "")


def distinct_samples(samples: dict[str, str]) -> list[tuple[str, str]]:
    """``(files, text)`` per distinct generated text, by host: under per_step every node writes
    the same ``sample.txt`` (each is rank 0 of its replica group), shown once with its files."""
    by_text: dict[str, list[str]] = defaultdict(list)
    for host, text in sorted(samples.items()):
        by_text[text].append(f"{host}/sample.txt")
    return [(", ".join(files), text) for text, files in by_text.items()]


@dataclass(frozen=True)
class Fault:
    """A fault injection, from summary.json ``faults`` or from events.jsonl (records with a mode)."""

    mode: str
    node: str
    rank: Any
    time: float | None
    detected_s: float | None = None
    recovered_s: float | None = None
    steps_lost: Any = None
    world_size_before: Any = None
    world_size_after: Any = None
    outcome: str = ""
    duration_s: float | None = None
    last_step_before: int | None = None  # the step the original group had completed when it stopped
    world_size_path: tuple[Any, ...] = ()  # the world sizes of the recovery, e.g. (3, 1, 2)
    interim_groups: tuple[dict[str, Any], ...] = ()  # groups formed and stopped on the way (ddplab.faults)

    @property
    def ws_text(self) -> str:
        """The recovery's world sizes for the page, e.g. ``3 → 1 → 2`` (``—`` when none is known)."""
        fault = {"world_size_path": list(self.world_size_path), "world_size_before": self.world_size_before,
                 "world_size_after": self.world_size_after}
        return "—" if all(w is None for w in world_size_path(fault)) else path_text(fault, " → ")

    @property
    def interim_text(self) -> str:
        """The interim groups in words (:func:`ddplab.faults.interim_text`), '' without one."""
        return interim_text({"interim_groups": list(self.interim_groups)}, " → ")


_SOURCE_REF = re.compile(r"\[[^\]\s]*/[^\]\s]*:\d+\]\s*")


def short_cause(text: str, limit: int = 160) -> str:
    """A failure message cut to what a reader needs in a table cell.

    Drops source references such as ``[/__w/pytorch/.../pair.cc:553]`` and gloo's boilerplate advice
    ("This is typically caused by ..."), keeps characters of the Basic Multilingual Plane only (the
    report's fonts have no emoji), and ends with "…" past ``limit`` characters.
    """
    t = _SOURCE_REF.sub("", str(text))
    t = re.split(r"\.\s+This is typically caused", t, maxsplit=1)[0]
    t = "".join(ch for ch in t if ord(ch) <= 0xFFFF)
    t = " ".join(t.split())
    return t if len(t) <= limit else t[: limit - 1].rstrip() + "…"


def _outcome(f: dict[str, Any]) -> str:
    parts = [str(f["outcome"])] if f.get("outcome") else []
    if f.get("cause"):
        parts.append(f"cause: {short_cause(f['cause'])}")
    notes = f.get("notes")
    if isinstance(notes, list):
        parts += [str(n) for n in notes]
    return "; ".join(parts)


def faults(run: RunFolder) -> list[Fault]:
    """The run's faults as summary.json has them (measured by ``summary build`` from the collected
    records, or by kill-node.yml from the records it fetched: :func:`ddplab.faults.measure_all`
    both); without them, measured here by the same function
    (:func:`ddplab.controller.summary.measure_faults`) from the run's records; else the events.jsonl
    records of ``kind: fault`` (not measured: a malformed fault event). Measured once per loaded
    run (kept in ``run.derived``): a report build reads the faults several times."""
    src = run.summary.get("faults")
    if not (isinstance(src, list) and src):
        if "faults" not in run.derived:
            run.derived["faults"] = measure_faults(run)
        src = run.derived["faults"]
    if isinstance(src, list) and src:
        return [Fault(str(f.get("mode", "?")), str(f.get("node", "?")), f.get("rank"),
                      num(f.get("injected_at")), num(f.get("detected_s")), num(f.get("recovered_s")),
                      f.get("steps_lost"), f.get("world_size_before"), f.get("world_size_after"), _outcome(f),
                      num(f.get("duration_s")), as_int(f.get("last_step_before")),
                      tuple(f.get("world_size_path") or ()),
                      tuple(g for g in f.get("interim_groups") or () if isinstance(g, dict)))
                for f in src if isinstance(f, dict)]
    return [Fault(str(e.get("mode")), str(e.get("node", "?")), e.get("rank"), num(e.get("time")),
                  outcome="not measured (no summary.json faults)", duration_s=num(e.get("duration_s")))
            for e in run.events if e.get("kind") == "fault"]


def step_at(run: RunFolder, t: float | None) -> int | None:
    """The step the run had completed at unix time ``t``: :func:`ddplab.faults.step_at` (the one rule
    of a fault's ``last_step_before`` in summary.json and of the recovery table's "at step")."""
    return None if t is None else fault_step_at(run.records, t)


def fault_step(run: RunFolder, f: Fault) -> int | None:
    """The step a fault hit: its measured ``last_step_before`` (summary.json's value, a failure
    record's step included), else :func:`step_at` its time."""
    return f.last_step_before if f.last_step_before is not None else step_at(run, f.time)


@dataclass(frozen=True)
class Rebalance:
    """How balanced batches followed a fault: the step the fault hit (``at_step``; ``what``: the
    fault, or its end for a throttle that ended) and the first new plan after it (``plan_step``,
    None: none by the run's last step record; ``reason``; ``shares``: host -> samples)."""

    what: str
    at_step: int
    plan_step: int | None
    reason: str | None
    shares: dict[str, int]

    @property
    def steps(self) -> int | None:
        """Steps from the fault to the new plan."""
        return None if self.plan_step is None else self.plan_step - self.at_step


def rebalances(run: RunFolder, fl: Sequence[Fault], gain: straggler.BalanceGain | None) -> list[Rebalance]:
    """For each fault of a balanced run, and for the end of each throttle: the first plan after
    the step it hit (``speed`` or ``group``; ``calibrated`` counts after a restart)."""
    if gain is None:
        return []
    plans = [p for p in gain.plans if p.reason != "start"]
    points = []
    for f in fl:
        if (s := fault_step(run, f)) is not None:
            points.append((f"{f.mode} {f.node}", s))
        if f.mode == "throttle" and f.time is not None and f.duration_s and (
                end := step_at(run, f.time + f.duration_s)) is not None and end > (s or -1):
            points.append((f"end of throttle {f.node}", end))
    out = []
    for what, at in points:
        nxt = next((p for p in plans if p.step > at), None)
        out.append(Rebalance(what, at, nxt and nxt.step, nxt and nxt.reason,
                             {h: n for (h, _), n in sorted(nxt.shares.items())} if nxt else {}))
    return out


@dataclass(frozen=True)
class InterimSegment:
    """An interim group a fault's recovery passed through (:func:`ddplab.faults.measure`'s
    ``interim_groups``): from ``start`` to ``end`` (unix s) at ``world_size`` on ``hosts``, training
    steps ``from_step`` to ``to_step``; ``fault`` names the fault (``kill-agent laptop-a``)."""

    start: float
    end: float
    world_size: int
    from_step: int | None
    to_step: int | None
    hosts: tuple[str, ...]
    fault: str


def interim_segments(run: RunFolder) -> list[InterimSegment]:
    """The interim groups of every fault of :func:`faults`, in time order (what the world-size plot
    draws between the fault and its recovery: the step records of a short-lived group are often
    none, with ``log_interval`` > 1)."""
    out = []
    for f in faults(run):
        for g in f.interim_groups:
            a, b, ws = num(g.get("started_s")), num(g.get("stopped_s")), as_int(g.get("world_size"))
            if f.time is None or a is None or b is None or ws is None:
                continue
            out.append(InterimSegment(f.time + a, f.time + b, ws, as_int(g.get("resumed_from_step")),
                                      as_int(g.get("last_step")), tuple(g.get("hosts") or ()),
                                      f"{f.mode} {f.node}"))
    return sorted(out, key=lambda x: x.start)


def world_size_points(run: RunFolder) -> list[tuple[float, int]]:
    """(unix time, world size) at every rank-0 ``step`` record, in time order, the world size read
    from the run's one :func:`ddplab.controller.rundir.world_size_timeline` (what the world-size
    plot draws)."""
    timeline = world_size_timeline(run.records)
    times = sorted({t for r in run.by_event("step", rank=0) if (t := num(r.get("time"))) is not None})
    return [(t, ws) for t in times if (ws := world_size_at(timeline, t)) is not None]


def ws_sequence(run: RunFolder) -> list[int]:
    """The world sizes the group went through, in order (e.g. [3, 2, 3])."""
    return [e["world_size"] for e in world_size_timeline(run.records)]


#: a band of "no training": committed steps this many median step times later than expected
BAND_K = 20.0
#: and at least this many seconds later (a tiny model's 12 ms steps: jitter is no band)
BAND_MIN_S = 2.0
#: a stop event this much before a band still explains it (the agents stop after their current step)
STOP_SLACK_S = 60.0
#: a launch's start-up: a band beginning this long after the launch's first ``start`` record is
#: still its start-up (measured: the recorded lab runs 2bec, 8b3d, c527 ran 2-4 median step times a
#: step for 80-110 s after their start records while the launch play was still running)
STARTUP_S = 120.0
#: what caused a band, in the order a cause is chosen when several fit (:func:`no_training_bands`)
BAND_CAUSES = ("fault", "stop", "restart", "checkpoint save", "eval", "start-up", "slow steps", "unknown")


@dataclass(frozen=True)
class Band:
    """A stretch without training: from the committed step record at ``start`` (unix s, step
    ``from_step``) to the next one at ``end`` (step ``to_step``). ``cause`` is one of
    :data:`BAND_CAUSES`; ``label`` says it for a reader (e.g. ``fault: kill-agent laptop-a``)."""

    start: float
    end: float
    from_step: int
    to_step: int
    cause: str
    label: str

    @property
    def seconds(self) -> float:
        """The band's length in seconds."""
        return self.end - self.start


def progress_records(run: RunFolder) -> list[Record]:
    """The committed ``step`` records that trace the group's progress, by time: rank 0's (one
    series across restarts: rank 0 exists in every generation; every rank's when there is no rank
    0) or, under per_step, every replica's (each replica is rank 0 of its own group)."""
    steps = [r for r in run.by_event("step") if r.get("committed") is not False
             and as_int(r.get("step")) is not None and num(r.get("time")) is not None]
    if not replica_groups(engine(run)):
        steps = [r for r in steps if as_int(r.get("rank")) == 0] or steps
    return by_time(steps)  # type: ignore[return-value]


def median_step_s(steps: Sequence[Record]) -> float | None:
    """The run's median wall time of one step (s): over consecutive ``steps`` records (by time)
    that advance the step, time between them / steps between them (step records may be written
    every ``log_interval`` steps; the gap includes logging, evaluation and checkpoints, not only
    ``step_time_s``). None with fewer than two such pairs."""
    per = [(num(b["time"]) - num(a["time"])) / (b["step"] - a["step"])  # type: ignore[operator]
           for a, b in zip(steps, steps[1:], strict=False) if b["step"] > a["step"]]
    return statistics.median(per) if len(per) >= 2 else None


def fault_window(f: Fault, step_times: Sequence[float]) -> tuple[float, float] | None:
    """(from, to) unix s while fault ``f`` held the training: its injection to its recovery
    (``recovered_s``: the group trains again, even if the fault itself lasts longer), else to the
    end of its ``duration_s`` (a freeze or partition the group rode out), else to the first
    committed step after it (``step_times``: of :func:`progress_records`, sorted; open-ended when
    none came). None without an injection time."""
    if f.time is None:
        return None
    if f.recovered_s is not None:
        return f.time, f.time + f.recovered_s
    if f.duration_s is not None:
        return f.time, f.time + f.duration_s
    i = bisect.bisect_right(step_times, f.time)
    return f.time, step_times[i] if i < len(step_times) else math.inf


def _launch_starts(run: RunFolder) -> list[tuple[float, str]]:
    """(time of the first ``start`` record after each launch/resume event, its kind), by time."""
    marks = sorted((t, str(e["kind"])) for e in run.events
                   if e.get("kind") in LAUNCH_WORDS and (t := num(e.get("time"))) is not None)
    starts = sorted(t for r in run.by_event("start") if (t := num(r.get("time"))) is not None)
    out = []
    for i, (t, kind) in enumerate(marks):
        nxt = marks[i + 1][0] if i + 1 < len(marks) else math.inf
        first = next((s for s in starts if t <= s < nxt), None)
        if first is not None:
            out.append((first, kind))
    return out


def _band_cause(run: RunFolder, ra: Record, rb: Record, excess: float,
                fl: Sequence[Fault], step_times: Sequence[float]) -> tuple[str, str]:
    """(cause, label) of the stretch without training between the step records ``ra`` and ``rb``,
    ``excess`` s later than the median step time predicts (see :func:`no_training_bands`)."""
    a, b = float(ra["time"]), float(rb["time"])
    covered = []
    for f in fl:
        w = fault_window(f, step_times)
        if w is not None and (overlap := min(b, w[1]) - max(a, w[0])) >= excess / 2:
            covered.append((overlap, f))
    if covered:
        f = max(covered, key=lambda x: x[0])[1]
        return "fault", f"fault: {f.mode} {f.node}"
    # stop.yml records its event before the agents finish their step and stop: up to STOP_SLACK_S earlier
    words = {STOP_KIND: "stopped", **LAUNCH_WORDS}
    marks = sorted((t, e["kind"]) for e in run.events if e.get("kind") in words and (t := num(e.get("time")))
                   is not None and a - (STOP_SLACK_S if e["kind"] == STOP_KIND else 0.0) <= t <= b)
    said = list(dict.fromkeys(words[kind] for _, kind in marks))  # in time order, each once
    if said:
        return "stop", ", then ".join(said)
    inside = {str(r.get("event")) for r in run.records if a < (num(r.get("time")) or -math.inf) < b}
    if "start" in inside or "failure" in inside:
        return "restart", "restart (no fault injected)"
    found = [c for c, ev in (("checkpoint save", "checkpoint"), ("eval", "val")) if ev in inside]
    if found:
        return found[0], " + ".join(found)
    up = [kind for t, kind in _launch_starts(run) if t <= a <= t + STARTUP_S]
    if up:
        return "start-up", f"start-up after {up[-1]}"
    own = [v for r in (ra, rb) if (v := num(r.get("step_time_s"))) is not None]
    per = (b - a) / max(rb["step"] - ra["step"], 1)
    if own and per <= max(own):
        return "slow steps", f"slow steps: {per:.1f} s a step (step records: {min(own):.2f}-{max(own):.2f} s)"
    return "unknown", "unknown"


def band_rule(k: float = BAND_K, min_s: float = BAND_MIN_S) -> str:
    """:func:`no_training_bands`' rule in words, for the report's page (one sentence, no period)."""
    return (f"the next committed step came later than the run's median step time predicts by more than "
            f"{k:g} median step times and {min_s:g} s, or, when a fault's window (injection to recovery, "
            f"or its duration) covers at least half of that delay, by more than one median step time and "
            f"{min_s:g} s")


def no_training_bands(run: RunFolder, k: float = BAND_K, min_s: float = BAND_MIN_S) -> list[Band]:
    """The stretches of the run without training, with what caused each.

    Between two consecutive committed step records (:func:`progress_records`) ``s`` steps apart,
    ``s`` x the median step time (:func:`median_step_s`) is expected; a gap longer than that by
    more than ``k`` median step times and ``min_s`` seconds is a band, and so is a gap longer than
    expected by more than ``min_s`` (and one step time) when a fault's window
    (:func:`fault_window`) overlaps it by at least half of that delay. Cause, the first that fits:
    ``fault`` (that overlap; the fault overlapping most), ``stop`` (a stop, resume or launch event
    inside; a stop event up to :data:`STOP_SLACK_S` before), ``restart`` (a start or failure record
    inside, no fault), ``checkpoint save`` / ``eval`` (a checkpoint / val record inside),
    ``start-up`` (the band begins within :data:`STARTUP_S` of a launch's or resume's first start
    record), ``slow steps`` (the time a step, gap / steps, is no more than the ``step_time_s`` of
    a bounding step record: training went on, slower), else ``unknown``.
    [] with fewer than three step records. Raises ValueError for ``k`` <= 0.
    """
    if k <= 0:
        raise ValueError(f"k={k}: a band must be longer than expected by a positive number of step times")
    steps = progress_records(run)
    med = median_step_s(steps)
    if med is None or len(steps) < 3:
        return []
    fl = faults(run)
    step_times = [float(r["time"]) for r in steps]
    out: list[Band] = []
    for a, b in zip(steps, steps[1:], strict=False):
        ta, tb = float(a["time"]), float(b["time"])
        excess = (tb - ta) - max(b["step"] - a["step"], 0) * med
        if excess <= max(med, min_s):
            continue
        cause, label = _band_cause(run, a, b, excess, fl, step_times)
        if excess > k * med or cause == "fault":
            out.append(Band(ta, tb, a["step"], b["step"], cause, label))
    return out


@dataclass(frozen=True)
class TrainLoss:
    """The run's newest train loss in the two senses the trainer records (None when not recorded).

    ``minibatch``/``minibatch_step``: the loss of the newest ``step`` record (the last minibatch,
    mean over the ranks: the figure of the progress lines and of the loss plot); ``estimate`` /
    ``estimate_step``: the evaluation estimate (mean loss over fixed windows of the train split)
    of the rank-0 ``end`` record, else of the newest ``val`` record, else summary.json's
    ``final_train_loss``.
    """

    minibatch: float | None
    minibatch_step: int | None
    estimate: float | None
    estimate_step: int | None
    val_loss: float | None = None  # of the same evaluation as ``estimate``


def train_loss(run: RunFolder) -> TrainLoss:
    """The newest train loss of ``run`` as :class:`TrainLoss` (minibatch and evaluation estimate);
    the evaluation is :func:`ddplab.controller.summary.final_evaluation`'s, as in summary.json."""
    tr = loss_per_step(run)
    est, val, est_step = final_evaluation(run.records, run.results.values())
    if est is None and val is None:
        est, val = num(run.summary.get("final_train_loss")), num(run.summary.get("final_val_loss"))
        est_step = as_int(run.summary.get("steps_completed")) if est is not None else None
    return TrainLoss(tr[-1][1] if tr else None, tr[-1][0] if tr else None, est, est_step, val)


def train_estimate_points(run: RunFolder) -> list[tuple[int, float]]:
    """(step, train loss evaluation estimate), one per step, from the ``val`` records."""
    pts = {r["step"]: float(r["train_loss"]) for r in run.by_event("val")
           if isinstance(r.get("step"), int) and num(r.get("train_loss")) is not None}
    return sorted(pts.items())


def steps_per_world_size(run: RunFolder) -> dict[int, int]:
    """World size -> number of training steps run at it (not records: step records may be logged
    every ``log_interval`` steps).

    Walks rank 0's records (every rank's when there are none of rank 0) in time order: a ``start``
    sets the position to its ``resumed_from_step``; a ``step``/``val``/``checkpoint``/``failure``/
    ``end`` record at step S credits S minus the position to its world size. Steps redone after a
    restart count again (they were trained again).
    """
    events = ("start", "step", "val", "checkpoint", "failure", "end")
    chosen = [r for r in run.records if r.get("event") in events]
    rank0 = [r for r in chosen if as_int(r.get("rank")) == 0]
    out: dict[int, int] = defaultdict(int)
    pos: int | None = None
    for r in by_time(rank0 or chosen):
        ws = as_int(r.get("world_size"))
        if r.get("event") == "start":
            pos = as_int(r.get("resumed_from_step")) or 0
            continue
        step = as_int(r.get("step"))
        if step is None or ws is None:
            continue
        if pos is None:
            pos = 0
        if step > pos:
            out[ws] += step - pos
            pos = step
    return dict(out)


@dataclass
class WorldSizeRow:
    world_size: int
    steps: int
    step_s: float | None
    compute_share: float | None
    allreduce_share: float | None
    tokens_per_s: float | None


def per_world_size(run: RunFolder) -> list[WorldSizeRow]:
    """Median figures of rank-0 step records grouped by world size; ``steps``: the training steps
    run at that world size (:func:`steps_per_world_size`)."""
    counted = steps_per_world_size(run)
    groups: dict[int, list[Record]] = defaultdict(list)
    for recs in step_series(run).values():
        for r in recs:
            if r.get("rank") == 0 and isinstance(r.get("world_size"), int):
                groups[r["world_size"]].append(r)
    rows = []
    for ws in sorted(groups):
        g = groups[ws]

        def med(key: str, g=g) -> float | None:
            vals = [v for r in g if (v := num(r.get(key))) is not None]
            return statistics.median(vals) if vals else None

        c, a, s = med("compute_s"), med("allreduce_s"), med("step_time_s")
        tot = (c or 0) + (a or 0)
        rows.append(WorldSizeRow(ws, counted.get(ws, 0), s, c / tot if c is not None and tot else None,
                                 a / tot if a is not None and tot else None, med("tokens_per_s")))
    return rows


@dataclass
class WireRow:
    """Bytes on the wire of one node at one world size under one gradient compression: means per
    step (bytes) over the ``steps`` steps its step records counted (ddplab.wire)."""

    host: str
    world_size: int
    engine: str
    grad_compression: str
    steps: int
    nic: str | None
    sent: float | None
    recv: float | None
    model: float | None

    @property
    def ratio(self) -> float | None:
        """NIC-sent bytes over the ring model's (headers and other traffic make it above 1)."""
        return self.sent / self.model if self.sent is not None and self.model else None


def wire_rows(run: RunFolder) -> list[WireRow]:
    """One :class:`WireRow` per (host, world size, grad_compression) of the step records of each
    node's first worker (local rank 0) that carry byte counts: ``sent``/``recv`` the NIC's bytes
    per step, weighted by each record's ``nic_steps``; ``model`` the ring model's
    ``wire_model_bytes`` over the same records. Records of older runs (no ``wire_model_bytes``)
    are left out."""
    runs_engine = engine(run)
    groups: dict[tuple[str, int, str], list[Record]] = defaultdict(list)
    for (host, local), recs in step_series(run).items():
        if local != 0:  # the NIC is the node's: its first worker's records count it
            continue
        for r in recs:
            if num(r.get("wire_model_bytes")) is not None and isinstance(r.get("world_size"), int):
                groups[(str(host), r["world_size"], str(r.get("grad_compression") or "none"))].append(r)
    rows = []
    for (host, ws, comp), recs in sorted(groups.items()):
        counted = [r for r in recs
                   if num(r.get("nic_sent_bytes")) is not None and (as_int(r.get("nic_steps")) or 0) > 0]
        weight = sum(as_int(r["nic_steps"]) for r in counted)

        def mean(key: str, counted=counted, weight=weight) -> float | None:
            return sum(float(r[key]) * as_int(r["nic_steps"]) for r in counted) / weight if weight else None

        model = statistics.fmean(float(r["wire_model_bytes"]) for r in (counted or recs))
        rows.append(WireRow(host, ws, str(recs[-1].get("engine") or runs_engine), comp, weight,
                            next((r.get("nic") for r in counted if r.get("nic")), None),
                            mean("nic_sent_bytes"), mean("nic_recv_bytes"), model))
    return rows


def time_span(run: RunFolder) -> tuple[float, float]:
    """(first, last) unix time of the metrics records; of the events when there are no records;
    (now, now) when there is neither."""
    times = [t for r in run.records if (t := num(r.get("time"))) is not None]
    ev_times = [t for e in run.events if (t := num(e.get("time"))) is not None]
    t0 = min(times) if times else (min(ev_times) if ev_times else time.time())
    return t0, max(times) if times else t0


def run_status(run: RunFolder, fl: Sequence[Fault],
               findings: Sequence[straggler.StragglerFinding], live: bool = False) -> tuple[str, str]:
    """(status text, css class ok|warn|bad) of the run: running (``live``), else its
    :func:`ddplab.runstate.run_outcome` in the words of :data:`ddplab.runstate.OUTCOME_WORDS`."""
    outcome = run_outcome(run.records, run.events)
    status, status_class = OUTCOME_WORDS[outcome]
    if live and outcome in ("incomplete", "failed"):  # a failure record mid-run: the group restarts
        status, status_class = "running", "ok"
    elif not live and run.summary.get("outcome") == "running":  # collect_snapshot: taken while it ran
        status, status_class = "running (snapshot taken by collect)", "warn"
    elif live and outcome == "no metrics":
        status, status_class = "starting", "warn"
    elif outcome == "finished" and fl:
        status, status_class = f"finished, {len(fl)} fault(s) survived", "ok"
    if outcome == "finished":  # per_step: a laptop cut off from the group that finished it
        status += "".join(f"; {cut_off_line(c)}" for c in cut_off_nodes(run.per_host, run.events))
    if not live and run.summary.get("unread"):  # collect could not read every trainer
        status += f"; PARTIAL: {', '.join(run.summary['unread'])} not read (collect again when it is back)"
        status_class = "warn" if status_class == "ok" else status_class
    if findings:
        status_class = "warn" if status_class == "ok" else status_class
    return status, status_class
