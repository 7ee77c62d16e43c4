"""Filters of the python_env role: wheel platform tags, pip errors, version mismatches."""

from __future__ import annotations

from collections import Counter

# Legacy manylinux names and the glibc minor version each one stands for (PEP 600).
_LEGACY = {17: "manylinux2014", 12: "manylinux2010", 5: "manylinux1"}


def manylinux_platforms(glibc: str, machine: str) -> list[str]:
    """Wheel platform tags a node with glibc ``glibc`` (e.g. ``"2.36"``) on ``machine`` accepts.

    Newest first: ``manylinux_2_36_x86_64 ... manylinux_2_5_x86_64`` plus the legacy aliases
    (PEP 600 / PEP 599). Raises ValueError for a version that is not ``2.N``.
    """
    major, _, minor = glibc.partition(".")
    if major != "2" or not minor.isdigit():
        raise ValueError(f"not a glibc 2.x version: {glibc!r}")
    tags = []
    for m in range(int(minor), 4, -1):
        tags.append(f"manylinux_2_{m}_{machine}")
        if m in _LEGACY:
            tags.append(f"{_LEGACY[m]}_{machine}")
    return tags


def pip_error(stderr: str) -> str:
    """The first ``ERROR:`` line of pip's stderr without the prefix (else its last line)."""
    lines = [ln.strip() for ln in (stderr or "").splitlines() if ln.strip()]
    for line in lines:
        if line.startswith("ERROR:"):
            return line[len("ERROR:"):].strip()
    return lines[-1] if lines else "no output"


def mismatch_summary(values: dict) -> str:
    """Describe which hosts differ from the most common value; ``""`` when all are equal.

    ``values``: ``{host: str}``. Example: ``"laptop-c has 3.12 (laptop-a, laptop-b have 3.11)"``.
    Ties go to the value of the first host in order.
    """
    counts = Counter(values.values())
    if len(counts) <= 1:
        return ""
    order = list(dict.fromkeys(values.values()))
    common = max(order, key=lambda v: (counts[v], -order.index(v)))
    odd = [v for v in order if v != common]
    parts = []
    for value in odd:
        hosts = [h for h, v in values.items() if v == value]
        parts.append(f"{', '.join(hosts)} {'has' if len(hosts) == 1 else 'have'} {value}")
    majority = [h for h, v in values.items() if v == common]
    return (f"{'; '.join(parts)} ({', '.join(majority)} "
            f"{'has' if len(majority) == 1 else 'have'} {common})")


class FilterModule:
    """Ansible filter plugin entry point."""

    def filters(self) -> dict:
        return {"manylinux_platforms": manylinux_platforms, "pip_error": pip_error,
                "mismatch_summary": mismatch_summary}
