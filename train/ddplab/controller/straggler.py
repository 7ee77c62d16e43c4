"""Straggler detection from the per-rank ``step`` records of the metrics JSONL (docs/CONTRACTS.md).

In synchronous data parallelism every step waits, inside the gradient all-reduce, for the slowest
rank: one slow laptop slows the whole group. Its signature is in ``compute_s`` (forward + backward
+ optimizer, excluding the all-reduce): the straggler's compute is longer than the others', while
the fast ranks show the difference as a longer ``allreduce_s`` (time spent waiting in the
collective). ``step_time_s`` is almost the same on every rank and cannot tell them apart.

Two rules, each over a window of consecutive step records of one worker (``host``, ``local_rank``):

* ``slow_compute``: ``compute_s / median(compute_s of the other ranks at the same step)``
  stays above ``1 + margin`` (default margin 0.20) for at least ``window`` records (default 10).
* ``clock_drop``: ``cpu_mhz`` stays below ``clock_drop`` (default 0.80) times the worker's own
  nominal clock for at least ``window`` records. The nominal clock is a high quantile (default the
  90th percentile) of the worker's own readings, so a node that throttles for most of a run is
  still compared with the clock it had when cool (a plain median would then be the throttled
  clock). Clocks are never compared across nodes: laptops differ.

``window`` counts step records, which are written every ``log_interval`` steps.
Records with the same (host, local_rank, step) -- a step redone after a restart -- count once
(the newest by ``time``).

With ``batch_balance: speed`` a slow laptop gets a smaller share of each step (``batch_share``,
ddplab.balance) and its compute no longer stands out: :func:`balance_gain` says what balancing
gained, from each rank's measured time per sample (``compute_s / batch_share``): the slowest
rank's compute per step as it was, and as equal shares would have made it.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from typing import Any

from ddplab.lr import equal_shares
from ddplab.records import num

DEFAULT_MARGIN = 0.20
DEFAULT_WINDOW = 10
DEFAULT_CLOCK_DROP = 0.80
DEFAULT_CLOCK_QUANTILE = 0.90

Record = Mapping[str, Any]
WorkerKey = tuple[str, int]  # (host, local_rank)


@dataclass(frozen=True)
class StragglerFinding:
    """One sustained anomaly of one worker.

    ``kind``: ``"slow_compute"`` or ``"clock_drop"``. ``from_step``/``to_step``: first and last step
    of the streak (inclusive); ``records``: how many step records it spans. ``ratio``: median over
    the streak of compute / others' median compute (slow_compute, > 1) or MHz / nominal MHz
    (clock_drop, < 1); ``worst_ratio``: the extreme value. ``active``: the streak reaches the
    worker's latest record (still going). ``rank``: the worker's rank at ``to_step`` (ranks can
    change after a restart). ``temp_c_max``: hottest reading in the streak, None without a sensor.
    """

    kind: str
    host: str
    local_rank: int
    rank: int
    from_step: int
    to_step: int
    records: int
    ratio: float
    worst_ratio: float
    active: bool
    reference: float | None = None
    temp_c_max: float | None = None

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict (the ``stragglers`` entries of summary.json)."""
        return asdict(self)


def step_records(records: Iterable[Record]) -> dict[WorkerKey, list[Record]]:
    """Group the ``step`` records per worker, sorted by step, one record per step (the newest).

    Records without a host or an integer step are ignored.
    """
    newest: dict[tuple[str, int, int], Record] = {}
    for r in records:
        if r.get("event") != "step" or not isinstance(r.get("step"), int) or not r.get("host"):
            continue
        key = (str(r["host"]), int(r.get("local_rank") or 0), r["step"])
        old = newest.get(key)
        if old is None or (num(r.get("time")) or 0.0) >= (num(old.get("time")) or 0.0):
            newest[key] = r
    out: dict[WorkerKey, list[Record]] = defaultdict(list)
    for (host, lr, _step), r in newest.items():
        out[(host, lr)].append(r)
    for recs in out.values():
        recs.sort(key=lambda r: r["step"])
    return dict(out)


@dataclass(frozen=True)
class StepTail:
    """Per-step spread of compute time across ranks (seconds): the straggler tail."""

    step: int
    workers: int
    median_compute_s: float
    max_compute_s: float
    slowest_host: str
    slowest_local_rank: int

    @property
    def ratio(self) -> float:
        """max / median compute at this step (1.0 = no tail)."""
        return self.max_compute_s / self.median_compute_s if self.median_compute_s > 0 else 1.0


def tail_by_step(records: Iterable[Record]) -> list[StepTail]:
    """Median and max ``compute_s`` over ranks for each step that has at least one worker."""
    by_step: dict[int, list[tuple[float, WorkerKey]]] = defaultdict(list)
    for key, recs in step_records(records).items():
        for r in recs:
            c = num(r.get("compute_s"))
            if c is not None:
                by_step[r["step"]].append((c, key))
    out = []
    for step in sorted(by_step):
        vals = by_step[step]
        cmax, (host, lr) = max(vals)
        out.append(StepTail(step, len(vals), statistics.median(v for v, _ in vals), cmax, host, lr))
    return out


def _streaks(points: list[tuple[int, float, Record]], flagged, window: int):
    """Maximal runs of consecutive ``points`` satisfying ``flagged(value)`` of length >= window."""
    run: list[tuple[int, float, Record]] = []
    for p in [*points, None]:
        if p is not None and flagged(p[1]):
            run.append(p)
            continue
        if len(run) >= window:
            yield run
        run = []


def _finding(kind, key, run, last_step, reference, worst) -> StragglerFinding:
    ratios = [v for _, v, _ in run]
    temps = [t for t in (num(r.get("temp_c")) for _, _, r in run) if t is not None]
    last_rank = run[-1][2].get("rank")
    return StragglerFinding(
        kind=kind,
        host=key[0],
        local_rank=key[1],
        rank=last_rank if isinstance(last_rank, int) else -1,
        from_step=run[0][0],
        to_step=run[-1][0],
        records=len(run),
        ratio=statistics.median(ratios),
        worst_ratio=worst(ratios),
        active=run[-1][0] == last_step,
        reference=reference,
        temp_c_max=max(temps) if temps else None,
    )


def _check_params(margin: float, window: int, clock_drop: float, clock_quantile: float) -> None:
    if not margin > 0:
        raise ValueError(f"margin must be > 0 (0.2 = 20 % slower), got {margin!r}")
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f"window must be an integer >= 1 (step records), got {window!r}")
    if not 0 < clock_drop < 1:
        raise ValueError(f"clock_drop must be in (0, 1) (0.8 = below 80 % of nominal), got {clock_drop!r}")
    if not 0 < clock_quantile <= 1:
        raise ValueError(f"clock_quantile must be in (0, 1], got {clock_quantile!r}")


def _quantile(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]


def detect_stragglers(
    records: Iterable[Record],
    margin: float = DEFAULT_MARGIN,
    window: int = DEFAULT_WINDOW,
    clock_drop: float = DEFAULT_CLOCK_DROP,
    clock_quantile: float = DEFAULT_CLOCK_QUANTILE,
) -> list[StragglerFinding]:
    """All sustained slow-compute and clock-drop streaks in ``records`` (metrics JSONL dicts).

    Returns findings sorted by (from_step, host). Raises ValueError on a margin <= 0, a window < 1,
    or a clock_drop / clock_quantile outside (0, 1).
    """
    _check_params(margin, window, clock_drop, clock_quantile)
    workers = step_records(records)
    compute_at: dict[int, dict[WorkerKey, float]] = defaultdict(dict)
    for key, recs in workers.items():
        for r in recs:
            c = num(r.get("compute_s"))
            if c is not None:
                compute_at[r["step"]][key] = c

    findings: list[StragglerFinding] = []
    for key, recs in workers.items():
        last_step = recs[-1]["step"]
        rel: list[tuple[int, float, Record]] = []
        for r in recs:
            row = compute_at.get(r["step"], {})
            mine = row.get(key)
            others = [v for k, v in row.items() if k != key]
            if mine is None or not others:
                continue
            med = statistics.median(others)
            if med > 0:
                rel.append((r["step"], mine / med, r))
        for run in _streaks(rel, lambda v: v > 1 + margin, window):
            findings.append(_finding("slow_compute", key, run, last_step, None, max))

        clocks = [(r["step"], mhz, r) for r in recs if (mhz := num(r.get("cpu_mhz"))) and mhz > 0]
        if len(clocks) >= window:
            nominal = _quantile([m for _, m, _ in clocks], clock_quantile)
            scaled = [(s, m / nominal, r) for s, m, r in clocks]
            for run in _streaks(scaled, lambda v: v < clock_drop, window):
                findings.append(_finding("clock_drop", key, run, last_step, nominal, min))
    findings.sort(key=lambda f: (f.from_step, f.host, f.local_rank, f.kind))
    return findings


@dataclass(frozen=True)
class WorkerShare:
    """One worker's part of the balanced steps: its median ``share`` (samples a step) and median
    ``speed`` (samples per second of compute: ``batch_share / compute_s``)."""

    host: str
    local_rank: int
    share: float
    speed: float


@dataclass(frozen=True)
class Replan:
    """A new batch plan (``batch_plan`` of the first step record that uses it): its ``step``, why
    (``reason``: start, calibrated, group, speed) and each worker's share, by worker."""

    step: int
    reason: str
    shares: dict[WorkerKey, int]


@dataclass(frozen=True)
class BalanceGain:
    """What speed-balanced batches gained over the ``steps`` whose every rank logged its compute
    and share.

    ``compute_s``: the median over those steps of the slowest rank's compute (every rank waits for
    it); ``equal_compute_s``: the same with equal shares of each step's global batch, from each
    rank's measured time per sample at that step (an estimate: a rank's time per sample barely
    depends on its share); ``workers``: each worker's share and speed; ``plans``: the plans.
    """

    steps: int
    compute_s: float
    equal_compute_s: float
    workers: tuple[WorkerShare, ...]
    plans: tuple[Replan, ...]

    @property
    def gain(self) -> float:
        """The share of the slowest rank's compute that balancing saved (0.25 = a quarter)."""
        return 1 - self.compute_s / self.equal_compute_s if self.equal_compute_s > 0 else 0.0


def balance_gain(records: Iterable[Record]) -> BalanceGain | None:
    """:class:`BalanceGain` of a run whose step records carry ``batch_shares`` (balancing on), or
    None (off, or no step that every rank of its group logged with a compute time and a share).

    A step counts when as many workers logged it as its ``batch_shares`` has members, each with a
    positive ``compute_s`` and ``batch_share``; equal shares deal the step's global batch (the sum
    of its shares) with the remainder to the first ranks, as the engines do.
    """
    workers = step_records(records)
    at_step: dict[int, list[tuple[WorkerKey, Record]]] = defaultdict(list)
    for key, recs in workers.items():
        for r in recs:
            if isinstance(r.get("batch_shares"), list):
                at_step[r["step"]].append((key, r))
    if not at_step:
        return None
    actual, equal, per_worker = [], [], defaultdict(list)
    plans = []
    for step in sorted(at_step):
        row = at_step[step]
        shares = row[0][1]["batch_shares"]
        reason = next((r.get("batch_plan") for _, r in row if r.get("batch_plan")), None)
        if reason:
            plans.append(Replan(step, str(reason), {k: int(r.get("batch_share") or 0) for k, r in row}))
        measured = [(k, c, n, as_rank) for k, r in row
                    if (c := num(r.get("compute_s"))) and c > 0 and (n := num(r.get("batch_share"))) and n > 0
                    and isinstance(as_rank := r.get("rank"), int)]
        if len(measured) != len(shares) or len(measured) < 2:
            continue
        even = equal_shares(sum(int(v) for v in shares), len(shares))
        actual.append(max(c for _, c, _, _ in measured))
        equal.append(max(even[rank] * c / n for _, c, n, rank in measured))
        for k, c, n, _ in measured:
            per_worker[k].append((n, n / c))
    if not actual:
        return None if not plans else BalanceGain(0, 0.0, 0.0, (), tuple(plans))
    shares_of = tuple(WorkerShare(h, lr, statistics.median(n for n, _ in v),
                                  statistics.median(x for _, x in v))
                      for (h, lr), v in sorted(per_worker.items()))
    return BalanceGain(len(actual), statistics.median(actual), statistics.median(equal), shares_of,
                       tuple(plans))


def format_balance(b: BalanceGain) -> str:
    """One line: what balancing gained, e.g. ``batches balanced by speed over 340 steps: the
    slowest rank's compute 0.251 s a step, 0.412 s with equal shares (estimated ...): 39 % less``."""
    if not b.steps:
        return (f"batches balanced by speed: {len(b.plans)} plan(s), no step with every rank's compute "
                "and share")
    return (f"batches balanced by speed over {b.steps} steps: the slowest rank's compute {b.compute_s:.3f} s "
            f"a step, {b.equal_compute_s:.3f} s with equal shares (estimated from each rank's time per "
            f"sample): {b.gain:.0%} less waiting for the slowest")


def live_stragglers(records: Iterable[Record], **params: Any) -> list[StragglerFinding]:
    """The findings still going on at each worker's latest record: for a live progress display.

    Pass the records read so far (all of them, or at least several windows' worth: the clock
    rule needs enough history to know the node's nominal clock). ``params``: the keyword
    parameters of :func:`detect_stragglers` (margin, window, clock_drop, clock_quantile), same
    errors.
    """
    return [f for f in detect_stragglers(records, **params) if f.active]


def format_finding(f: StragglerFinding) -> str:
    """One line naming the node, e.g. ``laptop-c (rank 2): compute 1.45x the others' median ...``."""
    where = f"{f.host}" + (f"/local{f.local_rank}" if f.local_rank else "") + f" (rank {f.rank})"
    span = f"steps {f.from_step}-{f.to_step}" + (" and still going" if f.active else "")
    if f.kind == "slow_compute":
        return (f"straggler {where}: compute {f.ratio:.2f}x the others' median "
                f"(worst {f.worst_ratio:.2f}x) over {span}")
    temp = f", up to {f.temp_c_max:.0f} C" if f.temp_c_max is not None else ""
    ref = f" of its {f.reference:.0f} MHz nominal" if f.reference else ""
    return (f"clock drop {where}: CPU at {f.ratio:.0%}{ref} (lowest {f.worst_ratio:.0%}) "
            f"over {span}{temp} - thermal throttling or power saving?")
