"""Filters of the wired_network role: parse ping output, render the RTT matrix."""

from __future__ import annotations

import re

_RTT = re.compile(r"=\s*[0-9.]+/([0-9.]+)/[0-9.]+")


def ping_rtt_ms(stdout: str) -> float | None:
    """Mean round-trip time in ms from iputils ``ping -q`` output, None when nothing came back.

    Reads the summary line ``rtt min/avg/max/mdev = 0.045/0.061/0.080/0.013 ms``.
    """
    match = _RTT.search(stdout or "")
    return float(match.group(1)) if match else None


def rtt_table(matrix: dict, count: int = 3) -> list[str]:
    """Render ``{from_host: {to_host: ms | None}}`` as fixed-width text lines, one per host.

    The diagonal shows ``-``, a pair without any reply ``x``. Hosts keep the dict's order.
    """
    hosts = list(matrix)
    width = max([len(h) for h in hosts] + [9]) + 2
    lines = [f"RTT in ms (mean of {count} pings), row pings column; x = no reply",
             "from \\ to".ljust(width) + "".join(h.rjust(width) for h in hosts)]
    for src in hosts:
        cells = []
        for dst in hosts:
            value = (matrix.get(src) or {}).get(dst)
            cells.append("-" if src == dst else ("x" if value is None else f"{float(value):.3f}"))
        lines.append(src.ljust(width) + "".join(c.rjust(width) for c in cells))
    return lines


class FilterModule:
    """Ansible filter plugin entry point."""

    def filters(self) -> dict:
        return {"ping_rtt_ms": ping_rtt_ms, "rtt_table": rtt_table}
