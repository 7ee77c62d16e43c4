"""One launch (or fault) at a time from a checkout: a lock on the controller, held by an
ansible-playbook run.

``--kind fault`` (kill-node.yml, roles/fault: ``runs/.fault.lock``): one fault at a time, held by
the kill-node play from before its injection to its end, so that each fault is measured alone
(a second fault's play watched from the first's node and called the job over); its refusal names
the fault under way and, for a timed one (``--until``), when it ends.

A launch (playbooks/train.yml, site.yml's train phase) takes the lock before its first check and
gives it back once its agents have started (or its refusal has stopped what it started); a
second launch meanwhile is refused in one line naming the first. The lock is a small JSON file
(``runs/.launch.lock``: the holder's pid and create time, the run ids asked for, since when); its
holder is the ``ansible-playbook`` process that runs the play (the outermost ancestor of this
process whose command line names ansible-playbook), so a play that dies (Ctrl-C, a crash) leaves
a lock whose holder is gone, which the next launch takes over. Taking and giving back happen
under ``flock`` of a guard file beside it, so two launches never both win.

Subcommands (each prints one JSON object on stdout):

``acquire --lock PATH [--what TEXT] [--kind launch|fault] [--until UNIX_S]``
    Take the lock (``changed: true``), or say it is this play's already (``changed: false``).
    Exit code 2, ``error`` one line, when another live launch holds it.
``release --lock PATH``
    Give it back when this play holds it (``changed: true``); no change otherwise.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil


class LockHeld(RuntimeError):
    """Another live launch holds the lock; the message is the one-line refusal."""


def holder_process(start: psutil.Process | None = None) -> psutil.Process:
    """The ansible-playbook process this one runs under: the outermost ancestor (or this process)
    whose command line names ``ansible-playbook`` (Ansible's workers are forks of it and carry the
    same command line); this process's parent when there is none (run by hand)."""
    me = start or psutil.Process()
    found = None
    for proc in [me, *me.parents()]:
        with contextlib.suppress(psutil.Error):
            if any(
                os.path.basename(a) == "ansible-playbook" or a.endswith("/ansible-playbook")
                for a in proc.cmdline()[:2]
            ):
                found = proc
    return found or me.parent() or me


def _alive(doc: dict[str, Any]) -> bool:
    """True when the holder recorded in ``doc`` is still that same process."""
    try:
        proc = psutil.Process(int(doc["pid"]))
        return abs(proc.create_time() - float(doc["ctime"])) < 1.0 and proc.status() != psutil.STATUS_ZOMBIE
    except (psutil.Error, KeyError, TypeError, ValueError):
        return False


def _read(path: Path) -> dict[str, Any] | None:
    try:
        doc = json.loads(path.read_text())
        return doc if isinstance(doc, dict) else None
    except (OSError, ValueError):
        return None


@contextlib.contextmanager
def _guard(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(path.name + ".guard"), "a+") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def refusal(doc: dict[str, Any], now: float | None = None) -> str:
    """The one line a second launch (or fault: ``doc['kind']``) gets while ``doc`` (a live
    holder) holds the lock."""
    now = now or time.time()
    since = float(doc.get("since") or 0.0)
    ago = max(0.0, now - since)
    if doc.get("kind") == "fault":
        until = doc.get("until")
        ends = (
            f", it ends at {time.strftime('%H:%M:%S', time.localtime(float(until)))}"
            f" (in {max(0.0, float(until) - now):.0f} s)"
            if until
            else ", it ends when its recovery is measured"
        )
        return (
            f"another fault is under way: {doc.get('what') or '?'} (kill-node.yml, ansible-playbook pid"
            f" {doc.get('pid')}, since {time.strftime('%H:%M:%S', time.localtime(since))}{ends}); one fault"
            " at a time, so that each is measured alone; nothing was injected; fix: wait until that"
            " kill-node.yml ends, then run this one again"
        )
    what = f" ({doc['what']})" if doc.get("what") else ""
    return (
        f"another launch from this checkout is under way: ansible-playbook pid {doc.get('pid')}{what},"
        f" since {time.strftime('%H:%M:%S', time.localtime(since))} ({ago:.0f} s ago); one launch at a"
        " time (it holds the lock until its agents start); nothing was started; fix: wait for it, then"
        " `ansible-playbook status.yml` shows its job"
    )


def acquire(
    path: Path,
    what: str = "",
    holder: psutil.Process | None = None,
    kind: str = "launch",
    until: float | None = None,
) -> dict[str, Any]:
    """Take the lock at ``path`` for ``holder`` (default :func:`holder_process`); ``kind`` and
    ``until`` (unix s: when the holder's work ends, if known) go into the refusal. Returns
    ``{changed, pid, ...}``; raises LockHeld when another live holder holds it."""
    proc = holder or holder_process()
    with _guard(path):
        doc = _read(path)
        if doc is not None and _alive(doc):
            if int(doc["pid"]) == proc.pid:
                return {**doc, "changed": False}
            raise LockHeld(refusal(doc))
        mine = {
            "pid": proc.pid,
            "ctime": proc.create_time(),
            "since": time.time(),
            "what": what,
            "kind": kind,
            "until": until,
            "took_over": doc.get("pid") if doc else None,
        }
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(mine) + "\n")
        os.replace(tmp, path)
        return {**mine, "changed": True}


def release(path: Path, holder: psutil.Process | None = None) -> dict[str, Any]:
    """Give the lock at ``path`` back when ``holder`` (default :func:`holder_process`) holds it."""
    proc = holder or holder_process()
    with _guard(path):
        doc = _read(path)
        if doc is None or int(doc.get("pid") or -1) != proc.pid:
            return {"changed": False, "held_by": (doc or {}).get("pid")}
        path.unlink(missing_ok=True)
        return {"changed": True}


def main(argv: list[str] | None = None) -> int:
    """CLI entry point (acquire, release); returns the exit code."""
    p = argparse.ArgumentParser(
        prog="python -m ddplab.controller.launch_lock", description=__doc__.split("\n")[0]
    )
    sub = p.add_subparsers(dest="cmd", required=True)
    for name in ("acquire", "release"):
        sp = sub.add_parser(name)
        sp.add_argument("--lock", type=Path, required=True)
        if name == "acquire":
            sp.add_argument("--what", default="")
            sp.add_argument("--kind", choices=("launch", "fault"), default="launch")
            sp.add_argument("--until", type=float, default=None)
    args = p.parse_args(argv)
    try:
        if args.cmd == "acquire":
            out = acquire(args.lock, args.what, kind=args.kind, until=args.until)
        else:
            out = release(args.lock)
    except LockHeld as exc:
        print(json.dumps({"changed": False, "error": str(exc)}))
        return 2
    except OSError as exc:
        print(json.dumps({"changed": False, "error": f"cannot use the launch lock {args.lock}: {exc}"}))
        return 2
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
