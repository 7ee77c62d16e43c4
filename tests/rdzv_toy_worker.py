"""A toy DDP worker for the rendezvous tests (started by torchrun, one per agent).

Trains a tiny linear model with DistributedDataParallel over gloo, one step every ``TOY_STEP_S``
seconds (default 0.2), and appends one JSON line per step to ``$TOY_LOG``:
``{event: "step", time, step, rank, world_size, restart_count, pid}``; a collective that fails
appends ``{event: "failure", time, error}`` and exits 1 (torchrun then restarts the group).
Stops after ``TOY_MAX_STEPS`` steps (default 100000) with exit code 0.
"""

from __future__ import annotations

import json
import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel


def _log(path: str, **rec: object) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(rec) + "\n")
        f.flush()


def main() -> int:
    log = os.environ["TOY_LOG"]
    step_s = float(os.environ.get("TOY_STEP_S", "0.2"))
    max_steps = int(os.environ.get("TOY_MAX_STEPS", "100000"))
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=30))
    rank, world = dist.get_rank(), dist.get_world_size()
    _log(
        log,
        event="start",
        time=time.time(),
        rank=rank,
        world_size=world,
        restart_count=restart,
        pid=os.getpid(),
    )
    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Linear(64, 64))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    try:
        for step in range(max_steps):
            x = torch.randn(8, 64)
            loss = model(x).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            _log(
                log,
                event="step",
                time=time.time(),
                step=step,
                rank=rank,
                world_size=world,
                restart_count=restart,
                pid=os.getpid(),
            )
            time.sleep(step_s)
    except Exception as exc:  # a peer vanished: record and let torchrun restart the group
        _log(log, event="failure", time=time.time(), rank=rank, error=str(exc)[:300])
        return 1
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
