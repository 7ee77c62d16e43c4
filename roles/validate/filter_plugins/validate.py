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


class FilterModule:
    """Ansible filter plugin entry point."""

    def filters(self) -> dict:
        return {"shared_values": shared_values}
