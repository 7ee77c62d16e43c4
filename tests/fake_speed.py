"""A test harness: ddplab.train (or ddplab.agent) with the work seconds a balanced run measures
replaced by a deterministic speed model, so that shares and re-plans do not depend on this
machine's load (tests/test_balance_distributed.py).

``python tests/fake_speed.py ARGS...``: ``ddplab.train`` with ARGS (torchrun runs it as the worker
script); ``python tests/fake_speed.py --agent ARGS...``: ``ddplab.agent`` with ARGS, whose forked
workers inherit the model.

The model, from the environment: ``DDPLAB_FAKE_SPEEDS`` (samples per second by torchrun ``RANK``,
e.g. ``4,2,1``; one value for a replica of its own); ``DDPLAB_FAKE_CHANGE`` (optional,
``RANK:STEP:FACTOR``: from attempt STEP on, that rank's speed times FACTOR). A step's work is then
``samples / speed`` seconds, whatever the real time was. ``DDPLAB_KILL_AT`` (optional): the fault
of tests/step_kill.py, in the worker script only.
"""

from __future__ import annotations

import os
import sys

from ddplab import balance


def speed(rank: int, step: int) -> float:
    """Samples per second of torchrun rank ``rank`` at attempt ``step`` (the model above)."""
    speeds = [float(v) for v in os.environ["DDPLAB_FAKE_SPEEDS"].split(",")]
    value = speeds[rank if len(speeds) > 1 else 0]
    change = os.environ.get("DDPLAB_FAKE_CHANGE")
    if change:
        who, since, factor = change.split(":")
        if int(who) == rank and step >= int(since):
            value *= float(factor)
    return value


def install() -> None:
    """Replace the measured work of every balanced attempt by the model's."""
    real = balance.SpeedBalancer.observe
    rank = int(os.environ.get("RANK", "0"))

    def observe(self, plan, work_s):  # noqa: ANN001, ANN202 (the patched method's signature)
        step = self.run.step + 1
        return real(self, plan, balance.plan_samples(plan) / speed(rank, step))

    balance.SpeedBalancer.observe = observe


if __name__ == "__main__":
    import step_kill  # beside this file: the fault of DDPLAB_KILL_AT, when set

    install()
    step_kill.install()
    if sys.argv[1:2] == ["--agent"]:
        from ddplab import agent

        sys.exit(agent.main(sys.argv[2:]))
    from ddplab import train

    train.cli(sys.argv[1:])
