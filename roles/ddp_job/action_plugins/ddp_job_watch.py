"""Action plugin ``ddp_job_watch``: follow a node's training job and print its progress line.

Runs on the controller, once per trainer (in parallel, like any task). Every ``interval_s`` it runs
``python -m ddplab.status --json`` on the node (read-only: the newest metrics records and
the agent unit's state), prints the node's line right away (``step, loss, val, world size, rank,
tokens/s, restarts, [state]``) and returns when the node's agent is no longer running, when the
node stayed unreachable for ``max_errors`` polls in a row, or after ``timeout_s``.

It never fails the task on the job's outcome: it returns ``state`` (succeeded | failed | absent |
unreachable | timeout) and the last ``progress``/``unit``/``line``/``workers``, and the role decides.

``once: true`` (``status.yml``, ``logs.yml``): one read, nothing printed; ``state`` is the node's
state as read (``running`` too), ``unreachable`` when the node cannot be reached, ``error`` when
the command failed there, with ``error`` holding the one-line reason.
"""

from __future__ import annotations

import json
import time

from ansible.errors import AnsibleConnectionFailure, AnsibleError
from ansible.plugins.action import ActionBase
from ansible.utils.display import Display

display = Display()

ARGS = {
    "out_dir": {"type": "str", "required": True},
    "python": {"type": "str", "required": True},
    "unit": {"type": "str", "default": "ddp-lab-agent"},
    "label": {"type": "str", "default": ""},
    "interval_s": {"type": "float", "default": 10.0},
    "timeout_s": {"type": "float", "default": 86400.0},
    "max_errors": {"type": "int", "default": 6},
    "once": {"type": "bool", "default": False},
}


def first_line(exc: BaseException, limit: int = 160) -> str:
    """The first line of an exception's message (at most ``limit`` characters), or its type's name."""
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0][:limit]


class ActionModule(ActionBase):
    """See the module docstring."""

    TRANSFERS_FILES = False
    _requires_connection = True

    def _poll(self, args: dict, task_vars: dict) -> dict:
        argv = [
            args["python"],
            "-m",
            "ddplab.status",
            "--out-dir",
            args["out_dir"],
            "--unit",
            args["unit"],
            "--host",
            args["label"],
            "--json",
        ]
        res = self._execute_module(
            module_name="ansible.builtin.command", module_args={"argv": argv}, task_vars=task_vars
        )
        if res.get("unreachable"):
            raise AnsibleConnectionFailure(res.get("msg", "unreachable"))
        if res.get("failed") or res.get("rc", 1) != 0:
            err = (res.get("stderr") or res.get("msg") or "").strip().splitlines()
            raise AnsibleError(f"progress command failed: {err[-1] if err else res.get('rc')}")
        return json.loads(res["stdout"].strip().splitlines()[-1])

    def run(self, tmp=None, task_vars=None):
        task_vars = task_vars or {}
        result = super().run(tmp, task_vars)
        _, args = self.validate_argument_spec(argument_spec=ARGS)
        args["label"] = args["label"] or task_vars.get("inventory_hostname", "")
        if args["once"]:
            return self._once(result, args, task_vars)
        start = time.monotonic()
        errors, polls, last = 0, 0, None
        state = "running"
        while True:
            polls += 1
            try:
                last = self._poll(args, task_vars)
                errors = 0
                state = last["state"]
                display.display(last["line"])
            except Exception as exc:  # noqa: BLE001 - a node that vanished is an outcome, not a crash
                errors += 1
                display.display(
                    f"{args['label']:<12} cannot read progress ({errors}/{args['max_errors']}): "
                    f"{first_line(exc)}",
                    color="yellow",
                )
                if errors >= args["max_errors"]:
                    state = "unreachable"
                    break
            if state != "running":
                break
            if time.monotonic() - start >= args["timeout_s"]:
                state = "timeout"
                break
            time.sleep(args["interval_s"])
        result.update(
            {
                "changed": False,
                "state": state,
                "polls": polls,
                "elapsed_s": round(time.monotonic() - start, 1),
                "progress": (last or {}).get("progress", {}),
                "unit": (last or {}).get("unit", {}),
                "line": (last or {}).get("line", ""),
                "workers": (last or {}).get("workers", []),
                # why the node's training stopped: the cause of its newest failure record
                # (divergence | signal | output | error), None when it did not fail
                "stop_cause": (last or {}).get("progress", {}).get("stop_cause"),
            }
        )
        return result

    def _once(self, result: dict, args: dict, task_vars: dict) -> dict:
        """One read of the node's state (see the module docstring: ``once``)."""
        start = time.monotonic()
        try:
            doc = self._poll(args, task_vars)
            state, error = doc["state"], None
        except AnsibleConnectionFailure as exc:
            doc, state, error = {}, "unreachable", first_line(exc, 1000)
        except Exception as exc:  # noqa: BLE001 - reported in the node's row, not a crash
            doc, error = {}, first_line(exc, 1000)
            state = "unreachable" if "unreachable" in error.lower() else "error"
        progress = doc.get("progress", {})
        result.update({"changed": False, "state": state, "error": error, "polls": 1,
                       "elapsed_s": round(time.monotonic() - start, 1), "progress": progress,
                       "unit": doc.get("unit", {}), "line": doc.get("line", ""),
                       "workers": doc.get("workers", []), "stop_cause": progress.get("stop_cause")})
        return result
