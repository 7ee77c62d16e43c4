"""Interface fact names as ansible-core really makes them (issue 27 item 11): a VLAN interface
(``enp3s0.10``) as the wired route was looked up as ``ansible_enp3s0_10`` by the firewall filter
and validate's interface check, but Ansible keeps the dot (only ``-`` becomes ``_``, and ``:`` in
the interfaces list). The facts here are gathered by ansible's own setup module inside a network
namespace of the test's own, holding interfaces named like a VLAN, a bridge and an alias label
(veth pairs: this kernel has no 8021q or dummy devices; the names are what the rule reads)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from ansible_collections.ddp_lab.cluster.plugins.action import validate_check as VC
from ansible_collections.ddp_lab.cluster.plugins.filter import firewall as FW
from ansible_collections.ddp_lab.cluster.plugins.module_utils import interfaces

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


@pytest.fixture(scope="module")
def facts(tmp_path_factory):
    """ansible_facts (network subset) of a namespace with enp3s0.10 (10.10.0.5/24, label
    enp3s0.10:1 for 10.20.0.5/16) and br-lan (192.168.7.2/24)."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("needs root and iproute2 to make a network namespace")
    ns = f"ddpt-{uuid.uuid4().hex[:8]}"
    try:
        _ip("netns", "add", ns)
    except subprocess.CalledProcessError as exc:
        pytest.skip(f"no network namespaces here: {exc.stderr.strip()}")
    try:
        _ip("-n", ns, "link", "add", "enp3s0.10", "type", "veth", "peer", "name", "br-lan")
        _ip("-n", ns, "addr", "add", "10.10.0.5/24", "dev", "enp3s0.10")
        _ip("-n", ns, "addr", "add", "10.20.0.5/16", "dev", "enp3s0.10", "label", "enp3s0.10:1")
        _ip("-n", ns, "addr", "add", "192.168.7.2/24", "dev", "br-lan")
        for dev in ("enp3s0.10", "br-lan"):
            _ip("-n", ns, "link", "set", dev, "up")
        args = tmp_path_factory.mktemp("facts") / "args.json"
        args.write_text(json.dumps({"ANSIBLE_MODULE_ARGS": {"gather_subset": ["!all", "!min", "network"]}}))
        # ansible-core's own setup module, run as a module runs on a node
        argv = ["ip", "netns", "exec", ns, sys.executable, "-m", "ansible.modules.setup", str(args)]
        out = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=True)
        raw = json.loads(out.stdout)["ansible_facts"]
        # ansible_facts: the keys without their ansible_ prefix (ansible.vars.clean.namespace_facts)
        from ansible.vars.clean import namespace_facts

        return namespace_facts(raw)["ansible_facts"]
    finally:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def test_ansible_keeps_the_dot_and_the_rule_names_every_interface(facts):
    assert "enp3s0.10" in facts["interfaces"] and "br-lan" in facts["interfaces"], facts["interfaces"]
    assert facts["enp3s0.10"]["ipv4"]["address"] == "10.10.0.5", sorted(facts)
    assert "enp3s0_10" not in facts and "br_lan" in facts
    for name in ("enp3s0.10", "br-lan", "lo"):
        entry = facts[interfaces.interface_fact_name(name)]
        assert entry["device"] == name
        assert interfaces.interface_list_name(name) in facts["interfaces"]


def test_firewall_finds_the_subnet_of_a_vlan_interface(facts):
    # failed before: "no interface holds 10.10.0.5" (looked up as enp3s0_10)
    assert FW.subnet_of(facts, "10.10.0.5") == "10.10.0.0/24"
    assert FW.subnet_of(facts, "10.20.0.5") == "10.20.0.0/16"
    assert FW.subnet_of(facts, "192.168.7.2") == "192.168.7.0/24"


def test_validate_interface_check_reads_the_vlan_interface(facts):
    ok = VC.interface("n0", "enp3s0.10", facts, "enp3s0.10", "10.10.0.5")
    assert ok["status"] == "ok", ok
    assert ok["detail"] == "wired_network_ifname enp3s0.10 exists (10.10.0.5)"
    wrong = VC.interface("n0", "br-lan", facts, "enp3s0.10", "10.10.0.5")
    assert wrong["status"] == "fail" and "(192.168.7.2)" in wrong["detail"], wrong
