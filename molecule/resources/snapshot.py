#!/usr/bin/env python3
"""What a node looks like, for "reset gives it back as it was" (molecule/default, side_effect.yml).

``snapshot.py take`` runs on the node (stdlib only, as root) and prints one JSON document: every
file, folder and symlink under the folders provisioning touches (kind, mode, owner, SHA-256 of the
content or the link's target), users and groups, unit-file states (masks included), transient units,
iptables rules, the cpufreq governors, the installed packages and which package owns each scanned
path. ``snapshot.py compare BEFORE AFTER`` runs on the controller and prints the differences that
are not known churn; exit status 1 when there is any. Packages installed in between are listed, not
counted: provisioning's packages stay after a reset (docs/roles.md), and so do the files they own.
"""

from __future__ import annotations

import argparse
import fnmatch
import glob
import grp
import hashlib
import json
import os
import pwd
import stat
import subprocess
import sys

# Folders scanned: where provisioning writes (roles/*/tasks/main.yml) and where users live.
ROOTS = ("/etc", "/opt", "/var/lib", "/home", "/root", "/usr/local", "/srv")

# Known churn, with its cause: not the project's doing, different on every run.
IGNORE = (
    "/var/lib/apt", "/var/lib/apt/*",        # package lists (apt update_cache)
    "/var/lib/dpkg", "/var/lib/dpkg/*",      # package database (packages may stay)
    "/var/lib/ucf", "/var/lib/ucf/*",        # conffile records of installed packages
    "/var/lib/systemd/*",                    # timers' stamps, random seed, catalog, deb-systemd-helper
    "/var/lib/sudo", "/var/lib/sudo/*",      # sudo's lecture/timestamp records of the sudo account
    "/var/lib/NetworkManager/*",             # NetworkManager's run-time state (timestamps, leases)
    "/var/lib/dhcp/*",                       # DHCP leases
    "/var/lib/private", "/var/lib/private/*",
    "/var/lib/logrotate/*",
    "/etc/ld.so.cache",                      # rebuilt by every package install
    "/home/*/.ansible", "/home/*/.ansible/*",  # Ansible's remote temporary folder of the ssh account
    "/root/.ansible", "/root/.ansible/*",
    # Ansible's async job folder of the sudo account (the folder alone: ddp_lab_await removes each
    # job's results file when the job has finished, a file left in it is a difference)
    "/root/.ansible_async", "/home/*/.ansible_async",
    "/home/*/.cache", "/home/*/.cache/*",
    "/etc/passwd-", "/etc/group-", "/etc/shadow-", "/etc/gshadow-",  # backups shadow-utils writes
    "/etc/subuid-", "/etc/subgid-",
)
# Unit names that come and go on their own (logins, sessions, devices, mounts).
UNIT_IGNORE = ("*.scope", "*.device", "*.mount", "*.swap", "*.slice", "session-*", "user@*",
               "user-runtime-dir@*", "run-*")


def _ignored(path: str, patterns: tuple[str, ...] | None = None) -> bool:
    return any(fnmatch.fnmatchcase(path, p) for p in (IGNORE if patterns is None else patterns))


def _entry(path: str) -> list | None:
    """[kind, mode, uid, gid, content]: content is the SHA-256 of a file, the target of a link."""
    try:
        st = os.lstat(path)
    except OSError:
        return None
    mode = stat.S_IMODE(st.st_mode)
    if stat.S_ISLNK(st.st_mode):
        return ["link", mode, st.st_uid, st.st_gid, os.readlink(path)]
    if stat.S_ISDIR(st.st_mode):
        return ["dir", mode, st.st_uid, st.st_gid, None]
    if stat.S_ISREG(st.st_mode):
        h = hashlib.sha256()
        try:
            with open(path, "rb") as f:
                for block in iter(lambda: f.read(1 << 20), b""):
                    h.update(block)
        except OSError as e:
            return ["file", mode, st.st_uid, st.st_gid, f"unreadable: {e.strerror}"]
        return ["file", mode, st.st_uid, st.st_gid, h.hexdigest()]
    return ["other", mode, st.st_uid, st.st_gid, None]


def _files() -> dict[str, list]:
    out: dict[str, list] = {}
    for root in ROOTS:
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames[:] = [d for d in dirnames if not _ignored(os.path.join(dirpath, d))]
            for name in [dirpath] + [os.path.join(dirpath, n) for n in dirnames + filenames]:
                if not _ignored(name) and name not in out:
                    e = _entry(name)
                    if e is not None:
                        out[name] = e
    return out


def _run(argv: list[str]) -> str | None:
    try:
        return subprocess.run(argv, capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return None


def _packages() -> tuple[list[str], dict[str, str]]:
    """Installed packages, and the package owning each path under ROOTS (dpkg's file lists)."""
    text = _run(["dpkg-query", "-W", "-f", "${Package}\t${db:Status-Abbrev}\n"]) or ""
    installed = sorted(p.split(":")[0] for p, _, s in (ln.partition("\t") for ln in text.splitlines())
                       if s.startswith("ii"))
    owners: dict[str, str] = {}
    for lst in glob.glob("/var/lib/dpkg/info/*.list"):
        pkg = os.path.basename(lst)[:-5].split(":")[0]
        with open(lst, encoding="utf-8", errors="replace") as f:
            for line in f:
                p = line.rstrip("\n")
                if p.startswith(ROOTS):
                    owners[p] = pkg
    return installed, owners


def _units() -> tuple[dict[str, str], list[str]]:
    """Unit-file states (enabled, disabled, masked, ...) and the loaded units without a unit file
    (transient units such as the job's agent), churn excluded."""
    files: dict[str, str] = {}
    for line in (_run(["systemctl", "list-unit-files", "--no-legend", "--no-pager"]) or "").splitlines():
        parts = line.split()
        if len(parts) >= 2:
            files[parts[0]] = parts[1]
    loaded = []
    for line in (_run(["systemctl", "list-units", "--all", "--plain", "--no-legend", "--no-pager"])
                 or "").splitlines():
        parts = line.split()
        if parts and parts[0] not in files and not _ignored(parts[0], UNIT_IGNORE) and "@" not in parts[0]:
            loaded.append(parts[0])
    return files, sorted(loaded)


def rules_of(save_text: str) -> list[str]:
    """The lines of an iptables-save output that make a difference: comments and packet counters
    dropped, and so is a table that holds only built-in chains with policy ACCEPT and no rule
    (the kernel creates it when a tool first lists it, e.g. ufw; it filters nothing, as no table)."""
    out: list[str] = []
    table: list[str] = []
    for ln in save_text.splitlines():
        if not ln or ln.startswith("#"):
            continue
        table.append(ln.split(" [")[0] if ln.startswith(":") else ln)
        if ln == "COMMIT":
            if any(not (x.startswith(("*", ":")) or x == "COMMIT") or
                   (x.startswith(":") and x.split()[1] != "ACCEPT") for x in table):
                out += table
            table = []
    return out + table


def _iptables() -> dict[str, list[str] | None]:
    """Rules of iptables-save and ip6tables-save (rules_of); None where the tool is missing."""
    out: dict[str, list[str] | None] = {}
    for tool in ("iptables-save", "ip6tables-save"):
        text = _run([tool])
        out[tool] = None if text is None else rules_of(text)
    return out


def take() -> dict:
    """The node's snapshot (see the module docstring). Needs root to read every file."""
    installed, owners = _packages()
    units, transient = _units()
    return {
        "files": _files(),
        "users": sorted(p.pw_name for p in pwd.getpwall()),
        "groups": sorted(f"{g.gr_name}:{','.join(sorted(g.gr_mem))}" for g in grp.getgrall()),
        "unit_files": units,
        "transient_units": transient,
        "iptables": _iptables(),
        "governors": {p: open(p).read().strip() for p in sorted(glob.glob(
            "/sys/devices/system/cpu/cpu*/cpufreq/scaling_governor"))},
        "packages": installed,
        "package_files": owners,
    }


def compare(before: dict, after: dict) -> tuple[list[str], list[str]]:
    """(differences, packages added). Differences are lines "<what>: <key>: <before> -> <after>";
    paths owned by a package installed in between are not differences."""
    new_pkgs = sorted(set(after["packages"]) - set(before["packages"]))
    owned_by_new = {p for p, pkg in after.get("package_files", {}).items() if pkg in new_pkgs}
    diffs: list[str] = []

    def dict_diff(what: str, a: dict, b: dict, skip=frozenset()) -> None:
        for key in sorted(set(a) | set(b)):
            if key not in skip and a.get(key) != b.get(key):
                diffs.append(f"{what}: {key}: {a.get(key)} -> {b.get(key)}")

    dict_diff("file", before["files"], after["files"], owned_by_new)
    for what in ("users", "groups", "transient_units", "packages"):
        gone = sorted(set(before[what]) - set(after[what]))
        added = [] if what == "packages" else sorted(set(after[what]) - set(before[what]))
        diffs += [f"{what}: removed {x}" for x in gone] + [f"{what}: added {x}" for x in added]
    dict_diff("unit file", before["unit_files"], after["unit_files"])
    dict_diff("iptables", before["iptables"], after["iptables"])
    dict_diff("governor", before["governors"], after["governors"])
    return diffs, new_pkgs


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("take", help="print this node's snapshot as JSON")
    c = sub.add_parser("compare", help="differences between two snapshots (exit 1 when any)")
    c.add_argument("before")
    c.add_argument("after")
    args = ap.parse_args(argv)
    if args.cmd == "take":
        json.dump(take(), sys.stdout)
        return 0
    with open(args.before) as f:
        before = json.load(f)
    with open(args.after) as f:
        after = json.load(f)
    diffs, new_pkgs = compare(before, after)
    print(f"packages installed since the snapshot (they stay): {', '.join(new_pkgs) or 'none'}")
    for line in diffs:
        print(line)
    print(f"{len(before['files'])} paths, {len(before['users'])} users, "
          f"{len(before['unit_files'])} unit files compared: {len(diffs)} difference(s)")
    return 1 if diffs else 0


if __name__ == "__main__":
    sys.exit(main())
