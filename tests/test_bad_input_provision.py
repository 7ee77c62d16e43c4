"""Bad input to the provisioning (validate + provision): one line naming host, cause and fix,
and nothing on the nodes changes.

Runs ``ansible-playbook playbooks/validate.yml playbooks/provision.yml`` against the nodes that
tests/labharness.py finds: inside ``molecule verify`` of the default scenario (which lists this
file in its verifier's additional_files_or_dirs) that scenario's containers, else the built-in lab
(``make lab-up``) or ``DDP_LAB_TEST_INVENTORY``. Skips, saying why, only when there are none.

"Nothing changed" is checked two ways: the play recap reports changed=0 for every host, and a
marker the provisioning always (re)creates early in its apply phase (the wired_network local fact
file) is removed before the run and must still be absent after it; the test then restores it.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from labharness import (
    REPO,
    Lab,
    assert_stopped_before_changes,
    errors,
    free_port,
    lab_or_skip,
    node_exec,
    nodes_untouched,
    run_playbooks,
    write_inventory,
)

pytestmark = [pytest.mark.slow, pytest.mark.lab]

PLAYBOOKS = [str(REPO / "playbooks" / "validate.yml"), str(REPO / "playbooks" / "provision.yml")]
FACT_FILE = yaml.safe_load((REPO / "roles/wired_network/defaults/main.yml").read_text())[
    "wired_network_fact_file"]


@pytest.fixture(scope="module")
def lab() -> Lab:
    return lab_or_skip()


# A store port of the matrix's own: a job of the lab on the default port (29400) must not turn every
# case into "port in use" before the check under test is reached. A case's own -e comes later and wins.
STORE_PORT = free_port()


def _provision(lab: Lab, *args: str, inventory: str | None = None) -> tuple[int, str]:
    port = f"rendezvous_port={STORE_PORT}"
    return run_playbooks(lab.env, inventory or lab.inventory, PLAYBOOKS, "-e", port, *args)


def _line(lines: list[str], *needles: str, start: str = "") -> str:
    """An error line that starts with ``start`` (the host) and contains every needle (cause, fix)."""
    hits = [e for e in lines if e.startswith(start) and all(n in e for n in needles)]
    assert hits, (start, needles, lines)
    return hits[0]


def test_unknown_governor(lab: Lab) -> None:
    """An -e value is refused once, before any trainer's task (it was one line per laptop)."""
    with nodes_untouched(lab, FACT_FILE):
        rc, out = _provision(lab, "-e", "cpu_governor_governor=turbo")
        assert_stopped_before_changes(rc, out, lab.trainers, contacted=False)
    found = errors(out)
    assert len(found) == 1, found
    _line(found, "cpu_governor_governor", "'turbo'", "fix", "performance", start="-e cpu_governor_governor=")


def test_torch_version_not_a_version(lab: Lab) -> None:
    with nodes_untouched(lab, FACT_FILE):
        rc, out = _provision(lab, "-e", "python_env_torch_version=latest")
        assert_stopped_before_changes(rc, out, lab.trainers, contacted=False)
    found = errors(out)
    assert len(found) == 1, found
    _line(found, "python_env_torch_version", "'latest'", "fix", start="-e: ")


def test_inventory_without_rendezvous_host(lab: Lab, tmp_path: Path) -> None:
    inventory = write_inventory(lab, tmp_path / "hosts.yml", keep_rendezvous=False)
    with nodes_untouched(lab, FACT_FILE):
        rc, out = _provision(lab, inventory=inventory)
        assert_stopped_before_changes(rc, out, lab.trainers, contacted=False)
    _line(errors(out), "no rendezvous host", "fix", "rendezvous_address", start=f"inventory {inventory}:")


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
    node_exec(lab, victim, "sh", "-c", "ip link del wlp2s0 2>/dev/null; rm -rf /run/ddp-lab-test")
    made = node_exec(lab, victim, "sh", "-c", setup)
    try:
        assert made.returncode == 0, made.stderr
        route = node_exec(lab, victim, "ip", "-4", "-o", "route", "get", "192.0.2.1").stdout
        assert " dev wlp2s0 " in route, route
        inventory = write_inventory(lab, tmp_path / "hosts.yml", {victim: {
            "wired_network_rendezvous_address": "192.0.2.1", "wired_network_sysfs_net_dir": fixture}})
        with nodes_untouched(lab, FACT_FILE):
            rc, out = _provision(lab, inventory=inventory)
            assert_stopped_before_changes(rc, out, lab.trainers)
    finally:
        node_exec(lab, victim, "sh", "-c", "ip link del wlp2s0; rm -rf /run/ddp-lab-test")
    _line(errors(out), "wlp2s0 (WiFi)", "plug in the cable", start=f"{victim} reaches the rendezvous host")


def test_unknown_torch_version(lab: Lab) -> None:
    wheelhouse = REPO / "build" / "wheelhouse"
    before = set(wheelhouse.iterdir()) if wheelhouse.is_dir() else set()
    try:
        with nodes_untouched(lab, FACT_FILE):
            rc, out = _provision(lab, "-e", "python_env_torch_version=9.9.9")
            assert_stopped_before_changes(rc, out, lab.trainers)
    finally:
        for new in (set(wheelhouse.iterdir()) if wheelhouse.is_dir() else set()) - before:
            if new.is_dir() and not any(new.iterdir()):
                new.rmdir()  # the empty folder the failed pip download left
    _line(errors(out), "torch==9.9.9", "cannot be downloaded into the wheelhouse", "(pip: ",
          "fix", "python_env_torch_version", start="controller:")
