"""Action plugin ``ddp_lab_progress``: where a ddp-lab job stands on a node, and whether it
recovered from a fault, for the fault role's plays to wait on.

Runs ``<venv>/bin/python -m ddplab.status --json`` on the node (the node runtime's one job-state
command, read-only: every record of the run's metrics files and the agent unit's state) and
returns its fields under the names the role's tasks use. With ``since`` it passes the injection
(``--since --mode --node --duration-s``) and, with ``wait_s``, polls until the ``phase`` is no
longer ``waiting`` (the loop runs here on the controller, one command per poll).

Options: ``metrics_dir`` (the run's ``<out_dir>/metrics`` on the node, required), ``since``
(unix s), ``duration_s``, ``mode`` (kill-agent), ``node``, ``unit`` (ddp-lab-agent),
``inventory_name`` (copied into every worker as ``node``), ``wait_s`` (0: read once), ``poll_s``
(1), ``python`` (default ``<python_env_prefix>/bin/python``, ``/opt/ddp-lab/venv`` without it).

Returns: ``records``, ``skipped_lines``, ``workers`` (newest record per worker, oldest first),
``agent_state``, ``agent_substate``, ``agent_running``, ``agent_pid``, ``progress`` (ddplab.status's
document: ``step``, ``finished``, ``stop_cause``, ...), ``waited_s``,
``timed_out``, and with ``since`` ``phase`` (waiting | recovered | continued | finished | ended)
and ``measure`` (a summary.json ``faults`` entry measured from this node's records). Fails when
the command fails (no venv, no ddplab, unreadable metrics).
"""

from __future__ import annotations

import json
import os
import time

from ansible.errors import AnsibleActionFail
from ansible.plugins.action import ActionBase
from ansible.template import trust_as_template

ARGS = {
    "metrics_dir": {"type": "path", "required": True},
    "since": {"type": "float"},
    "duration_s": {"type": "float"},
    "mode": {"type": "str", "default": "kill-agent"},
    "node": {"type": "str", "default": ""},
    "unit": {"type": "str", "default": "ddp-lab-agent"},
    "inventory_name": {"type": "str", "default": ""},
    "wait_s": {"type": "float", "default": 0.0},
    "poll_s": {"type": "float", "default": 1.0},
    "python": {"type": "str"},
}


def status_argv(args: dict, python: str) -> list[str]:
    """The ``ddplab.status`` command line of one read."""
    argv = [python, "-m", "ddplab.status", "--out-dir", os.path.dirname(args["metrics_dir"].rstrip("/")),
            "--unit", args["unit"], "--json"]
    if args["since"] is not None:
        argv += ["--since", repr(args["since"]), "--mode", args["mode"], "--node", args["node"] or "?"]
        if args["duration_s"]:
            argv += ["--duration-s", repr(args["duration_s"])]
    return argv


def to_result(doc: dict, inventory_name: str) -> dict:
    """The task result of one ``ddplab.status --json`` document."""
    workers = doc.get("workers") or []
    for w in workers:
        w["node"] = inventory_name or w["host"]
    agent = doc.get("agent") or {}
    out = {"changed": False, "records": doc.get("records", 0), "skipped_lines": doc.get("skipped_lines", 0),
           "workers": workers, "agent_state": agent.get("state", "unknown"),
           "agent_substate": agent.get("substate", "unknown"), "agent_running": bool(agent.get("running")),
           "agent_pid": agent.get("pid", 0), "progress": doc.get("progress") or {}}
    if "phase" in doc:
        out["phase"], out["measure"] = doc["phase"], doc["measure"]
    return out


class ActionModule(ActionBase):
    """See the module docstring."""

    TRANSFERS_FILES = False
    _requires_connection = True

    def _read(self, argv: list[str], task_vars: dict) -> dict:
        """One ``ddplab.status --json`` document from the node; AnsibleActionFail (one line) with its
        last error line."""
        res = self._execute_module("ansible.builtin.command", {"argv": argv}, task_vars=task_vars)
        if res.get("skipped"):  # command does not run in check mode: the task must say check_mode: false
            raise AnsibleActionFail(
                f"{' '.join(argv[:3])} was not run (check mode); the reading task needs check_mode: false"
            )
        if res.get("unreachable") or res.get("failed") or res.get("rc") != 0:
            lines = (res.get("stderr") or res.get("msg") or "").strip().splitlines()
            last = (lines or [res.get("rc")])[-1]
            raise AnsibleActionFail(f"{' '.join(argv[:3])} failed on the node: {last}")
        return json.loads(res["stdout"].strip().splitlines()[-1])

    def run(self, tmp=None, task_vars=None):
        result = super().run(tmp, task_vars)
        args = self.validate_argument_spec(argument_spec=ARGS)[1]
        task_vars = task_vars or {}
        python = args["python"] or self._templar.template(
            trust_as_template("{{ python_env_prefix | default('/opt/ddp-lab/venv') }}/bin/python"))
        argv = status_argv(args, python)
        start = time.monotonic()
        while True:
            out = to_result(self._read(argv, task_vars), args["inventory_name"])
            done = args["since"] is None or out["phase"] != "waiting"
            if done or time.monotonic() - start >= args["wait_s"]:
                break
            time.sleep(max(0.1, args["poll_s"]))
        out["waited_s"] = round(time.monotonic() - start, 3)
        out["timed_out"] = out.get("phase") == "waiting" and args["wait_s"] > 0
        result.update(out)
        return result
