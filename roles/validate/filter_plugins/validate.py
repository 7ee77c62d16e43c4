"""Filters of the validate role."""

from __future__ import annotations


def shared_values(values: dict) -> list[str]:
    """Groups of keys that map to the same value, as text: ``["a and b share 10.0.0.5"]``.

    ``values``: ``{host: value}``; None and empty values are ignored. Order follows the dict.
    """
    seen: dict[str, list[str]] = {}
    for key, value in values.items():
        if value in (None, ""):
            continue
        seen.setdefault(str(value), []).append(str(key))
    return [f"{' and '.join(keys)} share {value}" for value, keys in seen.items() if len(keys) > 1]


def connection_targets(hosts: list, hostvars) -> dict:
    """``{host: machine}``: each host's ``ansible_host``, or its inventory name when unset."""
    targets = {}
    for host in hosts:
        value = hostvars[host].get("ansible_host") if host in hostvars else None
        targets[host] = value or host
    return targets


class FilterModule:
    """Ansible filter plugin entry point."""

    def filters(self) -> dict:
        return {"shared_values": shared_values, "connection_targets": connection_targets}
