"""The node agent: torchrun, started in-process after a start barrier on the rendezvous store.

``python -m ddplab.agent <torchrun arguments>`` behaves like ``torchrun <torchrun arguments>``
(it calls ``torch.distributed.run.main`` in this process), with one addition: when
``DDPLAB_AGENT_BARRIER`` is set, it first waits until ``DDPLAB_AGENT_BARRIER_NODES`` agents of the
same launch have arrived at the rendezvous store (the ``--rdzv-endpoint``), for at most
``DDPLAB_AGENT_BARRIER_TIMEOUT`` seconds (default 120), then starts the agent.

Why: with ``--nnodes MIN:MAX`` the first rendezvous round closes ``last_call_timeout`` seconds
after the first agent arrives, unless all MAX are in before. Agents are started by Ansible a
little apart and each first imports torch (seconds, more on a busy laptop), so a node that is a
few seconds late joins through a restart of the group it just missed. Here torch is imported
*before* the barrier, so the agents of one launch enter the rendezvous within milliseconds of
each other and the first round is complete at once. The barrier key is per launch
(``ddplab/start-barrier/<DDPLAB_AGENT_BARRIER>``); a node started alone later (a rejoin) uses a
launch of its own with ``DDPLAB_AGENT_BARRIER_NODES=1`` and does not wait. A barrier that times
out is not an error: the agent starts anyway (elastic membership takes care of latecomers).

Exit status: torchrun's (0 when the workers finished; 1 with torchrun's error report otherwise);
2 for a bad barrier setting (nothing started).
"""

from __future__ import annotations

import os
import sys
import time
from datetime import timedelta

BARRIER_PREFIX = "ddplab/start-barrier/"


def _log(msg: str) -> None:
    print(f"[ddplab.agent] {msg}", file=sys.stderr, flush=True)


def barrier(
    endpoint: str, token: str, nodes: int, timeout_s: float, poll_s: float = 0.05
) -> tuple[int, float]:
    """Arrive at the start barrier ``token`` on the c10d store at ``endpoint`` (host:port) and wait
    until ``nodes`` agents have arrived or ``timeout_s`` passed.

    Returns ``(agents arrived, seconds waited)``. Raises RuntimeError/TimeoutError (from the c10d
    client) when the store cannot be reached within ``timeout_s``.
    """
    from torch.distributed import TCPStore

    host, _, port = endpoint.rpartition(":")
    start = time.monotonic()
    store = TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=max(1.0, timeout_s)))
    key = BARRIER_PREFIX + token
    arrived = store.add(key, 1)
    deadline = start + timeout_s
    while arrived < nodes and time.monotonic() < deadline:
        time.sleep(poll_s)
        arrived = store.add(key, 0)
    return arrived, time.monotonic() - start


def main(argv: list[str] | None = None) -> int:
    """Run the barrier (when configured), then torchrun with ``argv``; returns the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    import torch.distributed.run as torchrun  # the slow import, before the barrier

    token = os.environ.get("DDPLAB_AGENT_BARRIER", "")
    if token:
        try:
            nodes = int(os.environ.get("DDPLAB_AGENT_BARRIER_NODES", "1"))
            timeout_s = float(os.environ.get("DDPLAB_AGENT_BARRIER_TIMEOUT", "120"))
            if nodes < 1 or timeout_s <= 0:
                raise ValueError("nodes must be >= 1 and the timeout > 0")
        except ValueError as exc:
            _log(f"error: bad DDPLAB_AGENT_BARRIER_NODES/TIMEOUT: {exc}")
            return 2
        args = torchrun.parse_args(argv)
        if not args.rdzv_endpoint:
            _log("error: DDPLAB_AGENT_BARRIER needs --rdzv-endpoint host:port")
            return 2
        arrived, waited = barrier(args.rdzv_endpoint, token, nodes, timeout_s)
        if arrived >= nodes:
            _log(f"start barrier {token}: {arrived}/{nodes} agents after {waited:.1f} s")
        else:
            _log(
                f"start barrier {token}: only {arrived}/{nodes} agents after {waited:.0f} s; starting anyway"
            )
    torchrun.main(argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
