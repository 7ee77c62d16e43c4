"""Pairwise link benchmark: a torchrun worker measuring bandwidth and RTT between every pair of ranks.

One worker per node (bench.yml), or locally::

    torchrun --standalone --nproc-per-node=2 -m ddplab.bench.links --bytes 64e6 --out links.jsonl

The pairs are measured one at a time (the others wait at a barrier), so each figure is one link
alone, not a shared switch. For a pair (a, b) with a < b, using ``torch.distributed.send/recv``
over gloo:

* RTT: ``--rtt-repeats`` ping-pongs of a 4-byte tensor, a -> b -> a; median round trip (ms),
  timed on a (after 3 untimed ones).
* bandwidth a -> b, then b -> a: the sender sends ``--bytes`` of float32 and waits for a 4-byte
  acknowledgement; ``bytes / time`` (bytes/s, median of ``--repeats``, after one untimed
  transfer). The acknowledgement adds half an RTT, negligible for the default 64 MB.

Rank 0 prints two matrices (rows: sender, columns: receiver) and appends one JSON object to
``--out``: ``kind="links"``, ``world_size``, ``hosts`` (hostname by rank), ``bytes``,
``bandwidth_bytes_per_s`` and ``rtt_ms`` (N x N lists, None on the diagonal), ``slow_links``:
the directed links below ``--slow-fraction`` (default 0.5) of the median link, each
``{src, dst, src_rank, dst_rank, bytes_per_s, median_bytes_per_s}`` -- a 100 Mb/s cable or a
node that fell back to WiFi shows up there.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Sequence
from itertools import combinations
from pathlib import Path

from ddplab.bench.allreduce import MB
from ddplab.bench.worker import EXIT_BAD_INPUT, append_record, gather_hosts, run


def _exchange(dist, out, back, peer: int, timed: bool, repeats: int, warmup: int) -> list[float]:
    """``warmup`` untimed then ``repeats`` timed exchanges with ``peer``: the ``timed`` side sends
    ``out`` and waits for ``back``, the other side receives ``out`` and answers with ``back``.
    Returns the round-trip times (s) on the timed side, [] on the other."""
    times = []
    for i in range(warmup + repeats):
        if timed:
            t0 = time.perf_counter()
            dist.send(out, peer)
            dist.recv(back, peer)
            if i >= warmup:
                times.append(time.perf_counter() - t0)
        else:
            dist.recv(out, peer)
            dist.send(back, peer)
    return times


def _ping_pong(dist, torch, peer: int, first: bool, repeats: int) -> list[float]:
    """Round trips (s) of a 1-element tensor (3 untimed first); timed on the ``first`` side."""
    t = torch.zeros(1, dtype=torch.float32)
    return _exchange(dist, t, t, peer, first, repeats, warmup=3)


def _transfer(dist, torch, me: int, src: int, dst: int, nbytes: int, repeats: int) -> list[float]:
    """Times (s, on the sender) of ``nbytes`` src -> dst plus a 4-byte ack; empty list on dst."""
    buf = torch.ones(nbytes // 4, dtype=torch.float32)
    ack = torch.zeros(1, dtype=torch.float32)
    return _exchange(dist, buf, ack, dst if me == src else src, me == src, repeats, warmup=1)


def measure_links(dist, torch, nbytes: int, repeats: int, rtt_repeats: int) -> dict | None:
    """Measure every pair in turn (a collective). Rank 0 gets ``{"bw": NxN, "rtt": NxN}``, others None.

    ``bw[i][j]``: bytes/s from rank i to rank j; ``rtt[i][j]``: ms; None on the diagonal.
    """
    rank, n = dist.get_rank(), dist.get_world_size()
    mine: dict[str, dict] = {"bw": {}, "rtt": {}}
    for a, b in combinations(range(n), 2):
        dist.barrier()
        if rank not in (a, b):
            continue
        peer = b if rank == a else a
        rtts = _ping_pong(dist, torch, peer, rank == a, rtt_repeats)
        if rtts:
            mine["rtt"][(a, b)] = statistics.median(rtts) * 1e3
        for src, dst in ((a, b), (b, a)):
            times = _transfer(dist, torch, rank, src, dst, nbytes, repeats)
            if times:
                mine["bw"][(src, dst)] = nbytes / statistics.median(times)
    dist.barrier()
    gathered: list[dict | None] = [None] * n if rank == 0 else []
    dist.gather_object(mine, gathered if rank == 0 else None, dst=0)
    if rank != 0:
        return None
    bw = [[None] * n for _ in range(n)]
    rtt = [[None] * n for _ in range(n)]
    for part in gathered:
        for (i, j), v in part["bw"].items():
            bw[i][j] = v
        for (i, j), v in part["rtt"].items():
            rtt[i][j] = rtt[j][i] = v
    return {"bw": bw, "rtt": rtt}


def slow_links(bw: list[list[float | None]], hosts: list[str], fraction: float) -> list[dict]:
    """Directed links whose bandwidth is below ``fraction`` x the median of all directed links."""
    values = [v for row in bw for v in row if v is not None]
    if not values:
        return []
    med = statistics.median(values)
    return [
        {"src": hosts[i], "dst": hosts[j], "src_rank": i, "dst_rank": j, "bytes_per_s": v,
         "median_bytes_per_s": med}
        for i, row in enumerate(bw) for j, v in enumerate(row)
        if v is not None and v < fraction * med
    ]


def links_record(res: dict, hosts: list[str], nbytes: int, repeats: int, rtt_repeats: int,
                 slow_fraction: float) -> dict:
    """The ``kind: links`` record of a :func:`measure_links` result ``res`` (rank 0's)."""
    return {"kind": "links", "time": time.time(), "backend": "gloo", "world_size": len(hosts), "hosts": hosts,
            "bytes": nbytes, "repeats": repeats, "rtt_repeats": rtt_repeats,
            "bandwidth_bytes_per_s": res["bw"], "rtt_ms": res["rtt"],
            "slow_links": slow_links(res["bw"], hosts, slow_fraction)}


def format_matrices(rec: dict) -> str:
    """The bandwidth (MB/s and Gb/s) and RTT (ms) matrices of a links record, plus slow links."""
    hosts = [f"{h}#{i}" for i, h in enumerate(rec["hosts"])]
    w = max(13, *(len(h) for h in hosts)) + 2
    out = [f"bandwidth, MB/s (Gb/s)  [row -> column, {rec['bytes'] / MB:.0f} MB transfers]",
           "".join(f"{h:>{w}}" for h in ["from \\ to", *hosts])]
    for i, row in enumerate(rec["bandwidth_bytes_per_s"]):
        cells = ["-" if v is None else f"{v / MB:.0f} ({v * 8 / 1e9:.2f})" for v in row]
        out.append("".join(f"{c:>{w}}" for c in [hosts[i], *cells]))
    out += ["", "RTT, ms", "".join(f"{h:>{w}}" for h in ["", *hosts])]
    for i, row in enumerate(rec["rtt_ms"]):
        out.append("".join(f"{c:>{w}}" for c in [hosts[i], *("-" if v is None else f"{v:.3f}" for v in row)]))
    for s in rec["slow_links"]:
        out.append(f"SLOW LINK {s['src']} -> {s['dst']}: {s['bytes_per_s'] * 8 / 1e9:.2f} Gb/s, "
                   f"median link {s['median_bytes_per_s'] * 8 / 1e9:.2f} Gb/s: "
                   "check the cable/port speed or a WiFi fallback")
    return "\n".join(out)


def main(argv: Sequence[str] | None = None) -> int:
    """Worker entry point. Exit 0 on success, 2 on bad arguments, 1 on a failed transfer."""
    ap = argparse.ArgumentParser(prog="torchrun ... -m ddplab.bench.links",
                                 description="Pairwise bandwidth and RTT matrix (gloo send/recv).")
    ap.add_argument("--bytes", type=float, default=64 * MB, help="bytes per transfer (default 64e6)")
    ap.add_argument("--repeats", type=int, default=3, help="timed transfers per direction (default 3)")
    ap.add_argument("--rtt-repeats", type=int, default=20, help="timed ping-pongs per pair (default 20)")
    ap.add_argument("--slow-fraction", type=float, default=0.5,
                    help="flag links below this fraction of the median link (default 0.5)")
    ap.add_argument("--pg-timeout-s", type=float, default=300.0, help="process-group timeout, s")
    ap.add_argument("--out", type=Path, help="append the JSON record here (rank 0)")
    args = ap.parse_args(argv)
    nbytes = int(args.bytes) // 4 * 4

    def check() -> None:
        if args.bytes < 4 or args.repeats < 1 or args.rtt_repeats < 1 or not 0 < args.slow_fraction < 1:
            raise ValueError("need --bytes >= 4, --repeats >= 1, --rtt-repeats >= 1, 0 < --slow-fraction < 1")

    def body(dist, torch, rank: int, n: int) -> int | None:
        if n < 2:
            if rank == 0:
                print("bench_links: needs at least 2 ranks (one per node)", file=sys.stderr)
            return EXIT_BAD_INPUT
        hosts = gather_hosts(dist)
        res = measure_links(dist, torch, nbytes, args.repeats, args.rtt_repeats)
        if rank == 0:
            rec = links_record(res, hosts, nbytes, args.repeats, args.rtt_repeats, args.slow_fraction)
            print(format_matrices(rec), flush=True)
            if args.out:
                append_record(args.out, rec)
        dist.barrier()
        return None

    return run("bench_links", args.pg_timeout_s, check, body)


if __name__ == "__main__":
    sys.exit(main())
