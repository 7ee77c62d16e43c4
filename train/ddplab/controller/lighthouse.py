"""The torchft lighthouse of the ``per_step`` recovery engine, supervised on the controller.

Under ``ddp_job_fault_tolerance: per_step`` every laptop is one torchft replica group; the
lighthouse holds the quorum: which replica groups take part in the next step (participants), and
the quorum id that changes when they do. It is torchft's own server (``torchft_lighthouse``, the
Rust binary in the torchft wheel, next to the controller's ``python``), run under the same small
supervisor as the rendezvous store (:mod:`ddplab.controller.supervisor`): a detached process that
restarts it when it dies. State in ``--state-dir`` (default ``runs/.rdzv``):
``lighthouse-<port>.json`` (pidfile), ``lighthouse-<port>.log`` and ``lighthouse-<port>.run.json``
(which run it serves: ``serves``).

Subcommands (each prints one JSON object on stdout; ``changed`` tells Ansible the truth):

``start --host H --port P [--engine E --min-replicas N --quorum-tick-ms T --join-timeout-ms J ...]``
    (also ``--heartbeat-timeout-ms B``; J: milliseconds or JSON ``{engine: ms}``, E picks one).
    Idempotent: a live supervisor of port P answering at H -> ``changed: false``. Otherwise run
    ``torchft_lighthouse --bind H:P ...`` under a supervisor and wait until its status page answers.
``stop --port P``
    Terminate the supervisor and the lighthouse; ``changed: false`` when none was running.
``status --port P [--host H]``
    The supervisor's state plus the lighthouse's: ``quorum_id``, ``participants`` (replica ids of
    the last quorum), ``heartbeats`` (replica id -> seconds since its last heartbeat). Exit code
    0 running and answering, 1 running but not answering, 3 not running (another checkout's
    lighthouse on the port is not running: ``held_by`` names it).
``serves --port P --run-id R``
    Record that the running lighthouse serves run R: ``status`` then says ``run_id`` R.

Exit codes: 0 ok, 1 it did not come up / does not answer, 2 bad input or a conflict (the port is
held by another program, the same port served for another address, torchft not installed).
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from ddplab.controller import supervisor
from ddplab.controller.supervisor import ServiceError

DEFAULT_PORT = 29510
BINARY = "torchft_lighthouse"
# torchft's lighthouse serves its quorum as an HTML page at /status (torchft 0.2.0).
STATUS_PATH = "/status"


def _fetch_status(host: str, port: int, timeout_s: float) -> str | None:
    """The text of the lighthouse's status page, or None when it does not answer."""
    if not supervisor.connectable(host, port, timeout_s):
        return None
    try:
        with urllib.request.urlopen(f"http://{host}:{port}{STATUS_PATH}", timeout=timeout_s) as r:
            return r.read().decode("utf-8", "replace") if r.status == 200 else None
    except (urllib.error.URLError, OSError, ValueError):
        return None


def ping(host: str, port: int, timeout_s: float = 3.0) -> bool:
    """True when a torchft lighthouse at host:port serves its status page within ``timeout_s``."""
    page = _fetch_status(host, port, timeout_s)
    return page is not None and "quorum_id" in page


SERVICE = supervisor.Service(name="lighthouse", label="lighthouse", module="ddplab.controller.lighthouse",
                             port_setting="rendezvous_lighthouse_port", ping=ping, marker=BINARY)

_QUORUM_ID = re.compile(r"Current quorum_id:\s*(-?\d+)")
_MEMBER = re.compile(r"<b>([^<]+)</b>\s*<br/>\s*Step:\s*(-?\d+)")
_HEARTBEAT = re.compile(r"^\s*([^\s<>][^<>]*?): seen ([0-9.]+)(ms|s) ago", re.M)
_NEXT = re.compile(r"Next quorum status:\s*([^\n<]+)")


def parse_status(page: str) -> dict[str, Any]:
    """The quorum on torchft 0.2.0's lighthouse status page (``GET /status``, HTML).

    Returns ``{quorum_id: int|None, participants: [{replica_id, step}], heartbeats:
    {replica_id: seconds since the last heartbeat}, next_quorum: str|None}``; fields the page
    does not show are None / empty.
    """
    qid = _QUORUM_ID.search(page)
    nxt = _NEXT.search(page)
    beats = {}
    for name, value, unit in _HEARTBEAT.findall(page):
        beats[name.strip()] = round(float(value) / (1000.0 if unit == "ms" else 1.0), 3)
    return {
        "quorum_id": int(qid.group(1)) if qid else None,
        "participants": [{"replica_id": n.strip(), "step": int(s)} for n, s in _MEMBER.findall(page)],
        "heartbeats": beats,
        "next_quorum": nxt.group(1).strip() if nxt else None,
    }


def binary() -> str:
    """Path of ``torchft_lighthouse``: beside this Python (its venv), else on PATH.

    Raises ServiceError (code 2) when torchft is not installed.
    """
    beside = Path(sys.executable).parent / BINARY
    found = str(beside) if beside.exists() else shutil.which(BINARY)
    if not found:
        raise ServiceError(
            f"{BINARY} is not installed beside {sys.executable} nor on PATH: install torchft==0.2.0 "
            "into the controller's venv (requirements-torch.txt, make venv)",
            code=2,
        )
    return found


#: The lighthouse's wait for heartbeating stragglers (``--join_timeout_ms``) by recovery engine:
#: per_step forms a quorum every step, where a second is several steps of every laptop's time;
#: diloco once per ``sync_every`` inner steps, where a laptop that arrives part of a round late
#: would be left out of the sync and lose its round. A replica group that stops heartbeating is
#: left out after ``--heartbeat_timeout_ms`` whatever the wait.
JOIN_TIMEOUT_MS = {"per_step": 1000, "diloco": 30000}


def join_timeout_ms(setting: str | None, engine: str) -> int:
    """The join timeout for ``engine``: ``setting`` is JSON, milliseconds (one value for every
    engine) or an object of them by engine; None: :data:`JOIN_TIMEOUT_MS`.

    Raises:
        ServiceError: (code 2) the setting is neither, or names no value for ``engine``.
    """
    try:
        value = JOIN_TIMEOUT_MS if setting is None else json.loads(setting)
    except ValueError:
        value = setting
    if isinstance(value, dict):
        value = value.get(engine)
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ServiceError(
            f"join timeout {setting} for engine {engine}: give milliseconds >= 0, or one per engine "
            f"as in the default {json.dumps(JOIN_TIMEOUT_MS)} (rendezvous_lighthouse_join_timeout_ms)",
            code=2)
    return value


def command(host: str, port: int, min_replicas: int = 1, quorum_tick_ms: int = 100,
            join_timeout_ms: int = 1000, heartbeat_timeout_ms: int = 5000) -> list[str]:
    """The lighthouse's command line (torchft 0.2.0 flags); raises ServiceError on a bad setting."""
    for name, value, low in (("min_replicas", min_replicas, 1), ("quorum_tick_ms", quorum_tick_ms, 1),
                             ("join_timeout_ms", join_timeout_ms, 0),
                             ("heartbeat_timeout_ms", heartbeat_timeout_ms, 1)):
        if int(value) < low:
            raise ServiceError(f"{name}={value} must be >= {low}", code=2)
    return [binary(), "--bind", f"{host}:{port}", "--min_replicas", str(min_replicas),
            "--quorum_tick_ms", str(quorum_tick_ms), "--join_timeout_ms", str(join_timeout_ms),
            "--heartbeat_timeout_ms", str(heartbeat_timeout_ms)]


def start(host: str, port: int, state_dir: Path, wait_s: float = 30.0, **settings: int) -> dict[str, Any]:
    """Start the supervised lighthouse unless it already runs (``settings``: :func:`command`'s).

    Returns :func:`status` with ``changed``. Raises ServiceError (code 2: port held, another
    address, torchft missing, bad setting; code 1: no answer within ``wait_s``).
    """
    return describe(supervisor.start(SERVICE, host, port, state_dir, command(host, port, **settings), wait_s))


def stop(port: int, state_dir: Path, wait_s: float = 15.0) -> dict[str, Any]:
    """Terminate the lighthouse's supervisor and the lighthouse; ``changed: False`` when none ran."""
    return supervisor.stop(SERVICE, port, state_dir, wait_s)


def status(port: int, state_dir: Path, host: str | None = None) -> dict[str, Any]:
    """The supervisor's state (:func:`supervisor.status`) plus the quorum (:func:`parse_status`)."""
    return describe(supervisor.status(SERVICE, port, state_dir, host))


def describe(out: dict[str, Any]) -> dict[str, Any]:
    """``out`` (a supervisor status) with the lighthouse's quorum when it answers."""
    if out.get("running") and out.get("answering"):
        page = _fetch_status(out["host"], out["port"], 3.0)
        if page is not None:
            return {**out, **parse_status(page)}
    return out


def _start_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--min-replicas", type=int, default=1)
    p.add_argument("--quorum-tick-ms", type=int, default=100)
    p.add_argument("--engine", default="per_step", help="the job's recovery engine (JOIN_TIMEOUT_MS)")
    p.add_argument("--join-timeout-ms", default=None,
                   help="milliseconds, or JSON {engine: milliseconds} (default: JOIN_TIMEOUT_MS)")
    p.add_argument("--heartbeat-timeout-ms", type=int, default=5000)


def main(argv: list[str] | None = None) -> int:
    """CLI entry point (start, stop, status); returns the exit code."""
    return supervisor.cli(
        SERVICE, argv, description=__doc__.split("\n")[0], default_port=DEFAULT_PORT,
        start_argv=lambda a: command(a.host, a.port, a.min_replicas, a.quorum_tick_ms,
                                     join_timeout_ms(a.join_timeout_ms, a.engine), a.heartbeat_timeout_ms),
        add_start_args=_start_args, describe=describe,
    )


if __name__ == "__main__":
    sys.exit(main())
