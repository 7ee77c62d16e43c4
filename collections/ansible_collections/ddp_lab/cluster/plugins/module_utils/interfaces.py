"""The names under which Ansible's facts hold a network interface."""

from __future__ import annotations

from typing import Any


def interface_fact_name(ifname: Any) -> str:
    """The key of interface ``ifname`` in ``ansible_facts``: :func:`interface_list_name` with ``-``
    turned into ``_`` (ansible-core ``module_utils/facts/namespace.py``); a VLAN's dot is kept:
    ``enp3s0.10`` -> ``enp3s0.10``, ``br-lan`` -> ``br_lan``, ``eth0:1`` -> ``eth0_1``."""
    return interface_list_name(ifname).replace("-", "_")


def interface_list_name(ifname: Any) -> str:
    """How ``ansible_facts.interfaces`` lists interface ``ifname``: ``:`` turned into ``_``
    (ansible-core ``module_utils/facts/network/linux.py``)."""
    return str(ifname).replace(":", "_")
