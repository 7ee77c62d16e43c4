"""Inventory plugin ``ddp_lab_nodes``: the molecule lab nodes' fixed addresses, as literal values.

The molecule scenarios' nodes are the platforms ``<prefix>-laptop-a``, ``<prefix>-laptop-b``, ...
(.config/molecule/config.yml, or a scenario's own list, e.g. molecule/nodes5) at fixed addresses of
the scenario network (the platforms' ``ip``). This plugin gives every host of the group its
``ansible_host`` (that address) and ``lab_container`` (its container) for any number of nodes, with
the rule lab/lab.py gives the built-in lab (``node_index``, ``node_address``: host number 11 + the
node's position). The values are literals computed once while the inventory is read: a task
delegated to another node renders the delegating host's variables, so a per-host template (one
naming ``inventory_hostname``) would name the wrong node.
"""

from __future__ import annotations

import importlib
from functools import cache
from types import ModuleType

from ansible.errors import AnsibleParserError
from ansible.plugins.inventory import BaseInventoryPlugin
from ansible.template import trust_as_template

DOCUMENTATION = r"""
name: ddp_lab_nodes
short_description: Fixed addresses and container names of the molecule scenarios' lab nodes
description:
  - For each host of O(group) (the molecule platforms C(<prefix>-laptop-<letter>)) sets
    C(ansible_host) to the node's fixed address on the scenario network and C(lab_container) to its
    container's name, as literal host variables, for any number of nodes.
  - The address is the one C(lab/lab.py) gives a lab node (host number 11 + the node's position,
    C(node_address)); the platforms' C(ip) must match it.
  - Reads the hosts that the inventory sources read before it made; in a molecule inventory folder
    the generated C(ansible_inventory.yml) sorts before C(ddp_lab_nodes.yml).
options:
  plugin:
    description: The name of this plugin.
    required: true
    choices: [ddp_lab_nodes]
  name_prefix:
    description: The prefix of the scenario's container names (C(<prefix>-laptop-a)).
    type: str
    default: mol
    env:
      - name: DDP_LAB_MOLECULE_NAME
  subnet:
    description: The first three octets of the scenario network's /24 (C(10.89.211) for 10.89.211.0/24).
    type: str
    default: 10.89.211
    env:
      - name: DDP_LAB_MOLECULE_NET
  group:
    description: The group of the lab nodes.
    type: str
    default: trainers
  cpus:
    description:
      - The nodes' CPU quotas (C(0.6,0.6,0.3), one per node in address order, or one for all), which the
        scenarios' prepare step gives them (C(lab/lab.py limits)). Each node gets C(lab_cpus) and
        C(ddp_job_threads=null) (its workers follow the share, ddplab.cpushare), as C(make lab-up
        LAB_CPUS=...) writes them for the lab. Empty - no quotas.
    type: str
    default: ""
    env:
      - name: DDP_LAB_MOLECULE_CPUS
  link_mbit:
    description: The rate every node's link is shaped to (C(lab_link_mbit)); empty - not shaped.
    type: str
    default: ""
    env:
      - name: DDP_LAB_MOLECULE_LINK_MBIT
"""

EXAMPLES = r"""
# molecule/resources/inventory/ddp_lab_nodes.yml, linked into each scenario's inventory
plugin: ddp_lab_nodes
"""

@cache
def _lab() -> ModuleType:
    """lab/lab.py, the module ``lab`` (the venv's path holds this checkout's lab/: Makefile, venv): the
    one home of the lab nodes' names and addresses."""
    return importlib.import_module("lab")


def node_vars(
    hosts: list[str], name_prefix: str, subnet: str, cpus: str = "", link_mbit: str = ""
) -> dict[str, dict[str, object]]:
    """``ansible_host`` and ``lab_container`` of each molecule lab node of ``hosts``, and the limits
    the prepare step gives them.

    Args:
        hosts: inventory host names, each ``<name_prefix>-laptop-<letter>``.
        name_prefix: the scenario's prefix (DDP_LAB_MOLECULE_NAME).
        subnet: the first three octets of the scenario network's /24 (DDP_LAB_MOLECULE_NET).
        cpus: DDP_LAB_MOLECULE_CPUS (lab/node_limits.py's form of LAB_CPUS); "" for none.
        link_mbit: DDP_LAB_MOLECULE_LINK_MBIT; "" for none.

    Returns:
        {host: {"ansible_host": its fixed address, "lab_container": host}}, plus ``lab_cpus`` and
        ``ddp_job_threads`` (None) for a node with a quota, ``lab_link_mbit`` when shaped.

    Raises:
        ValueError: a host is not named as a lab node, or the subnet has no room for it, or a limit
            is malformed; the message names the host or setting and what to fix.
    """
    lab = _lab()
    try:
        shares = lab.node_limits.parse_cpus(cpus, lab.host_cpus())
        shares = lab.node_limits.shares_for(shares, len(hosts)) if shares else (None,) * len(hosts)
        rate = lab.node_limits.parse_link_mbit(link_mbit)
    except lab.node_limits.LimitError as exc:
        raise ValueError(f"DDP_LAB_MOLECULE_CPUS / _LINK_MBIT: {exc}") from None
    result = {}
    for host in hosts:
        node = host.removeprefix(f"{name_prefix}-")
        try:
            if node == host:
                raise lab.LabError(f"its name does not start with {name_prefix}-")
            address = lab.node_address(f"{subnet}.0/24", lab.node_index(node))
        except (lab.LabError, ValueError) as exc:
            first = f"{name_prefix}-{lab.NODE_NAME_PREFIX}"
            raise ValueError(
                f"{host} is not a molecule lab node ({first}a, {first}b, ... on {subnet}.0/24): {exc}; "
                "fix the platforms' names, DDP_LAB_MOLECULE_NAME or DDP_LAB_MOLECULE_NET"
            ) from exc
        result[host] = {"ansible_host": address, "lab_container": host}
    order = sorted(result, key=lambda h: lab.node_index(h.removeprefix(f"{name_prefix}-")))
    for host, share in zip(order, shares, strict=True):
        if share is not None:
            result[host].update(lab_cpus=share, ddp_job_threads=None)
        if rate:
            result[host]["lab_link_mbit"] = rate
    return result


class InventoryModule(BaseInventoryPlugin):
    """Sets the literal ``ansible_host`` and ``lab_container`` of the molecule lab nodes."""

    NAME = "ddp_lab_nodes"

    def verify_file(self, path: str) -> bool:
        return super().verify_file(path) and path.endswith(("ddp_lab_nodes.yml", "ddp_lab_nodes.yaml"))

    def parse(self, inventory, loader, path, cache=True):  # noqa: ANN001, ANN201 (Ansible's signature)
        super().parse(inventory, loader, path, cache)
        self._read_config_data(path)
        group = self.get_option("group")
        if group not in inventory.groups:
            raise AnsibleParserError(
                f"{path}: no group {group!r} yet: the inventory that lists the lab nodes must be read "
                "before this file (molecule's ansible_inventory.yml sorts first in the folder)"
            )
        hosts = [host.name for host in inventory.groups[group].get_hosts()]
        try:
            values = node_vars(hosts, self.get_option("name_prefix"), self.get_option("subnet"),
                               self.get_option("cpus"), self.get_option("link_mbit"))
        except ValueError as exc:
            raise AnsibleParserError(f"{path}: {exc}") from None
        # Trusted as a YAML inventory's text is (they hold no template): `ansible-inventory --list`
        # shows them as plain strings, where testinfra and tests/labharness.py read them.
        for host, host_vars in values.items():
            for key, value in host_vars.items():
                trusted = trust_as_template(value) if isinstance(value, str) else value
                inventory.set_variable(host, key, trusted)
