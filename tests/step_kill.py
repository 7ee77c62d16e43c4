"""A test harness: ``ddplab.train`` whose worker of one rank SIGKILLs itself at a given step, so
a test's fault lands at the same step whatever the machine's load (a poller that watches the
metrics and signals the worker can arrive any number of steps late, or after the run ended).

``python tests/step_kill.py ARGS...``: ``ddplab.train`` with ARGS (torchrun runs it as the worker
script). The fault, from the environment: ``DDPLAB_KILL_AT`` = ``RANK:STEP``: in the group's first
life (``TORCHELASTIC_RESTART_COUNT`` 0), the worker with torchrun ``RANK`` sends itself SIGKILL as
it begins attempt ``STEP``, so steps 1 .. STEP-1 are complete on every rank and its peers wait for
it in step STEP's collectives. Unset: ``ddplab.train`` unchanged.
"""

from __future__ import annotations

import os
import signal
import sys

from ddplab import train


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
            sys.stdout.flush()
            sys.stderr.flush()
            os.kill(os.getpid(), signal.SIGKILL)
        return real(self)

    train.Trainer.train_step = train_step


if __name__ == "__main__":
    install()
    train.cli(sys.argv[1:])
