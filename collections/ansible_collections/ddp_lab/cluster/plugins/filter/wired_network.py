"""Filters of the wired_network role: parse ping output, render the RTT matrix (rich)."""

from __future__ import annotations

import io
import re

from rich import box
from rich.console import Console
from rich.table import Table
from rich.text import Text

_RTT = re.compile(r"=\s*[0-9.]+/([0-9.]+)/[0-9.]+")


def ping_rtt_ms(stdout: str) -> float | None:
    """Mean round-trip time in ms from iputils ``ping -q``'s ``rtt min/avg/max/mdev = ...`` line,
    None when nothing came back."""
    match = _RTT.search(stdout or "")
    return float(match.group(1)) if match else None


def rtt_table(matrix: dict, count: int = 3) -> list[str]:
    """``{from_host: {to_host: ms | None}}`` as text lines: a title, the column heads, one row per
    host in the dict's order (``-`` on the diagonal, ``x`` for no reply)."""
    hosts = list(matrix)
    table = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False)
    table.add_column("from \\ to")
    for h in hosts:
        table.add_column(h, justify="right")
    for src in hosts:
        cells = []
        for dst in hosts:
            value = (matrix.get(src) or {}).get(dst)
            cells.append("-" if src == dst else ("x" if value is None else f"{float(value):.3f}"))
        table.add_row(Text(src), *cells)
    console = Console(file=io.StringIO(), width=1000, color_system=None, force_terminal=False)
    console.print(table)
    title = f"RTT in ms (mean of {count} pings), row pings column; x = no reply"
    return [title] + [line.rstrip() for line in console.file.getvalue().splitlines() if line.strip()]


# The role's rules for its settings (module_utils/settings.py).
SETTINGS = [{"name": "wired_network_min_speed_mbps", "min": 0},
            {"name": "wired_network_ping_count", "min": 1}]


class FilterModule:
    """Ansible filter plugin entry point."""

    def filters(self) -> dict:
        return {"ping_rtt_ms": ping_rtt_ms, "rtt_table": rtt_table}
