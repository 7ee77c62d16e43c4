"""The CPU share of this process and the intra-op thread count that follows from it.

A node's share is the most CPU time per second its processes can get, in CPUs:

    share = min(cgroup CPU bandwidth limit, CPUs in the affinity mask, physical cores)

* **cgroup limit**: the tightest ``quota / period`` of this process's cgroup and every ancestor up
  to the root of the mounted hierarchy -- cgroup v1 ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us``
  (quota ``-1``: none), cgroup v2 ``cpu.max`` (``"max 100000"``: none). A podman container made with
  ``--cpus 0.6`` (the lab), a systemd unit with ``CPUQuota=60%`` or a Kubernetes limit all appear
  here. Which directory is this process's cgroup follows from ``/proc/self/cgroup`` and the cgroup
  mounts of ``/proc/self/mountinfo`` (a container sees its own cgroup as the root of the mount).
* **affinity**: ``os.sched_getaffinity(0)`` (taskset, cpusets).
* **physical cores**: psutil's count when psutil is importable, else ``os.cpu_count()``.
  Hyper-threads share a core's arithmetic units: a worker's GEMMs do not gain from them.

Thread rule (``threads_for``): one intra-op thread per whole CPU of share per local worker, at least
one: ``max(1, floor(share / local_workers))``. More threads than the share make OpenMP's threads
wait for each other at every parallel region while the scheduler throttles the group.

Standard library only (psutil when present), so that the lab can run this file with a bare
``python3`` inside a container and Ansible can run it on a node before ddplab is installed:
``python3 cpushare.py [--local-workers N]`` prints one JSON object (the fields of ``CpuShare`` and
``threads``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

#: A share this close below a whole number counts as that number (0.9999 from a rounded quota).
_EPS = 1e-6


@dataclass(frozen=True)
class CpuShare:
    """The CPU share of a process. ``share``, ``quota`` in CPUs (CPU-seconds per second).

    ``quota`` is None when no cgroup level limits the CPU bandwidth; ``quota_file`` then is None
    too, else the file the tightest limit came from.
    """

    share: float
    quota: float | None
    quota_file: str | None
    affinity: int
    physical_cores: int


@dataclass(frozen=True)
class _Mount:
    root: str  # the cgroup path that the mount point shows (mountinfo field 4)
    point: Path
    version: int  # 1 or 2


def _mounts(mountinfo: str, controller: str = "cpu") -> list[_Mount]:
    """The cgroup mounts that carry ``controller``, from ``/proc/self/mountinfo`` text (the v2
    mount, and the v1 one of that controller)."""
    found = []
    for line in mountinfo.splitlines():
        head, sep, tail = line.partition(" - ")
        fields, rest = head.split(), tail.split()
        if not sep or len(fields) < 5 or len(rest) < 3:
            continue
        fstype, superopts = rest[0], rest[2].split(",")
        if fstype == "cgroup2":
            found.append(_Mount(fields[3], Path(_unescape(fields[4])), 2))
        elif fstype == "cgroup" and controller in superopts:
            found.append(_Mount(fields[3], Path(_unescape(fields[4])), 1))
    return found


def _unescape(text: str) -> str:
    """mountinfo's octal escapes (``\\040`` for a space) decoded."""
    return text.encode().decode("unicode_escape") if "\\" in text else text


def _cgroup_paths(proc_cgroup: str, controller: str = "cpu") -> dict[int, str]:
    """{1: path of the v1 ``controller``, 2: the v2 path} from ``/proc/self/cgroup`` text."""
    paths: dict[int, str] = {}
    for line in proc_cgroup.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        if controllers == "" and parts[0] == "0":
            paths[2] = path
        elif controller in controllers.split(","):
            paths[1] = path
    return paths


def _limit(folder: Path, version: int) -> float | None:
    """The CPU bandwidth limit set in one cgroup folder (CPUs), None when none or unreadable."""
    try:
        if version == 2:
            quota, _, period = (folder / "cpu.max").read_text().strip().partition(" ")
            if quota == "max":
                return None
            return int(quota) / int(period or 100000)
        quota = int((folder / "cpu.cfs_quota_us").read_text())
        period = int((folder / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError, ZeroDivisionError):
        return None
    return quota / period if quota > 0 and period > 0 else None


def _levels(mount: _Mount, path: str) -> list[Path]:
    """The folders of cgroup ``path`` and its ancestors inside ``mount``, innermost first. A path
    outside what the mount shows (another cgroup namespace) gives the mount's root alone."""
    root = mount.root.rstrip("/")
    if path != root and not path.startswith(root + "/"):
        return [mount.point]
    parts = [p for p in path[len(root):].split("/") if p]
    return [mount.point.joinpath(*parts[:i]) for i in range(len(parts), -1, -1)]


def cgroup_folders(controller: str, proc: Path = Path("/proc/self")) -> list[tuple[Path, int]]:
    """The folders (with their cgroup version, 1 or 2) of this process's cgroup and of each
    ancestor, innermost first, in every mounted hierarchy that carries ``controller`` (e.g.
    ``memory``: ddplab.memory reads its limits there); empty when the files cannot be read."""
    try:
        mounts = _mounts((proc / "mountinfo").read_text(), controller)
        paths = _cgroup_paths((proc / "cgroup").read_text(), controller)
    except OSError:
        return []
    return [(folder, mount.version) for mount in mounts if mount.version in paths
            for folder in _levels(mount, paths[mount.version])]


def cgroup_limit(proc: Path = Path("/proc/self")) -> tuple[float | None, str | None]:
    """The tightest CPU bandwidth limit over this process's cgroup and its ancestors.

    Args:
        proc: the ``/proc/<pid>`` folder whose ``cgroup`` and ``mountinfo`` are read.

    Returns:
        (limit in CPUs, the file it came from), or (None, None) when no level sets one or the
        files cannot be read (no cgroup filesystem).
    """
    try:
        mounts = _mounts((proc / "mountinfo").read_text())
        paths = _cgroup_paths((proc / "cgroup").read_text())
    except OSError:
        return None, None
    best: tuple[float | None, str | None] = (None, None)
    for mount in mounts:
        if mount.version not in paths:
            continue
        for folder in _levels(mount, paths[mount.version]):
            limit = _limit(folder, mount.version)
            if limit is not None and (best[0] is None or limit < best[0]):
                name = "cpu.max" if mount.version == 2 else "cpu.cfs_quota_us"
                best = (limit, str(folder / name))
    return best


def physical_cores() -> int:
    """Physical CPU cores of this machine (psutil), logical CPUs when psutil cannot tell."""
    try:
        import psutil
    except ImportError:
        return os.cpu_count() or 1
    return psutil.cpu_count(logical=False) or os.cpu_count() or 1


def affinity() -> int:
    """CPUs this process may run on (``os.sched_getaffinity``; ``os.cpu_count`` where missing)."""
    getter = getattr(os, "sched_getaffinity", None)
    return len(getter(0)) if getter else os.cpu_count() or 1


def read_share(proc: Path = Path("/proc/self")) -> CpuShare:
    """The CPU share of this process (see the module docstring)."""
    quota, quota_file = cgroup_limit(proc)
    cpus, cores = affinity(), physical_cores()
    share = float(min(cpus, cores) if quota is None else min(quota, cpus, cores))
    return CpuShare(round(share, 4), None if quota is None else round(quota, 4), quota_file, cpus, cores)


def threads_for(share: float, local_workers: int = 1) -> int:
    """Intra-op threads per worker: ``max(1, floor(share / local_workers))``.

    Raises:
        ValueError: ``share`` is not a positive finite number or ``local_workers`` < 1.
    """
    if not isinstance(share, (int, float)) or not math.isfinite(share) or share <= 0:
        raise ValueError(f"a CPU share must be a number > 0, got {share!r}")
    if isinstance(local_workers, bool) or not isinstance(local_workers, int) or local_workers < 1:
        raise ValueError(f"local_workers must be an integer >= 1, got {local_workers!r}")
    return max(1, math.floor(share / local_workers + _EPS))


def main(argv: list[str] | None = None) -> int:
    """Print this process's share and thread count as one JSON object; exit 2 on bad arguments."""
    ap = argparse.ArgumentParser(prog="cpushare.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--local-workers", type=int, default=1, help="worker processes on this node (1)")
    args = ap.parse_args(argv)
    share = read_share()
    try:
        threads = threads_for(share.share, args.local_workers)
    except ValueError as exc:
        print(f"cpushare: {exc}", file=sys.stderr)
        return 2
    print(json.dumps({**asdict(share), "threads": threads}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
