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


def pip_error(stderr: str, stdout: str = "") -> str:
    """One line saying why ``pip download``/``pip install`` failed, from its stderr and stdout
    (pip prints the explanation of a resolution conflict on stdout).

    Prefers pip's "Could not find a version that satisfies ..." line (it lists the versions on
    offer); otherwise names packages without a matching distribution and any pip constraint
    (pip.conf / PIP_CONSTRAINT) that excluded the request; otherwise the first ``ERROR:`` line,
    else the last line.
    """
    lines = [ln.strip() for ln in f"{stdout or ''}\n{stderr or ''}".splitlines() if ln.strip()]
    errors = [ln[len("ERROR:"):].strip() for ln in lines if ln.startswith("ERROR:")]
    for err in errors:
        if err.startswith("Could not find a version that satisfies"):
            return err
    parts = []
    for i, line in enumerate(lines):
        if "no matching distributions available" in line and i + 1 < len(lines):
            parts.append(f"no matching distribution of {lines[i + 1]} for the nodes' Python/platform")
        if line.startswith("The user requested (constraint)"):
            parts.append(f"pip constraint {line.split(')', 1)[1].strip()} excludes it")
    if parts:
        return "; ".join(parts)
    if errors:
        return errors[0]
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
