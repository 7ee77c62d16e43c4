"""Filters of the wifi_powersave role."""

from __future__ import annotations

import base64


def wifi_radios_to_block(results: list) -> list[str]:
    """rfkill switch folders of type ``wlan`` whose ``soft`` state is 0 (radio on), from the
    ``results`` of a ``slurp`` loop over ``[{"path": folder}, "type" | "soft"]`` items."""
    attrs: dict[str, dict[str, str]] = {}
    for res in results:
        if res.get("skipped") or "content" not in res:
            continue
        folder, name = res["item"][0]["path"], res["item"][1]
        attrs.setdefault(folder, {})[name] = base64.b64decode(res["content"]).decode().strip()
    return sorted(f for f, a in attrs.items() if a.get("type") == "wlan" and a.get("soft") == "0")


class FilterModule:
    """Ansible filter plugin entry point."""

    def filters(self) -> dict:
        return {"wifi_radios_to_block": wifi_radios_to_block}


