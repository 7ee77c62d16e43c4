"""Filters of the python_env role: wheel platform tags, pip errors, version mismatches, and the
role's rule for its settings (:data:`SETTINGS`: the torch version's form)."""

from __future__ import annotations

import re
from typing import Any

from ansible_collections.ddp_lab.cluster.plugins.module_utils.hostvars import odd_ones
from ansible_collections.ddp_lab.cluster.plugins.module_utils.settings import record

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
    Ties go to the value of the first host in order (module_utils.hostvars.odd_ones).
    """
    found = odd_ones(values)

    def have(value: Any) -> str:
        hosts = [h for h, v in values.items() if v == value]
        return f"{', '.join(hosts)} {'has' if len(hosts) == 1 else 'have'} {value}"

    odd = dict.fromkeys(values[h] for h in found["odd"])  # each value once, in the hosts' order
    return f"{'; '.join(map(have, odd))} ({have(found['reference'])})" if odd else ""


def dist_info_globs(requirements: list[str]) -> list[str]:
    """Globs of the ``*.dist-info`` folders pip leaves in site-packages for pinned requirements
    (``name==version``; the name normalised as in wheel file names: ``-``/``.`` -> ``_``, PEP 427),
    e.g. ``torch==2.13.0`` -> ``torch-2.13.0*.dist-info`` (a local version ``+cpu`` matches too).
    Raises ValueError for a requirement that is not pinned with ``==``.
    """
    out = []
    for req in requirements:
        name, sep, version = str(req).partition("==")
        if not sep or not name.strip() or not version.strip():
            raise ValueError(f"not a pinned requirement (name==version): {req!r}")
        norm = name.strip().replace("-", "_").replace(".", "_")
        out.append(f"{norm}-{version.strip()}*.dist-info")
    return out


def venv_problem(cfg_text: str, rc: object, stdout: str, error: str, node_version: str, prefix: str,
                 python: str) -> str:
    """Why the venv at ``prefix`` must be rebuilt, in one line; "" when it is sound or absent.

    ``cfg_text``: its ``pyvenv.cfg`` ("" when there is no venv: made fresh); ``rc``, ``stdout``,
    ``error``: what ``<prefix>/bin/python -c 'print(platform.python_version())'`` did; the node's
    ``python`` is ``node_version``. A venv whose Python no longer runs (a distro upgrade removed
    it: pip then fails with "Error executing command.") or runs another major.minor than the node's
    Python is rebuilt: it holds only packages the wheelhouse reinstalls.
    """
    if not (cfg_text or "").strip():
        return ""
    cfg = dict((k.strip(), v.strip()) for k, _, v in (ln.partition("=") for ln in cfg_text.splitlines()) if _)
    made = cfg.get("version") or cfg.get("version_info") or "?"
    home = cfg.get("home", "?")
    if str(rc) != "0":
        # the command module says only "Error executing command." for a program it cannot start
        why = [ln for ln in (error or "").strip().splitlines() if "Error executing command" not in ln]
        cause = why[-1].strip() if why else f"{prefix}/bin/python cannot be started"
        return (f"the venv {prefix} was made by Python {made} ({home}), which no longer runs ({cause}):"
                f" rebuilding it with {python} {node_version} from the wheelhouse")
    got = (stdout or "").strip()
    if got.split(".")[:2] != str(node_version).split(".")[:2]:
        return (f"the venv {prefix} runs Python {got}, but {python} is {node_version} (its packages are"
                f" built for {got}): rebuilding it with {python} {node_version} from the wheelhouse")
    return ""


# A release as pip accepts it in torch==X: 2.13.0, 2.13, 2.13.0+cpu, 2.14.0rc1 (PEP 440, the subset
# torch publishes).
TORCH_VERSION = re.compile(r"[0-9]+(\.[0-9]+){1,2}((a|b|rc)[0-9]+)?(\.post[0-9]+)?(\.dev[0-9]+)?"
                           r"(\+[a-z0-9.]+)?")


def torch_version(host: str, version: Any) -> dict:
    """``python_env_torch_version`` is a release number (:data:`TORCH_VERSION`)."""
    version = str(version)
    problem = None if TORCH_VERSION.fullmatch(version) else (
        f"{host}: python_env_torch_version '{version}' is not a version (like 2.13.0);"
        " fix: set it to the torch release to install, without 'torch=='")
    return record("torch_version", problem, f"python_env_torch_version {version}")


# The role's rule for its settings (module_utils/settings.py).
SETTINGS = [{"check": "torch_version", "run": torch_version,
             "reads": {"version": "python_env_torch_version"}}]


class FilterModule:
    """Ansible filter plugin entry point."""

    def filters(self) -> dict:
        return {"manylinux_platforms": manylinux_platforms, "pip_error": pip_error,
                "mismatch_summary": mismatch_summary, "python_env_dist_info_globs": dist_info_globs,
                "python_env_venv_problem": venv_problem}
