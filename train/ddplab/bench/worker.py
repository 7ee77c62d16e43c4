"""What every bench worker shares: joining the gloo group under torchrun, the hosts by rank,
appending a JSON record, and the exit-code contract.

Exit status of every worker (:func:`run`): 0 done; 2 bad arguments or not started by torchrun
(nothing measured); 1 a collective failed (a peer was lost or timed out: gloo raises
RuntimeError). The process group is destroyed in every case.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import socket
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

EXIT_OK, EXIT_FAILED, EXIT_BAD_INPUT = 0, 1, 2


def init_distributed(pg_timeout_s: float):
    """Join the gloo process group from torchrun's environment. Returns (torch.distributed, rank, N).

    gloo binds ``DDPLAB_GLOO_ADDR`` when the ddp_job role set it, as in training
    (:func:`ddplab.distributed.gloo_backend`); a group of one rank is joined too.

    Raises RuntimeError with a one-line hint when not started by torchrun or when
    ``DDPLAB_GLOO_ADDR`` (or another torchrun variable) is malformed.
    """
    import torch.distributed as dist

    from ddplab.distributed import DistEnv, gloo_backend

    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        raise RuntimeError("not started by torchrun (RANK/WORLD_SIZE unset): "
                           "use torchrun --nproc-per-node=2 -m ddplab.bench.<bench> ...")
    try:
        env = DistEnv.from_environ()
    except ValueError as exc:
        raise RuntimeError(str(exc)) from None
    if not dist.is_initialized():
        dist.init_process_group(gloo_backend(env), timeout=dt.timedelta(seconds=pg_timeout_s))
    return dist, dist.get_rank(), dist.get_world_size()


def gather_hosts(dist) -> list[str]:
    """Hostname of every rank, indexed by rank (a collective: every rank must call it)."""
    hosts: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(hosts, socket.gethostname())
    return [str(h) for h in hosts]


def append_record(path: Path, rec: dict[str, Any]) -> None:
    """Append ``rec`` as one JSON line to ``path`` (its folder is created)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as fh:
        fh.write(json.dumps(rec) + "\n")


def run(prog: str, pg_timeout_s: float, check: Callable[[], None],
        body: Callable[[Any, Any, int, int], int | None]) -> int:
    """Run a bench worker under the exit-code contract (module docstring).

    ``check()`` validates the arguments before anything is joined (raises ValueError: exit 2);
    ``body(dist, torch, rank, world_size)`` measures and returns an exit status (None: 0).
    Messages go to stderr prefixed with ``prog``.
    """
    try:
        check()
    except ValueError as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    try:
        import torch

        dist, rank, n = init_distributed(pg_timeout_s)
    except RuntimeError as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    try:
        return body(dist, torch, rank, n) or EXIT_OK
    except RuntimeError as exc:  # gloo raises RuntimeError (and subclasses) on a lost peer or timeout
        print(f"{prog}: rank {rank}: {exc}", file=sys.stderr)
        return EXIT_FAILED
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
