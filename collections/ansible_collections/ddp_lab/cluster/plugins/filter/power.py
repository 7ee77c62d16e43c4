"""Filters of the power role."""

from __future__ import annotations

import re

# cat-config's line before each file: "# " and the file's path (a comment never is just a path)
_FILE_LINE = re.compile(r"^# (/\S+\.conf)$")


def logind_settings(cat_config: str, section: str = "Login") -> dict[str, dict[str, str]]:
    """``{key: {"value", "file"}}`` of every key set in ``[section]`` of ``systemd-analyze
    cat-config systemd/logind.conf`` (every file in the order logind applies them, each after a
    ``# /path`` line): a later assignment wins."""
    merged: dict[str, dict[str, str]] = {}
    path, current = "", None
    for raw in (cat_config or "").splitlines():
        line = raw.strip()
        header = _FILE_LINE.match(line)
        if header:
            path, current = header.group(1), None
        elif not line or line[0] in "#;":
            continue
        elif line.startswith("[") and line.endswith("]"):
            current = line[1:-1]
        elif current == section and "=" in line:
            key, value = (part.strip() for part in line.split("=", 1))
            merged[key] = {"value": value, "file": path}
    return merged


def logind_mismatches(cat_config: str, want: dict) -> list[str]:
    """``"<key>=<value> (<file>)"`` for each key of ``want`` whose merged value differs (``unset``
    when nothing sets it); empty when logind's configuration has every wanted value."""
    merged = logind_settings(cat_config)
    wrong = []
    for key, value in want.items():
        got = merged.get(key)
        if got is None:
            wrong.append(f"{key} unset (no file sets it)")
        elif got["value"] != str(value):
            wrong.append(f"{key}={got['value']} ({got['file']})")
    return wrong


class FilterModule:
    """Ansible filter plugin entry point."""

    def filters(self) -> dict:
        return {"power_logind_settings": logind_settings, "power_logind_mismatches": logind_mismatches}
