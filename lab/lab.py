#!/usr/bin/env python3
"""The ddp-lab built-in lab: N systemd containers (3 unless told) that play N laptops.

Subcommands (``lab/lab.py --help``):

- ``image``  build ``localhost/ddp-lab-node:bookworm`` offline: debootstrap (cached tarball) ->
  ``podman import`` -> ``podman build`` from ``lab/image/Containerfile``. Skipped when the image
  carries the hash of the current recipe in its ``ddp-lab.recipe`` label.
- ``up``     network ``ddp-lab`` + containers ``laptop-a``, ``laptop-b``, ... (``--nodes N``, default the
  running lab's size, else 3; systemd as PID 1) at fixed addresses (.11, .12, ... of the
  network), waits for systemd, checks that a server on the network gateway (the
  controller) is reachable from a node, gives every node SSH access as a laptop has it (see
  ``access``) and writes ``inventory/lab/hosts.yml``. A second run changes nothing.
- ``access`` the SSH path for given containers (the molecule scenarios' prepare step uses it): a key
  pair of the project in the state folder, the sudo account ``labadmin`` on every node with that
  key authorised and passwordless sudo (a sudoers drop-in: the lab only), and a known_hosts file
  with each node's host keys read from inside the container (trusted; no TOFU scan over the
  network). Ansible connects as that account over SSH, host-key checking on.
- ``down``   removes the containers (every lab node, whatever N was), the network, the generated
  inventory and the lab's SSH state.
- ``status`` one line per node.
- ``detect`` container-runtime detection alone (see below); prints the containers.conf path.

Container-runtime detection: some hosts cannot run podman's defaults (crun fails with "cgroups in
hybrid mode", or the runtime may not raise RLIMIT_NOFILE/RLIMIT_NPROC as high as podman asks for).
A tiny probe container finds out; what it needs is written to ``lab/.state/containers.conf`` (the
host's own containers.conf settings merged with the overrides), and every podman user of the
project points ``CONTAINERS_CONF`` at it (the Makefile, ``lab/env.sh``, the molecule base config).

Only the standard library is used, except for writing containers.conf (``tomli_w``, pinned in
requirements.txt: ``make image`` and ``make lab-up`` run this script with the controller venv's
python); the other subcommands run before the controller venv exists.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import functools
import hashlib
import http.server
import ipaddress
import json
import os
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import NamedTuple

try:
    import tomllib
except ImportError:  # Python < 3.11: the host's containers.conf cannot be carried over
    tomllib = None
try:
    import tomli_w
except ImportError:  # outside the controller venv: only writing containers.conf needs it
    tomli_w = None

REPO = Path(__file__).resolve().parent.parent
LAB_DIR = REPO / "lab"
if str(LAB_DIR) not in sys.path:  # lab/node_limits.py, beside this script (also when loaded by path)
    sys.path.insert(0, str(LAB_DIR))
import node_limits  # noqa: E402
from node_limits import LimitError  # noqa: E402

RECIPE_DIR = LAB_DIR / "image"
STATE_DIR = Path(os.environ.get("DDP_LAB_STATE_DIR", LAB_DIR / ".state"))
CONTAINERS_CONF = STATE_DIR / "containers.conf"
INVENTORY_FILE = REPO / "inventory" / "lab" / "hosts.yml"
RUNS_DIR = REPO / "runs"  # the controller's runs (ddp_job_runs_dir's default)
# The training program's reader of a process's CPU share, run with the node's bare python3 (it needs
# only the standard library): what the lab reports is what the node's workers will see.
CPUSHARE_PY = REPO / "train" / "ddplab" / "cpushare.py"
# The link check: bytes each node sends to the next one, one pair at a time.
LINK_CHECK_BYTES = 64_000_000
# The CPU check: seconds every node spins at once.
CPU_CHECK_S = 2.0

SUITE = "bookworm"
MIRROR = os.environ.get("DDP_LAB_MIRROR", "http://deb.debian.org/debian")
# The molecule scenarios name this image; override the tag only to build a second copy aside.
TAG = os.environ.get("DDP_LAB_IMAGE_TAG", SUITE)
BASE_IMAGE = f"localhost/ddp-lab-base:{TAG}"
NODE_IMAGE = f"localhost/ddp-lab-node:{TAG}"
NETWORK = "ddp-lab"
# The lab's laptops: laptop-a, laptop-b, ... (``up --nodes N``; `make lab-up LAB_NODES=N`).
NODE_NAME_PREFIX = "laptop-"
NODE_LETTERS = "abcdefghijklmnopqrstuvwxyz"
DEFAULT_NODE_COUNT = 3
LABEL = "ddp-lab.lab"
RECIPE_LABEL = "ddp-lab.recipe"

# Upper bounds podman itself would use for root; the probe lowers them until the runtime accepts.
RLIMIT_CEILING = {"nofile": 1048576, "nproc": 4194304}
RLIMIT_FLOOR = 1024
SYSTEMD_READY_TIMEOUT_S = 120
# The image build's long steps (debootstrap, podman import, podman build) print a progress line at
# least this often; their whole output goes to BUILD_LOG.
PROGRESS_INTERVAL_S = 10.0
BUILD_LOG = STATE_DIR / "image-build.log"
# The output lines that say which step a tool is at: podman build's `STEP 3/14: RUN ...`,
# debootstrap's `I: Retrieving ...` / `I: Unpacking ...`.
STEP_PREFIXES = ("STEP ", "I: ")
# The lab's laptops get fixed addresses on the lab network (host numbers 11, 12, ...), as laptops
# with DHCP reservations: an address survives a power-off (roles/fault) and the inventory keeps it.
FIRST_HOST_NUMBER = 11

# The SSH path (see ``access``): the unprivileged account Ansible connects as, the lab's key pair
# and known_hosts (lab/.state/ssh/; the molecule scenarios use a folder of their own).
ADMIN_USER = "labadmin"
SUDOERS_DROPIN = f"/etc/sudoers.d/ddp-lab-{ADMIN_USER}"
LAB_SSH_DIR = STATE_DIR / "ssh"
KEY_NAME = "id_ed25519"
KNOWN_HOSTS_NAME = "known_hosts"
SSH_READY_TIMEOUT_S = 60
# Ansible's SSH control sockets (ansible.cfg: control_path_dir, control_path = %(directory)s/%%C).
SSH_CONTROL_PATH = "/tmp/ddp-lab-ssh/%C"


class LabError(Exception):
    """A failure the user can act on; the message says what to do."""


def log(msg: str) -> None:
    print(f"lab: {msg}", flush=True)


def rel(path: Path) -> str:
    """``path`` relative to the repository when inside it, for messages."""
    try:
        return str(path.relative_to(REPO))
    except ValueError:
        return str(path)


# --------------------------------------------------------------------------- podman plumbing


def podman_env(conf: Path | None = None) -> dict[str, str]:
    """Environment for podman: ``conf``, else the project's containers.conf once it exists."""
    env = dict(os.environ)
    conf = conf or (CONTAINERS_CONF if CONTAINERS_CONF.is_file() else None)
    if conf is not None:
        env["CONTAINERS_CONF"] = str(conf)
    return env


def podman(
    *args: str,
    check: bool = True,
    capture: bool = True,
    timeout: float | None = 600,
    conf: Path | None = None,
) -> subprocess.CompletedProcess:
    """Run ``podman ARGS``; raise LabError with podman's stderr when ``check`` and it fails, and
    when it does not finish within ``timeout`` seconds (whatever ``check``)."""
    if shutil.which("podman") is None:
        raise LabError("podman is not installed: run `make deps` (or lab/host-deps.sh as root)")
    try:
        proc = subprocess.run(
            ["podman", *args],
            env=podman_env(conf),
            capture_output=capture,
            timeout=timeout,
            check=False,
        )
    except subprocess.TimeoutExpired:
        raise LabError(f"`podman {' '.join(args)}` did not finish in {timeout:g} s: podman or the "
                       "container hangs (`make lab-down lab-up` starts the lab again)") from None
    if check and proc.returncode != 0:
        err = proc.stderr.decode(errors="replace").strip() if capture else ""
        raise LabError(f"`podman {' '.join(args)}` failed (exit {proc.returncode}): {err}")
    return proc


def out(proc: subprocess.CompletedProcess) -> str:
    return proc.stdout.decode(errors="replace").strip()


def image_exists(name: str) -> bool:
    return podman("image", "exists", name, check=False).returncode == 0


def image_label(name: str, label: str) -> str | None:
    if not image_exists(name):
        return None
    value = out(podman("image", "inspect", "--format", f'{{{{ index .Labels "{label}" }}}}', name))
    return value if value and value != "<no value>" else None


# --------------------------------------------------------------------------- containers.conf


def _system_conf_files() -> list[Path]:
    """containers.conf files podman reads when CONTAINERS_CONF is unset, lowest priority first."""
    files = [Path("/usr/share/containers/containers.conf"), Path("/etc/containers/containers.conf")]
    dropins = Path("/etc/containers/containers.conf.d")
    if dropins.is_dir():
        files += sorted(dropins.glob("*.conf"))
    if os.geteuid() != 0:
        cfg = Path(os.environ.get("XDG_CONFIG_HOME", Path.home() / ".config")) / "containers"
        files.append(cfg / "containers.conf")
        if (cfg / "containers.conf.d").is_dir():
            files += sorted((cfg / "containers.conf.d").glob("*.conf"))
    return [f for f in files if f.is_file()]


def _merge(base: dict, extra: dict) -> dict:
    merged = dict(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def dump_toml(data: dict) -> str:
    """``data`` as TOML text (tomli_w): tables, arrays of tables, scalars, dates, any Unicode.

    Raises:
        LabError: tomli_w is not importable (lab/lab.py run outside the controller venv), or
            ``data`` holds a value TOML has no type for (e.g. None).
    """
    if tomli_w is None:
        raise LabError(
            "writing containers.conf needs tomli_w: run `make image` (it uses the controller venv), "
            "or .venv/bin/python lab/lab.py after `make venv`"
        )
    try:
        return tomli_w.dumps(data)
    except TypeError as exc:
        raise LabError(f"cannot write these settings to containers.conf: {exc}") from exc


def atomic_write(path: Path, text: str) -> bool:
    """Replace ``path`` with ``text`` atomically (temp file + rename). False when already equal."""
    if path.is_file() and path.read_text() == text:
        return False
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w") as fh:
            fh.write(text)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    return True


def render_containers_conf(overrides: dict, notes: list[str]) -> str:
    """containers.conf text = the host's own settings + ``overrides``, ``notes`` as comments."""
    settings: dict = {}
    for path in _system_conf_files():
        if tomllib is None:
            log(f"warning: Python < 3.11 cannot read {path}; its settings are not in {CONTAINERS_CONF}")
            continue
        with path.open("rb") as fh:
            settings = _merge(settings, tomllib.load(fh))
    settings = _merge(settings, overrides)
    header = [
        "# Written by lab/lab.py (container-runtime detection); regenerated by `make image`/`make lab-up`.",
        "# Podman reads ONLY this file when CONTAINERS_CONF points here, so it carries the host's own",
        "# containers.conf settings plus what this host needs for the lab:",
        *(f"#   {n}" for n in notes or ["nothing: podman's defaults work here"]),
    ]
    return "\n".join(header) + "\n" + dump_toml(settings)


def _hard_limit(which: int, ceiling: int) -> int:
    hard = resource.getrlimit(which)[1]
    return ceiling if hard == resource.RLIM_INFINITY else min(hard, ceiling)


def _lower(value: int) -> int:
    """The next candidate below ``value``: the largest power of two strictly smaller."""
    return 1 << ((value - 1).bit_length() - 1)


def _probe(image: str, conf: Path) -> tuple[bool, str]:
    """Start and remove a container from ``image`` with podman reading only ``conf``."""
    proc = podman(
        "run",
        "--rm",
        "--network",
        "none",
        "--pull",
        "never",
        image,
        "true",
        check=False,
        timeout=120,
        conf=conf,
    )
    return proc.returncode == 0, proc.stderr.decode(errors="replace").strip()


def detect_runtime(image: str) -> Path:
    """Find podman settings under which a container starts on this host; write containers.conf.

    Probes ``podman run --rm IMAGE true``. On crun's "cgroups in hybrid mode" (or any other
    failure of a non-runc default runtime) switches to runc; on an rlimit error caps
    ``default_ulimits`` at the hard limit of this process, then at lower powers of two, until
    the runtime accepts them. Raises LabError naming the podman error when nothing works.
    """
    if CONTAINERS_CONF.is_file() and _probe(image, CONTAINERS_CONF)[0]:
        return CONTAINERS_CONF  # the earlier result still works (delete the file to detect afresh)
    # Candidates go to a private file: a podman user of the published file never sees a bad one.
    candidate = STATE_DIR / f".containers.conf.probe-{os.getpid()}"
    try:
        return _detect(image, candidate)
    finally:
        with contextlib.suppress(FileNotFoundError):
            candidate.unlink()


def _detect(image: str, candidate: Path) -> Path:
    overrides: dict = {}
    notes: list[str] = []
    ulimits: dict[str, int] | None = None
    err = ""
    for _ in range(40):
        atomic_write(candidate, render_containers_conf(overrides, notes))
        ok, err = _probe(image, candidate)
        if ok:
            if ulimits:
                notes.append(
                    "rlimits: "
                    + ", ".join(f"{k}={v}" for k, v in ulimits.items())
                    + " (the runtime may not set podman's defaults here)"
                )
            atomic_write(CONTAINERS_CONF, render_containers_conf(overrides, notes))
            return CONTAINERS_CONF
        low = err.lower()
        rlimit_err = "rlimit" in low
        if rlimit_err:
            if ulimits is None:
                ulimits = {
                    "nofile": _hard_limit(resource.RLIMIT_NOFILE, RLIMIT_CEILING["nofile"]),
                    "nproc": _hard_limit(resource.RLIMIT_NPROC, RLIMIT_CEILING["nproc"]),
                }
            else:
                # runc: "error setting rlimit type 7" (7 = NOFILE, 6 = NPROC); crun names it.
                hit = [
                    k
                    for k, pats in (("nofile", ("type 7", "nofile")), ("nproc", ("type 6", "nproc")))
                    if any(p in low for p in pats)
                ] or ["nofile", "nproc"]
                for key in hit:
                    ulimits[key] = _lower(ulimits[key])
            if min(ulimits.values()) < RLIMIT_FLOOR:
                raise LabError(f"containers fail to start even with low rlimits {ulimits}: {err}")
            overrides.setdefault("containers", {})["default_ulimits"] = [
                f"{k}={v}:{v}" for k, v in ulimits.items()
            ]
        elif overrides.get("engine", {}).get("runtime") != "runc" and shutil.which("runc"):
            last = (err.splitlines() or ["no error text"])[-1]
            why = "crun cannot run on cgroups v1/hybrid hosts" if "hybrid" in low else last
            notes.append(f"runtime = runc ({why})")
            overrides.setdefault("engine", {})["runtime"] = "runc"
        else:
            raise LabError(f"podman cannot start a container on this host: {err}")
    raise LabError(f"container-runtime detection did not converge; last podman error: {err}")


# --------------------------------------------------------------------------- image


def _short(line: str, width: int = 100) -> str:
    return line if len(line) <= width else line[: width - 3] + "..."


def run_with_progress(
    argv: list[str],
    what: str,
    *,
    log_path: Path,
    stdin: object = None,
    env: dict[str, str] | None = None,
    timeout: float = 1800.0,
    interval: float = PROGRESS_INTERVAL_S,
) -> tuple[int, list[str]]:
    """Run ``argv`` (stdout and stderr into ``log_path``, appended) and print ``lab: <what>: <s> s,
    <the step it is at>`` every ``interval`` seconds while it runs; the step is its latest line
    starting with one of ``STEP_PREFIXES`` (podman build's ``STEP n/m``, debootstrap's ``I:``),
    followed by its latest line when that differs.

    Returns:
        (exit code, its last 20 non-empty output lines).

    Raises:
        LabError: it ran longer than ``timeout`` seconds (it is killed first).
    """
    t0 = time.monotonic()
    tail: collections.deque[str] = collections.deque(maxlen=20)
    step = ["started"]
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("a", encoding="utf-8", errors="replace") as log_fh:
        log_fh.write(f"$ {' '.join(argv)}\n")
        log_fh.flush()
        proc = subprocess.Popen(
            argv,
            stdin=stdin if stdin is not None else subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=env,
            text=True,
            errors="replace",
        )

        def read() -> None:
            for raw in proc.stdout:
                log_fh.write(raw)
                line = raw.strip()
                if line:
                    tail.append(line)
                    if line.startswith(STEP_PREFIXES):
                        step[0] = line

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        while proc.poll() is None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=interval)
            elapsed = time.monotonic() - t0
            if proc.returncode is not None:
                break
            if elapsed > timeout:
                proc.kill()
                proc.wait()
                raise LabError(f"{what} ran longer than {timeout:.0f} s and was stopped; see {rel(log_path)}")
            latest = tail[-1] if tail else ""
            more = f" | {_short(latest)}" if latest and latest != step[0] else ""
            log(f"{what}: {elapsed:.0f} s, {_short(step[0])}{more}")
        reader.join()
    return proc.returncode, list(tail)


def recipe_hash() -> str:
    """sha256 over the files of lab/image/ and the debootstrap parameters."""
    digest = hashlib.sha256(f"{SUITE} minbase {MIRROR}\n".encode())
    for path in sorted(p for p in RECIPE_DIR.rglob("*") if p.is_file()):
        digest.update(str(path.relative_to(RECIPE_DIR)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


def base_tarball() -> Path:
    """The debootstrap'd root filesystem as a tarball, cached in lab/.state."""
    tarball = STATE_DIR / f"rootfs-{SUITE}-minbase.tar"
    if tarball.is_file():
        return tarball
    if shutil.which("debootstrap") is None:
        raise LabError("debootstrap is not installed: run `make deps` (or lab/host-deps.sh as root)")
    if os.geteuid() != 0:
        raise LabError("debootstrap needs root: run `sudo make image`")
    STATE_DIR.mkdir(parents=True, exist_ok=True)
    log(f"debootstrap --variant=minbase {SUITE} from {MIRROR} (about a minute, cached afterwards)")
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(dir=STATE_DIR, prefix="rootfs-") as tmp:
        rootfs = Path(tmp) / "rootfs"
        argv = ["debootstrap", "--variant=minbase", SUITE, str(rootfs), MIRROR]
        code, tail = run_with_progress(argv, "debootstrap", log_path=BUILD_LOG)
        if code != 0:
            raise LabError(f"debootstrap failed (is {MIRROR} reachable?): " + " | ".join(tail[-5:]))
        partial = Path(tmp) / "rootfs.tar"
        argv = ["tar", "-C", str(rootfs), "--numeric-owner", "-cf", str(partial), "."]
        code, tail = run_with_progress(
            argv, f"tar of the root filesystem -> {rel(tarball)}", log_path=BUILD_LOG
        )
        if code != 0:
            raise LabError("tar of the debootstrap'd root filesystem failed: " + " | ".join(tail[-5:]))
        partial.replace(tarball)
    log(f"debootstrap done in {time.monotonic() - t0:.0f} s -> {rel(tarball)}")
    return tarball


def ensure_base_image() -> None:
    if image_exists(BASE_IMAGE):
        return
    tarball = base_tarball()
    log(f"podman import {tarball.name} -> {BASE_IMAGE}")
    with tarball.open("rb") as fh:
        argv = ["podman", "import", "--quiet", "-", BASE_IMAGE]
        code, tail = run_with_progress(argv, "podman import", log_path=BUILD_LOG, stdin=fh, env=podman_env())
    if code != 0:
        raise LabError("podman import failed: " + " | ".join(tail[-5:]))


def probe_image() -> str:
    return BASE_IMAGE if image_exists(BASE_IMAGE) else NODE_IMAGE


def cmd_image(_args: argparse.Namespace | None = None) -> None:
    want = recipe_hash()
    if image_label(NODE_IMAGE, RECIPE_LABEL) == want:
        detect_runtime(NODE_IMAGE)
        log(f"image {NODE_IMAGE} is up to date (recipe {want})")
        return
    t0 = time.monotonic()
    if shutil.which("podman") is None:
        raise LabError("podman is not installed: run `make deps` (or lab/host-deps.sh as root)")
    STATE_DIR.mkdir(parents=True, exist_ok=True)
    BUILD_LOG.write_text("")  # this build's output only
    ensure_base_image()
    detect_runtime(BASE_IMAGE)
    log(f"podman build {NODE_IMAGE} (recipe {want}); its output goes to {rel(BUILD_LOG)}")
    argv = [
        "podman", "build", "--pull=never", "--build-arg", f"BASE_IMAGE={BASE_IMAGE}",
        "--label", f"{RECIPE_LABEL}={want}", "--tag", NODE_IMAGE,
        "--file", str(RECIPE_DIR / "Containerfile"), str(RECIPE_DIR),
    ]  # fmt: skip
    code, tail = run_with_progress(argv, "podman build", log_path=BUILD_LOG, env=podman_env())
    if code != 0:
        last = " | ".join(tail[-5:])
        raise LabError(f"podman build failed (exit {code}): {last}; the whole output: {rel(BUILD_LOG)}")
    podman("image", "prune", "--force", "--filter", f"label={RECIPE_LABEL}", check=False)
    log(f"image {NODE_IMAGE} built in {time.monotonic() - t0:.0f} s")


# --------------------------------------------------------------------------- lab up/down


def container_state(name: str) -> dict | None:
    proc = podman("container", "inspect", name, check=False)
    if proc.returncode != 0:
        return None
    return json.loads(out(proc))[0]


def network_gateway() -> str:
    info = json.loads(out(podman("network", "inspect", NETWORK)))[0]
    for subnet in info.get("subnets") or []:
        gateway = subnet.get("gateway", "")
        if gateway and ":" not in gateway:
            return gateway
    raise LabError(f"podman network {NETWORK} has no IPv4 gateway: `make lab-down lab-up` recreates it")


def agent_unit() -> str:
    """The training agent's systemd unit on a laptop (``ddp_lab_unit`` of roles/ddp_lab), with .service."""
    text = (REPO / "roles" / "ddp_lab" / "defaults" / "main.yml").read_text()
    match = re.search(r"^ddp_lab_unit:\s*[\"']?([^\s\"'#]+)", text, re.M)
    unit = match.group(1) if match else "ddp-lab-agent"
    return unit if unit.endswith(".service") else f"{unit}.service"


def stop_event(runs_dir: Path | None = None) -> tuple[str, dict]:
    """The run runs/current points at and the ``kind: stop`` event stop.yml wrote for its newest
    launch ({} when it was not stopped; ("", {}) without runs/current; ``runs_dir``: default
    RUNS_DIR): ddplab.runstate.stop_event, the one reading status.yml and collect share."""
    link = (runs_dir or RUNS_DIR) / "current"
    if not link.is_symlink():
        return "", {}
    from ddplab.runstate import stop_event as read_stop_event  # train/ on the venv's path: make venv

    run = link.resolve()
    try:
        text = (run / "events.jsonl").read_text(errors="replace")
    except OSError:
        text = ""
    return run.name, read_stop_event(text)


def failed_units(name: str) -> list[str]:
    """The units systemd lists as failed in the container ``name``."""
    listing = out(podman("exec", name, "systemctl", "--failed", "--plain", "--no-legend", check=False))
    return [line.split()[0] for line in listing.splitlines() if line.split()]


def wait_for_systemd(name: str) -> str:
    """Wait until systemd in ``name`` has booted; returns its state (running, degraded). A degraded
    state is logged with its failed units, except the agent unit of a run stop.yml stopped on this
    node (the SIGTERM fails the unit; a job the user stopped is not a degraded lab: it is named as
    stopped, and `make status` reads it so)."""
    deadline = time.monotonic() + SYSTEMD_READY_TIMEOUT_S
    state = "unknown"
    while time.monotonic() < deadline:
        proc = podman("exec", name, "systemctl", "is-system-running", check=False, timeout=30)
        state = out(proc) or "unknown"
        if state in ("running", "degraded"):
            if state == "degraded":
                failed = failed_units(name)
                run, stop = stop_event()
                if agent_unit() in failed and name in (stop.get("hosts") or []):
                    failed.remove(agent_unit())
                    when = time.strftime("%H:%M:%S", time.localtime(float(stop.get("time") or 0)))
                    log(f"{name}: the agent of run {run} was stopped by stop.yml at {when} (its unit stays"
                        " failed until the next launch; `make status` reads it stopped)")
                    state = "running, job stopped" if not failed else state
                if state == "degraded":
                    log(f"{name}: systemd is degraded; failed units: {' '.join(failed) or '?'}")
            return state
        time.sleep(1)
    raise LabError(
        f"{name}: systemd did not finish booting in {SYSTEMD_READY_TIMEOUT_S} s (state "
        f"{state}); see `podman logs {name}`"
    )


class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args: object) -> None:
        pass


def check_gateway_reachable(gateway: str, node: str) -> None:
    """Serve HTTP on the gateway address of the host; fetch it from ``node``.

    The rendezvous store runs on the controller, bound to this address: this is the same path.
    """
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "ok").write_text("ddp-lab\n")
        handler = functools.partial(_Quiet, directory=tmp)
        try:
            server = http.server.ThreadingHTTPServer((gateway, 0), handler)
        except OSError as exc:
            raise LabError(
                f"cannot bind {gateway} on the host ({exc}): the network gateway is not a host "
                "address (rootless podman?); run the lab as root"
            ) from exc
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        try:
            url = f"http://{gateway}:{server.server_address[1]}/ok"
            code = f"import urllib.request; print(urllib.request.urlopen({url!r}, timeout=5).read().decode())"
            proc = podman("exec", node, "python3", "-c", code, check=False, timeout=30)
        finally:
            server.shutdown()
            server.server_close()
    if proc.returncode != 0 or out(proc) != "ddp-lab":
        raise LabError(
            f"{node} cannot reach a server on the host at {gateway} (a firewall dropping "
            f"input from the podman bridge?): {proc.stderr.decode(errors='replace').strip()}"
        )


# --------------------------------------------------------------------------- SSH path


def node_names(count: int) -> tuple[str, ...]:
    """The names of a lab of ``count`` laptops: ``laptop-a``, ``laptop-b``, ... in address order.

    Raises:
        LabError: ``count`` is below 1 or above 26 (one letter per node).
    """
    if not 1 <= count <= len(NODE_LETTERS):
        raise LabError(f"a lab has 1 to {len(NODE_LETTERS)} nodes, not {count}: choose LAB_NODES in range")
    return tuple(NODE_NAME_PREFIX + letter for letter in NODE_LETTERS[:count])


def node_index(name: str) -> int:
    """Position (0-based) of the lab node ``name`` (``laptop-<letter>``): 0 for laptop-a.

    Raises:
        LabError: ``name`` is not a lab node's name.
    """
    letter = name.removeprefix(NODE_NAME_PREFIX)
    if not name.startswith(NODE_NAME_PREFIX) or len(letter) != 1 or letter not in NODE_LETTERS:
        raise LabError(f"{name!r} is not a lab node's name ({NODE_NAME_PREFIX}a ... {NODE_NAME_PREFIX}z)")
    return NODE_LETTERS.index(letter)


def node_address(subnet: str, index: int) -> str:
    """The fixed address of lab node ``index`` (0-based) in the IPv4 network ``subnet`` (e.g.
    ``10.89.3.0/24``): host number ``FIRST_HOST_NUMBER + index``, so .11, .12, ... on a /24.

    Raises:
        LabError: ``subnet`` is not IPv4 or has no room for that host number below its broadcast.
    """
    net = ipaddress.ip_network(subnet, strict=False)
    number = FIRST_HOST_NUMBER + index
    if net.version != 4 or number >= net.num_addresses - 1:
        raise LabError(f"the network {subnet} has no room for node {index + 1} (host number {number})")
    return str(net[number])


def node_addresses(names: tuple[str, ...]) -> dict[str, str]:
    """The fixed addresses of the lab nodes ``names`` on the lab network's IPv4 subnet."""
    info = json.loads(out(podman("network", "inspect", NETWORK)))[0]
    for subnet in info.get("subnets") or []:
        if ":" in subnet.get("subnet", ":"):
            continue
        try:
            return {name: node_address(subnet["subnet"], node_index(name)) for name in names}
        except LabError:
            break
    raise LabError(
        f"podman network {NETWORK} has no IPv4 subnet with room for the nodes: `make lab-down lab-up`"
    )


def lab_containers() -> list[str]:
    """The lab's node containers that exist (running or not), in address order: containers with the
    lab's label and a lab node's name (molecule's nodes carry a prefix and no label)."""
    proc = podman("container", "ls", "--all", "--filter", f"label={LABEL}=1", "--format", "{{.Names}}")
    names = set(out(proc).split())
    return sorted((n for n in names if n in node_names(len(NODE_LETTERS))), key=node_index)


def node_count(requested: int | None, present: list[str]) -> int:
    """How many nodes ``up`` gives the lab: ``requested``, else enough to keep every node of
    ``present`` (the existing lab's node containers), else ``DEFAULT_NODE_COUNT``.

    Raises:
        LabError: ``requested`` would leave an existing node out of the inventory (a one-line error
            before anything is changed: nothing of a running lab is removed by ``up``).
    """
    keep = max((node_index(n) + 1 for n in present), default=0)
    if requested is None:
        return keep or DEFAULT_NODE_COUNT
    names = node_names(requested)
    extra = [n for n in present if n not in names]
    if extra:
        raise LabError(
            f"the lab has the nodes {', '.join(present)}; LAB_NODES={requested} would leave "
            f"{', '.join(extra)} out of the inventory: `make lab-down` first, or LAB_NODES={keep}"
        )
    return requested


def container_address(name: str) -> str:
    """The IPv4 address of running container ``name`` on its (single) network."""
    state = container_state(name)
    if state is None or not state["State"].get("Running"):
        raise LabError(f"container {name} is not running")
    for net in (state.get("NetworkSettings", {}).get("Networks") or {}).values():
        if net.get("IPAddress"):
            return net["IPAddress"]
    raise LabError(f"container {name} has no IPv4 address")


def ensure_keypair(state_dir: Path) -> tuple[Path, list[str]]:
    """The project's SSH key pair in ``state_dir`` (ed25519, no passphrase: a lab key, never in the
    image), made when missing; the private key is kept at mode 0600, the folder at 0700."""
    key = state_dir / KEY_NAME
    pub = key.with_name(KEY_NAME + ".pub")
    state_dir.mkdir(parents=True, exist_ok=True)
    os.chmod(state_dir, 0o700)
    if key.is_file() and pub.is_file():
        os.chmod(key, 0o600)
        return key, []
    if shutil.which("ssh-keygen") is None:
        raise LabError("ssh-keygen is not installed: run `make deps` (or lab/host-deps.sh as root)")
    for stale in (key, pub):
        stale.unlink(missing_ok=True)
    proc = subprocess.run(
        ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", f"ddp-lab {state_dir.name}", "-f", str(key)],
        capture_output=True,
        check=False,
    )
    if proc.returncode != 0:
        raise LabError(f"ssh-keygen failed: {proc.stderr.decode(errors='replace').strip()}")
    os.chmod(key, 0o600)
    return key, [f"key pair {rel(key)} made"]


# Writes stdin to a file in a node, atomically, with owner and mode; $4, when set, is a command that
# must accept the new file first (visudo -cf). Run with `podman exec -i NODE sh -c SCRIPT sh ARGS`.
_PUT_FILE = """set -eu
path=$1 owner=$2 mode=$3 check=${4:-}
dir=$(dirname "$path")
tmp=$(mktemp "$dir/.ddp-lab.XXXXXX")
trap 'rm -f "$tmp"' EXIT
cat > "$tmp"
chown "$owner" "$tmp"
chmod "$mode" "$tmp"
if [ -n "$check" ]; then $check "$tmp" >/dev/null; fi
mv "$tmp" "$path"
trap - EXIT
"""


def put_node_file(name: str, path: str, text: str, owner: str, mode: str, check: str = "") -> bool:
    """Make ``path`` in container ``name`` hold ``text`` with ``owner`` (user:group) and octal
    ``mode``; False when it already does. The parent folder must exist."""
    have = podman("exec", name, "stat", "-c", "%U:%G %a", path, check=False)
    if out(have) == f"{owner} {mode.lstrip('0')}":
        current = podman("exec", name, "cat", path, check=False)
        if current.returncode == 0 and current.stdout.decode(errors="replace") == text:
            return False
    proc = subprocess.run(
        ["podman", "exec", "-i", name, "sh", "-c", _PUT_FILE, "sh", path, owner, mode, check],
        input=text.encode(),
        env=podman_env(),
        capture_output=True,
        timeout=60,
        check=False,
    )
    if proc.returncode != 0:
        raise LabError(f"{name}: cannot write {path}: {proc.stderr.decode(errors='replace').strip()}")
    return True


def ensure_admin_account(name: str, public_key: str) -> list[str]:
    """The sudo account Ansible connects as, on node ``name``: created when missing (member of
    `sudo`, as Ubuntu's first user), passwordless sudo by a sudoers drop-in (lab only; laptops keep
    their password and `-K`), ``public_key`` its only authorised key."""
    changed = []
    home = f"/home/{ADMIN_USER}"
    if podman("exec", name, "id", "-u", ADMIN_USER, check=False).returncode != 0:
        podman("exec", name, "useradd", "--create-home", "--shell", "/bin/bash", "-G", "sudo", ADMIN_USER)
        changed.append(f"{name}: account {ADMIN_USER} created")
    rule = f"{ADMIN_USER} ALL=(ALL:ALL) NOPASSWD: ALL\n"
    if put_node_file(name, SUDOERS_DROPIN, rule, "root:root", "0440", "visudo -cqf"):
        changed.append(f"{name}: {SUDOERS_DROPIN} written")
    # Lingering keeps the account's systemd user manager (user@UID.service, started by pam_systemd
    # at the first SSH login) running between logins. Else it is stopped after the last session
    # closes, and on a cgroup-v1 host systemd in the container is never told that its cgroup
    # emptied: the stop never ends and every later login waits for it (ssh hangs in session setup).
    if podman("exec", name, "test", "-e", f"/var/lib/systemd/linger/{ADMIN_USER}", check=False).returncode:
        podman("exec", name, "loginctl", "enable-linger", ADMIN_USER)
        changed.append(f"{name}: {ADMIN_USER}'s user manager lingers")
    podman("exec", name, "install", "-d", "-o", ADMIN_USER, "-g", ADMIN_USER, "-m", "0700", f"{home}/.ssh")
    if put_node_file(name, f"{home}/.ssh/authorized_keys", public_key, f"{ADMIN_USER}:{ADMIN_USER}", "0600"):
        changed.append(f"{name}: the lab key authorised for {ADMIN_USER}")
    return changed


def read_host_keys(name: str, address: str) -> list[str]:
    """Node ``name``'s SSH host public keys as known_hosts lines under its name and ``address``,
    read from inside the container (made at its first boot by ssh-keygen -A: waits for them)."""
    deadline = time.monotonic() + SSH_READY_TIMEOUT_S
    while True:
        proc = podman("exec", name, "sh", "-c", "cat /etc/ssh/ssh_host_*_key.pub", check=False)
        keys = [line.split()[:2] for line in out(proc).splitlines() if len(line.split()) >= 2]
        if proc.returncode == 0 and keys:
            return [f"{name},{address} {kind} {blob}" for kind, blob in sorted(keys)]
        if time.monotonic() > deadline:
            raise LabError(f"{name} has no SSH host keys after {SSH_READY_TIMEOUT_S} s: is ssh.service up?")
        time.sleep(1)


def check_ssh(name: str, address: str, key: Path, known_hosts: Path) -> None:
    """Log in to ``name`` as Ansible will (key, strict host-key checking) and run ``sudo -n true``;
    retried while sshd starts."""
    argv = [
        "ssh", "-F", "none", "-i", str(key), "-o", "BatchMode=yes", "-o", "IdentitiesOnly=yes",
        "-o", "StrictHostKeyChecking=yes", "-o", f"UserKnownHostsFile={known_hosts}",
        "-o", "ConnectTimeout=5", f"{ADMIN_USER}@{address}",
        "sudo", "-n", "true",
    ]  # fmt: skip
    deadline = time.monotonic() + SSH_READY_TIMEOUT_S
    while True:
        proc = subprocess.run(argv, capture_output=True, timeout=60, check=False)
        if proc.returncode == 0:
            return
        if time.monotonic() > deadline:
            err = proc.stderr.decode(errors="replace").strip()
            raise LabError(f"ssh {ADMIN_USER}@{address} ({name}) with sudo fails: {err}")
        time.sleep(1)


def ensure_ssh_access(state_dir: Path, addresses: dict[str, str]) -> list[str]:
    """The SSH path to the containers of ``addresses`` ({container: address}): key pair in
    ``state_dir``, sudo account on each node, ``state_dir``/known_hosts with their host keys; then
    checks a login with sudo on each. Returns what it changed."""
    key, changed = ensure_keypair(state_dir)
    public_key = key.with_name(KEY_NAME + ".pub").read_text()
    lines: list[str] = []
    for name, address in addresses.items():
        changed += ensure_admin_account(name, public_key)
        lines += read_host_keys(name, address)
    known_hosts = state_dir / KNOWN_HOSTS_NAME
    if atomic_write(known_hosts, "\n".join(lines) + "\n"):
        changed.append(f"{rel(known_hosts)} written")
    for name, address in addresses.items():
        check_ssh(name, address, key, known_hosts)
    return changed


def ssh_common_args(known_hosts: Path) -> str:
    """ssh options of the lab's inventories: the lab's known_hosts (checked strictly, as
    ansible.cfg's host_key_checking asks; its entries name each node's fixed address). No
    per-host template here: a task delegated to another node renders the delegating host's
    variables, so an option naming ``inventory_hostname`` would check the wrong node's key."""
    return f"-o UserKnownHostsFile={known_hosts}"


def _host_entry(name: str, address: str, cpus: float | None) -> str:
    entry = f"        {name}:\n          ansible_host: {address}\n          lab_container: {name}"
    if cpus is not None:
        # beats group_vars/all.yml's 1 thread (meant for nodes without a quota): the worker takes
        # one thread per whole CPU of its share (ddplab.cpushare)
        entry += f"\n          lab_cpus: {cpus:g}\n          ddp_job_threads: null"
    return entry


def render_inventory(
    gateway: str,
    addresses: dict[str, str],
    cpus: dict[str, float | None] | None = None,
    link_mbit: float | None = None,
) -> str:
    """The lab's inventory. ``cpus``: each node's CPU quota in force (a node with one gets host
    variables ``lab_cpus`` and ``ddp_job_threads: null``); ``link_mbit``: the rate every node's link
    is shaped to (group variable ``lab_link_mbit``), None when not shaped."""
    venv_python = Path(os.environ.get("DDP_LAB_CONTROLLER_PYTHON", REPO / ".venv" / "bin" / "python"))
    hosts = "\n".join(_host_entry(name, addr, (cpus or {}).get(name)) for name, addr in addresses.items())
    link = "" if link_mbit is None else f"\n        lab_link_mbit: {link_mbit:g}"
    key, known_hosts = LAB_SSH_DIR / KEY_NAME, LAB_SSH_DIR / KNOWN_HOSTS_NAME
    return f"""---
# Written by `make lab-up` (lab/lab.py); `make lab-down` removes it. Do not edit: edit lab/lab.py.
# The {len(addresses)} lab laptops are podman containers on the network {NETWORK}; the controller (this
# machine) hosts the rendezvous store on that network's gateway address. Ansible reaches them as
# a laptop is reached: SSH as the sudo account {ADMIN_USER}, the project's key, host keys from
# {rel(known_hosts)} (read from inside each container). lab_container: the podman container
# of the node, for what the lab does from outside (roles/fault: power off, start). The job's
# elastic range follows the group's size: torchrun --nnodes 1:{len(addresses)} unless
# ddp_job_nnodes_min/ddp_job_nnodes_max say otherwise. lab_cpus: the node's CPU quota (make lab-up
# LAB_CPUS=...), lab_link_mbit: the rate of every node's link (LAB_LINK_MBIT=...), as in force.
all:
  children:
    trainers:
      hosts:
{hosts}
      vars:
        ansible_connection: ssh
        ansible_user: {ADMIN_USER}
        ansible_ssh_private_key_file: {json.dumps(str(key))}
        ansible_ssh_common_args: {json.dumps(ssh_common_args(known_hosts))}
        ansible_python_interpreter: /usr/bin/python3{link}
    rendezvous:
      hosts:
        controller:
          ansible_connection: local
          ansible_python_interpreter: {json.dumps(str(venv_python))}
          rendezvous_address: {json.dumps(gateway)}
"""


# --------------------------------------------------------------------------- CPU quotas and links


def host_cpus() -> int:
    """CPUs this machine gives its containers (this process's affinity)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def made_with_cpus(state: dict) -> float | None:
    """The CPU quota container ``state`` (podman inspect) was made with, None without one."""
    host = state.get("HostConfig") or {}
    if host.get("NanoCpus"):
        return round(host["NanoCpus"] / 1e9, 4)
    quota, period = host.get("CpuQuota") or 0, host.get("CpuPeriod") or 100000
    return round(quota / period, 4) if quota > 0 else None


def node_share(name: str) -> dict:
    """The CPU share in force in container ``name`` as its processes see it (train/ddplab/cpushare.py
    run there by the node's python3): {share, quota, quota_file, affinity, physical_cores, threads}.

    Raises:
        LabError: the node's python3 cannot run it.
    """
    proc = podman("exec", name, "python3", "-c", CPUSHARE_PY.read_text(), check=False, timeout=60)
    try:
        return json.loads(out(proc))
    except json.JSONDecodeError:
        err = proc.stderr.decode(errors="replace").strip()
        raise LabError(f"{name}: cannot read its CPU share (exit {proc.returncode}): {err}") from None


def node_ifname(name: str) -> str:
    """The interface of container ``name``'s default route (the lab network's: eth0)."""
    found = re.search(r"\bdev (\S+)", out(podman("exec", name, "ip", "-o", "route", "show", "default")))
    if found is None:
        raise LabError(f"{name} has no default route: `make lab-down lab-up` recreates it")
    return found.group(1)


def node_link_mbit(name: str, ifname: str) -> float | None:
    """The rate of the lab's tbf on ``ifname`` in container ``name``, None when not shaped."""
    return node_limits.shaped_mbit(out(podman("exec", name, "tc", "qdisc", "show", "dev", ifname, "root")))


def apply_cpus(name: str, want: float | None, state: dict) -> list[str]:
    """Give container ``name`` the CPU quota ``want`` (None: none) now, with ``podman update``, when
    its cgroup holds another one; returns what changed. podman (4.3) keeps the quota a container
    was made with across a restart: a change of an existing node is live only, and says so."""
    have = node_share(name)["quota"]
    if in_force(have, want):
        return []
    podman("update", *node_limits.cpu_args(want if want is not None else host_cpus()), name)
    made = made_with_cpus(state)
    line = f"{name}: CPU quota {quota_text(have)} -> {quota_text(want)}"
    if not node_limits.same_share(made, want):
        line += (
            f" (live: a restart of the container, e.g. kill-node.yml's poweroff and rejoin, brings back the "
            f"quota it was made with, {quota_text(made)}; `make lab-down lab-up LAB_CPUS=...` makes it stay)"
        )
    return [line]


def quota_text(quota: float | None) -> str:
    return "none" if quota is None else f"{quota:g}"


def in_force(have: float | None, want: float | None) -> bool:
    """A cgroup quota ``have`` is the quota ``want``; for no quota, all of the host's CPUs is none
    too (podman cannot remove a quota once set, ``apply_cpus`` sets that)."""
    if want is None and have is not None:
        return have >= host_cpus() - 5e-4
    return node_limits.same_share(have, want)


def apply_link(name: str, ifname: str, mbit: int) -> list[str]:
    """Shape the egress of ``ifname`` in container ``name`` to ``mbit`` Mbit/s by the node's unit
    ``node_limits.LINK_UNIT`` (0: remove unit and shaping); returns what changed."""
    unit, path = node_limits.LINK_UNIT, node_limits.LINK_UNIT_PATH
    if mbit == 0:
        if podman("exec", name, "test", "-e", path, check=False).returncode != 0:
            return []
        podman("exec", name, "systemctl", "disable", "--now", unit)
        podman("exec", name, "rm", "-f", path)
        podman("exec", name, "systemctl", "daemon-reload")
        return [f"{name}: {ifname} no longer shaped"]
    if put_node_file(name, path, node_limits.link_unit(ifname, mbit), "root:root", "0644"):
        podman("exec", name, "systemctl", "daemon-reload")
        podman("exec", name, "systemctl", "enable", unit)
        podman("exec", name, "systemctl", "restart", unit)
        return [f"{name}: {ifname} shaped to {mbit} Mbit/s ({unit})"]
    if podman("exec", name, "systemctl", "is-active", unit, check=False).returncode != 0:
        podman("exec", name, "systemctl", "enable", "--now", unit)
        return [f"{name}: {unit} started"]
    return []


def measure_cpu(names: list[str], seconds: float = CPU_CHECK_S) -> dict[str, float]:
    """CPU-seconds per second that each container got while all of them spun at once for
    ``seconds`` (as many spinning processes as the node has CPUs): the share in force, and less
    when the machine is busier than the shares allow."""
    procs = {}
    for name in names:
        workers = str(node_share(name)["affinity"])
        argv = ["podman", "exec", name, "python3", "-c", node_limits.BUSY_LOOP, str(seconds), workers]
        procs[name] = subprocess.Popen(argv, env=podman_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    rates = {}
    for name, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=seconds + 120)
        try:
            rates[name] = round(float(stdout.decode().strip()), 3)
        except ValueError:
            err = stderr.decode(errors="replace").strip()
            raise LabError(f"{name}: the CPU check failed: {err}") from None
    return rates


def qdisc_sent(name: str, ifname: str) -> int | None:
    stats = out(podman("exec", name, "tc", "-s", "qdisc", "show", "dev", ifname, "root", check=False))
    return node_limits.qdisc_sent_bytes(stats)


def measure_link(sender: str, receiver: str, address: str, ifname: str,
                 nbytes: int = LINK_CHECK_BYTES) -> node_limits.Transfer:
    """Send ``nbytes`` over TCP from container ``sender`` to ``receiver`` (at ``address``); the rate
    the receiver saw and the bytes the sender's queueing discipline on ``ifname`` sent meanwhile."""
    argv = ["podman", "exec", receiver, "python3", "-c", node_limits.RECEIVER]
    recv = subprocess.Popen(argv, env=podman_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        port = recv.stdout.readline().strip()
        if not port.isdigit():
            err = recv.stderr.read().strip()
            raise LabError(f"{receiver}: the link check's receiver did not start: {err}")
        before = qdisc_sent(sender, ifname)
        podman("exec", sender, "python3", "-c", node_limits.SENDER, address, port, str(nbytes), timeout=300)
        after = qdisc_sent(sender, ifname)
        stdout, stderr = recv.communicate(timeout=60)
    finally:
        if recv.poll() is None:
            recv.kill()
            recv.wait()
    try:
        got, seconds = stdout.split()
    except ValueError:
        raise LabError(f"{receiver}: the link check's receiver failed: {stderr.strip()}") from None
    wire = after - before if before is not None and after is not None else None
    return node_limits.Transfer(sender, receiver, int(got), float(seconds), wire)


def limits_text(limits: NodeLimits) -> str:
    """``, 0.6 CPU, link 1000 Mbit/s`` for a node's limits in force (``""`` without any)."""
    text = "" if limits.cpus is None else f", {limits.cpus:g} CPU"
    return text + ("" if limits.link_mbit is None else f", link {limits.link_mbit:g} Mbit/s")


class NodeLimits(NamedTuple):
    """What is in force on one lab node: CPU quota (None: none), its share and threads as its
    workers see them, the interface and its shaped rate (None: not shaped)."""

    cpus: float | None
    share: float
    threads: int
    ifname: str
    link_mbit: float | None


def read_limits(names: list[str]) -> dict[str, NodeLimits]:
    """The limits in force on the containers ``names`` (read inside each one)."""
    found = {}
    for name in names:
        share = node_share(name)
        ifname = node_ifname(name)
        found[name] = NodeLimits(share["quota"], share["share"], share["threads"], ifname,
                                 node_link_mbit(name, ifname))
    return found


class Applied(NamedTuple):
    """What ``apply_limits`` did and found: the lines of what changed, the limits in force per node,
    the CPU each node got in the busy loop ({} when no node has a quota) and the transfers of the
    link check ([] when not shaped or a single node)."""

    changed: list[str]
    limits: dict[str, NodeLimits]
    cpu: dict[str, float]
    links: list[node_limits.Transfer]


def apply_limits(
    names: list[str],
    cpus: tuple[float | None, ...] | None,
    link_mbit: int | None,
    addresses: dict[str, str],
) -> Applied:
    """Give the containers ``names`` the CPU quotas ``cpus`` (one per node; None: keep theirs) and
    links shaped to ``link_mbit`` (0: none; None: keep), then check what is in force and measure it:
    every node's CPU rate while all spin at once (when a node has a quota) and each node's send rate
    to the next node (when the links are shaped), each logged in a line.

    Raises:
        LabError: a node holds other limits than asked after they were applied.
    """
    changed: list[str] = []
    for i, name in enumerate(names):
        state = container_state(name) or {}
        if cpus is not None:
            changed += apply_cpus(name, cpus[i], state)
        if link_mbit is not None:
            changed += apply_link(name, node_ifname(name), link_mbit)
    limits = read_limits(names)
    for i, name in enumerate(names):
        have = limits[name]
        if cpus is not None and not in_force(have.cpus, cpus[i]):
            raise LabError(f"{name}: its cgroup holds a CPU quota of {have.cpus}, not {cpus[i]}")
        if link_mbit is not None and have.link_mbit != (link_mbit or None):
            raise LabError(
                f"{name}: {have.ifname} is shaped to {have.link_mbit} Mbit/s, not {link_mbit or 'none'}: see "
                f"`podman exec {name} systemctl status {node_limits.LINK_UNIT}`"
            )
    quotas = tuple(limits[n].cpus for n in names)
    warning = node_limits.oversubscribed(quotas, host_cpus())
    if warning:
        log(warning)
    rates: dict[str, float] = {}
    if any(q is not None for q in quotas):
        rates = measure_cpu(names)
        log("CPU in force: " + "; ".join(
            f"{n} quota {node_limits.shares_text([limits[n].cpus])} ({limits[n].threads} thread(s)), "
            f"a busy loop got {rates[n]:.2f} CPU" for n in names
        ) + f" (load {os.getloadavg()[0]:.1f})")
    transfers = []
    if any(limits[n].link_mbit is not None for n in names) and len(names) >= 2:
        for i, name in enumerate(names):
            peer = names[(i + 1) % len(names)]
            transfers.append(measure_link(name, peer, addresses[peer], limits[name].ifname))
            log("link: " + transfers[-1].line(limits[name].link_mbit))
    return Applied(changed, limits, rates, transfers)


def cmd_up(args: argparse.Namespace | None = None) -> None:
    t0 = time.monotonic()
    cpus = node_limits.parse_cpus(getattr(args, "cpus", None), host_cpus())
    link_mbit = node_limits.parse_link_mbit(getattr(args, "link_mbit", None))
    present, requested = lab_containers(), getattr(args, "nodes", None)
    if cpus is not None and len(cpus) > 1 and requested is None and not present:
        requested = len(cpus)  # a new lab of one laptop per share
    nodes = node_names(node_count(requested, present))
    if cpus is not None:
        cpus = node_limits.shares_for(cpus, len(nodes))
    cmd_image()
    changed: list[str] = []
    if podman("network", "exists", NETWORK, check=False).returncode != 0:
        podman("network", "create", "--label", f"{LABEL}=1", NETWORK)
        changed.append(f"network {NETWORK} created")
    image_id = out(podman("image", "inspect", "--format", "{{.Id}}", NODE_IMAGE))
    addresses = node_addresses(nodes)
    for i, name in enumerate(nodes):
        state = container_state(name)
        if state is None:
            quota = [] if cpus is None or cpus[i] is None else node_limits.cpu_args(cpus[i])
            podman(
                "run",
                *quota,
                "--detach",
                "--name",
                name,
                "--hostname",
                name,
                "--network",
                NETWORK,
                "--ip",
                addresses[name],
                "--systemd=always",
                "--cap-add",
                "NET_ADMIN,NET_RAW",
                "--restart",
                "no",
                "--label",
                f"{LABEL}=1",
                NODE_IMAGE,
            )
            changed.append(f"{name} created")
        else:
            if state.get("Config", {}).get("Labels", {}).get(LABEL) != "1":
                raise LabError(
                    f"a container named {name} exists but is not a ddp-lab node: rename or "
                    f"remove it (`podman rm -f {name}`)"
                )
            if state.get("Image") != image_id:
                log(f"{name} runs an older node image; `make lab-down lab-up` recreates it")
            if not state["State"].get("Running"):
                podman("start", name)
                changed.append(f"{name} started")
    states = {name: wait_for_systemd(name) for name in nodes}
    gateway = network_gateway()
    check_gateway_reachable(gateway, nodes[0])
    for name in nodes:
        have = container_address(name)
        if have != addresses[name]:
            raise LabError(
                f"{name} has the address {have}, not the lab's {addresses[name]} (made by an older "
                "lab/lab.py?): `make lab-down lab-up` recreates it"
            )
    applied = apply_limits(list(nodes), cpus, link_mbit, addresses)
    changed += applied.changed
    limits = applied.limits
    changed += ensure_ssh_access(LAB_SSH_DIR, addresses)
    rates = {v.link_mbit for v in limits.values()}
    inventory = render_inventory(gateway, addresses, {n: v.cpus for n, v in limits.items()},
                                 rates.pop() if len(rates) == 1 else None)
    if atomic_write(INVENTORY_FILE, inventory):
        changed.append(f"{rel(INVENTORY_FILE)} written")
    summary = ", ".join(f"{n} {addresses[n]} ({s}{limits_text(limits[n])})" for n, s in states.items())
    log(f"{'; '.join(changed) if changed else 'nothing changed'}")
    log(
        f"lab is up in {time.monotonic() - t0:.0f} s: {summary}; SSH as {ADMIN_USER} works; "
        f"rendezvous_address {gateway} (reachable from {nodes[0]}); inventory {rel(INVENTORY_FILE)}"
    )


def close_ssh_master(address: str) -> bool:
    """End Ansible's persistent SSH connection to ``address`` (as ``ADMIN_USER``) if there is one:
    a master left behind by a removed container would hold its address until ServerAlive gives up
    (15 s), and a node made again at that address would first be unreachable. True when one ended."""
    if shutil.which("ssh") is None:
        return False
    argv = ["ssh", "-F", "none", "-o", f"ControlPath={SSH_CONTROL_PATH}", "-l", ADMIN_USER, "-O", "exit"]
    argv.append(address)
    return subprocess.run(argv, capture_output=True, timeout=30, check=False).returncode == 0


def cmd_down(_args: argparse.Namespace | None = None) -> None:
    changed: list[str] = []
    for name in lab_containers():
        state = container_state(name)
        if state is None:
            continue
        for net in (state.get("NetworkSettings", {}).get("Networks") or {}).values():
            if net.get("IPAddress") and close_ssh_master(net["IPAddress"]):
                changed.append(f"{name}: Ansible's SSH connection closed")
        podman("rm", "--force", "--time", "10", name)
        changed.append(f"{name} removed")
    if podman("network", "exists", NETWORK, check=False).returncode == 0:
        podman("network", "rm", NETWORK)
        changed.append(f"network {NETWORK} removed")
    if INVENTORY_FILE.exists():
        INVENTORY_FILE.unlink()
        changed.append(f"{rel(INVENTORY_FILE)} removed")
    if LAB_SSH_DIR.exists():
        shutil.rmtree(LAB_SSH_DIR)
        changed.append(f"{rel(LAB_SSH_DIR)} (key pair, known_hosts) removed")
    log(("; ".join(changed) if changed else "nothing to remove") + "; the lab is down")


def cmd_access(args: argparse.Namespace) -> None:
    state_dir = Path(args.state_dir).resolve()
    addresses = {name: container_address(name) for name in args.containers}
    for name in args.containers:
        wait_for_systemd(name)
    changed = ensure_ssh_access(state_dir, addresses)
    log(
        f"{'; '.join(changed) if changed else 'nothing changed'}; SSH as {ADMIN_USER} works on "
        + ", ".join(f"{n} ({a})" for n, a in addresses.items())
    )


def cmd_limits(args: argparse.Namespace) -> None:
    """``limits --cpus ... --link-mbit ... CONTAINER...``: the molecule scenarios' prepare step
    (their containers are made by molecule's podman driver, so quotas are given live)."""
    cpus = node_limits.parse_cpus(args.cpus, host_cpus())
    link_mbit = node_limits.parse_link_mbit(args.link_mbit)
    if cpus is not None:
        cpus = node_limits.shares_for(cpus, len(args.containers))
    addresses = {name: container_address(name) for name in args.containers}
    applied = apply_limits(list(args.containers), cpus, link_mbit, addresses)
    log(f"{'; '.join(applied.changed) if applied.changed else 'nothing changed'}; "
        + ", ".join(f"{n}{limits_text(v) or ' (no limits)'}" for n, v in applied.limits.items()))


def cmd_network(args: argparse.Namespace) -> None:
    """Make the podman network ``args.name`` with the IPv4 subnet ``args.subnet`` unless it exists.

    The molecule scenarios give their nodes fixed addresses in it (a powered-off node keeps its
    address); the podman driver only makes a network with a subnet of podman's choosing.

    Raises:
        LabError: the network exists with another subnet.
    """
    if podman("network", "exists", args.name, check=False).returncode != 0:
        podman("network", "create", "--label", f"{LABEL}=1", "--subnet", args.subnet, args.name)
        log(f"network {args.name} made with subnet {args.subnet}")
        return
    info = json.loads(out(podman("network", "inspect", args.name)))[0]
    subnets = [s.get("subnet") for s in info.get("subnets") or []]
    if args.subnet not in subnets:
        have = ", ".join(map(str, subnets)) or "none"
        raise LabError(
            f"network {args.name} exists with subnet {have}, not {args.subnet}: "
            f"remove it (podman network rm {args.name}) or choose another DDP_LAB_MOLECULE_NET"
        )
    log(f"network {args.name} ({args.subnet}): nothing changed")


def cmd_status(_args: argparse.Namespace | None = None) -> None:
    want = recipe_hash()
    have = image_label(NODE_IMAGE, RECIPE_LABEL)
    verdict = "missing" if have is None else "current" if have == want else "outdated"
    print(f"image    {NODE_IMAGE}: {verdict}")
    net = podman("network", "exists", NETWORK, check=False).returncode == 0
    print(f"network  {NETWORK}: {network_gateway() if net else 'absent'}")
    present = lab_containers()
    if not present:
        print("nodes    none (`make lab-up [LAB_NODES=N]`)")
    for name in present:
        state = container_state(name)
        if state is None:
            continue
        running = state["State"].get("Running")
        systemd = "-"
        if running:
            systemd = out(podman("exec", name, "systemctl", "is-system-running", check=False)) or "?"
        limits = limits_text(read_limits([name])[name]) if running else ""
        print(f"{name} {state['State'].get('Status')} systemd={systemd}{limits}")
    print(f"conf     {CONTAINERS_CONF if CONTAINERS_CONF.is_file() else 'none (podman defaults)'}")


def cmd_detect(_args: argparse.Namespace | None = None) -> None:
    image = probe_image()
    if not image_exists(image):
        ensure_base_image()
        image = BASE_IMAGE
    print(detect_runtime(image))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="lab/lab.py", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    for name, func, help_ in (
        ("image", cmd_image, "build the node image (cached by recipe hash)"),
        ("up", cmd_up, "start the lab laptops (--nodes N) and write inventory/lab/hosts.yml"),
        ("access", cmd_access, "SSH access for given containers: key pair, sudo account, known_hosts"),
        ("limits", cmd_limits, "CPU quotas and shaped links for given containers, checked and measured"),
        ("network", cmd_network, "make a podman network with a given subnet unless it exists"),
        ("down", cmd_down, "remove the lab containers, network, generated inventory and SSH state"),
        ("status", cmd_status, "show image, network and node states"),
        ("detect", cmd_detect, "container-runtime detection; prints the containers.conf path"),
    ):
        sub.add_parser(name, help=help_).set_defaults(func=func)
    sub.choices["up"].add_argument(
        "--nodes",
        type=int,
        help=f"how many laptops (laptop-a, laptop-b, ...; 1-{len(NODE_LETTERS)}): default the running "
        f"lab's size, else {DEFAULT_NODE_COUNT}; fewer than the lab has is an error (`down` first)",
    )
    for name in ("up", "limits"):
        sub.choices[name].add_argument(
            "--cpus", metavar="SHARES",
            help="CPU quota per laptop in CPUs, in address order (0.6,0.6,0.3), one for all (0.6) or off; "
            "default: keep what the nodes have",
        )
        sub.choices[name].add_argument(
            "--link-mbit", metavar="RATE",
            help="shape every node's link to RATE Mbit/s (tbf, e.g. 1000) or off; default: keep",
        )
    sub.choices["limits"].add_argument("containers", nargs="+", metavar="CONTAINER",
                                       help="running node containers, in address order")
    access = sub.choices["access"]
    access.add_argument(
        "--state-dir", required=True, help="folder of the key pair and known_hosts (created, mode 0700)"
    )
    access.add_argument("containers", nargs="+", metavar="CONTAINER", help="running node containers")
    network = sub.choices["network"]
    network.add_argument("name", help="the network's name")
    network.add_argument("subnet", help="its IPv4 subnet, e.g. 10.89.211.0/24")
    args = parser.parse_args(argv)
    try:
        args.func(args)
    except (LabError, LimitError) as exc:
        print(f"lab: error: {exc}", file=sys.stderr)
        return 1
    except subprocess.TimeoutExpired as exc:
        print(f"lab: error: timed out: {' '.join(map(str, exc.cmd))}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    with contextlib.suppress(BrokenPipeError):
        sys.exit(main())
