"""One rank of tests/test_peer_partition.py, run inside a network namespace.

Joins the group as the torchelastic engine does (``TorchElastic.connect`` with the default run
configuration and the ``key=value`` settings of argv: env:// rendezvous from RANK, WORLD_SIZE,
MASTER_ADDR, MASTER_PORT; gloo bound to DDPLAB_GLOO_ADDR), prints one JSON line
``{"event": "ready"}`` after a first all-reduce, then one all-reduce per line read from stdin,
each reported as ``{"event": "done", "sum": S, "seconds": T}`` or ``{"event": "error", "seconds":
T, "error": "..."}`` (then exit 1).
"""

import json
import sys
import time

import torch
from ddplab.config import build_config
from ddplab.distributed import DistEnv, sum_over_world
from ddplab.engines.torchelastic import TorchElastic


def report(**rec: object) -> None:
    print(json.dumps(rec), flush=True)


def main(argv: list[str]) -> int:
    settings = dict(arg.split("=", 1) for arg in argv)
    engine = TorchElastic(build_config(overrides=settings), DistEnv.from_environ(), run=None)
    engine.connect()
    sum_over_world(torch.ones(1))
    report(event="ready")
    for _line in sys.stdin:
        t0 = time.monotonic()
        total = torch.ones(1)
        try:
            sum_over_world(total)
        except RuntimeError as exc:
            report(event="error", seconds=round(time.monotonic() - t0, 1), error=str(exc)[:300])
            return 1
        report(event="done", sum=float(total[0]), seconds=round(time.monotonic() - t0, 1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
