"""The controller-hosted c10d rendezvous store, with a small supervisor.

Why: with torchrun's c10d backend the store normally lives inside the agent of the endpoint host,
so losing that laptop ends the whole job (pytorch/pytorch#67742). ddp-lab runs the store in its
own process on a host that does not train (the controller by default) and starts every agent with
``--rdzv-conf is_host=false`` (docs/rendezvous.md has the measurements).

The controller may have no systemd (containers, WSL, this project's CI), so ``start`` runs the
store under a supervisor of its own: a detached process (new session) that restarts the store
when it dies and removes its pidfile when told to stop. State lives in ``--state-dir``
(default ``runs/.rdzv``): ``store-<port>.json`` (the pidfile: supervisor pid, its create time,
host, port, restarts, child pid) and ``store-<port>.log``.

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
    answering.

Exit codes: 0 ok, 1 the store did not come up / does not answer, 2 bad input or a conflict
(the port is held by another program, or by a store of ours bound to another host address),
3 not running (status only).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import psutil

LOG = logging.getLogger("ddplab.controller.rdzv_store")

DEFAULT_PORT = 29400
DEFAULT_STATE_DIR = "runs/.rdzv"
PING_KEY = "ddplab/rdzv_store/ping"
# A store that dies more than this many times within RESTART_WINDOW_S is not restarted again:
# something is wrong (port stolen, torch broken) and a crash loop would hide it.
MAX_RESTARTS_IN_WINDOW = 5
RESTART_WINDOW_S = 60.0
RESTART_BACKOFF_S = 1.0


class StoreError(RuntimeError):
    """A store could not be started, reached or stopped; ``code`` is the CLI exit code."""

    def __init__(self, message: str, code: int = 1) -> None:
        super().__init__(message)
        self.code = code


@dataclass
class StoreState:
    """The pidfile contents. ``supervisor_ctime``: psutil create time (unix s), guards pid reuse."""

    host: str
    port: int
    supervisor_pid: int
    supervisor_ctime: float
    server_pid: int | None = None
    restarts: int = 0
    started_at: float = 0.0
    log: str = ""


def _paths(state_dir: Path, port: int) -> tuple[Path, Path]:
    return state_dir / f"store-{port}.json", state_dir / f"store-{port}.log"


def _write_state(path: Path, state: StoreState) -> None:
    """Atomic pidfile write (temp file + os.replace)."""
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(asdict(state), indent=1) + "\n")
    os.replace(tmp, path)


def read_state(state_dir: Path, port: int) -> StoreState | None:
    """The pidfile of the store on ``port``, or None when absent or unreadable."""
    path, _ = _paths(state_dir, port)
    try:
        return StoreState(**json.loads(path.read_text()))
    except (OSError, ValueError, TypeError):
        return None


def _alive(state: StoreState | None) -> bool:
    """True when the supervisor recorded in ``state`` is still that same process."""
    if state is None:
        return False
    try:
        proc = psutil.Process(state.supervisor_pid)
        return (
            abs(proc.create_time() - state.supervisor_ctime) < 1.0 and proc.status() != psutil.STATUS_ZOMBIE
        )
    except psutil.Error:
        return False


def ping(host: str, port: int, timeout_s: float = 3.0) -> bool:
    """True when a c10d store at host:port answers a set/get round trip within ``timeout_s``."""
    try:  # a plain connect first: the c10d client logs a stack trace for every refused attempt
        socket.create_connection((host, port), timeout=timeout_s).close()
    except OSError:
        return False
    from torch.distributed import TCPStore

    try:
        client = TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout_s))
        token = f"{os.getpid()}-{time.time()}".encode()
        client.set(PING_KEY, token)
        return client.get(PING_KEY) == token
    except (RuntimeError, ValueError, TimeoutError, OSError):
        return False


def _port_free(port: int) -> bool:
    """True when nothing listens on ``port`` (wildcard bind, like the c10d server)."""
    for family, addr in ((socket.AF_INET6, "::"), (socket.AF_INET, "0.0.0.0")):
        try:
            with socket.socket(family, socket.SOCK_STREAM) as s:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                s.bind((addr, port))
                return True
        except OSError as exc:
            if family == socket.AF_INET6 and exc.errno in (97, 99):  # no IPv6 here: try IPv4
                continue
            return False
    return False


# --------------------------------------------------------------------------- serve


def serve(host: str, port: int) -> int:
    """Host the store in the foreground until SIGTERM/SIGINT. Returns the exit code (0)."""
    from torch.distributed import TCPStore

    stop = {"flag": False}

    def _on_signal(signum: int, _frame: Any) -> None:
        stop["flag"] = True

    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)
    store = TCPStore(host, port, is_master=True, wait_for_workers=False, multi_tenant=True)
    LOG.info("c10d TCPStore serving on *:%d (clients use %s:%d), pid %d", port, host, port, os.getpid())
    while not stop["flag"]:
        time.sleep(0.2)
    del store
    LOG.info("store on port %d stopped", port)
    return 0


# --------------------------------------------------------------------------- supervise


def supervise(host: str, port: int, state_dir: Path) -> int:
    """Run ``serve`` as a child, restart it when it dies, keep the pidfile current.

    Stops (terminating the child) on SIGTERM/SIGINT and removes the pidfile. Gives up with exit
    code 1 after MAX_RESTARTS_IN_WINDOW deaths within RESTART_WINDOW_S.
    """
    pidfile, logfile = _paths(state_dir, port)
    me = psutil.Process()
    state = StoreState(host, port, me.pid, me.create_time(), None, 0, time.time(), str(logfile))
    stopping = {"flag": False}

    def _on_signal(signum: int, _frame: Any) -> None:
        stopping["flag"] = True

    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)
    deaths: list[float] = []
    child: subprocess.Popen[bytes] | None = None
    code = 0
    try:
        while not stopping["flag"]:
            if child is None:
                child = subprocess.Popen(
                    [sys.executable, "-m", "ddplab.controller.rdzv_store", "serve", "--host", host,
                     "--port", str(port)],
                    stdin=subprocess.DEVNULL,
                )
                state.server_pid = child.pid
                _write_state(pidfile, state)
            rc = child.poll()
            if rc is None:
                time.sleep(0.2)
                continue
            now = time.time()
            deaths = [t for t in deaths if now - t < RESTART_WINDOW_S] + [now]
            LOG.warning("store process %d exited with %s", child.pid, rc)
            child = None
            if len(deaths) > MAX_RESTARTS_IN_WINDOW:
                LOG.error(
                    "store died %d times within %.0f s: giving up (see the lines above)",
                    len(deaths),
                    RESTART_WINDOW_S,
                )
                code = 1
                break
            state.restarts += 1
            time.sleep(RESTART_BACKOFF_S)
    finally:
        if child is not None and child.poll() is None:
            child.terminate()
            try:
                child.wait(timeout=10)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()
        current = read_state(state_dir, port)
        if current is not None and current.supervisor_pid == me.pid:
            pidfile.unlink(missing_ok=True)
        LOG.info("supervisor %d exits (code %d)", me.pid, code)
    return code


# --------------------------------------------------------------------------- start / stop / status


def start(host: str, port: int, state_dir: Path, wait_s: float = 30.0) -> dict[str, Any]:
    """Start the supervised store unless it already runs; see the module docstring.

    Returns the status dict with ``changed``. Raises StoreError (code 2: port held by another
    program or by our store under another host address; code 1: it did not come up in ``wait_s``).
    """
    state_dir.mkdir(parents=True, exist_ok=True)
    state = read_state(state_dir, port)
    if _alive(state):
        assert state is not None
        if state.host != host:
            raise StoreError(
                f"a ddp-lab store already serves port {port} for host address {state.host}, not {host}: "
                f"run `python -m ddplab.controller.rdzv_store stop --port {port}` first",
                code=2,
            )
        if ping(host, port):
            return {**status(port, state_dir), "changed": False}
        # Alive but not answering: the supervisor is between restarts. Give it the wait budget.
        if _wait_ping(host, port, wait_s):
            return {**status(port, state_dir), "changed": False}
        raise StoreError(
            f"the store supervisor {state.supervisor_pid} runs but {host}:{port} does not answer"
        )
    if state is not None:  # stale pidfile
        _paths(state_dir, port)[0].unlink(missing_ok=True)
    if not _port_free(port):
        raise StoreError(
            f"port {port} on this host is held by another program: free it or choose another rendezvous_port",
            code=2,
        )
    _, logfile = _paths(state_dir, port)
    env = dict(os.environ)
    pkg_root = str(Path(__file__).resolve().parents[2])  # the folder holding ddplab/
    env["PYTHONPATH"] = os.pathsep.join(p for p in (pkg_root, env.get("PYTHONPATH", "")) if p)
    with open(logfile, "ab") as log:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "ddplab.controller.rdzv_store",
                "supervise",
                "--host",
                host,
                "--port",
                str(port),
                "--state-dir",
                str(state_dir.resolve()),
            ],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=log,
            start_new_session=True,
            close_fds=True,
            env=env,
            cwd="/",
        )
    if not _wait_ping(host, port, wait_s, proc):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        raise StoreError(f"the store did not answer at {host}:{port} within {wait_s:.0f} s; see {logfile}")
    return {**status(port, state_dir), "changed": True}


def _wait_ping(host: str, port: int, wait_s: float, proc: subprocess.Popen[bytes] | None = None) -> bool:
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            return False
        if ping(host, port, timeout_s=2.0):
            return True
        time.sleep(0.3)
    return False


def stop(port: int, state_dir: Path, wait_s: float = 15.0) -> dict[str, Any]:
    """Terminate the supervisor of ``port`` (SIGTERM, then SIGKILL of its process group)."""
    state = read_state(state_dir, port)
    pidfile, _ = _paths(state_dir, port)
    if not _alive(state):
        pidfile.unlink(missing_ok=True)
        return {"changed": False, "running": False, "port": port}
    assert state is not None
    sup = psutil.Process(state.supervisor_pid)
    children = sup.children(recursive=True)
    sup.terminate()
    _, alive = psutil.wait_procs([sup, *children], timeout=wait_s)
    for p in alive:
        with contextlib.suppress(psutil.Error):
            p.kill()
    psutil.wait_procs(alive, timeout=5)
    pidfile.unlink(missing_ok=True)
    return {"changed": True, "running": False, "port": port}


def status(port: int, state_dir: Path, host: str | None = None) -> dict[str, Any]:
    """The store's state: ``running`` (supervisor alive), ``answering`` (set/get round trip)."""
    state = read_state(state_dir, port)
    if not _alive(state):
        return {"running": False, "answering": False, "port": port}
    assert state is not None
    target = host or state.host
    return {
        "running": True,
        "answering": ping(target, port),
        "host": state.host,
        "port": port,
        "supervisor_pid": state.supervisor_pid,
        "server_pid": state.server_pid,
        "restarts": state.restarts,
        "started_at": state.started_at,
        "log": state.log,
    }


# --------------------------------------------------------------------------- CLI


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m ddplab.controller.rdzv_store",
                                description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    for name in ("serve", "supervise", "start", "stop", "status"):
        sp = sub.add_parser(name)
        sp.add_argument("--port", type=int, default=DEFAULT_PORT)
        if name != "stop":
            sp.add_argument("--host", required=name != "status", default=None)
        if name != "serve":
            sp.add_argument("--state-dir", type=Path, default=Path(DEFAULT_STATE_DIR))
        if name == "start":
            sp.add_argument("--wait", type=float, default=30.0, help="seconds to wait for the store")
    return p


def main(argv: list[str] | None = None) -> int:
    """CLI entry point; returns the exit code."""
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if not 1 <= args.port <= 65535:
        print(json.dumps({"error": f"port {args.port} is not in 1..65535"}))
        return 2
    try:
        if args.cmd == "serve":
            return serve(args.host, args.port)
        if args.cmd == "supervise":
            return supervise(args.host, args.port, args.state_dir)
        if args.cmd == "start":
            out = start(args.host, args.port, args.state_dir, args.wait)
            print(json.dumps(out))
            return 0
        if args.cmd == "stop":
            print(json.dumps(stop(args.port, args.state_dir)))
            return 0
        out = status(args.port, args.state_dir, args.host)
        print(json.dumps(out))
        if not out["running"]:
            return 3
        return 0 if out["answering"] else 1
    except StoreError as exc:
        print(json.dumps({"error": str(exc), "changed": False}))
        return exc.code


if __name__ == "__main__":
    sys.exit(main())
