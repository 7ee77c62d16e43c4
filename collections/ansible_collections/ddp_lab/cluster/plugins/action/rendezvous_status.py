"""Action plugin ``rendezvous_status``: the supervised services' state on the controller.

Reads ``python -m ddplab.controller.<module> status --port P --state-dir D`` of every service given
in the background, so that status.yml reads the trainers meanwhile: a task without ``started``
starts the reads, a task with it (the start's registered result) collects them.

Options: ``python``, ``pythonpath`` (the checkout's ``train`` folder), ``state_dir`` (the
supervisor's state folder), ``services`` (fact name -> ``{module, port}``), ``started``,
``timeout_s`` (how long a collect waits, default 60).

Start returns ``dir`` and ``reads`` (fact name -> result file). Collect returns ``ansible_facts``:
fact name -> the service's status document. Exit status 0 (running and answering), 1 (running, not
answering) and 3 (not running) are answers; any other, a timeout or output that is not a JSON
object fails the task in one line.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from ansible.errors import AnsibleActionFail
from ansible.plugins.action import ActionBase

ARGS = {
    "python": {"type": "str", "default": ""},
    "pythonpath": {"type": "str", "default": ""},
    "state_dir": {"type": "str", "default": ""},
    "services": {"type": "dict", "default": {}},
    "started": {"type": "dict", "default": {}},
    "timeout_s": {"type": "float", "default": 60.0},
}
ANSWERS = (0, 1, 3)  # running and answering, running but not answering, not running
# argv: OUT CMD...; runs CMD, writes {rc, stdout, stderr} to OUT.tmp and renames it to OUT
WRAPPER = (
    "import json, os, subprocess, sys\n"
    "p = subprocess.run(sys.argv[2:], capture_output=True, text=True)\n"
    "with open(sys.argv[1] + '.tmp', 'w') as f:\n"
    "    json.dump({'rc': p.returncode, 'stdout': p.stdout, 'stderr': p.stderr}, f)\n"
    "os.replace(sys.argv[1] + '.tmp', sys.argv[1])\n"
)


def parse_status(name: str, rc: int, stdout: str, stderr: str) -> dict[str, Any]:
    """The status document of one read; AnsibleActionFail (one line) when it is not an answer."""
    lines = stdout.strip().splitlines()
    if rc not in ANSWERS or not lines:
        last = (stderr.strip().splitlines() or lines or ["no output"])[-1]
        raise AnsibleActionFail(f"reading the {name}'s state failed (exit {rc}): {last}")
    try:
        doc = json.loads(lines[-1])
    except ValueError as exc:
        raise AnsibleActionFail(f"reading the {name}'s state printed no JSON: {lines[-1][:160]}") from exc
    if not isinstance(doc, dict):
        raise AnsibleActionFail(f"reading the {name}'s state printed {type(doc).__name__}, not an object")
    return doc


def start(python: str, pythonpath: str, state_dir: str, services: dict[str, Any]) -> dict[str, Any]:
    """Start every read in the background, each in its own session under :data:`WRAPPER` (its
    result file appears whole); ``{dir: a fresh temporary folder, reads: {fact name: result file}}``."""
    env = dict(os.environ, PYTHONPATH=pythonpath) if pythonpath else None
    folder = tempfile.mkdtemp(prefix="ddp-lab-rdzv-status-")
    reads = {}
    for name, svc in services.items():
        out = str(Path(folder) / f"{name}.json")
        argv = [sys.executable, "-c", WRAPPER, out, python, "-m", f"ddplab.controller.{svc['module']}",
                "status", "--port", str(svc["port"]), "--state-dir", state_dir]
        subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                         env=env, start_new_session=True)
        reads[name] = out
    return {"dir": folder, "reads": reads}


def collect(started: dict[str, Any], timeout_s: float, poll_s: float = 0.05) -> dict[str, Any]:
    """Wait (at most ``timeout_s``) for every read of :func:`start`; fact name -> status document.
    Removes the start's folder."""
    deadline = time.monotonic() + timeout_s
    facts = {}
    try:
        for name, out in started.get("reads", {}).items():
            while not os.path.exists(out):
                if time.monotonic() >= deadline:
                    raise AnsibleActionFail(f"reading the {name}'s state took more than {timeout_s:.0f} s")
                time.sleep(poll_s)
            res = json.loads(Path(out).read_text(encoding="utf-8"))
            facts[name] = parse_status(name, res["rc"], res["stdout"], res["stderr"])
    finally:
        if started.get("dir"):
            shutil.rmtree(started["dir"], ignore_errors=True)
    return facts


class ActionModule(ActionBase):
    """See the module docstring."""

    _requires_connection = False

    def run(self, tmp=None, task_vars=None):
        result = super().run(tmp, task_vars or {})
        _, args = self.validate_argument_spec(argument_spec=ARGS)
        if args["started"]:
            result.update({"changed": False, "ansible_facts": collect(args["started"], args["timeout_s"])})
            return result
        missing = [k for k in ("python", "state_dir", "services") if not args[k]]
        if missing:
            raise AnsibleActionFail(
                f"rendezvous_status: {', '.join(missing)} missing (needed to start the reads)")
        result.update({"changed": False, **start(args["python"], args["pythonpath"], args["state_dir"],
                                                 args["services"])})
        return result
