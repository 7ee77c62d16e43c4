"""A small process supervisor for the controller's network services (no systemd needed).

The controller may have no systemd (containers, WSL, this project's CI), so the services a job
needs from it, the c10d rendezvous store (:mod:`.rdzv_store`) and the torchft lighthouse
(:mod:`.lighthouse`), each run under a supervisor of their own: a detached process (new session)
that runs the service as its child, restarts it when it dies and removes its pidfile when told to
stop. A service is named by a :class:`Service` (its name, how to ask it whether it answers, the
module whose CLI manages it); this module holds what they share.

State lives in ``state_dir`` (default ``runs/.rdzv``): ``<name>-<port>.json`` (the pidfile: the
supervisor's pid and create time, host, port, restarts, the child's pid), ``<name>-<port>.log`` and
``<name>-<port>.run.json`` (the run record: which run the service serves, written by each launch
whose agents it serves, :func:`record_run`; it holds for the process it names only).

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
from collections.abc import Callable, Mapping, Sequence
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
    when the service answers at ``host:port``; ``marker``: see :func:`holders`.
    """

    name: str
    label: str
    module: str
    port_setting: str
    ping: Callable[[str, int, float], bool]
    # a word of the serving process's command line (``ddplab.controller.rdzv_store``,
    # ``torchft_lighthouse``): tells this service when it serves without its supervisor
    marker: str = ""

    def paths(self, state_dir: Path, port: int) -> tuple[Path, Path]:
        """(pidfile, log) of the service on ``port``."""
        return state_dir / f"{self.name}-{port}.json", state_dir / f"{self.name}-{port}.log"

    def run_path(self, state_dir: Path, port: int) -> Path:
        """The run record of the service on ``port`` (:func:`record_run`)."""
        return state_dir / f"{self.name}-{port}.run.json"


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


def _served_argv(state: ServiceState) -> list[str] | None:
    """The command line the live supervisor of ``state`` runs (its arguments after ``--``), or None
    when it cannot be read."""
    try:
        cmdline = psutil.Process(state.supervisor_pid).cmdline()
    except psutil.Error:
        return None
    return cmdline[cmdline.index("--") + 1:] if "--" in cmdline else None


def _flags(argv: Sequence[str]) -> dict[str, str | None]:
    """``--flag value`` pairs of ``argv`` (a flag without value maps to None), and under "program"
    the program's resolved path (a symlink to the same interpreter is the same program)."""
    out: dict[str, str | None] = {"program": os.path.realpath(argv[0]) if argv else None}
    for i, arg in enumerate(argv):
        if arg.startswith("--"):
            nxt = argv[i + 1] if i + 1 < len(argv) else None
            out[arg] = None if nxt is None or nxt.startswith("--") else nxt
    return out


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


# --------------------------------------------------------------------------- which run it serves


def served_run(service: Service, state_dir: Path | str | None, port: int, pid: int | None,
               ctime: float | None) -> str | None:
    """The run id of the run record in ``state_dir`` when it names the process ``pid`` created at
    ``ctime`` (unix s; the supervisor, or a server whose supervisor is gone), else None (no
    record, or one of an earlier process on that port)."""
    if not state_dir or pid is None or ctime is None:
        return None
    try:
        doc = json.loads(service.run_path(Path(state_dir), port).read_text())
        same = int(doc["pid"]) == pid and abs(float(doc["ctime"]) - float(ctime)) < 1.0
        return str(doc["run_id"]) if same and doc.get("run_id") else None
    except (OSError, ValueError, TypeError, KeyError):
        return None


def record_run(service: Service, port: int, state_dir: Path, run_id: str) -> dict[str, Any]:
    """Note that ``run_id`` is the run this checkout's ``service`` on ``port`` serves (a launch whose
    agents it serves calls it): the run record ``<name>-<port>.run.json`` names the run and the
    process (the supervisor of the pidfile, else the one :func:`holders` finds as ``ours``), so
    :func:`status` can say which run it serves, also with its pidfile gone. Returns ``changed``
    (False: already recorded, or no service of this checkout runs on ``port``: ``note`` says so),
    ``run_id``, ``port``. Atomic write (temp file + os.replace)."""
    state = read_state(service, state_dir, port)
    if alive(state):
        assert state is not None
        pid, ctime = state.supervisor_pid, state.supervisor_ctime
    else:
        ours = [h for h in holders(service, port, state_dir) if h["kind"] == "ours"]
        if not ours:
            return {"changed": False, "run_id": run_id, "port": port,
                    "note": f"no {service.label} of this checkout runs on port {port}: no run recorded"}
        pid, ctime = ours[0].get("supervisor_pid") or ours[0]["server_pid"], ours[0]["created"]
    if served_run(service, state_dir, port, pid, ctime) == run_id:
        return {"changed": False, "run_id": run_id, "port": port}
    path = service.run_path(state_dir, port)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps({"run_id": run_id, "pid": pid, "ctime": ctime, "since": time.time()}) + "\n")
    os.replace(tmp, path)
    return {"changed": True, "run_id": run_id, "port": port}


# --------------------------------------------------------------------------- what listens on a port


def _flag(argv: Sequence[str], name: str) -> str | None:
    """The value after ``name`` in ``argv`` (``--state-dir D``), or None."""
    for i, arg in enumerate(argv[:-1]):
        if arg == name:
            return argv[i + 1]
    return None


def _listening_pids(port: int) -> tuple[set[int], bool]:
    """(pids of the processes listening on TCP ``port`` on any address, whether one listener's
    process could not be seen: another user's, which this user may not inspect)."""
    pids, hidden = set(), False
    try:
        conns = psutil.net_connections(kind="tcp")
    except psutil.AccessDenied:  # some systems list only one's own processes' sockets
        conns = []
        for proc in psutil.process_iter():
            with contextlib.suppress(psutil.Error):
                conns += [c._replace(pid=proc.pid) for c in proc.net_connections(kind="tcp")]
    for c in conns:
        if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port:
            if c.pid is None:
                hidden = True
            else:
                pids.add(c.pid)
    return pids, hidden


def holders(service: Service, port: int, state_dir: Path) -> list[dict[str, Any]]:
    """Every process that listens on ``port``, and whose it is (psutil; no pidfile needed).

    Each: ``pid`` (None: a process this user cannot see), ``program``, ``user``, ``created`` (unix
    s), and ``kind``: ``ours`` (this ``service`` under a ddp-lab supervisor whose state folder is
    ``state_dir``, or serving without one from this Python's venv), ``other`` (this service of
    another state folder or venv: another checkout's), ``unknown`` (not this service: another
    program, or one this user cannot see). A ddp-lab one also has ``supervisor_pid`` (None: its
    supervisor is gone), ``host``, ``state_dir`` (the supervisor's), ``server_pid`` and ``run_id``
    (the run it serves by the run record of its state folder, :func:`served_run`; None: not known).
    """
    pids, hidden = _listening_pids(port)
    out: list[dict[str, Any]] = []
    mine = Path(sys.executable).parent  # this venv's bin/ (argv[0] names it; exe() is the resolved binary)
    for pid in sorted(pids):
        try:
            proc = psutil.Process(pid)
            argv, chain = proc.cmdline(), [proc, *proc.parents()]
            doc = {"pid": pid, "program": proc.name(), "user": proc.username(), "created": proc.create_time(),
                   "kind": "unknown"}
            sup = next((p for p in chain if "ddplab.controller.supervisor" in " ".join(p.cmdline())), None)
            sup_argv = sup.cmdline() if sup is not None else []
            if sup is not None and _flag(sup_argv, "--name") == service.name:
                folder = _flag(sup_argv, "--state-dir") or ""
                same = Path(folder).resolve() == state_dir.resolve()
                doc.update(kind="ours" if same else "other", supervisor_pid=sup.pid, state_dir=folder,
                           host=_flag(sup_argv, "--host"), server_pid=pid, created=sup.create_time())
                doc["run_id"] = served_run(service, folder, port, sup.pid, doc["created"])
            elif service.marker and any(service.marker in a for a in argv):
                exe_dir = Path(argv[0]).parent if argv and os.path.isabs(argv[0]) else None
                bind = _flag(argv, "--bind") or ""
                doc.update(kind="ours" if exe_dir == mine else "other", supervisor_pid=None,
                           host=_flag(argv, "--host") or bind.rsplit(":", 1)[0] or None, state_dir=None,
                           server_pid=pid, venv=str(exe_dir.parent) if exe_dir else None)
                if doc["kind"] == "ours":  # its supervisor gone: the record names the server itself
                    doc["run_id"] = served_run(service, state_dir, port, pid, doc["created"])
        except psutil.Error:
            doc = {"pid": pid, "program": "?", "user": "?", "created": None, "kind": "unknown"}
        out.append(doc)
    if hidden:
        out.append({"pid": None, "program": "?", "user": "another user", "created": None, "kind": "unknown"})
    return out


def holder_text(service: Service, doc: Mapping[str, Any]) -> str:
    """One holder of :func:`holders` in words: ``a ddp-lab lighthouse of this checkout (supervisor pid
    12, no pidfile)``, ``... of another checkout (state folder /x/runs/.rdzv)``, ``nginx (pid 7, user
    www)``."""
    if doc["kind"] == "unknown":
        if doc.get("pid") is None:
            return "a process of another user (not visible to this one)"
        return f"{doc['program']} (pid {doc['pid']}, user {doc['user']}), not a ddp-lab {service.label}"
    sup = (f"supervisor pid {doc['supervisor_pid']}" if doc.get("supervisor_pid")
           else f"pid {doc['server_pid']}, its supervisor gone")
    if doc["kind"] == "ours":
        return f"a ddp-lab {service.label} of this checkout ({sup}) with no pidfile"
    where = (f"state folder {doc['state_dir']}" if doc.get("state_dir") else f"venv {doc.get('venv') or '?'}")
    run = f"; serving run {doc['run_id']}" if doc.get("run_id") else ""
    return f"a ddp-lab {service.label} of another checkout ({where}; {sup}{run})"


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

    Idempotent: a live supervisor of ``service`` on ``port`` that answers at ``host`` with the same
    ``argv`` -> ``changed: False``; with another ``argv`` (other settings) it is refused, not
    reused. Otherwise a new detached supervisor, then wait up to ``wait_s`` seconds until the
    service answers (``service.ping``). Returns :func:`status` with ``changed``.
    Raises ServiceError (code 2: port held by another program, or by this service under another
    host address or other settings; code 1: it did not answer in ``wait_s``).
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
        running = _served_argv(state)
        ran, asked = _flags(running or []), _flags(argv)
        if running is not None and ran != asked:
            differ = ", ".join(f"{k} {asked.get(k)} (runs {ran.get(k)})" for k in asked | ran
                               if asked.get(k) != ran.get(k))
            raise ServiceError(
                f"a ddp-lab {service.label} already serves port {port} with other settings: "
                f"{differ or ' '.join(running)}; stop it first (`python -m {service.module} stop "
                f"--port {port}`; collect.yml and stop.yml stop it after a run)",
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
        found = holders(service, port, state_dir)
        what = "; ".join(holder_text(service, h) for h in found) or "another program"
        raise ServiceError(
            f"port {port} on this host is held by {what}: free it (python -m {service.module} stop"
            f" --port {port} stops one of this checkout's) or choose another {service.port_setting}",
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


def _terminate(pid: int, wait_s: float) -> None:
    """SIGTERM to ``pid`` (a supervisor, or a server without one), then SIGKILL of what is left of
    it and its children after ``wait_s``."""
    try:
        top = psutil.Process(pid)
        procs = [top, *top.children(recursive=True)]
        top.terminate()
    except psutil.NoSuchProcess:
        return
    _, left = psutil.wait_procs(procs, timeout=wait_s)
    for p in left:
        with contextlib.suppress(psutil.Error):
            p.kill()
    psutil.wait_procs(left, timeout=5)


def _left_note(service: Service, port: int, state_dir: Path, doc: Mapping[str, Any]) -> str:
    """Why stop leaves what holds ``port`` (a holder of :func:`holders` that is not ``ours``)."""
    what = holder_text(service, doc)
    if doc["kind"] == "other":
        where = f" --state-dir {doc['state_dir']}" if doc.get("state_dir") else ""
        return (f"{service.label} on port {port} left running: it is {what}, not this state folder's"
                f" ({state_dir}); fix: stop it from that checkout"
                f" (python -m {service.module} stop --port {port}{where})")
    return (f"port {port} is held by {what}: nothing was stopped; fix: stop that program, or choose another"
            f" {service.port_setting}")


def stop(service: Service, port: int, state_dir: Path, wait_s: float = 15.0, check: bool = False
         ) -> dict[str, Any]:
    """Terminate the supervisor of ``service`` on ``port`` (SIGTERM, then SIGKILL of what is left).

    The supervisor of the pidfile in ``state_dir``; without one (the pidfile gone while it runs),
    the one found by what listens on ``port`` (:func:`holders`) when it is this state folder's (or
    serves from this venv with its supervisor gone): ``note`` says so. Another checkout's service
    or another program on the port is left, with ``note`` saying why and what to do (``owner``
    ``other`` for another checkout's; ``running`` False: this checkout's service does not run, as
    :func:`status` says). ``changed: False`` when none was stopped. ``check``: stop nothing,
    touch no file, and say what would be stopped (``changed`` True and ``supervisor_pid`` when one
    runs), as ``ansible-playbook --check`` (reset.yml) lists it.
    """
    state = read_state(service, state_dir, port)
    pidfile, _ = service.paths(state_dir, port)
    if alive(state):
        assert state is not None
        if check:
            return {"changed": True, "running": True, "port": port, "check": True,
                    "supervisor_pid": state.supervisor_pid}
        _terminate(state.supervisor_pid, wait_s)
        pidfile.unlink(missing_ok=True)
        service.run_path(state_dir, port).unlink(missing_ok=True)
        return {"changed": True, "running": False, "port": port}
    found = holders(service, port, state_dir)
    ours = [h for h in found if h["kind"] == "ours"]
    out: dict[str, Any] = {"changed": False, "running": False, "port": port}
    if check:
        out["check"] = True
    if ours:
        what = "; ".join(holder_text(service, h) for h in ours)
        if check:
            return {**out, "changed": True, "running": True, "supervisor_pid": ours[0].get("supervisor_pid"),
                    "note": f"would stop {what}, found by its port {port}"}
        for h in ours:
            _terminate(h.get("supervisor_pid") or h["server_pid"], wait_s)
        pidfile.unlink(missing_ok=True)
        service.run_path(state_dir, port).unlink(missing_ok=True)
        return {**out, "changed": True, "note": f"stopped {what}, found by its port {port}"}
    if not check:
        pidfile.unlink(missing_ok=True)
    if found:
        other = {"owner": "other"} if any(h["kind"] == "other" for h in found) else {}
        return {**out, **other, "note": "; ".join(_left_note(service, port, state_dir, h) for h in found)}
    return out


def status(service: Service, port: int, state_dir: Path, host: str | None = None) -> dict[str, Any]:
    """The service's state: ``running`` (supervisor alive), ``answering`` (``service.ping``),
    host, port, supervisor and server pids, restarts, start time (unix s), log path, ``run_id``
    (the run it serves by its run record, :func:`served_run`; None: not known).

    Without a live pidfile, what listens on ``port`` (:func:`holders`): this checkout's
    ``service`` there (``ours``: this state folder's, or this venv's with its supervisor gone) is
    ``running`` with ``recorded`` False, ``owner`` ``ours`` and ``note`` (whose it is). Anything
    else there is not this checkout's service: ``running`` False and ``held_by`` (whose it is:
    another checkout's ddp-lab service, ``owner`` ``other``, or another program), so a port that
    serves never reads stopped, and another checkout's service never reads as this one's.
    """
    state = read_state(service, state_dir, port)
    if not alive(state):
        found = holders(service, port, state_dir)
        ours = [h for h in found if h["kind"] == "ours"]
        if ours:
            h = ours[0]
            where = host or h.get("host") or "127.0.0.1"
            return {"running": True, "answering": service.ping(where, port, 3.0), "port": port,
                    "host": h.get("host") or where, "supervisor_pid": h.get("supervisor_pid"),
                    "server_pid": h.get("server_pid"),
                    "restarts": None, "started_at": h.get("created"), "log": "", "recorded": False,
                    "owner": h["kind"], "note": holder_text(service, h), "run_id": h.get("run_id")}
        if found:
            held = {"running": False, "answering": False, "port": port,
                    "held_by": "; ".join(holder_text(service, h) for h in found)}
            return {**held, "owner": "other"} if any(h["kind"] == "other" for h in found) else held
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
        "recorded": True,
        "run_id": served_run(service, state_dir, port, state.supervisor_pid, state.supervisor_ctime),
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
    """The ``start|stop|status|serves`` CLI of a supervised service; returns the exit code
    (``serves --run-id R``: :func:`record_run`).

    ``start_argv(args)``: the service's command for ``start`` (host and port in ``args``);
    ``add_start_args``: its own options of ``start``; ``extra``: more subcommands, name ->
    (add their arguments, run them -> exit code); ``describe``: adds to a running service's
    ``status``. Every subcommand except the extra ones prints one JSON object on stdout.
    """
    p = argparse.ArgumentParser(prog=f"python -m {service.module}", description=description)
    sub = p.add_subparsers(dest="cmd", required=True)
    extra = extra or {}
    for name in ("start", "stop", "status", "serves", *extra):
        sp = sub.add_parser(name)
        sp.add_argument("--port", type=int, default=default_port)
        if name == "serves":
            sp.add_argument("--run-id", required=True, help=f"the run the {service.label} now serves")
        if name not in ("stop", "serves"):
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
        if args.cmd == "serves":
            print(json.dumps(record_run(service, args.port, args.state_dir, args.run_id)))
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
