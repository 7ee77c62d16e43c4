"""Cost model of one data-parallel training step on N nodes joined by one shared link rate.

Quantities and units (decimal SI throughout, as network rates are quoted):

* ``D``  -- gradient bytes all-reduced per step (bytes). For fp32 gradients ``D = 4 * params``;
  GPT-2 124M gives ``D = 496e6`` bytes ("496 MB").
* ``N``  -- world size, one rank per node (dimensionless, >= 1).
* ``B``  -- effective per-link goodput (bytes/s) = ``link_gbps * 1e9 / 8 * link_efficiency``.
  A gigabit link carries 125e6 bytes/s of raw bits; what a collective actually moves is less:
  Ethernet + IP + TCP framing caps TCP goodput near 94 % of the line rate (1448 payload bytes per
  1538 bytes on the wire at MTU 1500), and the collective library's chunking, copies and
  reduction add more. ``DEFAULT_LINK_EFFICIENCY = 0.88`` (110 MB/s on gigabit) is the value that
  reproduces the figures measured on real laptops on a gigabit switch (the project seed's table:
  ~4.5 s at N=2, ~6.0 s at N=3, ~9 s limit for 496 MB). Measure yours with
  ``ddplab.bench.links`` / ``ddplab.bench.allreduce`` and pass it in.
* ``alpha`` -- per-message latency (s); each of the ``2(N-1)`` ring steps pays it once.

Ring all-reduce (reduce-scatter then all-gather, each ``N-1`` steps of ``D/N`` bytes per rank)::

    t_allreduce(N) = 2 (N-1) alpha + 2 (N-1)/N * D / B          (seconds)

Source: P. Patarasuk and X. Yuan, "Bandwidth optimal all-reduce algorithms for clusters of
workstations", J. Parallel Distrib. Comput. 69(2), 2009 -- the ring is bandwidth optimal: every
rank sends and receives ``2(N-1)/N * D`` bytes, which tends to ``2 D`` as ``N`` grows, so the
all-reduce time tends to ``2 D / B`` and never falls below ``D / B`` for N >= 2. The latency term
is the alpha-beta form of R. Thakur, R. Rabenseifner, W. Gropp, "Optimization of collective
communication operations in MPICH", IJHPCA 19(1), 2005.

Bus bandwidth (the NCCL-tests definition, ``doc/PERFORMANCE.md`` of NVIDIA/nccl-tests)::

    algbw = D / t            busbw = algbw * 2 (N-1)/N

``busbw`` is the rate each link actually carried during a ring all-reduce; it is comparable with
the link's goodput ``B`` whatever ``N`` is.

Step time per rank, given the compute time ``C`` (forward + backward + optimizer, seconds)::

    no overlap : T(N) = C + t_allreduce(N)
    overlap    : T(N) = max(C, t_allreduce(N))

The overlap form is the optimistic bound: DDP launches the all-reduce of each gradient bucket
while backward is still running, so at best the communication hides fully behind compute (or
compute behind communication). Real overlap sits between the two because the forward pass and
the last bucket cannot overlap. ``T(1) = C`` (no communication alone).

Speedup against one node, two batch policies (the names of ``TrainConfig.batch_policy``):

* ``keep_per_rank`` (weak scaling, the default): each rank keeps its batch, so N nodes process
  N times the samples per step. ``speedup(N) = N * C / T(N)``.
* ``keep_global``: the global batch is split, each rank computes ``C / N``.
  ``speedup(N) = C / T_{C/N}(N)``.

``efficiency(N) = speedup(N) / N``.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass

BYTES_PER_FP32 = 4
GIGABIT_BYTES_PER_S = 1e9 / 8  # 125e6 bytes/s of raw line rate
DEFAULT_LINK_GBPS = 1.0
DEFAULT_LINK_EFFICIENCY = 0.88
BATCH_POLICIES = ("keep_per_rank", "keep_global")


def _check_positive(name: str, value: float, allow_zero: bool = False) -> None:
    if value is None or not math.isfinite(value) or value < 0 or (value == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"{name} must be a finite number {bound}, got {value!r}")


def _check_world_size(world_size: int) -> None:
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an integer >= 1, got {world_size!r}")


def grad_bytes_from_params(params: float, bytes_per_param: int = BYTES_PER_FP32) -> float:
    """Gradient bytes all-reduced per step for ``params`` parameters (bytes).

    Raises ValueError when ``params`` or ``bytes_per_param`` is not positive.
    """
    _check_positive("params", params)
    _check_positive("bytes_per_param", bytes_per_param)
    return float(params) * bytes_per_param


def link_bytes_per_s(link_gbps: float, efficiency: float = DEFAULT_LINK_EFFICIENCY) -> float:
    """Effective goodput ``B`` (bytes/s) of a link of ``link_gbps`` Gbit/s at ``efficiency`` (0, 1].

    Raises ValueError on a non-positive rate or an efficiency outside (0, 1].
    """
    _check_positive("link_gbps", link_gbps)
    if not (0 < efficiency <= 1):
        raise ValueError(f"link efficiency must be in (0, 1], got {efficiency!r}")
    return link_gbps * GIGABIT_BYTES_PER_S * efficiency


def ring_factor(world_size: int) -> float:
    """``2 (N-1) / N``: bytes each rank sends (and receives) per byte of data in a ring all-reduce.

    0 for N=1, 1 for N=2, tends to 2. Same factor converts algbw to busbw (nccl-tests).
    Raises ValueError when ``world_size`` < 1.
    """
    _check_world_size(world_size)
    return 2.0 * (world_size - 1) / world_size


def ring_allreduce_time(nbytes: float, world_size: int, bytes_per_s: float, latency_s: float = 0.0) -> float:
    """Ring all-reduce time (s): ``2(N-1)*alpha + 2(N-1)/N * D / B`` (Patarasuk & Yuan 2009).

    ``nbytes`` D in bytes, ``bytes_per_s`` B in bytes/s, ``latency_s`` alpha in s per message.
    Returns 0.0 for world_size 1. Raises ValueError on negative or non-finite inputs.
    """
    _check_positive("nbytes", nbytes, allow_zero=True)
    _check_positive("bytes_per_s", bytes_per_s)
    _check_positive("latency_s", latency_s, allow_zero=True)
    _check_world_size(world_size)
    return 2 * (world_size - 1) * latency_s + ring_factor(world_size) * nbytes / bytes_per_s


def ring_allreduce_limit(nbytes: float, bytes_per_s: float) -> float:
    """Large-N limit of the ring all-reduce time (s), latency ignored: ``2 D / B``."""
    _check_positive("nbytes", nbytes, allow_zero=True)
    _check_positive("bytes_per_s", bytes_per_s)
    return 2.0 * nbytes / bytes_per_s


def bus_bandwidth(nbytes: float, seconds: float, world_size: int) -> tuple[float, float]:
    """``(algbw, busbw)`` in bytes/s for an all-reduce of ``nbytes`` that took ``seconds``.

    ``algbw = D / t``; ``busbw = algbw * 2(N-1)/N`` (nccl-tests, doc/PERFORMANCE.md).
    Raises ValueError when ``seconds`` is not positive.
    """
    _check_positive("seconds", seconds)
    _check_positive("nbytes", nbytes, allow_zero=True)
    algbw = nbytes / seconds
    return algbw, algbw * ring_factor(world_size)


def step_time(compute_s: float, allreduce_s: float, overlap: bool = False) -> float:
    """Step time (s): ``C + t_ar`` without overlap, ``max(C, t_ar)`` with (optimistic bound)."""
    _check_positive("compute_s", compute_s, allow_zero=True)
    _check_positive("allreduce_s", allreduce_s, allow_zero=True)
    return max(compute_s, allreduce_s) if overlap else compute_s + allreduce_s


@dataclass(frozen=True)
class Prediction:
    """Model output for one world size. Times in seconds, bytes in bytes, rates in bytes/s.

    ``step_s``, ``speedup`` and ``efficiency`` are None when no compute time was given.
    """

    world_size: int
    grad_bytes: float
    link_bytes_per_s: float
    allreduce_s: float
    bytes_sent_per_rank: float
    compute_s: float | None
    step_s: float | None
    speedup: float | None
    efficiency: float | None


def predict(
    grad_bytes: float,
    world_sizes: Iterable[int],
    link_gbps: float = DEFAULT_LINK_GBPS,
    link_efficiency: float = DEFAULT_LINK_EFFICIENCY,
    compute_s: float | None = None,
    overlap: bool = False,
    latency_s: float = 0.0,
    batch_policy: str = "keep_per_rank",
) -> list[Prediction]:
    """Predict all-reduce time, step time and speedup for each world size in ``world_sizes``.

    ``compute_s`` is the measured compute time of one step on one node at the per-rank batch
    (seconds). See the module docstring for the formulas. Raises ValueError on bad input
    (non-positive sizes or rates, efficiency outside (0, 1], unknown batch policy).
    """
    if batch_policy not in BATCH_POLICIES:
        raise ValueError(f"batch_policy must be one of {BATCH_POLICIES}, got {batch_policy!r}")
    if compute_s is not None:
        _check_positive("compute_s", compute_s)
    bps = link_bytes_per_s(link_gbps, link_efficiency)
    sizes = list(world_sizes)
    if not sizes:
        raise ValueError("at least one world size is needed")
    out = []
    for n in sizes:
        t_ar = ring_allreduce_time(grad_bytes, n, bps, latency_s)
        step = speedup = eff = None
        if compute_s is not None:
            per_rank_compute = compute_s if batch_policy == "keep_per_rank" else compute_s / n
            step = step_time(per_rank_compute, t_ar, overlap)
            work = n * compute_s if batch_policy == "keep_per_rank" else compute_s
            speedup = work / step
            eff = speedup / n
        out.append(
            Prediction(
                world_size=n,
                grad_bytes=float(grad_bytes),
                link_bytes_per_s=bps,
                allreduce_s=t_ar,
                bytes_sent_per_rank=ring_factor(n) * grad_bytes,
                compute_s=compute_s,
                step_s=step,
                speedup=speedup,
                efficiency=eff,
            )
        )
    return out


def _fmt(value: float | None, spec: str, suffix: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{suffix}"


def format_table(preds: Sequence[Prediction], overlap: bool = False) -> str:
    """Plain-text table of ``preds`` (one row per world size) plus the 2D/B limit line."""
    head = f"{'N':>3}  {'sent/rank':>10}  {'all-reduce':>10}  {'step':>9}  {'speedup':>7}  {'eff':>5}"
    lines = [head, "-" * len(head)]
    for p in preds:
        lines.append(
            f"{p.world_size:>3}  {p.bytes_sent_per_rank / 1e6:>8.0f}MB  {p.allreduce_s:>9.2f}s  "
            f"{_fmt(p.step_s, '8.2f', 's'):>9}  {_fmt(p.speedup, '6.2f', 'x'):>7}  "
            f"{_fmt(p.efficiency, '5.0%'):>5}"
        )
    if preds:
        p = preds[0]
        limit = ring_allreduce_limit(p.grad_bytes, p.link_bytes_per_s)
        lines.append(
            f"limit N->inf: all-reduce -> 2D/B = {limit:.2f}s"
            f"  (D = {p.grad_bytes / 1e6:.0f} MB, B = {p.link_bytes_per_s / 1e6:.1f} MB/s"
            f"{', overlap' if overlap else ''})"
        )
    return "\n".join(lines)


def _parse_nodes(text: str) -> list[int]:
    """``"3"`` -> [1, 2, 3]; ``"2,3,4"`` -> [2, 3, 4]; ``"1-4"`` -> [1, 2, 3, 4]."""
    try:
        if "," in text:
            nodes = [int(x) for x in text.split(",") if x.strip()]
        elif "-" in text:
            lo, hi = (int(x) for x in text.split("-", 1))
            nodes = list(range(lo, hi + 1))
        else:
            nodes = list(range(1, int(text) + 1))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--nodes: expected N, A-B or a comma list, got {text!r}") from None
    if not nodes or min(nodes) < 1:
        raise argparse.ArgumentTypeError(f"--nodes: world sizes must be >= 1, got {text!r}")
    return nodes


def main(argv: Sequence[str] | None = None) -> int:
    """CLI: print the prediction table (or JSON lines with ``--json``). Exit 2 on bad input."""
    ap = argparse.ArgumentParser(
        prog="python -m ddplab.bench.costmodel",
        description="Predict ring all-reduce time, step time and speedup of data-parallel training.",
        epilog="Example: python -m ddplab.bench.costmodel --params 124e6 --nodes 3 --link-gbps 1 "
        "--compute-s 5",
    )
    size = ap.add_mutually_exclusive_group(required=True)
    size.add_argument("--params", type=float, help="parameter count (fp32 gradients: D = 4 * params)")
    size.add_argument("--bytes", type=float, help="gradient bytes all-reduced per step (D)")
    ap.add_argument("--nodes", type=_parse_nodes, default=[1, 2, 3],
                    help="world sizes: N (1..N), A-B, or a list 2,3,4 (default 1,2,3)")
    ap.add_argument("--link-gbps", type=float, default=DEFAULT_LINK_GBPS,
                    help="line rate, Gbit/s (default 1)")
    ap.add_argument("--link-efficiency", type=float, default=DEFAULT_LINK_EFFICIENCY,
                    help=f"goodput / line rate (default {DEFAULT_LINK_EFFICIENCY}: 110 MB/s on gigabit)")
    ap.add_argument("--latency-ms", type=float, default=0.0, help="per-message latency alpha, ms (default 0)")
    ap.add_argument("--compute-s", type=float, help="measured compute time of one step on one node, s")
    ap.add_argument("--overlap", action="store_true", help="step = max(compute, all-reduce) (optimistic)")
    ap.add_argument("--batch-policy", choices=BATCH_POLICIES, default="keep_per_rank",
                    help="keep_per_rank: weak scaling (default); keep_global: the batch is split")
    ap.add_argument("--json", action="store_true", help="one JSON object per world size")
    args = ap.parse_args(argv)
    try:
        grad_bytes = grad_bytes_from_params(args.params) if args.params is not None else args.bytes
        preds = predict(grad_bytes, args.nodes, args.link_gbps, args.link_efficiency, args.compute_s,
                        args.overlap, args.latency_ms / 1e3, args.batch_policy)
    except ValueError as exc:
        print(f"costmodel: {exc}", file=sys.stderr)
        return 2
    if args.json:
        for p in preds:
            print(json.dumps(asdict(p) | {"overlap": args.overlap, "batch_policy": args.batch_policy}))
    else:
        print(format_table(preds, args.overlap))
    return 0


if __name__ == "__main__":
    sys.exit(main())
