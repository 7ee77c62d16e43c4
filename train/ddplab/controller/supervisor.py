"""A small process supervisor for the controller's network services (no systemd needed).

The controller may have no systemd (containers, WSL, this project's CI), so the services a job
needs from it, the c10d rendezvous store (:mod:`.rdzv_store`) and the torchft lighthouse
(:mod:`.lighthouse`), each run under a supervisor of their own: a detached process (new session)
that runs the service as its child, restarts it when it dies and removes its pidfile when told to
stop. A service is named by a :class:`Service` (its name, how to ask it whether it answers, the
module whose CLI manages it); this module holds what they share.

State lives in ``state_dir`` (default ``runs/.rdzv``): ``<name>-<port>.json`` (the pidfile: the
supervisor's pid and create time, host, port, restarts, the child's pid) and ``<name>-<port>.log``.

Run as ``python -m ddplab.controller.supervisor --name N --host H --port P --state-dir D -- ARGV``
(what :func:`start` launches): supervise the command ARGV.

Exit codes of the service CLIs built on it (:func:`cli`): 0 ok, 1 the service did not come up /
does not answer, 2 bad input or a conflict (the port is held by another program, or by the same
service bound to another host address), 3 not running (status only).
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
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import psutil

LOG = logging.getLogger("ddplab.controller.supervisor")

DEFAULT_STATE_DIR = "runs/.rdzv"
# A service that dies more than this many times within RESTART_WINDOW_S is not restarted again:
# something is wrong (port stolen, a broken install) and a crash loop would hide it.
MAX_RESTARTS_IN_WINDOW = 5
RESTART_WINDOW_S = 60.0
RESTART_BACKOFF_S = 1.0


class ServiceError(RuntimeError):
    """A service could not be started, reached or stopped; ``code`` is the CLI exit code."""

    def __init__(self, message: str, code: int = 1) -> None:
        super().__init__(message)
        self.code = code


@dataclass
class ServiceState:
    """The pidfile contents. ``supervisor_ctime``: psutil create time (unix s), guards pid reuse."""

    host: str
    port: int
    supervisor_pid: int
    supervisor_ctime: float
    server_pid: int | None = None
    restarts: int = 0
    started_at: float = 0.0
    log: str = ""


@dataclass(frozen=True)
class Service:
    """One kind of supervised service.

    ``name``: file prefix and label (``store``, ``lighthouse``); ``label``: how messages call it;
    ``module``: the module whose CLI manages it (named in the messages that say how to stop it);
    ``port_setting``: the inventory variable of its port; ``ping(host, port, timeout_s)``: True
    when the service answers at ``host:port``.
    """

    name: str
    label: str
    module: str
    port_setting: str
    ping: Callable[[str, int, float], bool]

    def paths(self, state_dir: Path, port: int) -> tuple[Path, Path]:
        """(pidfile, log) of the service on ``port``."""
        return state_dir / f"{self.name}-{port}.json", state_dir / f"{self.name}-{port}.log"


def _write_state(path: Path, state: ServiceState) -> None:
    """Atomic pidfile write (temp file + os.replace)."""
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(asdict(state), indent=1) + "\n")
    os.replace(tmp, path)


def read_state(service: Service, state_dir: Path, port: int) -> ServiceState | None:
    """The pidfile of ``service`` on ``port``, or None when absent or unreadable."""
    path, _ = service.paths(state_dir, port)
    try:
        return ServiceState(**json.loads(path.read_text()))
    except (OSError, ValueError, TypeError):
        return None


def alive(state: ServiceState | None) -> bool:
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


def port_free(port: int) -> bool:
    """True when nothing listens on ``port`` (tried as a wildcard bind, IPv6 then IPv4)."""
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


def connectable(host: str, port: int, timeout_s: float) -> bool:
    """True when a TCP connection to ``host:port`` opens within ``timeout_s``."""
    try:
        socket.create_connection((host, port), timeout=timeout_s).close()
        return True
    except OSError:
        return False


# --------------------------------------------------------------------------- supervise


def supervise(name: str, host: str, port: int, state_dir: Path, argv: Sequence[str]) -> int:
    """Run ``argv`` as a child, restart it when it dies, keep the pidfile ``<name>-<port>.json``.

    Stops (terminating the child) on SIGTERM/SIGINT and removes the pidfile. Gives up with exit
    code 1 after MAX_RESTARTS_IN_WINDOW deaths within RESTART_WINDOW_S.
    """
    pidfile, logfile = state_dir / f"{name}-{port}.json", state_dir / f"{name}-{port}.log"
    me = psutil.Process()
    state = ServiceState(host, port, me.pid, me.create_time(), None, 0, time.time(), str(logfile))
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
                child = subprocess.Popen(list(argv), stdin=subprocess.DEVNULL)
                state.server_pid = child.pid
                _write_state(pidfile, state)
            rc = child.poll()
            if rc is None:
                time.sleep(0.2)
                continue
            now = time.time()
            deaths = [t for t in deaths if now - t < RESTART_WINDOW_S] + [now]
            LOG.warning("%s process %d exited with %s", name, child.pid, rc)
            child = None
            if len(deaths) > MAX_RESTARTS_IN_WINDOW:
                LOG.error("%s died %d times within %.0f s: giving up (see the lines above)",
                          name, len(deaths), RESTART_WINDOW_S)
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
        try:
            current = ServiceState(**json.loads(pidfile.read_text()))
        except (OSError, ValueError, TypeError):
            current = None
        if current is not None and current.supervisor_pid == me.pid:
            pidfile.unlink(missing_ok=True)
        LOG.info("supervisor %d exits (code %d)", me.pid, code)
    return code


# --------------------------------------------------------------------------- start / stop / status


def start(service: Service, host: str, port: int, state_dir: Path, argv: Sequence[str],
          wait_s: float = 30.0) -> dict[str, Any]:
    """Start ``argv`` (the service serving ``host:port``) under a supervisor unless it already runs.

    Idempotent: a live supervisor of ``service`` on ``port`` that answers at ``host`` ->
    ``changed: False``. Otherwise a new detached supervisor, then wait up to ``wait_s`` seconds
    until the service answers (``service.ping``). Returns :func:`status` with ``changed``.
    Raises ServiceError (code 2: port held by another program or by this service under another
    host address; code 1: it did not answer in ``wait_s``).
    """
    state_dir.mkdir(parents=True, exist_ok=True)
    pidfile, logfile = service.paths(state_dir, port)
    state = read_state(service, state_dir, port)
    if alive(state):
        assert state is not None
        if state.host != host:
            raise ServiceError(
                f"a ddp-lab {service.label} already serves port {port} for host address {state.host}, "
                f"not {host}: "
                f"run `python -m {service.module} stop --port {port}` first",
                code=2,
            )
        # Alive: answering now, or between restarts (given the wait budget).
        if _wait_ping(service, host, port, wait_s):
            return {**status(service, port, state_dir), "changed": False}
        raise ServiceError(
            f"the {service.label} supervisor {state.supervisor_pid} runs but {host}:{port} does not answer")
    if state is not None:  # stale pidfile
        pidfile.unlink(missing_ok=True)
    if not port_free(port):
        raise ServiceError(
            f"port {port} on this host is held by another program: free it or choose another "
            f"{service.port_setting}",
            code=2,
        )
    env = dict(os.environ)
    pkg_root = str(Path(__file__).resolve().parents[2])  # the folder holding ddplab/
    env["PYTHONPATH"] = os.pathsep.join(p for p in (pkg_root, env.get("PYTHONPATH", "")) if p)
    with open(logfile, "ab") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "ddplab.controller.supervisor", "--name", service.name, "--host", host,
             "--port", str(port), "--state-dir", str(state_dir.resolve()), "--", *argv],
            stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True, close_fds=True,
            env=env, cwd="/",
        )
    if not _wait_ping(service, host, port, wait_s, proc):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        raise ServiceError(
            f"the {service.label} did not answer at {host}:{port} within {wait_s:.0f} s; see {logfile}")
    return {**status(service, port, state_dir), "changed": True}


def _wait_ping(service: Service, host: str, port: int, wait_s: float,
               proc: subprocess.Popen[bytes] | None = None) -> bool:
    deadline = time.monotonic() + wait_s
    while True:
        if proc is not None and proc.poll() is not None:
            return False
        if service.ping(host, port, 2.0):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.3)


def stop(service: Service, port: int, state_dir: Path, wait_s: float = 15.0, check: bool = False
         ) -> dict[str, Any]:
    """Terminate the supervisor of ``service`` on ``port`` (SIGTERM, then SIGKILL of what is left).

    ``changed: False`` when none was running. ``check``: stop nothing, touch no file, and say
    what would be stopped (``changed`` True and ``supervisor_pid`` when one runs), as
    ``ansible-playbook --check`` (reset.yml) lists it.
    """
    state = read_state(service, state_dir, port)
    pidfile, _ = service.paths(state_dir, port)
    if check:
        if not alive(state):
            return {"changed": False, "running": False, "port": port, "check": True}
        assert state is not None
        return {"changed": True, "running": True, "port": port, "check": True,
                "supervisor_pid": state.supervisor_pid}
    if not alive(state):
        pidfile.unlink(missing_ok=True)
        return {"changed": False, "running": False, "port": port}
    assert state is not None
    sup = psutil.Process(state.supervisor_pid)
    children = sup.children(recursive=True)
    sup.terminate()
    _, left = psutil.wait_procs([sup, *children], timeout=wait_s)
    for p in left:
        with contextlib.suppress(psutil.Error):
            p.kill()
    psutil.wait_procs(left, timeout=5)
    pidfile.unlink(missing_ok=True)
    return {"changed": True, "running": False, "port": port}


def status(service: Service, port: int, state_dir: Path, host: str | None = None) -> dict[str, Any]:
    """The service's state: ``running`` (supervisor alive), ``answering`` (``service.ping``),
    host, port, supervisor and server pids, restarts, start time (unix s), log path."""
    state = read_state(service, state_dir, port)
    if not alive(state):
        return {"running": False, "answering": False, "port": port}
    assert state is not None
    return {
        "running": True,
        "answering": service.ping(host or state.host, port, 3.0),
        "host": state.host,
        "port": port,
        "supervisor_pid": state.supervisor_pid,
        "server_pid": state.server_pid,
        "restarts": state.restarts,
        "started_at": state.started_at,
        "log": state.log,
    }


# --------------------------------------------------------------------------- CLI


def cli(
    service: Service,
    argv: list[str] | None,
    *,
    description: str,
    default_port: int,
    start_argv: Callable[[argparse.Namespace], list[str]],
    add_start_args: Callable[[argparse.ArgumentParser], None] = lambda p: None,
    extra: dict[str, tuple[Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], int]]]
    | None = None,
    describe: Callable[[dict[str, Any]], dict[str, Any]] = lambda out: out,
) -> int:
    """The ``start|stop|status`` CLI of a supervised service; returns the exit code.

    ``start_argv(args)``: the service's command for ``start`` (host and port in ``args``);
    ``add_start_args``: its own options of ``start``; ``extra``: more subcommands, name ->
    (add their arguments, run them -> exit code); ``describe``: adds to a running service's
    ``status``. Every subcommand except the extra ones prints one JSON object on stdout.
    """
    p = argparse.ArgumentParser(prog=f"python -m {service.module}", description=description)
    sub = p.add_subparsers(dest="cmd", required=True)
    extra = extra or {}
    for name in ("start", "stop", "status", *extra):
        sp = sub.add_parser(name)
        sp.add_argument("--port", type=int, default=default_port)
        if name != "stop":
            sp.add_argument("--host", required=name != "status", default=None)
        if name not in extra:
            sp.add_argument("--state-dir", type=Path, default=Path(DEFAULT_STATE_DIR))
        if name == "stop":
            sp.add_argument("--check", action="store_true",
                            help=f"stop nothing: say whether a {service.label} runs that stop would end")
        if name == "start":
            sp.add_argument("--wait", type=float, default=30.0,
                            help=f"seconds to wait for the {service.label}")
            add_start_args(sp)
        if name in extra:
            extra[name][0](sp)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if not 1 <= args.port <= 65535:
        print(json.dumps({"error": f"port {args.port} is not in 1..65535"}))
        return 2
    try:
        if args.cmd in extra:
            return extra[args.cmd][1](args)
        if args.cmd == "start":
            out = start(service, args.host, args.port, args.state_dir, start_argv(args), args.wait)
            print(json.dumps(describe(out)))
            return 0
        if args.cmd == "stop":
            print(json.dumps(stop(service, args.port, args.state_dir, check=args.check)))
            return 0
        out = status(service, args.port, args.state_dir, args.host)
        print(json.dumps(describe(out)))
        if not out["running"]:
            return 3
        return 0 if out["answering"] else 1
    except ServiceError as exc:
        print(json.dumps({"error": str(exc), "changed": False}))
        return exc.code


def main(argv: list[str] | None = None) -> int:
    """``python -m ddplab.controller.supervisor --name N --host H --port P --state-dir D -- ARGV``."""
    p = argparse.ArgumentParser(prog="python -m ddplab.controller.supervisor",
                                description=__doc__.split("\n")[0])
    p.add_argument("--name", required=True)
    p.add_argument("--host", required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--state-dir", type=Path, required=True)
    p.add_argument("argv", nargs=argparse.REMAINDER)
    args = p.parse_args(argv)
    command = args.argv[1:] if args.argv[:1] == ["--"] else args.argv
    if not command:
        p.error("no command to supervise (after --)")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    return supervise(args.name, args.host, args.port, args.state_dir, command)


if __name__ == "__main__":
    sys.exit(main())
