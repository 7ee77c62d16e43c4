"""The names under which Ansible's facts hold a network interface: one rule for every role that
looks an interface up in ``ansible_facts`` (validate's interface check, the firewall's subnet)."""

from __future__ import annotations

from typing import Any


def interface_fact_name(ifname: Any) -> str:
    """The key of interface ``ifname`` (a kernel name such as ``enp3s0.10``, ``br-lan``, ``eth0:1``)
    in ``ansible_facts`` (``ansible_<key>`` as a variable).

    ansible-core's rule, in two steps: the Linux network facts list an interface with ``:`` turned
    into ``_`` (``module_utils/facts/network/linux.py``, ``get_interfaces_info``: that is also the
    name in ``ansible_facts.interfaces``), then the fact namespace turns ``-`` into ``_``
    (``module_utils/facts/namespace.py``, ``FactNamespace._underscore``). Every other character,
    the dot of a VLAN interface among them, is kept: ``enp3s0.10`` -> ``enp3s0.10``,
    ``br-lan`` -> ``br_lan``, ``eth0:1`` -> ``eth0_1``.
    """
    return interface_list_name(ifname).replace("-", "_")


def interface_list_name(ifname: Any) -> str:
    """How ``ansible_facts.interfaces`` lists interface ``ifname``: ``:`` turned into ``_`` (the
    first step of :func:`interface_fact_name`), ``eth0:1`` -> ``eth0_1``, ``enp3s0.10`` unchanged."""
    return str(ifname).replace(":", "_")
