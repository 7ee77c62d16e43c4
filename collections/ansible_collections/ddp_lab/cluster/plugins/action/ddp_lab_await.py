"""Action plugin ``ddp_lab_await``: wait for an async task (``async: N``, ``poll: 0``) on the node,
printing a progress line (:func:`progress_line`) every ``interval_s`` while it runs.

Polls ``ansible.builtin.async_status`` of ``jid``; ``what`` names the work in the line. With
``probe_path`` and ``probe_patterns`` (shell globs) the line also counts the patterns that match
an entry of the node's folder ``probe_path`` (``ansible.builtin.find``).

Returns the finished job's result (as its module gave it) plus ``elapsed_s`` and ``polls``, and
removes the job's results file; fails in one line after ``timeout_s`` (the job keeps running).
"""

from __future__ import annotations

import fnmatch
import time

from ansible.errors import AnsibleActionFail, AnsibleError
from ansible.plugins.action import ActionBase
from ansible.utils.display import Display

display = Display()

ARGS = {
    "jid": {"type": "str", "required": True},
    "what": {"type": "str", "required": True},
    "interval_s": {"type": "float", "default": 10.0},
    "timeout_s": {"type": "float", "default": 3600.0},
    "probe_path": {"type": "str", "default": ""},
    "probe_patterns": {"type": "list", "elements": "str", "default": []},
}


def in_place(patterns: list[str], names: list[str]) -> list[str]:
    """The ``patterns`` (shell globs) that match at least one of ``names`` (base names), in order."""
    return [p for p in patterns if any(fnmatch.fnmatch(n, p) for n in names)]


def progress_line(host: str, what: str, elapsed_s: float, done: list[str] | None, total: int) -> str:
    """``<host>  <what>: <k> of <n> in place (<names>) after <s> s``, e.g. ``laptop-a    installing
    torch, numpy into /opt/ddp-lab/venv: 1 of 2 in place (numpy) after 20 s`` (no count when nothing
    is probed)."""
    how_far = ""
    if done is not None and total:
        names = ", ".join(p.split("-")[0].split("*")[0] for p in done)
        how_far = f": {len(done)} of {total} in place" + (f" ({names})" if names else "")
    return f"{host:<12} {what}{how_far} after {elapsed_s:.0f} s"


class ActionModule(ActionBase):
    """See the module docstring."""

    def _status(self, jid: str, task_vars: dict, mode: str = "status") -> dict:
        """async_status of job ``jid`` on the node (``mode: cleanup`` removes its results file)."""
        async_dir = self._remote_expand_user(self.get_shell_option("async_dir", default="~/.ansible_async"))
        res = self._execute_module(module_name="ansible.legacy.async_status",
                                   module_args={"jid": jid, "mode": mode, "_async_dir": async_dir},
                                   task_vars=task_vars)
        if res.get("unreachable"):
            raise AnsibleError(res.get("msg", "unreachable"))
        return res

    def _probe(self, path: str, task_vars: dict) -> list[str] | None:
        """Base names of the entries of the folder ``path``; None when it cannot be read."""
        res = self._execute_module(
            module_name="ansible.builtin.find",
            module_args={"paths": [path], "file_type": "any", "recurse": False},
            task_vars=task_vars)
        if res.get("failed") or res.get("unreachable"):
            return None
        return [f["path"].rsplit("/", 1)[-1] for f in res.get("files", [])]

    def run(self, tmp=None, task_vars=None):
        task_vars = task_vars or {}
        result = super().run(tmp, task_vars)
        _, args = self.validate_argument_spec(argument_spec=ARGS)
        host = task_vars.get("inventory_hostname", "")
        start = time.monotonic()
        polls = 0
        while True:
            polls += 1
            job = self._status(args["jid"], task_vars)
            if job.get("finished") or job.get("failed") and "finished" not in job:
                break
            elapsed = time.monotonic() - start
            if elapsed >= args["timeout_s"]:
                raise AnsibleActionFail(f"{host}: {args['what']} still running after {elapsed:.0f} s "
                                        f"(async job {args['jid']}); raise the timeout or look at the node")
            if polls > 1:  # the first poll is at once: a job done by then prints nothing
                done = None
                if args["probe_path"] and args["probe_patterns"]:
                    names = self._probe(args["probe_path"], task_vars)
                    done = in_place(args["probe_patterns"], names) if names is not None else None
                display.display(progress_line(host, args["what"], elapsed, done, len(args["probe_patterns"])))
            time.sleep(args["interval_s"] if polls > 1 else min(args["interval_s"], 2.0))
        self._status(args["jid"], task_vars, mode="cleanup")  # the job's results file goes (reset.yml)
        for key in ("ansible_job_id", "started", "finished", "results_file", "erased"):
            job.pop(key, None)
        result.update(job)
        result.update({"elapsed_s": round(time.monotonic() - start, 1), "polls": polls})
        return result
