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

Workers forked from the agent: when the worker is ``-m ddplab.train ...`` and the start method is
``fork`` (``--start-method fork``), the agent imports ``ddplab.train`` (and so torch) once, before the
barrier, and launches the workers as the function entrypoint :func:`ddplab.train.worker` through
torch's ``elastic_launch`` with the same launch configuration torchrun would build from the same
arguments (rendezvous, ``--max-restarts``, ``--monitor-interval``, ``--log-dir``/``--tee``/
``--redirects`` with the same per-rank files ``<log-dir>/<run>/attempt_<n>/<local_rank>/``).
Each (re)started worker is then a fork of a process that already imported torch and skips the
imports (figures: docs/faults.md). The agent only imports: no tensor work, no OpenMP pool, no gloo
group exists in it before the fork; the worker sets its own thread count. Any other worker command,
or ``--start-method spawn`` (torchrun's default), runs exactly as ``torchrun`` (a new interpreter
per worker).

Workers learn the rendezvous endpoint: the agent sets ``DDPLAB_RDZV_ENDPOINT`` to
``--rdzv-endpoint`` (when given) in the environment its workers inherit. Under the per_step engine
(one replica group per node, torchrun with a local store: ``--nnodes 1 --rdzv-endpoint
NODE_ADDR:PORT --rdzv-conf is_host=true``) that store, hosted by this agent on a fixed port, is the
replica's store where the peers meet (ddplab.engines.torchft_replica); torchrun's worker store is on
a random port.

Membership watch (``--rdzv-backend c10d`` with ``--nnodes MIN:MAX``, MAX > 1): the agent uses
torch's own c10d rendezvous handler under the backend name ``ddplab-c10d``
(:class:`MembershipWatchedHandler`), which adds one check to the agent's monitor loop. torch's
agent restarts its workers for a membership change only when nodes wait for the next round
(``num_nodes_waiting``). An agent starved past the heartbeat window (keep_alive_interval x
keep_alive_max_attempt) is dropped from the store's state by the other agents; if it was the last
participant of its round they open the next round and form a group without it, while its own
workers, healthy at world size 1, go on training alone (seen under load > 19). The watch compares
the round the agent joined with the store's state at every monitor interval; when a later round
is complete without this node, the agent reports a node waiting, so torch restarts its workers and
it joins the next round like any newcomer (the others then re-form the group with it). An agent
dropped while no group formed without it (its round goes on, or every agent missed its heartbeats
at once and the emptied round was closed: the workers are still one group) only logs it: it
re-joins at the next membership change.

Store restart: the watched handler's backend reconnects to a restarted rendezvous store
(:class:`StoreReconnect`) instead of ending the agent at its next store call.

Final worker exits: a worker that exits with one of :data:`FINAL_EXIT_CODES` (``EXIT_CUT_OFF``:
a per_step replica cut off from its group, which waited for it already) is not restarted: the agent
stops at once with torchrun's error report, instead of spending ``--max-restarts`` on workers that
would each end the same way (:func:`stop_restarts_on_final_exits`). torch's agent restarts on any
failure up to ``--max-restarts`` and has no such rule.

Exit status: torchrun's (0 when the workers finished; 1 with torchrun's error report otherwise);
2 for a bad barrier setting (nothing started).

Torch internals this module replaces or relies on, each checked by one test of
tests/test_agent_torch_patches.py (the checklist of a torch upgrade): ``dynamic_rendezvous.
get_method_name`` (:func:`cheap_event_names`), ``LocalElasticAgent._monitor_workers`` and
``_remaining_restarts`` (:func:`stop_restarts_on_final_exits`), ``DynamicRendezvousHandler``'s
``_state_holder``/``_this_node`` and the rendezvous handler interface
(:class:`MembershipWatchedHandler`), ``C10dRendezvousBackend._call_store``/``_store``/``_key`` and
the handler's ``_store`` (:class:`StoreReconnect`), torchrun's parsed arguments and ``config_from_args``
(:func:`fork_launch`).
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time
import uuid
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from ddplab.exit_codes import EXIT_CUT_OFF

BARRIER_PREFIX = "ddplab/start-barrier/"
#: The training module whose workers the agent can fork (``-m ddplab.train``).
WORKER_MODULE = "ddplab.train"
#: Start methods under which the workers are forked from this process.
FORK_START_METHODS = ("fork",)
#: torch's c10d rendezvous with the membership watch (:class:`MembershipWatchedHandler`).
WATCHED_BACKEND = "ddplab-c10d"
#: Worker exit codes a restart cannot mend (:mod:`ddplab.exit_codes`): the agent ends instead.
FINAL_EXIT_CODES = {EXIT_CUT_OFF: "cut off from its per_step group (it waited for the group already)"}


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


class MembershipWatchedHandler:
    """torch's c10d rendezvous handler (``DynamicRendezvousHandler``) with a membership watch.

    Every call is torch's, except :meth:`num_nodes_waiting` (called by torch's agent once per
    monitor interval while its workers are healthy): it also returns 1 when a later round than the
    one this node joined is complete without it, i.e. the other agents dropped this node (its
    heartbeats expired) and formed a group without it. torch's agent then restarts its workers and
    re-joins (a membership change: no ``--max-restarts`` used).

    ``inner``: the handler torch's ``c10d`` backend creates. Raises RuntimeError when it lacks the
    rendezvous state of torch's DynamicRendezvousHandler (``_state_holder``/``_this_node``; torch
    2.13's layout), rather than run without the watch.
    """

    def __init__(self, inner: Any, backend: str = "") -> None:
        if not (hasattr(inner, "_state_holder") and hasattr(inner, "_this_node")):
            raise RuntimeError(f"ddplab.agent: the rendezvous handler {type(inner).__name__} has no "
                               "rendezvous state to watch (needs torch's DynamicRendezvousHandler)")
        self._inner = inner
        self._backend = backend or WATCHED_BACKEND
        self.joined_round: int | None = None
        self._warned_round: int | None = None

    def get_backend(self) -> str:
        """The backend name it was created under (``ddplab-c10d``)."""
        return self._backend

    @property
    def use_agent_store(self) -> bool:
        return self._inner.use_agent_store

    def next_rendezvous(self) -> Any:
        """torch's next_rendezvous; remembers the round joined. Returns torch's RendezvousInfo."""
        info = self._inner.next_rendezvous()
        self.joined_round = self._inner._state_holder.state.round
        return info

    def membership(self) -> tuple[int, bool, bool]:
        """``(current round, it is complete, this node is among its participants)`` in the state
        last synced."""
        state = self._inner._state_holder.state
        return state.round, state.complete, self._inner._this_node in state.participants

    def num_nodes_waiting(self) -> int:
        """Nodes waiting for the next round (torch's count, which syncs the state and drops
        nodes whose heartbeats expired), or 1 when a later round than the joined one is complete
        without this node (a group formed without it).

        A later round that is not complete (e.g. every agent of a loaded machine missed its
        heartbeats at once and the emptied round was closed: the workers still form one group)
        is no split and restarts nothing; the watch acts once such a round completes without it.
        """
        waiting = self._inner.num_nodes_waiting()
        if waiting or self.joined_round is None:
            return waiting
        current, complete, member = self.membership()
        if current != self.joined_round and complete and not member:
            _log(f"membership watch: this node trains in rendezvous round {self.joined_round} but "
                 f"round {current} was formed without it (its heartbeats expired); re-joining")
            return 1
        if not member and self._warned_round != current:
            self._warned_round = current
            _log(f"membership watch: dropped from the rendezvous state (round {current}, heartbeats "
                 "expired) while its workers stay in their group; re-joins at the next change")
        return 0

    def is_closed(self) -> bool:
        return self._inner.is_closed()

    def set_closed(self) -> None:
        self._inner.set_closed()

    def get_run_id(self) -> str:
        return self._inner.get_run_id()

    def shutdown(self) -> bool:
        return self._inner.shutdown()


class StoreReconnect:
    """Reconnects torch's c10d rendezvous backend to a restarted store.

    The controller's store is supervised: killed, it is started again on its port, empty, within
    seconds. torch's backend keeps one TCPStore client and raises ``RendezvousConnectionError`` on
    every call once its connection is gone, so each agent died at its next ``num_nodes_waiting``.
    Installed on a backend, a failed store call connects a new client to the endpoint (every
    ``RETRY_S`` for at most ``patience_s``, the store's read timeout), writes the backend's empty
    state marker again (what its constructor does), gives the new client to the backend and the
    handler, and repeats the call. The rendezvous state starts over in the new store: the running
    workers are untouched (they meet in their own store), and the next membership change forms
    its group there. Raises the last ``RendezvousConnectionError`` when the store stays away.

    torch internals (2.13; tests/test_agent_torch_patches.py): ``C10dRendezvousBackend._store``,
    ``._key``, ``._NULL_SENTINEL``, ``._call_store``, ``DynamicRendezvousHandler._store``.
    """

    RETRY_S = 1.0

    def __init__(self, backend: Any, host: str, port: int, patience_s: float) -> None:
        self.backend = backend
        self.host, self.port = host, port
        self.patience_s = patience_s
        self.handler: Any = None  # set once the handler exists
        self.reconnects = 0
        self._call = backend._call_store
        backend._call_store = self.call_store

    def call_store(self, store_op: str, *args: Any, **kwargs: Any) -> Any:
        from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError

        try:
            return self._call(store_op, *args, **kwargs)
        except RendezvousConnectionError as first:
            error = first
        deadline = time.monotonic() + self.patience_s
        while True:
            try:
                self._reconnect()
                return self._call(store_op, *args, **kwargs)
            except RendezvousConnectionError as exc:
                error = exc
            if time.monotonic() + self.RETRY_S > deadline:
                raise error
            time.sleep(self.RETRY_S)

    def _reconnect(self) -> None:
        from torch.distributed import TCPStore
        from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError

        backend = self.backend
        try:
            store = TCPStore(self.host, self.port, is_master=False, multi_tenant=True,
                             timeout=timedelta(seconds=min(self.patience_s, 10)))
            store.compare_set(backend._key, "", backend._NULL_SENTINEL)
            store.set_timeout(timedelta(seconds=self.patience_s))
        except (ValueError, RuntimeError, TimeoutError) as exc:
            raise RendezvousConnectionError(f"rendezvous store {self.host}:{self.port}: {exc}") from exc
        backend._store = store
        if self.handler is not None:
            self.handler._store = store
        self.reconnects += 1
        _log(f"reconnected to the rendezvous store {self.host}:{self.port} (the connection had failed: "
             "the store was restarted, its state starts over, or it was out of reach)")


def _create_watched_handler(params: Any) -> MembershipWatchedHandler:
    """Rendezvous handler creator for ``ddplab-c10d``: torch's c10d handler, watched, whose
    backend reconnects to a restarted store (:class:`StoreReconnect`)."""
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import create_backend
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler
    from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

    backend, store = create_backend(params)
    host, port = parse_rendezvous_endpoint(params.endpoint, default_port=29400)
    reconnect = StoreReconnect(backend, host, port, float(params.get_as_int("read_timeout", 60)))
    handler = create_handler(store, backend, params)
    reconnect.handler = handler
    return MembershipWatchedHandler(handler, params.backend)


def watch_membership(args: argparse.Namespace) -> bool:
    """Switch torchrun's parsed ``args`` from ``c10d`` to the watched ``ddplab-c10d`` backend
    when more than one node may join (``--nnodes`` MAX > 1; not under ``--standalone``).

    Registers the backend with torch's rendezvous registry (once). Returns True when switched.
    """
    import torch.distributed.run as torchrun
    from torch.distributed.elastic.rendezvous import rendezvous_handler_registry as registry

    if args.standalone or args.rdzv_backend != "c10d" or torchrun.parse_min_max_nnodes(args.nnodes)[1] < 2:
        return False
    registry.register(WATCHED_BACKEND, _create_watched_handler)  # idempotent for the same creator
    args.rdzv_backend = WATCHED_BACKEND
    return True


def caller_name(depth: int = 2) -> str:
    """The name of the function ``depth`` frames up from this call (0: this function itself),
    "no_method_name" when the stack is shorter: what torch's
    ``dynamic_rendezvous.get_method_name`` returns, from one frame instead of ``inspect.stack()``.

    torch names every rendezvous event after its caller with ``inspect.stack()``, twice per event,
    even when no event handler is configured: it reads every frame's source and scans
    ``sys.modules`` for frames of no module, about 1 ms of CPU per event in an agent that imported
    ``ddplab.train`` (over a thousand modules). The rendezvous loop and the heartbeat thread
    record several events per second, so under load the agent's main thread spends most of its
    time there.
    """
    try:
        return sys._getframe(depth).f_code.co_name  # frame 0: this function, as inspect.stack()[0]
    except ValueError:
        return "no_method_name"


def cheap_event_names() -> None:
    """Make torch's rendezvous name its events with :func:`caller_name` (see there)."""
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous

    dynamic_rendezvous.get_method_name = caller_name


def final_exit(result: Any) -> str | None:
    """Why torch's run ``result`` (``RunResult``) must not be restarted: every failed worker
    exited with a code of :data:`FINAL_EXIT_CODES` (its meaning), else None."""
    failures = getattr(result, "failures", None) or {}
    codes = {getattr(f, "exitcode", None) for f in failures.values()}
    if not result.is_failed() or not codes or not codes <= FINAL_EXIT_CODES.keys():
        return None
    return "; ".join(f"exit {c}: {FINAL_EXIT_CODES[c]}" for c in sorted(codes))


def stop_restarts_on_final_exits() -> None:
    """Make torch's local agent end, instead of restarting its workers, after a final exit
    (:func:`final_exit`): its ``_monitor_workers`` result then leaves no restart (torch's own
    loop stops the workers and returns the failure, as after the last of ``--max-restarts``).
    Idempotent; the agent process only."""
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    monitor = LocalElasticAgent._monitor_workers
    if getattr(monitor, "ddplab_final_exits", False):
        return

    @functools.wraps(monitor)
    def _monitor_workers(self: Any, worker_group: Any) -> Any:
        result = monitor(self, worker_group)
        why = final_exit(result)
        if why and self._remaining_restarts > 0:
            _log(f"worker ended for good ({why}): not restarted ({self._remaining_restarts} of "
                 f"--max-restarts {worker_group.spec.max_restarts} left unused)")
            self._remaining_restarts = 0
        return result

    _monitor_workers.ddplab_final_exits = True  # type: ignore[attr-defined]
    LocalElasticAgent._monitor_workers = _monitor_workers  # type: ignore[method-assign]


def forks_worker(args: argparse.Namespace) -> bool:
    """True when torchrun's parsed ``args`` start ``-m ddplab.train`` with a fork start method."""
    return (bool(args.module) and args.training_script == WORKER_MODULE and not args.no_python
            and not args.run_path and args.start_method in FORK_START_METHODS)


def fork_launch(args: argparse.Namespace) -> tuple[Any, Callable[..., None], tuple[str, ...]]:
    """The launch configuration, function entrypoint and its arguments for torchrun's ``args``.

    Applies what ``torch.distributed.run.run`` does before building the configuration
    (``--standalone``: c10d on an OS-chosen local port with a random run id; ``static`` without
    an endpoint on one node: the same), then builds it with torchrun's own ``config_from_args``,
    so every launch option means what it means to torchrun. Returns ``(LaunchConfig,
    ddplab.train.worker, training arguments)``. Raises what ``config_from_args`` raises on bad
    arguments (AssertionError/ValueError).
    """
    import torch.distributed.run as torchrun

    from ddplab import train

    one_node = torchrun.parse_min_max_nnodes(args.nnodes)[1] == 1
    if args.standalone or (args.rdzv_backend == "static" and not args.rdzv_endpoint
                           and args.master_port is None and one_node):
        args.rdzv_backend, args.rdzv_endpoint, args.rdzv_id = "c10d", "localhost:0", str(uuid.uuid4())
    if args.master_port is None:
        args.master_port = 29500
    config, _cmd, _cmd_args = torchrun.config_from_args(args)
    return config, train.worker, tuple(args.training_script_args)


def run_forked(args: argparse.Namespace) -> None:
    """Launch the forked workers for torchrun's ``args`` and wait for them (see the module doc).

    Raises ``ChildFailedError`` (torchrun's error report is logged) when the workers failed after
    the last restart, as ``torch.distributed.run.main`` does.
    """
    from torch.distributed.elastic.multiprocessing.errors import record
    from torch.distributed.launcher.api import elastic_launch

    config, entrypoint, worker_args = fork_launch(args)
    _log(f"workers forked from the agent ({args.start_method}): {WORKER_MODULE}.worker "
         f"{' '.join(worker_args)}")
    record(elastic_launch(config=config, entrypoint=entrypoint))(*worker_args)


def main(argv: list[str] | None = None) -> int:
    """Run the barrier (when configured), then torchrun with ``argv``; returns the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    import torch.distributed.run as torchrun  # the slow import, before the barrier

    args = torchrun.parse_args(argv)
    fork = forks_worker(args)
    if args.rdzv_endpoint:
        from ddplab.distributed import RDZV_ENDPOINT_ENV

        os.environ[RDZV_ENDPOINT_ENV] = args.rdzv_endpoint  # inherited by the workers
    if fork:
        import ddplab.train  # noqa: F401  (imported once here; every forked worker inherits it)

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
    cheap_event_names()
    stop_restarts_on_final_exits()
    if watch_membership(args):
        _log(f"rendezvous {WATCHED_BACKEND}: torch's c10d with the membership watch")
    if fork:
        run_forked(args)
    else:
        from torch.distributed.elastic.multiprocessing.errors import record

        record(torchrun.run)(args)  # torchrun.main(argv) with the watched backend
    return 0


if __name__ == "__main__":
    sys.exit(main())
