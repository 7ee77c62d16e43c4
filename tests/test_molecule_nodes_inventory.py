"""Inventory plugin ddp_lab_nodes (molecule/resources/inventory_plugins): the molecule lab nodes'
ansible_host and lab_container as literal values, for any number of nodes."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
PLUGINS = REPO / "molecule" / "resources" / "inventory_plugins"
PLUGIN_CONFIG = REPO / "molecule" / "resources" / "inventory" / "ddp_lab_nodes.yml"


@pytest.fixture(scope="module")
def plugin():
    import ddp_lab_nodes

    return ddp_lab_nodes


def test_five_nodes_get_the_labs_fixed_addresses(plugin):
    hosts = [f"h4-laptop-{x}" for x in "abcde"]
    assert plugin.node_vars(hosts, "h4", "10.89.64") == {
        h: {"ansible_host": f"10.89.64.{11 + i}", "lab_container": h} for i, h in enumerate(hosts)
    }


def test_the_address_follows_the_name_not_the_order(plugin):
    assert plugin.node_vars(["mol-laptop-e", "mol-laptop-a"], "mol", "10.89.211") == {
        "mol-laptop-e": {"ansible_host": "10.89.211.15", "lab_container": "mol-laptop-e"},
        "mol-laptop-a": {"ansible_host": "10.89.211.11", "lab_container": "mol-laptop-a"},
    }


@pytest.mark.parametrize(
    ("host", "why"),
    [
        ("x-laptop-a", "does not start with h4-"),
        ("h4-laptop-ab", "not a lab node's name"),
        ("h4-desk", "not a lab"),
    ],
)
def test_a_host_not_named_as_a_lab_node_is_an_error(plugin, host, why):
    with pytest.raises(ValueError, match=why) as err:
        plugin.node_vars([host], "h4", "10.89.64")
    assert f"{host} is not a molecule lab node" in str(err.value) and "DDP_LAB_MOLECULE_NAME" in str(
        err.value
    )


def _inventory(tmp_path: Path, hosts: list[str], **env: str) -> subprocess.CompletedProcess:
    """`ansible-inventory --list` of a folder as molecule makes it: ansible_inventory.yml (the
    platforms in group trainers) and the linked ddp_lab_nodes.yml, read in that order."""
    folder = tmp_path / "inventory"
    folder.mkdir()
    group = {"hosts": dict.fromkeys(hosts, {"ansible_connection": "ssh"})}
    (folder / "ansible_inventory.yml").write_text(yaml.safe_dump({"all": group, "trainers": group}))
    (folder / "ddp_lab_nodes.yml").symlink_to(PLUGIN_CONFIG)
    run_env = {k: v for k, v in os.environ.items() if not k.startswith(("ANSIBLE_", "DDP_LAB_MOLECULE_"))}
    run_env.update(
        ANSIBLE_INVENTORY_PLUGINS=str(PLUGINS), ANSIBLE_INVENTORY_ANY_UNPARSED_IS_FAILED="1", **env
    )
    cli = Path(sys.executable).with_name("ansible-inventory")
    return subprocess.run(
        [str(cli), "-i", str(folder), "--list"], env=run_env, capture_output=True, text=True, check=False
    )


def test_ansible_inventory_lists_literal_values(tmp_path):
    hosts = [f"h4-laptop-{x}" for x in "abcde"]
    proc = _inventory(tmp_path, hosts, DDP_LAB_MOLECULE_NAME="h4", DDP_LAB_MOLECULE_NET="10.89.64")
    assert proc.returncode == 0, proc.stderr
    hostvars = json.loads(proc.stdout)["_meta"]["hostvars"]
    # plain strings, as a YAML inventory's (testinfra and tests/labharness.py read them here)
    assert {h: (v["ansible_host"], v["lab_container"]) for h, v in hostvars.items()} == {
        h: (f"10.89.64.{11 + i}", h) for i, h in enumerate(hosts)
    }


def test_ansible_inventory_defaults_to_the_mol_prefix_and_subnet(tmp_path):
    proc = _inventory(tmp_path, ["mol-laptop-a", "mol-laptop-c"])
    assert proc.returncode == 0, proc.stderr
    hostvars = json.loads(proc.stdout)["_meta"]["hostvars"]
    assert hostvars["mol-laptop-c"]["ansible_host"] == "10.89.211.13"


def test_ansible_inventory_fails_on_a_wrong_prefix(tmp_path):
    proc = _inventory(tmp_path, ["mol-laptop-a"], DDP_LAB_MOLECULE_NAME="h4")
    assert proc.returncode != 0
    assert "mol-laptop-a is not a molecule lab node (h4-laptop-a, h4-laptop-b, ..." in proc.stderr


def test_the_cpu_quotas_and_link_of_the_environment_become_host_variables(tmp_path):
    """DDP_LAB_MOLECULE_CPUS / _LINK_MBIT (what the prepare step gives the nodes): lab_cpus and
    ddp_job_threads null per node in address order, lab_link_mbit; none without them."""
    hosts = ["mol-laptop-c", "mol-laptop-a", "mol-laptop-b"]
    proc = _inventory(tmp_path, hosts, DDP_LAB_MOLECULE_CPUS="0.6,0.6,0.3", DDP_LAB_MOLECULE_LINK_MBIT="1000")
    assert proc.returncode == 0, proc.stderr
    hostvars = json.loads(proc.stdout)["_meta"]["hostvars"]
    got = {h: (v["lab_cpus"], v["ddp_job_threads"], v["lab_link_mbit"]) for h, v in hostvars.items()}
    assert got == {"mol-laptop-a": (0.6, None, 1000), "mol-laptop-b": (0.6, None, 1000),
                   "mol-laptop-c": (0.3, None, 1000)}
    (tmp_path / "inventory").rename(tmp_path / "first")
    proc = _inventory(tmp_path, hosts)
    hostvars = json.loads(proc.stdout)["_meta"]["hostvars"]
    assert not {"lab_cpus", "ddp_job_threads", "lab_link_mbit"} & set(hostvars["mol-laptop-a"])


def test_a_malformed_quota_in_the_environment_is_one_line(plugin):
    with pytest.raises(ValueError, match=r"^DDP_LAB_MOLECULE_CPUS / _LINK_MBIT: LAB_CPUS has 2 shares for"):
        plugin.node_vars(["mol-laptop-a", "mol-laptop-b", "mol-laptop-c"], "mol", "10.89.211", "0.6,0.3")
    with pytest.raises(ValueError, match=r"LAB_CPUS=0.6,x: 'x' is not a CPU share"):
        plugin.node_vars(["mol-laptop-a"], "mol", "10.89.211", "0.6,x")
