"""The cluster bench in one torchrun job: the links matrix, then the all-reduce sweep at several N.

bench.yml runs it once on every trainer (one worker per node)::

    torchrun ... -m ddplab.bench.cluster --world-sizes 2,3 --max-bytes 64e6 --out-dir .

It measures, in one process group (one rendezvous and one launch instead of one per measurement):

1. the links, as :mod:`ddplab.bench.links` does (every pair alone), written to
   ``<out-dir>/links.jsonl`` (skipped with ``--no-links``);
2. for each N in ``--world-sizes`` (default: the world size): the all-reduce sweep of
   :mod:`ddplab.bench.allreduce` over the first N ranks (a ``torch.distributed.new_group``;
   the other ranks wait at a barrier, so each figure is N nodes alone), appended to
   ``<out-dir>/allreduce.jsonl`` with ``world_size`` N and the N hosts.

The records are those of the two modules (their docstrings list the fields). Rank 0 writes them
and prints the tables. Exit 0 on success, 2 on bad arguments or outside torchrun, 1 when a peer
is lost.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from ddplab.bench import allreduce as ba
from ddplab.bench import costmodel
from ddplab.bench import links as bl
from ddplab.bench.worker import EXIT_BAD_INPUT, append_record, gather_hosts, run


def parse_world_sizes(text: str) -> list[int]:
    """``"2,3"`` -> [2, 3] (sorted, unique). Raises ValueError on anything but integers >= 2."""
    try:
        sizes = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        raise ValueError(f"--world-sizes: expected a comma list of integers, got {text!r}") from None
    if not sizes or sizes[0] < 2:
        raise ValueError(f"--world-sizes: every size must be >= 2, got {text!r}")
    return sizes


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="torchrun ... -m ddplab.bench.cluster",
        description="Links matrix, then the all-reduce sweep at several world sizes.")
    ap.add_argument("--out-dir", type=Path, required=True, help="links.jsonl and allreduce.jsonl go here")
    ap.add_argument("--no-links", action="store_true", help="skip the links matrix")
    ap.add_argument("--links-bytes", type=float, default=64 * ba.MB, help="bytes per link transfer (64e6)")
    ap.add_argument("--links-repeats", type=int, default=3, help="timed transfers per direction (3)")
    ap.add_argument("--rtt-repeats", type=int, default=20, help="timed ping-pongs per pair (20)")
    ap.add_argument("--no-allreduce", action="store_true", help="skip the all-reduce sweep")
    ap.add_argument("--world-sizes", default="",
                    help="all-reduce over the first N ranks for each N, e.g. 2,3 (default: all ranks)")
    ap.add_argument("--min-bytes", type=float, default=1 * ba.MB, help="smallest all-reduce, bytes (1e6)")
    ap.add_argument("--max-bytes", type=float, default=496 * ba.MB, help="largest all-reduce, bytes (496e6)")
    ap.add_argument("--warmup", type=int, default=1, help="untimed all-reduces per size (1)")
    ap.add_argument("--repeats", type=int, default=5, help="timed all-reduces per size, at most (5)")
    ap.add_argument("--budget-s", type=float, default=30.0, help="timed seconds per size, at most (30)")
    ap.add_argument("--link-gbps", type=float, default=costmodel.DEFAULT_LINK_GBPS,
                    help="nominal link rate for the records' model, Gbit/s (1)")
    ap.add_argument("--link-efficiency", type=float, default=costmodel.DEFAULT_LINK_EFFICIENCY,
                    help="goodput / line rate for the records' model (0.88)")
    ap.add_argument("--pg-timeout-s", type=float, default=1800.0,
                    help="process-group timeout, s: ranks outside a subgroup wait this long at most (1800)")
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    """Worker entry point (see the module docstring for the exit status)."""
    args = _parser().parse_args(argv)
    sizes: list[int] = []
    world_sizes: list[int] = []

    def check() -> None:
        nonlocal sizes, world_sizes
        sizes = ba.sizes_between(args.min_bytes, args.max_bytes)
        world_sizes = parse_world_sizes(args.world_sizes) if args.world_sizes else []
        if args.warmup < 0 or args.repeats < 1 or args.budget_s <= 0:
            raise ValueError("need --warmup >= 0, --repeats >= 1, --budget-s > 0")
        if args.links_bytes < 4 or args.links_repeats < 1 or args.rtt_repeats < 1:
            raise ValueError("need --links-bytes >= 4, --links-repeats >= 1, --rtt-repeats >= 1")
        costmodel.link_bytes_per_s(args.link_gbps, args.link_efficiency)

    def body(dist, torch, rank: int, n: int) -> int | None:
        if n < 2 or (world_sizes and world_sizes[-1] > n):
            if rank == 0:
                print(f"bench_cluster: world size {n}: needs at least 2 ranks and at least "
                      f"max(--world-sizes) = {world_sizes[-1] if world_sizes else 2}", file=sys.stderr)
            return EXIT_BAD_INPUT
        hosts = gather_hosts(dist)
        if not args.no_links:
            nbytes = int(args.links_bytes) // 4 * 4
            res = bl.measure_links(dist, torch, nbytes, args.links_repeats, args.rtt_repeats)
            if rank == 0:
                rec = bl.links_record(res, hosts, nbytes, args.links_repeats, args.rtt_repeats, 0.5)
                print(bl.format_matrices(rec), flush=True)
                append_record(args.out_dir / "links.jsonl", rec)
        records = []
        for ws in ([] if args.no_allreduce else world_sizes or [n]):
            group = None if ws == n else dist.new_group(list(range(ws)))  # every rank takes part
            if rank < ws:
                for nbytes in sizes:
                    times = ba.time_allreduce(dist, torch, nbytes, args.warmup, args.repeats, args.budget_s,
                                              group)
                    if rank == 0:
                        rec = ba.result_record(nbytes, ws, hosts[:ws], times, args.link_gbps,
                                               args.link_efficiency)
                        records.append(rec)
                        append_record(args.out_dir / "allreduce.jsonl", rec)
                        print(f"[bench_cluster] all-reduce N={ws} {nbytes / ba.MB:.0f} MB x{len(times)}: "
                              f"{rec['median_s'] * 1e3:.1f} ms", flush=True)
            dist.barrier()
        if rank == 0 and records:
            print(ba.format_table(records), flush=True)
        dist.barrier()
        return None

    return run("bench_cluster", args.pg_timeout_s, check, body)


if __name__ == "__main__":
    sys.exit(main())
