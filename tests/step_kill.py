"""A test harness: ``ddplab.train`` whose worker of one rank SIGKILLs itself at a given step, so
a test's fault lands at the same step whatever the machine's load (a poller that watches the
metrics and signals the worker can arrive any number of steps late, or after the run ended).

``python tests/step_kill.py ARGS...``: ``ddplab.train`` with ARGS (torchrun runs it as the worker
script). The fault, from the environment: ``DDPLAB_KILL_AT`` = ``RANK:STEP``: in the group's first
life (``TORCHELASTIC_RESTART_COUNT`` 0), the worker with torchrun ``RANK`` begins attempt ``STEP``,
waits until every other local rank's metrics file (``<out_dir>/metrics``, the same host) records
step STEP-1 as committed, and sends itself SIGKILL. So steps 1 .. STEP-1 are complete and logged on
every rank, and its peers wait for it in step STEP's collectives when torchrun's agent stops them.
Unset: ``ddplab.train`` unchanged.
"""

from __future__ import annotations

import os
import signal
import sys
import time

from ddplab import train
from ddplab.records import read_jsonl

#: How long the worker waits for its peers to log the step before its kill, in s.
PEERS_TIMEOUT_S = 120.0


def peers_logged(trainer: train.Trainer, step: int) -> bool:
    """Every other local rank's metrics file beside this worker's holds a committed ``step``."""
    others = int(os.environ.get("LOCAL_WORLD_SIZE", "1")) - 1
    peers = [p for p in trainer.metrics.dir.glob("*.jsonl") if p != trainer.metrics.path]
    return len(peers) >= others and all(
        any(r.get("event") == "step" and r.get("step") == step for r in read_jsonl(p)[0]) for p in peers)


def install() -> None:
    """Patch :meth:`ddplab.train.Trainer.train_step` with the fault of ``DDPLAB_KILL_AT``."""
    spec = os.environ.get("DDPLAB_KILL_AT")
    if not spec or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return
    rank, step = (int(v) for v in spec.split(":"))
    if int(os.environ.get("RANK", "0")) != rank:
        return
    real = train.Trainer.train_step

    def train_step(self):  # noqa: ANN001, ANN202 (the patched method's signature)
        if self.step + 1 == step:
            deadline = time.monotonic() + PEERS_TIMEOUT_S
            while not peers_logged(self, step - 1) and time.monotonic() < deadline:
                time.sleep(0.01)
            sys.stdout.flush()
            sys.stderr.flush()
            os.kill(os.getpid(), signal.SIGKILL)
        return real(self)

    train.Trainer.train_step = train_step


if __name__ == "__main__":
    install()
    train.cli(sys.argv[1:])
