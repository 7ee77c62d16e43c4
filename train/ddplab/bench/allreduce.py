"""All-reduce benchmark: a torchrun worker timing gloo ``all_reduce`` of float32 tensors of D bytes.

Run one worker per node (the cluster's bench.yml does it), or locally::

    torchrun --standalone --nproc-per-node=2 -m ddplab.bench.allreduce --max-bytes 64e6 \
        --out runs/bench-x/allreduce.jsonl

Sizes double from ``--min-bytes`` (default 1 MB) and end at ``--max-bytes`` (default 496 MB, the
fp32 gradients of GPT-2 124M). For each size: ``--warmup`` untimed calls, then up to
``--repeats`` timed calls (fewer when ``--budget-s`` seconds have gone by, at least one). One
call is timed on every rank from after a barrier to the return of ``all_reduce``; the call's
time is the maximum over ranks (the collective is done when the slowest rank is done).

Rank 0 prints a table and appends one JSON object per size to ``--out`` (JSON lines):
``kind="allreduce"``, ``bytes`` D, ``world_size`` N, ``hosts`` (hostname by rank), ``repeats``,
``median_s``, ``min_s``, ``max_s`` (seconds), ``algbw_bytes_per_s`` = D / median,
``busbw_bytes_per_s`` = algbw * 2(N-1)/N (nccl-tests' bus bandwidth, comparable with a link's
goodput whatever N is), ``link_gbps``, ``link_efficiency``, ``link_source``, ``model_s`` (ring
model of :mod:`ddplab.bench.costmodel` at that link rate), ``measured_over_model`` = median / model,
``time``. With ``--link-from links.jsonl`` (the output of :mod:`ddplab.bench.links`) the model
uses the measured goodput of the slowest directed link (a ring runs at the pace of its slowest
link) at efficiency 1.0, instead of the nominal ``--link-gbps`` x ``--link-efficiency``.
Every call's result is checked (each element must equal the sum of the ranks' fill values).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from ddplab.bench import costmodel
from ddplab.bench.worker import append_record, gather_hosts, run
from ddplab.records import read_jsonl

MB = 1e6


def sizes_between(min_bytes: float, max_bytes: float) -> list[int]:
    """Sizes in bytes, multiples of 4 (float32): min, 2*min, 4*min, ... below max, then max itself.

    Raises ValueError when min_bytes < 4 or max_bytes < min_bytes.
    """
    if min_bytes < 4 or max_bytes < min_bytes:
        raise ValueError(f"need 4 <= min-bytes <= max-bytes, got {min_bytes:g} and {max_bytes:g}")
    out, d = [], float(min_bytes)
    while d < max_bytes:
        out.append(int(d) // 4 * 4)
        d *= 2
    out.append(int(max_bytes) // 4 * 4)
    return sorted(set(out))


def link_rate_from_links(path: str | Path) -> float:
    """Goodput (bytes/s) of the slowest directed link in the last record of a bench_links JSONL file.

    Raises ValueError when the file has no links record with a measured link.
    """
    try:
        recs, _bad = read_jsonl(path)
    except OSError as exc:
        raise ValueError(f"--link-from {path}: {exc.strerror}") from None
    for rec in reversed(recs):
        if rec.get("kind") == "links":
            vals = [v for row in rec.get("bandwidth_bytes_per_s") or [] for v in row
                    if isinstance(v, int | float) and v > 0]
            if vals:
                return float(min(vals))
    raise ValueError(f"--link-from {path}: no links record with a measured link (run ddplab.bench.links)")


def _max_over_ranks(dist, torch, seconds: float, group=None) -> float:
    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return float(t.item())


def time_allreduce(dist, torch, nbytes: int, warmup: int, repeats: int, budget_s: float,
                   group=None) -> list[float]:
    """Times (s, max over ranks) of ``repeats`` all-reduces of ``nbytes`` of float32 after ``warmup``.

    Stops early once the timed calls add up to ``budget_s`` (the decision uses the rank-max times,
    which every rank holds, so all ranks stop together). ``group``: a process group of which this
    rank is a member (default: the whole world); only its members may call this.
    Raises RuntimeError when a result is wrong.
    """
    rank, n = dist.get_rank(group), dist.get_world_size(group)
    buf = torch.empty(nbytes // 4, dtype=torch.float32)
    expected = n * (n + 1) / 2
    times: list[float] = []
    for i in range(warmup + repeats):
        buf.fill_(rank + 1)
        dist.barrier(group=group)
        t0 = time.perf_counter()
        dist.all_reduce(buf, group=group)
        elapsed = time.perf_counter() - t0
        if buf.numel() and (buf[0].item() != expected or buf[-1].item() != expected):
            raise RuntimeError(f"all_reduce of {nbytes} bytes returned {buf[0].item()}, expected {expected}")
        elapsed = _max_over_ranks(dist, torch, elapsed, group)
        if i >= warmup:
            times.append(elapsed)
            if sum(times) >= budget_s:
                break
    return times


def result_record(nbytes: int, world_size: int, hosts: list[str], times: Sequence[float], link_gbps: float,
                  link_efficiency: float, latency_s: float = 0.0, link_source: str = "nominal") -> dict:
    """The JSON record for one size (fields in the module docstring)."""
    med = statistics.median(times)
    algbw, busbw = costmodel.bus_bandwidth(nbytes, med, world_size)
    bps = costmodel.link_bytes_per_s(link_gbps, link_efficiency)
    model = costmodel.ring_allreduce_time(nbytes, world_size, bps, latency_s)
    return {
        "kind": "allreduce", "time": time.time(), "backend": "gloo", "dtype": "float32",
        "bytes": nbytes, "world_size": world_size, "hosts": hosts, "repeats": len(times),
        "median_s": med, "min_s": min(times), "max_s": max(times),
        "algbw_bytes_per_s": algbw, "busbw_bytes_per_s": busbw,
        "link_gbps": link_gbps, "link_efficiency": link_efficiency, "link_source": link_source,
        "latency_s": latency_s,
        "model_s": model, "measured_over_model": med / model if model > 0 else None,
    }


def format_table(records: Sequence[dict]) -> str:
    """Plain-text table of allreduce records: size, time, algbw, busbw, model, measured/model."""
    head = (f"{'size':>8}  {'N':>2}  {'median':>9}  {'min':>9}  {'algbw':>10}  {'busbw':>10}  "
            f"{'model':>9}  {'meas/model':>10}")
    lines = [head, "-" * len(head)]
    for r in records:
        ratio = r.get("measured_over_model")
        lines.append(
            f"{r['bytes'] / MB:>6.0f}MB  {r['world_size']:>2}  {r['median_s'] * 1e3:>7.1f}ms  "
            f"{r['min_s'] * 1e3:>7.1f}ms  {r['algbw_bytes_per_s'] / MB:>6.1f}MB/s  "
            f"{r['busbw_bytes_per_s'] / MB:>6.1f}MB/s  {r['model_s'] * 1e3:>7.1f}ms  "
            f"{'-' if ratio is None else f'{ratio:.2f}':>10}"
        )
    if records:
        r = records[0]
        lines.append(f"model: ring 2(N-1)/N*D/B at {r['link_gbps']:.3g} Gb/s x {r['link_efficiency']:g} "
                     f"efficiency ({r.get('link_source', 'nominal')}); "
                     f"hosts by rank: {', '.join(r['hosts'])}")
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="torchrun ... -m ddplab.bench.allreduce",
                                 description="Time gloo all_reduce of float32 tensors, 1 MB up to D.")
    ap.add_argument("--min-bytes", type=float, default=1 * MB, help="smallest size, bytes (default 1e6)")
    ap.add_argument("--max-bytes", type=float, default=496 * MB, help="largest size, bytes (default 496e6)")
    ap.add_argument("--warmup", type=int, default=1, help="untimed calls per size (default 1)")
    ap.add_argument("--repeats", type=int, default=5, help="timed calls per size, at most (default 5)")
    ap.add_argument("--budget-s", type=float, default=30.0,
                    help="stop repeating a size after this many timed seconds (default 30)")
    ap.add_argument("--link-gbps", type=float, default=costmodel.DEFAULT_LINK_GBPS,
                    help="link rate for the ring model, Gbit/s (default 1)")
    ap.add_argument("--link-efficiency", type=float, default=costmodel.DEFAULT_LINK_EFFICIENCY,
                    help="goodput / line rate for the model (default 0.88; 1.0 with a measured goodput)")
    ap.add_argument("--link-from", type=Path,
                    help="model at the slowest link measured by ddplab.bench.links (its JSONL output)")
    ap.add_argument("--latency-ms", type=float, default=0.0, help="per-message latency for the model, ms")
    ap.add_argument("--pg-timeout-s", type=float, default=300.0, help="process-group timeout, s")
    ap.add_argument("--out", type=Path, help="append JSON lines here (rank 0)")
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    """Worker entry point. Exit 0 on success, 2 on bad arguments, 1 on a failed collective."""
    args = _parser().parse_args(argv)
    link_source = "nominal"
    sizes: list[int] = []

    def check() -> None:
        nonlocal link_source, sizes
        sizes = sizes_between(args.min_bytes, args.max_bytes)
        if args.warmup < 0 or args.repeats < 1 or args.budget_s <= 0:
            raise ValueError("need --warmup >= 0, --repeats >= 1, --budget-s > 0")
        if args.link_from:
            args.link_gbps = link_rate_from_links(args.link_from) * 8 / 1e9
            args.link_efficiency = 1.0
            link_source = f"slowest link measured in {args.link_from}"
        costmodel.link_bytes_per_s(args.link_gbps, args.link_efficiency)

    def body(dist, torch, rank: int, n: int) -> None:
        hosts = gather_hosts(dist)
        records = []
        for nbytes in sizes:
            times = time_allreduce(dist, torch, nbytes, args.warmup, args.repeats, args.budget_s)
            if rank == 0:
                rec = result_record(nbytes, n, hosts, times, args.link_gbps, args.link_efficiency,
                                    args.latency_ms / 1e3, link_source)
                records.append(rec)
                print(f"[bench_allreduce] {nbytes / MB:.0f} MB x{len(times)}: {rec['median_s'] * 1e3:.1f} ms",
                      flush=True)
                if args.out:
                    append_record(args.out, rec)
        if rank == 0:
            print(format_table(records), flush=True)
        dist.barrier()

    return run("bench_allreduce", args.pg_timeout_s, check, body)


if __name__ == "__main__":
    sys.exit(main())
