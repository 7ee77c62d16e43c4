"""The controller-hosted c10d rendezvous store, with a small supervisor.

Why: with torchrun's c10d backend the store normally lives inside the agent of the endpoint host,
so losing that laptop ends the whole job (pytorch/pytorch#67742). ddp-lab runs the store in its
own process on a host that does not train (the controller by default) and starts every agent with
``--rdzv-conf is_host=false`` (docs/rendezvous.md has the measurements).

The controller may have no systemd (containers, WSL, this project's CI), so ``start`` runs the
store under the supervisor of :mod:`ddplab.controller.supervisor` (shared with the torchft
lighthouse): a detached process that restarts the store when it dies. State lives in
``--state-dir`` (default ``runs/.rdzv``): ``store-<port>.json`` (the pidfile: supervisor pid, its
create time, host, port, restarts, child pid), ``store-<port>.log`` and ``store-<port>.run.json``
(which run it serves: ``serves``).

Subcommands (every one prints one JSON object on stdout; ``changed`` tells Ansible the truth):

``serve --host H --port P``
    Run ``torch.distributed.TCPStore(H, P, is_master=True, wait_for_workers=False)`` in the
    foreground until SIGTERM/SIGINT. The server listens on every interface of the host (c10d binds
    the wildcard address); ``H`` is the address clients are told to use and the one checked.
``start --host H --port P``
    Idempotent: a live supervisor already serving port P that answers at H -> ``changed: false``.
    Otherwise start one and wait until the store answers a set/get round trip.
``stop --port P``
    Terminate the supervisor (and with it the store); ``changed: false`` when none was running.
``status --port P [--host H]``
    Report; exit code 0 when running and answering, 3 when not running, 1 when running but not
    answering. Another checkout's store on the port is not running (``held_by`` names it).
``serves --port P --run-id R``
    Record that the running store serves run R (a launch whose agents it serves): ``status``
    then says ``run_id`` R, also when the store is found by its port without a pidfile.

Exit codes: 0 ok, 1 the store did not come up / does not answer, 2 bad input or a conflict
(the port is held by another program, or by a store of ours bound to another host address),
3 not running (status only).
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

from ddplab.controller import supervisor
from ddplab.controller.supervisor import DEFAULT_STATE_DIR, ServiceError, ServiceState

LOG = logging.getLogger("ddplab.controller.rdzv_store")

DEFAULT_PORT = 29400
PING_KEY = "ddplab/rdzv_store/ping"

# The names this module has always exported (tests, benchmarks, the validate role).
StoreError = ServiceError
StoreState = ServiceState
__all__ = ["DEFAULT_PORT", "DEFAULT_STATE_DIR", "StoreError", "StoreState", "SERVICE", "ping", "serve",
           "start", "stop", "status", "read_state", "main"]


def ping(host: str, port: int, timeout_s: float = 3.0) -> bool:
    """True when a c10d store at host:port answers a set/get round trip within ``timeout_s``."""
    # a plain connect first: the c10d client logs a stack trace for every refused attempt
    if not supervisor.connectable(host, port, timeout_s):
        return False
    from torch.distributed import TCPStore

    try:
        client = TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout_s))
        token = f"{os.getpid()}-{time.time()}".encode()
        client.set(PING_KEY, token)
        return client.get(PING_KEY) == token
    except (RuntimeError, ValueError, TimeoutError, OSError):
        return False


SERVICE = supervisor.Service(name="store", label="store", module="ddplab.controller.rdzv_store",
                             port_setting="rendezvous_port", ping=ping, marker="ddplab.controller.rdzv_store")


def read_state(state_dir: Path, port: int) -> StoreState | None:
    """The pidfile of the store on ``port``, or None when absent or unreadable."""
    return supervisor.read_state(SERVICE, state_dir, port)


def serve(host: str, port: int) -> int:
    """Host the store in the foreground until SIGTERM/SIGINT. Returns the exit code (0)."""
    from torch.distributed import TCPStore

    stop_flag = {"flag": False}

    def _on_signal(signum: int, _frame: Any) -> None:
        stop_flag["flag"] = True

    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)
    store = TCPStore(host, port, is_master=True, wait_for_workers=False, multi_tenant=True)
    LOG.info("c10d TCPStore serving on *:%d (clients use %s:%d), pid %d", port, host, port, os.getpid())
    while not stop_flag["flag"]:
        time.sleep(0.2)
    del store
    LOG.info("store on port %d stopped", port)
    return 0


def _serve_argv(host: str, port: int) -> list[str]:
    return [sys.executable, "-m", "ddplab.controller.rdzv_store", "serve", "--host", host,
            "--port", str(port)]


def start(host: str, port: int, state_dir: Path, wait_s: float = 30.0) -> dict[str, Any]:
    """Start the supervised store unless it already runs (supervisor.start); the status dict with
    ``changed``. Raises StoreError (code 2: port held by another program or by our store under
    another host address; code 1: it did not answer a set/get round trip in ``wait_s``)."""
    return supervisor.start(SERVICE, host, port, state_dir, _serve_argv(host, port), wait_s)


def stop(port: int, state_dir: Path, wait_s: float = 15.0) -> dict[str, Any]:
    """Terminate the store's supervisor (and with it the store); ``changed: False`` when none ran."""
    return supervisor.stop(SERVICE, port, state_dir, wait_s)


def status(port: int, state_dir: Path, host: str | None = None) -> dict[str, Any]:
    """The store's state: ``running`` (supervisor alive), ``answering`` (set/get round trip)."""
    return supervisor.status(SERVICE, port, state_dir, host)


def main(argv: list[str] | None = None) -> int:
    """CLI entry point (start, stop, status, serve); returns the exit code."""
    return supervisor.cli(
        SERVICE, argv, description=__doc__.split("\n")[0], default_port=DEFAULT_PORT,
        start_argv=lambda a: _serve_argv(a.host, a.port),
        extra={"serve": (lambda p: None, lambda a: serve(a.host, a.port))},
    )


if __name__ == "__main__":
    sys.exit(main())
