"""Complete the nodes' wheelhouse for the nodes' interpreter, not the controller's.

``pip download --python-version X.Y --platform ... --implementation cp --abi cpXY`` picks wheels
for the nodes' Python, but evaluates the environment markers of every dependency with the Python
that runs pip (pip's ``InstallRequirement.match_markers`` passes only ``extra``): a dependency
conditioned on the node's Python version (``foo; python_version >= "3.12"``) is dropped when the
controller runs 3.11, and the offline install on the node then fails. This module reads the
``Requires-Dist`` of every wheel in the wheelhouse, evaluates each marker with the node's own
marker environment (``packaging.markers``, the values the node's probe printed), and downloads
what applies on the node but no wheel there satisfies (``pip download --no-deps`` with the same
target flags), until nothing is missing. Wheels the controller's markers added in excess stay:
the node's own pip (``--no-index --find-links``) ignores them.

CLI: ``python -m ddplab.controller.wheelhouse complete --dest D --env JSON [--extra E] -- PIP_ARGS``
prints ``{changed, added: [requirement, ...]}``; exit code 1 (``error``, one line) when pip cannot
get a missing requirement, 2 on bad input.

The nodes get the wheelhouse as one archive (one transfer instead of one per wheel):
``python -m ddplab.controller.wheelhouse pack --dest D --archive A`` reads the manifest (sha256sum
lines, ``<hex>  <wheel file name>``) on stdin and prints ``{changed, archive, wheels, mb, label}`` (label:
``<n> wheels, <mb> MB``); exit
code 1 (``error``, one line) for a manifest line that is not one, or a wheel it names that is not
in ``D``.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import re
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from collections.abc import Iterable, Mapping, Sequence
from email.parser import Parser
from pathlib import Path
from typing import Any

from packaging.markers import Marker
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name, parse_wheel_filename

MAX_ROUNDS = 50
MANIFEST_NAME = "SHA256SUMS"
_MANIFEST_LINE = re.compile(r"[0-9a-f]{64}  ([^/]+\.whl)")


def wheel_metadata(path: Path) -> tuple[str, str, list[str]]:
    """(name, version, Requires-Dist lines) of the wheel at ``path`` (its ``*.dist-info/METADATA``)."""
    with zipfile.ZipFile(path) as zf:
        meta = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA") and n.count("/") == 1)
        msg = Parser().parsestr(zf.read(meta).decode("utf-8", "replace"))
    return str(msg["Name"]), str(msg["Version"]), list(msg.get_all("Requires-Dist") or [])


def applies(req: Requirement, env: Mapping[str, str], extras: Iterable[str] = ()) -> bool:
    """True when ``req``'s marker holds on the node (``env``: its marker environment), for no extra
    or one of ``extras`` (the extras its requirer was asked with)."""
    if req.marker is None:
        return True
    marker = Marker(str(req.marker))
    return any(marker.evaluate({**env, "extra": e}) for e in ["", *extras])


def missing(folder: Path, env: Mapping[str, str], roots: Sequence[str]) -> list[Requirement]:
    """The requirements (of ``roots`` and of every wheel in ``folder``, as they apply on the node)
    that no wheel in ``folder`` satisfies; several on one name are merged (their specifiers)."""
    have: dict[str, list[str]] = {}
    wanted: dict[str, Requirement] = {}
    extras: dict[str, set[str]] = {}
    reqs = [Requirement(r) for r in roots]
    wheels = sorted(folder.glob("*.whl"))
    for w in wheels:
        name, version, _ = wheel_metadata(w)
        have.setdefault(canonicalize_name(name), []).append(version)
    for r in reqs:
        extras.setdefault(canonicalize_name(r.name), set()).update(r.extras)
    pending = list(reqs)
    for w in wheels:
        name, _, requires = wheel_metadata(w)
        for line in requires:
            req = Requirement(line)
            if applies(req, env, extras.get(canonicalize_name(name), ())):
                extras.setdefault(canonicalize_name(req.name), set()).update(req.extras)
                pending.append(req)
    for req in pending:
        key = canonicalize_name(req.name)
        if key in wanted:
            merged = Requirement(str(wanted[key]))
            merged.specifier &= req.specifier
            merged.marker = None
            wanted[key] = merged
        else:
            plain = Requirement(str(req))
            plain.marker = None
            wanted[key] = plain
    out = []
    for key, req in sorted(wanted.items()):
        if not any(req.specifier.contains(v, prereleases=True) for v in have.get(key, [])):
            out.append(req)
    return out


def _wheel_name(path: Path) -> str:
    return str(canonicalize_name(parse_wheel_filename(path.name)[0]))


def complete(
    dest: Path,
    env: Mapping[str, str],
    roots: Sequence[str],
    pip_args: Sequence[str],
    python: str = sys.executable,
) -> list[str]:
    """Download (``pip download --no-deps`` + ``pip_args``: the target flags and sources of the
    first download) every requirement that applies on the node and is missing from ``dest``, until
    none is; returns what was added (requirement strings). Raises RuntimeError (pip's last line)
    when pip cannot get one, or when the same one stays missing."""
    added: list[str] = []
    for _ in range(MAX_ROUNDS):
        todo = missing(dest, env, roots)
        if not todo:
            return added
        for req in todo:
            if str(req) in added:
                raise RuntimeError(f"{req} is still missing from {dest} after its download")
            argv = [
                python,
                "-m",
                "pip",
                "download",
                "--no-deps",
                "--dest",
                str(dest),
                "--find-links",
                str(dest),
                "--only-binary=:all:",
                "--progress-bar",
                "off",
                *pip_args,
                str(req),
            ]
            proc = subprocess.run(argv, capture_output=True, text=True, check=False)
            if proc.returncode != 0:
                last = (
                    proc.stderr.strip().splitlines() or proc.stdout.strip().splitlines() or ["no output"]
                )[-1]
                raise RuntimeError(
                    f"{req} (needed on the nodes' Python {env.get('python_full_version', '?')}): {last}"
                )
            added.append(str(req))
    raise RuntimeError(f"the wheelhouse {dest} is still incomplete after {MAX_ROUNDS} rounds")


def manifest_text(manifest: Sequence[str]) -> str:
    """The manifest as the file ``SHA256SUMS`` holds it: its lines, each ended by a newline."""
    return "".join(f"{line}\n" for line in manifest)


def archived_manifest(archive: Path) -> str | None:
    """The text of ``SHA256SUMS`` in ``archive``; None when there is no archive, no such member or
    no readable tar."""
    try:
        with tarfile.open(archive, "r:") as tar:
            member = tar.extractfile(MANIFEST_NAME)
            return member.read().decode("utf-8") if member else None
    except (OSError, KeyError, tarfile.TarError, UnicodeDecodeError):
        return None


def pack(dest: Path, manifest: Sequence[str], archive: Path) -> bool:
    """Make ``archive``: an uncompressed tar (wheels are zip files already) of the wheels of
    ``dest`` that ``manifest`` names, in its order, then ``SHA256SUMS`` (``manifest_text``) as the
    last member, so that a node that unpacks it holds the manifest only once every wheel is there.
    Members are plain files at the top level, owned by root (uid and gid 0), mode 0644, with the
    wheels' mtimes. Written to a temporary file beside ``archive``, then renamed; skipped when
    ``archive`` already holds this manifest. Returns whether it was written.

    ``manifest``: sha256sum lines ``<64 hex>  <wheel file name>``. Raises ValueError for a line
    that is not one, FileNotFoundError for a named wheel missing from ``dest``.
    """
    names = []
    for line in manifest:
        match = _MANIFEST_LINE.fullmatch(line)
        if not match:
            raise ValueError(f"not a manifest line (<sha256>  <file>.whl): {line!r}")
        names.append(match.group(1))
    text = manifest_text(manifest)
    if archived_manifest(archive) == text:
        return False
    for name in names:
        if not (dest / name).is_file():
            raise FileNotFoundError(f"{dest / name} is named by the manifest but not in the wheelhouse")

    def owned_by_root(info: tarfile.TarInfo) -> tarfile.TarInfo:
        info.uid = info.gid = 0
        info.uname = info.gname = "root"
        info.mode = 0o644
        return info

    archive.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=archive.parent, prefix=f".{archive.name}.", suffix=".part")
    try:
        raw = os.fdopen(fd, "wb")
        with raw, tarfile.open(fileobj=raw, mode="w:", format=tarfile.PAX_FORMAT) as tar:
            for name in names:
                tar.add(dest / name, arcname=name, recursive=False, filter=owned_by_root)
            data = text.encode("utf-8")
            info = owned_by_root(tarfile.TarInfo(MANIFEST_NAME))
            info.size = len(data)
            info.mtime = max((int((dest / n).stat().st_mtime) for n in names), default=0)
            tar.addfile(info, io.BytesIO(data))
        os.replace(tmp, archive)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return True


def main(argv: list[str] | None = None) -> int:
    """CLI entry point (``complete``, ``pack``); returns the exit code."""
    p = argparse.ArgumentParser(
        prog="python -m ddplab.controller.wheelhouse", description=__doc__.split("\n")[0]
    )
    sub = p.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("complete")
    c.add_argument("--dest", type=Path, required=True)
    c.add_argument("--env", required=True, help="the node's marker environment, JSON")
    c.add_argument("--requirement", action="append", default=[], help="a top-level requirement (repeat)")
    c.add_argument(
        "pip_args", nargs=argparse.REMAINDER, help="-- then pip download's target flags and sources"
    )
    k = sub.add_parser("pack", help="the wheelhouse as one archive for the nodes; the manifest on stdin")
    k.add_argument("--dest", type=Path, required=True, help="the wheelhouse folder")
    k.add_argument("--archive", type=Path, required=True, help="the archive to write")
    args = p.parse_args(argv)
    if args.cmd == "pack":
        return _pack_cli(args.dest, args.archive, sys.stdin.read().splitlines())
    pip_args = args.pip_args[1:] if args.pip_args[:1] == ["--"] else args.pip_args
    try:
        env: Any = json.loads(args.env)
        if not isinstance(env, dict) or "python_version" not in env:
            raise ValueError("not a marker environment (python_version missing)")
    except ValueError as exc:
        print(json.dumps({"changed": False, "error": f"--env: {exc}"}))
        return 2
    try:
        added = complete(args.dest, {str(k): str(v) for k, v in env.items()}, args.requirement, pip_args)
    except (RuntimeError, OSError, zipfile.BadZipFile, StopIteration) as exc:
        print(json.dumps({"changed": False, "error": str(exc) or type(exc).__name__}))
        return 1
    print(json.dumps({"changed": bool(added), "added": added}))
    return 0


def _pack_cli(dest: Path, archive: Path, manifest: list[str]) -> int:
    try:
        changed = pack(dest, manifest, archive)
    except (ValueError, OSError, tarfile.TarError) as exc:
        print(json.dumps({"changed": False, "error": str(exc) or type(exc).__name__}))
        return 1
    mb = round(archive.stat().st_size / 1e6, 1)
    print(json.dumps({"changed": changed, "archive": str(archive), "wheels": len(manifest), "mb": mb,
                      "label": f"{len(manifest)} wheels, {mb} MB"}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
