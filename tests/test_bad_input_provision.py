"""Bad input to the provisioning (validate + provision): one line naming host, cause and fix,
and nothing on the nodes changes.

Runs ``ansible-playbook playbooks/validate.yml playbooks/provision.yml`` against the built-in lab
(``make lab-up``) or, inside ``molecule verify`` of the default scenario (which lists this file in
its verifier's additional_files_or_dirs), against that scenario's containers. Skips, saying why,
only when neither is running.

"Nothing changed" is checked two ways: the play recap reports changed=0 for every host, and a
marker the provisioning always (re)creates early in its apply phase (the wired_network local fact
file) is removed before the run and must still be absent after it; the test then restores it.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

pytestmark = [pytest.mark.slow, pytest.mark.lab]

REPO = Path(__file__).resolve().parents[1]
PLAYBOOKS = [str(REPO / "playbooks" / "validate.yml"), str(REPO / "playbooks" / "provision.yml")]
FACT_FILE = yaml.safe_load((REPO / "roles/wired_network/defaults/main.yml").read_text())[
    "wired_network_fact_file"]
PLAY_TIMEOUT_S = 1800
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


def _lab_or_skip() -> Lab:
    env = dict(os.environ)
    if env.get("MOLECULE_INVENTORY_FILE"):
        inventory = str(Path(env["MOLECULE_INVENTORY_FILE"]).parent)
    else:
        inventory = str(REPO / "inventory" / "lab")
        if not (REPO / "inventory" / "lab" / "hosts.yml").is_file():
            pytest.skip("the lab is not up (no inventory/lab/hosts.yml): run `make lab-up`; "
                        "CI runs these cases in `molecule verify` of the default scenario")
        env["ANSIBLE_CONFIG"] = str(REPO / "ansible.cfg")
        conf = REPO / "lab" / ".state" / "containers.conf"
        if conf.is_file():
            env.setdefault("CONTAINERS_CONF", str(conf))
    if shutil.which("podman") is None:
        pytest.skip("podman is not installed: the lab needs it (`make deps`)")
    # Plain output to parse: molecule exports ANSIBLE_FORCE_COLOR=1 to everything it runs.
    env.update(ANSIBLE_FORCE_COLOR="0", ANSIBLE_NOCOLOR="1")
    bindir = Path(sys.executable).parent
    env["PATH"] = f"{bindir}{os.pathsep}{env.get('PATH', '')}"
    listing = subprocess.run([str(bindir / "ansible-inventory"), "-i", inventory, "--list"], env=env,
                             capture_output=True, text=True, check=True)
    data = json.loads(listing.stdout)
    trainers = data.get("trainers", {}).get("hosts", [])
    hostvars = data.get("_meta", {}).get("hostvars", {})
    containers = {h: hostvars.get(h, {}).get("ansible_host", h) for h in trainers}
    for host, name in containers.items():
        state = subprocess.run(["podman", "container", "inspect", "--format", "{{.State.Running}}", name],
                               env=env, capture_output=True, text=True, check=False)
        if state.stdout.strip() != "true":
            pytest.skip(f"the lab is not up ({host}: container {name} is not running): run `make lab-up`")
    rendezvous = data.get("rendezvous", {}).get("hosts", [])
    return Lab(inventory, trainers, hostvars, rendezvous, containers, env)


@pytest.fixture(scope="module")
def lab() -> Lab:
    return _lab_or_skip()


def _exec(lab: Lab, host: str, *cmd: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(["podman", "exec", "-i", lab.containers[host], *cmd], env=lab.env, input=stdin,
                          capture_output=True, text=True, check=False, timeout=120)


def _provision(lab: Lab, *args: str, inventory: str | None = None) -> tuple[int, str]:
    proc = subprocess.run(
        ["ansible-playbook", "-i", inventory or lab.inventory, *PLAYBOOKS, *args], env=lab.env,
        capture_output=True, text=True, check=False, timeout=PLAY_TIMEOUT_S, cwd=REPO)
    return proc.returncode, ANSI.sub("", proc.stdout + proc.stderr)


def _recap(output: str) -> dict[str, dict[str, int]]:
    """The last PLAY RECAP of an ansible-playbook run: {host: {ok, changed, unreachable, failed}}."""
    table = output.rsplit("PLAY RECAP", 1)[-1]
    return {m[0]: dict(zip(("ok", "changed", "unreachable", "failed"), map(int, m[1:]), strict=True))
            for m in RECAP.findall(table)}


def _errors(output: str) -> list[str]:
    """The failure messages Ansible printed, one per failed host (echoed for `pytest -s`)."""
    found = ERROR.findall(output)
    for line in found:
        print(f"bad input -> {line}")
    return found


@contextlib.contextmanager
def _nodes_untouched(lab: Lab) -> Iterator[None]:
    """Remove the marker on every trainer; after the block it must still be absent. Restores it."""
    saved = {h: _exec(lab, h, "cat", FACT_FILE) for h in lab.trainers}
    for host in lab.trainers:
        _exec(lab, host, "rm", "-f", FACT_FILE)
    try:
        yield
        for host in lab.trainers:
            assert _exec(lab, host, "test", "-e", FACT_FILE).returncode != 0, (
                f"{host}: the provisioning went on to change the node ({FACT_FILE} was written)")
    finally:
        for host, old in saved.items():
            if old.returncode == 0:
                _exec(lab, host, "sh", "-c", f"cat > {FACT_FILE}", stdin=old.stdout)


def _assert_stopped_before_changes(lab: Lab, rc: int, output: str, contacted: bool = True) -> None:
    """The run failed and its recap shows no change anywhere; ``contacted``: the trainers ran at
    least one task (False: the run stopped on the controller before reaching them)."""
    assert rc != 0, output[-3000:]
    recap = _recap(output)
    assert recap, output[-3000:]
    for host in lab.trainers:
        assert (host in recap) == contacted, (host, recap)
    assert all(r["changed"] == 0 for r in recap.values()), recap


def _trainers_only_inventory(lab: Lab, tmp_path: Path, extra_hostvars: dict | None = None,
                             keep_rendezvous: bool = True) -> str:
    """A copy of the inventory (vars resolved by ansible-inventory), optionally changed."""
    hosts = {h: {**lab.hostvars.get(h, {}), **(extra_hostvars or {}).get(h, {})} for h in lab.trainers}
    children: dict = {"trainers": {"hosts": hosts}}
    if keep_rendezvous:
        children["rendezvous"] = {"hosts": {h: lab.hostvars.get(h, {}) for h in lab.rendezvous}}
    path = tmp_path / "hosts.yml"
    path.write_text(yaml.safe_dump({"all": {"children": children}}, sort_keys=False))
    return str(path)


def _line(errors: list[str], *needles: str, start: str = "") -> str:
    """An error line that starts with ``start`` (the host) and contains every needle (cause, fix)."""
    hits = [e for e in errors if e.startswith(start) and all(n in e for n in needles)]
    assert hits, (start, needles, errors)
    return hits[0]


def test_unknown_governor(lab: Lab) -> None:
    with _nodes_untouched(lab):
        rc, out = _provision(lab, "-e", "cpu_governor_governor=turbo")
        _assert_stopped_before_changes(lab, rc, out)
    errors = _errors(out)
    for host in lab.trainers:
        _line(errors, "cpu_governor_governor", "'turbo'", "fix", "performance", start=f"{host}:")


def test_torch_version_not_a_version(lab: Lab) -> None:
    with _nodes_untouched(lab):
        rc, out = _provision(lab, "-e", "python_env_torch_version=latest")
        _assert_stopped_before_changes(lab, rc, out)
    errors = _errors(out)
    for host in lab.trainers:
        _line(errors, "python_env_torch_version", "'latest'", "fix", start=f"{host}:")


def test_inventory_without_rendezvous_host(lab: Lab, tmp_path: Path) -> None:
    inventory = _trainers_only_inventory(lab, tmp_path, keep_rendezvous=False)
    with _nodes_untouched(lab):
        rc, out = _provision(lab, inventory=inventory)
        _assert_stopped_before_changes(lab, rc, out, contacted=False)
    _line(_errors(out), "no rendezvous host", "fix", "rendezvous_address", start=f"inventory {inventory}:")


def test_route_to_rendezvous_over_wifi(lab: Lab, tmp_path: Path) -> None:
    """A trainer whose route to the rendezvous host leaves over its WiFi card.

    The kernel here has no WiFi driver (no mac80211_hwsim), so the card is simulated honestly in
    two parts: a real interface named like a laptop's WiFi card (a veth ``wlp2s0``) on which the
    kernel really routes the rendezvous address (a TEST-NET-1 address given to this host as
    wired_network_rendezvous_address, so the real route to the controller stays untouched), and
    a fixture copy of its sysfs folder that carries the ``wireless`` subfolder a WiFi driver
    creates, which the role reads through wired_network_sysfs_net_dir.
    """
    victim = lab.trainers[1 % len(lab.trainers)]
    fixture = "/run/ddp-lab-test/sys-class-net"
    # veth: the lab kernel has no dummy driver; both ends stay inside the node.
    setup = (f"ip link add wlp2s0 type veth peer name wlp2s0-peer && ip addr add 192.0.2.2/24 dev wlp2s0 && "
             f"ip link set wlp2s0-peer up && ip link set wlp2s0 up && mkdir -p {fixture}/wlp2s0/wireless && "
             f"echo up > {fixture}/wlp2s0/operstate")
    _exec(lab, victim, "sh", "-c", "ip link del wlp2s0 2>/dev/null; rm -rf /run/ddp-lab-test")
    made = _exec(lab, victim, "sh", "-c", setup)
    try:
        assert made.returncode == 0, made.stderr
        route = _exec(lab, victim, "ip", "-4", "-o", "route", "get", "192.0.2.1").stdout
        assert " dev wlp2s0 " in route, route
        inventory = _trainers_only_inventory(lab, tmp_path, {victim: {
            "wired_network_rendezvous_address": "192.0.2.1", "wired_network_sysfs_net_dir": fixture}})
        with _nodes_untouched(lab):
            rc, out = _provision(lab, inventory=inventory)
            _assert_stopped_before_changes(lab, rc, out)
    finally:
        _exec(lab, victim, "sh", "-c", "ip link del wlp2s0; rm -rf /run/ddp-lab-test")
    _line(_errors(out), "wlp2s0 (WiFi)", "plug in the cable", start=f"{victim} reaches the rendezvous host")


def test_unknown_torch_version(lab: Lab) -> None:
    wheelhouse = REPO / "build" / "wheelhouse"
    before = set(wheelhouse.iterdir()) if wheelhouse.is_dir() else set()
    try:
        with _nodes_untouched(lab):
            rc, out = _provision(lab, "-e", "python_env_torch_version=9.9.9")
            _assert_stopped_before_changes(lab, rc, out)
    finally:
        for new in (set(wheelhouse.iterdir()) if wheelhouse.is_dir() else set()) - before:
            if new.is_dir() and not any(new.iterdir()):
                new.rmdir()  # the empty folder the failed pip download left
    _line(_errors(out), "torch==9.9.9", "cannot be downloaded into the wheelhouse", "(pip: ",
          "fix", "python_env_torch_version", start="controller:")
