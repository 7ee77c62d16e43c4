"""Filters of the firewall role."""

from __future__ import annotations

import ipaddress


def subnet_of(facts: dict, address: str) -> str:
    """The IPv4 subnet (CIDR) of the interface that holds ``address``, searching every entry of
    Ansible's network facts (``ipv4`` and ``ipv4_secondaries``). ValueError when none holds it."""
    for entry in facts.values():
        if not isinstance(entry, dict):
            continue
        for ipv4 in [entry.get("ipv4", {}), *entry.get("ipv4_secondaries", [])]:
            if isinstance(ipv4, dict) and ipv4.get("address") == address:
                return str(ipaddress.IPv4Interface(f"{ipv4['address']}/{ipv4['netmask']}").network)
    raise ValueError(f"no interface holds {address}")


def ufw_enabled(conf_text: str) -> bool:
    """True when ufw's settings file (/etc/ufw/ufw.conf) says ``ENABLED=yes``."""
    for line in (conf_text or "").splitlines():
        key, _, value = line.strip().partition("=")
        if key.strip() == "ENABLED":
            return value.strip().strip("\"'").lower() == "yes"
    return False


class FilterModule:
    """Ansible filter plugin entry point."""

    def filters(self) -> dict:
        return {"firewall_subnet_of": subnet_of, "firewall_ufw_enabled": ufw_enabled}
