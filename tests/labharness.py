"""Shared harness of the bad-input matrices (tests/test_bad_input_provision.py,
tests/test_bad_input_preflight.py): find the nodes to run against, run playbooks, read the recap
and the failure lines, and prove that nothing on the nodes changed.

Where the node tests run, first match wins:

1. ``DDP_LAB_TEST_INVENTORY``: an inventory folder or file of your own podman containers (trainers
   reached over SSH or the ``containers.podman.podman`` connection, each one's container named by
   its ``lab_container`` host variable or else its host name; one host in ``rendezvous``); ``none``
   turns the node cases off (as in CI's ``make test-unit``, where no node is up).
2. ``MOLECULE_INVENTORY_FILE`` (set by ``molecule verify``): the scenario's containers. This is how
   CI runs the matrices: the ``default`` scenario lists both files in its verifier's
   ``additional_files_or_dirs``.
3. The built-in lab (``inventory/lab/hosts.yml``, written by ``make lab-up``).

Without any of them the node tests skip, saying why (with ``DDP_LAB_TEST_REQUIRE_NODES=1``, as in
molecule's verifier, they fail instead); the controller-side cases of the preflight
matrix need no node and always run.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
BINDIR = Path(sys.executable).parent
PLAY_TIMEOUT_S = 1800
AGENT_UNIT = yaml.safe_load((REPO / "roles/ddp_lab/defaults/main.yml").read_text())["ddp_lab_unit"]
RECAP = re.compile(r"^(\S+)\s+:\s+ok=(\d+)\s+changed=(\d+)\s+unreachable=(\d+)\s+failed=(\d+)", re.M)
ERROR = re.compile(r"^\[ERROR\]: Task failed: Action failed: (.*)$", re.M)
ANSI = re.compile(r"\x1b\[[0-9;]*m")


@dataclass
class Lab:
    """Where the tests run: an inventory, its trainers and their containers."""

    inventory: str
    trainers: list[str]
    hostvars: dict[str, dict]
    rendezvous: list[str]
    containers: dict[str, str]
    env: dict[str, str]
    rendezvous_address: str


def ansible_env() -> dict[str, str]:
    """The environment for ansible-playbook: this venv first on PATH, the project's ansible.cfg
    (unless molecule set its own), and the podman settings the lab detected."""
    env = dict(os.environ)
    if not env.get("MOLECULE_INVENTORY_FILE"):
        env["ANSIBLE_CONFIG"] = str(REPO / "ansible.cfg")
    conf = REPO / "lab" / ".state" / "containers.conf"
    if conf.is_file():
        env.setdefault("CONTAINERS_CONF", str(conf))
    env["PATH"] = f"{BINDIR}{os.pathsep}{env.get('PATH', '')}"
    # Plain text to parse (molecule forces colours for its own output).
    env["ANSIBLE_FORCE_COLOR"] = "0"
    env["ANSIBLE_NOCOLOR"] = "1"
    return env


def skip_or_fail(reason: str) -> None:
    """``pytest.skip``, or a failure where the nodes must be there (``DDP_LAB_TEST_REQUIRE_NODES=1``,
    set by the molecule verifier that runs these cases in CI): a skipped check is not a passed one."""
    if os.environ.get("DDP_LAB_TEST_REQUIRE_NODES") == "1":
        pytest.fail(f"DDP_LAB_TEST_REQUIRE_NODES=1 but {reason}", pytrace=False)
    pytest.skip(reason)


def lab_image_or_skip():
    """lab/lab.py (module ``lab``, on pytest's pythonpath), for a case that starts its own containers
    of the lab image; ``pytest.skip`` (a failure with ``DDP_LAB_TEST_REQUIRE_NODES=1``) without
    podman, root or the image, or with ``DDP_LAB_TEST_INVENTORY=none``."""
    if os.environ.get("DDP_LAB_TEST_INVENTORY") == "none":
        skip_or_fail("DDP_LAB_TEST_INVENTORY=none: the node cases are off")
    if shutil.which("podman") is None or os.geteuid() != 0:
        skip_or_fail("needs podman and root (the lab's containers)")
    import lab

    if not lab.image_exists(lab.NODE_IMAGE):
        skip_or_fail(f"no lab image {lab.NODE_IMAGE}: run `make image`")
    return lab


def lab_or_skip() -> Lab:
    """The nodes to test against (see the module docstring), or ``pytest.skip`` saying why (a failure
    with ``DDP_LAB_TEST_REQUIRE_NODES=1``)."""
    env = ansible_env()
    if env.get("DDP_LAB_TEST_INVENTORY") == "none":
        skip_or_fail("DDP_LAB_TEST_INVENTORY=none: the node cases are off")
    if env.get("DDP_LAB_TEST_INVENTORY"):
        inventory = env["DDP_LAB_TEST_INVENTORY"]
    elif env.get("MOLECULE_INVENTORY_FILE"):
        inventory = str(Path(env["MOLECULE_INVENTORY_FILE"]).parent)
    else:
        inventory = str(REPO / "inventory" / "lab")
        if not (REPO / "inventory" / "lab" / "hosts.yml").is_file():
            skip_or_fail(
                "no nodes to test against: the lab is not up (no inventory/lab/hosts.yml; `make lab-up`) "
                "and neither DDP_LAB_TEST_INVENTORY nor MOLECULE_INVENTORY_FILE is set; CI runs these "
                "cases in `molecule verify` of the default scenario"
            )
    if shutil.which("podman") is None:
        skip_or_fail("podman is not installed: the lab needs it (`make deps`)")
    listing = subprocess.run(
        [str(BINDIR / "ansible-inventory"), "-i", inventory, "--list"],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    data = json.loads(listing.stdout)
    trainers = data.get("trainers", {}).get("hosts", [])
    hostvars = data.get("_meta", {}).get("hostvars", {})
    # The lab's inventories connect over SSH (ansible_host is an address) and name each node's
    # container in lab_container; the molecule scenarios template it from the environment.
    containers = {h: hostvars.get(h, {}).get("lab_container", h) for h in trainers}
    if any("{{" in name for name in containers.values()):
        containers = _rendered_vars(env, inventory, "trainers", "lab_container")
    for host, name in containers.items():
        running = subprocess.run(
            ["podman", "container", "inspect", "--format", "{{.State.Running}}", name],
            env=env,
            capture_output=True,
            text=True,
            check=False,
        )
        if running.stdout.strip() != "true":
            skip_or_fail(f"the nodes are not up ({host}: container {name} is not running): run `make lab-up`")
        # Busy as ddp_job sees it: the agent unit is up and not merely remaining after its exit.
        show = subprocess.run(
            ["podman", "exec", name, "systemctl", "show", AGENT_UNIT, "-p", "ActiveState", "-p", "SubState"],
            env=env,
            capture_output=True,
            text=True,
            check=False,
        )
        unit = dict(line.split("=", 1) for line in show.stdout.splitlines() if "=" in line)
        if (
            unit.get("ActiveState") in ("active", "activating", "deactivating")
            and unit.get("SubState") != "exited"
        ):
            skip_or_fail(
                f"{host} runs a training job ({AGENT_UNIT} is {unit.get('SubState')}): these tests "
                "change the nodes for a moment; run them when the cluster is idle"
            )
    rendezvous = data.get("rendezvous", {}).get("hosts", [])
    return Lab(
        inventory,
        trainers,
        hostvars,
        rendezvous,
        containers,
        env,
        _rendered_var(env, inventory, rendezvous[0], "rendezvous_address") if rendezvous else "",
    )


def _rendered_vars(env: dict[str, str], inventory: str, pattern: str, name: str) -> dict[str, str]:
    """A variable of the hosts matching ``pattern`` as plays see it, {host: value} (ansible-inventory
    prints templates unrendered, e.g. the molecule inventory's lookup of its network's gateway)."""
    done = subprocess.run(
        [
            str(BINDIR / "ansible"),
            pattern,
            "-i",
            inventory,
            "-o",
            "-m",
            "ansible.builtin.debug",
            "-a",
            f"var={name}",
        ],
        env=env,
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    values = {}
    for line in done.stdout.splitlines():
        if "=>" in line:
            host, result = line.split("=>", 1)
            values[host.split("|")[0].strip()] = str(json.loads(result)[name])
    return values


def _rendered_var(env: dict[str, str], inventory: str, host: str, name: str) -> str:
    """One host's variable as plays see it (see :func:`_rendered_vars`)."""
    return _rendered_vars(env, inventory, host, name)[host]


@contextlib.contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """Within the block SIGTERM raises KeyboardInterrupt, so that the ``finally`` clauses that undo
    changes on the nodes run even when the test run is terminated."""

    def interrupt(_signum, _frame):
        raise KeyboardInterrupt("SIGTERM")

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def node_exec(
    lab: Lab, host: str, *cmd: str, stdin: str | None = None, timeout: float = 120
) -> subprocess.CompletedProcess:
    """Run a command in a trainer's container (as root), capturing its output."""
    return subprocess.run(
        ["podman", "exec", "-i", lab.containers[host], *cmd],
        env=lab.env,
        input=stdin,
        capture_output=True,
        text=True,
        check=False,
        timeout=timeout,
    )


# Below the kernel's ephemeral range (net.ipv4.ip_local_port_range, 32768-60999 by default) and
# above the project's fixed ports (29400 store, 29510 lighthouse, 29520/29521 replica), which
# molecule or the lab may hold on this host while tests run.
TEST_PORTS = range(30000, 32768)
#: One lock file per port handed out (``<port>.lock``), flock-ed by the process that got it for as
#: long as it lives: test processes running at once on this machine (pytest-xdist workers, other
#: checkouts' suites) never hand out the same port.
PORT_LOCKS = Path(os.environ.get("DDP_LAB_TEST_PORT_LOCKS", "/tmp/ddp-lab-test-ports"))
_handed_out: dict[int, int] = {}  # port -> the fd holding its lock (closed when the process ends)


def _reserve(port: int) -> int | None:
    """The fd of ``port``'s lock file, locked by this process; None when another process holds it."""
    PORT_LOCKS.mkdir(mode=0o777, parents=True, exist_ok=True)
    fd = os.open(PORT_LOCKS / f"{port}.lock", os.O_CREAT | os.O_RDWR, 0o666)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


def free_port() -> int:
    """A TCP port that nothing listens on now, that no other test process on this machine is
    given while this one lives, and that no outgoing connection can take before the process it is
    meant for binds it, e.g. for a store or a Manager of a test's own.

    A port the kernel picks (``bind(("127.0.0.1", 0))``) lies in the ephemeral range: the
    connections of processes already running (gloo pairs, store and gRPC clients) draw their
    local ports from that range too, and one of them can take it first (CI saw a per_step
    replica's worker fail to start that way). This picks at random from :data:`TEST_PORTS`,
    below that range, one that binds on every address, was not handed out before in this
    process, and whose lock in :data:`PORT_LOCKS` no other living process holds (two test
    processes picking the same port between the check and the bind: a lighthouse that could not
    bind left its test talking to another test's lighthouse). A process that does not use this
    function can still take a port: a server started on one should check that it listens itself
    (e.g. tests/test_per_step_e2e.py's lighthouse).

    Raises:
        RuntimeError: the ephemeral range reaches into :data:`TEST_PORTS`, or none is free.
    """
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    if low < TEST_PORTS.stop:
        raise RuntimeError(f"net.ipv4.ip_local_port_range starts at {low}, inside the test ports "
                           f"{TEST_PORTS.start}-{TEST_PORTS.stop - 1}: fix the range or TEST_PORTS")
    for port in random.sample(TEST_PORTS, len(TEST_PORTS)):
        if port in _handed_out:
            continue
        fd = _reserve(port)
        if fd is None:
            continue
        with socket.socket() as s:
            try:
                s.bind(("0.0.0.0", port))  # also refused when a listener holds any address
            except OSError:
                os.close(fd)
                continue
        _handed_out[port] = fd
        return port
    raise RuntimeError(f"no free TCP port in {TEST_PORTS.start}-{TEST_PORTS.stop - 1}")


def run_playbooks(
    env: dict[str, str], inventory: str, playbooks: list[str], *args: str, timeout: float = PLAY_TIMEOUT_S
) -> tuple[int, str]:
    """``ansible-playbook -i inventory playbooks... args...`` from the repository: (rc, stdout+stderr)."""
    proc = subprocess.run(
        ["ansible-playbook", "-i", inventory, *playbooks, *args],
        env=env,
        capture_output=True,
        text=True,
        check=False,
        timeout=timeout,
        cwd=REPO,
    )
    return proc.returncode, ANSI.sub("", proc.stdout + proc.stderr)


def run_playbooks_watching(
    env: dict[str, str],
    inventory: str,
    playbooks: list[str],
    *args: str,
    on_line=None,
    timeout: float = PLAY_TIMEOUT_S,
) -> tuple[int, str]:
    """Like :func:`run_playbooks`, calling ``on_line(line)`` for every output line as it comes
    (e.g. to release a lock once the play says it waits for it)."""
    lines: list[str] = []
    with subprocess.Popen(
        ["ansible-playbook", "-i", inventory, *playbooks, *args],
        env=env,
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    ) as proc:
        deadline = time.monotonic() + timeout
        for line in proc.stdout:
            lines.append(line)
            if on_line is not None:
                on_line(ANSI.sub("", line))
            if time.monotonic() > deadline:
                proc.kill()
                raise TimeoutError(f"ansible-playbook ran longer than {timeout} s")
        rc = proc.wait()
    return rc, ANSI.sub("", "".join(lines))


def recap(output: str) -> dict[str, dict[str, int]]:
    """The last PLAY RECAP of an ansible-playbook run: {host: {ok, changed, unreachable, failed}}."""
    table = output.rsplit("PLAY RECAP", 1)[-1]
    return {
        m[0]: dict(zip(("ok", "changed", "unreachable", "failed"), map(int, m[1:]), strict=True))
        for m in RECAP.findall(table)
    }


def errors(output: str) -> list[str]:
    """The failure messages Ansible printed, one per failure (echoed for `pytest -s`)."""
    found = ERROR.findall(output)
    for line in found:
        print(f"bad input -> {line}")
    return found


def assert_unchanged(output: str) -> None:
    """The run's recap lists hosts and shows changed=0 on every one."""
    table = recap(output)
    assert table, output[-3000:]
    assert all(r["changed"] == 0 for r in table.values()), table


def assert_stopped_before_changes(
    rc: int, output: str, trainers: list[str] | None = None, contacted: bool = True
) -> None:
    """The run failed and changed nothing on any host (recap changed=0). With ``trainers``: each
    of them ran at least one task (``contacted``) or none (the run stopped on the controller)."""
    assert rc != 0, output[-3000:]
    assert_unchanged(output)
    table = recap(output)
    for host in trainers or []:
        assert (host in table) == contacted, (host, table)


@contextlib.contextmanager
def nodes_untouched(lab: Lab, marker: str) -> Iterator[None]:
    """Remove ``marker`` (a file the provisioning always (re)creates early in its apply phase) on
    every trainer; after the block it must still be absent. Restores it."""
    saved = {h: node_exec(lab, h, "cat", marker) for h in lab.trainers}
    for host in lab.trainers:
        node_exec(lab, host, "rm", "-f", marker)
    try:
        yield
        for host in lab.trainers:
            assert node_exec(lab, host, "test", "-e", marker).returncode != 0, (
                f"{host}: the provisioning went on to change the node ({marker} was written)"
            )
    finally:
        for host, old in saved.items():
            if old.returncode == 0:
                node_exec(lab, host, "sh", "-c", f"cat > {marker}", stdin=old.stdout)


def local_controller(tmp_path: Path, port: int | None = None) -> dict:
    """The rendezvous group of a controller-side test's inventory: this machine as ``controller``
    (local connection, this interpreter) at a TEST-NET address that is never dialled, with a store
    port (``port``, else a :func:`free_port`) and a store state folder of the test's own."""
    return {
        "controller": {
            "ansible_connection": "local",
            "ansible_python_interpreter": sys.executable,
            "rendezvous_address": "192.0.2.10",
            "rendezvous_port": free_port() if port is None else port,
            "rendezvous_state_dir": str(tmp_path / "rdzv"),
        }
    }

def write_inventory(
    lab: Lab,
    path: Path,
    extra_hostvars: dict | None = None,
    keep_rendezvous: bool = True,
    rendezvous_vars: dict | None = None,
) -> str:
    """A copy of the inventory (vars resolved by ansible-inventory) at ``path``, optionally changed:
    ``extra_hostvars`` ``{host: {var: value}}`` for trainers, ``rendezvous_vars`` for the rendezvous host."""
    hosts = {h: {**lab.hostvars.get(h, {}), **(extra_hostvars or {}).get(h, {})} for h in lab.trainers}
    children: dict = {"trainers": {"hosts": hosts}}
    if keep_rendezvous:
        children["rendezvous"] = {
            "hosts": {h: {**lab.hostvars.get(h, {}), **(rendezvous_vars or {})} for h in lab.rendezvous}
        }
    path.write_text(yaml.safe_dump({"all": {"children": children}}, sort_keys=False))
    return str(path)


def render_agent_launch(tmp_path: Path, *extra: str) -> tuple[list[str], list[str], dict]:
    """ddp_job's launch of trainer ``t-a`` (of two, t-a and t-b, rendezvous host 192.168.50.10;
    t-a at 192.168.50.11 on enp3s0, run r1, 4 cores) as Ansible renders it from the role's own
    defaults and vars, ``extra`` given to ansible-playbook (e.g. ``-e ddp_job_fault_tolerance=per_step``):
    (systemd-run + agent argv, the options each laptop has its own value of, run.json)."""
    local = {"ansible_connection": "local"}
    inventory = tmp_path / "hosts.yml"
    inventory.write_text(yaml.safe_dump({"all": {"children": {
        "trainers": {"hosts": {"t-a": local, "t-b": local}},
        "rendezvous": {"hosts": {"controller": {**local, "rendezvous_address": "192.168.50.10"}}}}}}))
    what = ("ARGV={{ (__ddp_job_systemd_run + ddp_job_agent_argv) | to_json }} "
            "NODEOPTS={{ ddp_job_agent_node_options | to_json }} CONFIG={{ __ddp_job_config | to_json }} END")
    play = tmp_path / "render.yml"
    play.write_text(yaml.safe_dump([{
        "name": "Render the agent command line", "hosts": "t-a", "gather_facts": False,
        "vars_files": [str(REPO / f"roles/{f}/main.yml") for f in ("ddp_lab/defaults", "ddp_job/defaults",
                                                                   "ddp_job/vars")],
        "vars": {"ddp_lab_run_id": "r1", "wired_network_ifname": "enp3s0",
                 "wired_network_address": "192.168.50.11", "__ddp_job_launch_token": "tok",
                 "__ddp_job_node": {"cores": 4, "cpu": {"threads": 4}}},
        "tasks": [{"name": "Print it", "ansible.builtin.debug": {"msg": what}}],
    }]))
    rc, out = run_playbooks(ansible_env(), str(inventory), [str(play)], *extra, timeout=120)
    assert rc == 0, out[-3000:]
    m = re.search(r'"msg": "ARGV=(\[.*?\]) NODEOPTS=(\[.*?\]) CONFIG=(\{.*?\}) END"', out)
    assert m, out[-3000:]
    argv, node_options, config = (json.loads(g.replace('\\"', '"')) for g in m.groups())
    return argv, node_options, config
