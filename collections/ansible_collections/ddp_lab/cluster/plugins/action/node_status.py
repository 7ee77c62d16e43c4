"""Action plugin ``node_status``: the one poller of a node's job, ``python -m ddplab.status --json``.

Runs on the controller for one node, as the training user (become). Returns ddplab.status's
document (``state``: :data:`ddplab.runstate.JOB_STATES`, ``run_state``, ``unit_holds_run``,
``current_run``, ``unit``, ``agent``, ``progress``, ``line``, ``workers`` with ``node`` set to
``label``, ``records``, ``skipped_lines``, ``run_dir``, ``endpoints``) plus ``error`` (a read's one-line
reason, else None), ``polls``, ``elapsed_s`` and ``stop_cause`` (``progress.stop_cause``). Modes:

- ``once``: one read, nothing printed, never a failed task: a node that cannot be reached is
  ``state: unreachable``, one whose ddplab.status fails ``state: error`` (its unit then read from
  systemd: ``UNIT_PROPS``). ``probe_timeout_s`` > 0 with a plain ssh connection: the SSH port is
  probed first (:meth:`ActionModule._probe`); no answer in that time is unreachable.
- ``watch``: a read every ``interval_s``, the progress line printed, until the agent no longer runs
  (``state`` its end), ``max_errors`` reads in a row failed (``unreachable``) or ``timeout_s``
  passed (``timeout``). ``report_dir`` (the run's folder on the controller): the live report
  (:class:`LiveReport`). Never fails on the job's outcome.
- ``until``: the fault injected at ``since`` (``fault``, ``node``, ``duration_s``) measured from this
  node's records every ``interval_s`` until its ``phase`` is no longer ``waiting`` or ``timeout_s``
  passed: also ``phase``, ``measure`` (a summary.json ``faults`` entry), ``timed_out``, ``waited_s``.
  A read that fails fails the task (one line).
"""

from __future__ import annotations

import json
import os
import shlex
import socket
import subprocess
import time
from pathlib import Path

import filelock
from ansible.errors import AnsibleActionFail, AnsibleConnectionFailure
from ansible.plugins.action import ActionBase
from ansible.template import trust_as_template
from ansible.utils.display import Display
from ansible_collections.ddp_lab.cluster.plugins.module_utils.become import become_problem
from ansible_collections.ddp_lab.cluster.plugins.module_utils.ssh import host_key_changed
from ddplab.faults import MODES
from ddplab.status import UNIT_PROPS

display = Display()

ARGS = {
    "out_dir": {"type": "str", "required": True},  # the run's folder on the node
    "python": {"type": "str"},  # default <python_env_prefix>/bin/python
    "unit": {"type": "str", "default": "ddp-lab-agent"},
    "label": {"type": "str", "default": ""},  # default inventory_hostname
    "mode": {"type": "str", "default": "once", "choices": ["once", "watch", "until"]},
    "interval_s": {"type": "float", "default": 10.0},
    "timeout_s": {"type": "float", "default": 86400.0},
    "max_errors": {"type": "int", "default": 6},
    "probe_timeout_s": {"type": "float", "default": 0.0},  # once: TCP probe of the SSH port; 0 = none
    "report_dir": {"type": "str", "default": ""},  # watch: the live report ("" = none)
    "report_python": {"type": "str", "default": ""},
    "report_pythonpath": {"type": "str", "default": ""},
    "since": {"type": "float"},  # until: the injection's time (unix s)
    "fault": {"type": "str", "default": "kill-agent", "choices": list(MODES)},
    "node": {"type": "str", "default": ""},
    "duration_s": {"type": "float"},
}
REPORT_WAIT_S = 120.0  # how long a returning watch waits for its live report build


class LiveReport:
    """The controller's copy of one node's metrics (``<run_dir>/.watch/<host>/metrics/``, fed by
    ``ddplab.status --chunks-from``) and the live report ``<run_dir>/report.html`` built from all
    copies in the background by one watch at a time (a file lock).

    ``python`` / ``pythonpath``: what runs ``ddplab.controller.report``; ``interval_s``: at most one
    build per interval (and the page's reload interval).
    """

    def __init__(self, run_dir: str, host: str, python: str, pythonpath: str, interval_s: float):
        self.run_dir = Path(run_dir)
        self.watch_dir = self.run_dir / ".watch"
        self.copy_dir = self.watch_dir / host / "metrics"
        self.python, self.pythonpath, self.interval_s = python, pythonpath, interval_s
        self.offsets: dict[str, int] = {}
        self.lock = filelock.FileLock(str(self.watch_dir / "report.lock"))
        self.child: subprocess.Popen | None = None
        self.error: str | None = None
        self.shown: set[str] = set()  # errors printed already

    def store(self, chunks: dict) -> None:
        """Append each file's new lines (``ddplab.status`` ``chunks``) to the copy; a chunk from
        offset 0 (first poll, or the node's file was replaced) rewrites the copy."""
        self.copy_dir.mkdir(parents=True, exist_ok=True)
        for name, chunk in sorted(chunks.items()):
            if Path(name).name != name or not name.endswith(".jsonl"):
                continue  # only plain metrics file names: nothing is written outside the copy folder
            start, text = int(chunk["from"]), str(chunk["text"])
            mode = "a" if start and start == self.offsets.get(name) else "w"
            if mode == "w" and start:
                continue  # a gap: ask again from 0 next time
            with open(self.copy_dir / name, mode, encoding="utf-8") as fh:
                fh.write(text)
            self.offsets[name] = int(chunk["to"])

    def _reap(self, wait_s: float = 0.0) -> bool:
        """Whether no build of this watch is running now (waiting up to ``wait_s``); releases the
        lock and notes the error of a failed build."""
        if self.child is None:
            return True
        try:
            rc = self.child.wait(timeout=wait_s) if wait_s else self.child.poll()
        except subprocess.TimeoutExpired:
            self.child.kill()
            rc = self.child.wait()
        if rc is None:
            return False
        if rc not in (0, 3):  # 3: no step metrics yet, a page says so
            log = (self.watch_dir / "report.log").read_text(errors="replace").strip().splitlines()
            last = log[-1] if log else "?"
            self.error = f"live report: exit {rc}: {last} (see {self.watch_dir}/report.log)"
        self.child = None
        self.lock.release()
        return True

    def maybe_build(self) -> bool:
        """Start a build in the background when none runs (here or in another trainer's watch) and
        report.html is older than 0.8 interval; returns whether one was started."""
        if not self._reap():
            return False
        try:
            age = time.time() - (self.run_dir / "report.html").stat().st_mtime
        except OSError:
            age = float("inf")
        if age < 0.8 * self.interval_s:
            return False
        try:
            self.lock.acquire(timeout=0)
        except filelock.Timeout:
            return False  # another trainer's watch is building it
        env = dict(os.environ, PYTHONPATH=self.pythonpath) if self.pythonpath else None
        argv = [self.python, "-m", "ddplab.controller.report", str(self.run_dir), "--metrics",
                str(self.watch_dir), "--live", str(max(1, round(self.interval_s)))]  # the live page
        try:
            with open(self.watch_dir / "report.log", "w", encoding="utf-8") as log:
                self.child = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=log, env=env)
        except OSError:
            self.lock.release()
            raise
        return True

    def close(self) -> None:
        """Wait (at most REPORT_WAIT_S) for this watch's build to end."""
        self._reap(REPORT_WAIT_S)


def first_line(exc: BaseException, limit: int = 160) -> str:
    """The first line of an exception's message (at most ``limit`` characters), or its type's name."""
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0][:limit]


class ActionModule(ActionBase):
    """See the module docstring."""

    def _argv(self, args: dict, live: LiveReport | None = None) -> list[str]:
        argv = [args["python"], "-m", "ddplab.status", "--out-dir", args["out_dir"], "--unit", args["unit"],
                "--host", args["label"], "--json"]
        if live is not None:
            argv += ["--chunks-from", json.dumps(live.offsets)]
        if args["mode"] == "until":
            argv += ["--since", repr(args["since"]), "--mode", args["fault"], "--node", args["node"] or "?"]
            argv += ["--duration-s", repr(args["duration_s"])] if args["duration_s"] else []
        return argv

    def _poll(self, args: dict, live: LiveReport | None = None) -> dict:
        """One ddplab.status document from the node, run over the connection (no module payload);
        AnsibleActionFail (one line) when it cannot run."""
        res = self._low_level_execute_command(shlex.join(self._argv(args, live)), sudoable=True)
        if res.get("rc") == 127:  # the shell's "not found"
            raise AnsibleActionFail("progress command failed: the venv's python is not there (exit 127; "
                                    "not provisioned? site.yml)")
        if res.get("rc", 1) != 0:
            err = (res.get("stderr") or res.get("stdout") or "").strip().splitlines()
            raise AnsibleActionFail(f"progress command failed: {err[-1] if err else res.get('rc')}")
        try:
            doc = json.loads(res["stdout"].strip().splitlines()[-1])
        except (ValueError, IndexError) as exc:
            raise AnsibleActionFail(f"progress command printed no JSON: {first_line(exc)}") from exc
        for worker in doc.get("workers") or []:
            worker["node"] = args["label"]
        return doc

    def run(self, tmp=None, task_vars=None):
        task_vars = task_vars or {}
        result = super().run(tmp, task_vars)
        _, args = self.validate_argument_spec(argument_spec=ARGS)
        if args["mode"] == "until" and args["since"] is None:
            raise AnsibleActionFail("node_status: mode until needs since (the injection's unix time)")
        args["label"] = args["label"] or task_vars.get("inventory_hostname", "")
        args["python"] = args["python"] or self._templar.template(
            trust_as_template("{{ python_env_prefix | default('/opt/ddp-lab/venv') }}/bin/python"))
        start = time.monotonic()
        if args["mode"] == "once":
            doc, extra = self._once(args, task_vars)
        else:
            doc, extra = (self._watch if args["mode"] == "watch" else self._until)(args, start)
        known = ("run_state", "unit_holds_run", "current_run", "run_dir")  # None: not known (not read)
        result.update({key: doc.get(key) for key in known})
        result.update({k: doc[k] for k in ("records", "skipped_lines", "phase", "measure") if k in doc})
        result.update({k: doc.get(k) or {} for k in ("progress", "unit", "agent", "endpoints")})
        result.update({"changed": False, "state": doc.get("state", "error"), "error": None,
                       "workers": doc.get("workers") or [], "line": doc.get("line", ""),
                       "stop_cause": result["progress"].get("stop_cause"),
                       "elapsed_s": round(time.monotonic() - start, 1), **extra})
        return result

    def _watch(self, args: dict, start: float) -> tuple[dict, dict]:
        """Read every interval until the agent no longer runs (see the module docstring)."""
        errors, polls, last, state = 0, 0, {}, "running"
        live = LiveReport(args["report_dir"], args["label"], args["report_python"] or "python3",
                          args["report_pythonpath"], args["interval_s"]) if args["report_dir"] else None
        while True:
            polls += 1
            try:
                last = self._poll(args, live)
                errors = 0
                state = last["state"]
                display.display(last["line"])
                if live is not None:
                    self._live_report(live, last)
            except Exception as exc:  # noqa: BLE001 - a node that vanished is an outcome, not a crash
                if live is not None and "--chunks-from" in str(exc):
                    # a job launched by an older checkout: its ddplab.status has no --chunks-from
                    display.warning(f"{args['label']}: no live report (the node's ddplab.status is older "
                                    "than this checkout); the final report comes with collect")
                    live.close()
                    live = None
                    continue
                errors += 1
                display.display(f"{args['label']:<12} cannot read progress ({errors}/{args['max_errors']}): "
                                f"{first_line(exc)}", color="yellow")
                if errors >= args["max_errors"]:
                    state = "unreachable"
                    break
            if state != "running":
                break
            if time.monotonic() - start >= args["timeout_s"]:
                state = "timeout"
                break
            time.sleep(args["interval_s"])
        if live is not None:
            live.close()
        return {**last, "state": state}, {"polls": polls}

    def _until(self, args: dict, start: float) -> tuple[dict, dict]:
        """Read until the fault's phase is no longer ``waiting`` (see the module docstring)."""
        polls = 0
        while True:
            polls += 1
            doc = self._poll(args)
            if doc.get("phase") != "waiting" or time.monotonic() - start >= args["timeout_s"]:
                break
            time.sleep(max(0.1, args["interval_s"]))
        timed_out = doc.get("phase") == "waiting" and args["timeout_s"] > 0
        return doc, {"polls": polls, "timed_out": timed_out, "waited_s": round(time.monotonic() - start, 3)}

    @staticmethod
    def _live_report(live: LiveReport, doc: dict) -> None:
        """Store the poll's metrics lines and start a live report build when one is due; a problem
        is printed once and never ends the watch."""
        try:
            live.store(doc.get("chunks") or {})
            live.maybe_build()
        except (OSError, ValueError, KeyError, TypeError) as exc:
            live.error = f"live report: {first_line(exc)}"
        if live.error and live.error not in live.shown:
            display.warning(live.error)
            live.shown.add(live.error)  # printed once

    def _unit_from_systemd(self, unit: str, task_vars: dict) -> dict:
        """The agent unit's ``UNIT_PROPS`` read by ansible.builtin.systemd_service (no state: a read),
        for a node whose ``ddplab.status`` cannot run; ``{}`` when systemd cannot be asked either."""
        res = self._execute_module(module_name="ansible.builtin.systemd_service", module_args={"name": unit},
                                   task_vars=task_vars)
        status = res.get("status") or {}
        return {k: str(status[k]) for k in UNIT_PROPS if k in status} if not res.get("failed") else {}

    def _ssh_endpoint(self) -> tuple[str, int] | None:
        """``(address, port)`` the connection's ssh dials, as ``ssh -G`` resolves it with the
        connection's ssh arguments (ssh_config included); None when the connection is not ssh, goes
        through a proxy (a direct probe would say nothing), or ssh cannot resolve it."""
        conn = self._connection
        if getattr(conn, "transport", "") not in ("ssh", "ansible.builtin.ssh"):
            return None
        try:
            host = str(conn.get_option("host") or self._play_context.remote_addr)
            port = conn.get_option("port")
            extra = [a for o in ("ssh_args", "ssh_common_args", "ssh_extra_args")
                     for a in shlex.split(str(conn.get_option(o) or ""))]
            argv = ["ssh", "-G", *extra, *(["-p", str(port)] if port else []), host]
            out = subprocess.run(argv, capture_output=True, text=True, timeout=10, check=False)
        except (KeyError, ValueError, OSError, subprocess.TimeoutExpired):
            return None
        conf = dict(line.split(" ", 1) for line in out.stdout.splitlines() if " " in line)
        if out.returncode != 0 or conf.get("proxyjump", "none") != "none" or "proxycommand" in conf:
            return None
        try:
            return conf["hostname"], int(conf.get("port", "22"))
        except (KeyError, ValueError):
            return None

    def _probe(self, timeout_s: float) -> str | None:
        """None when the node's SSH port answers within ``timeout_s`` (or cannot be probed: see
        :meth:`_ssh_endpoint`), else the one-line reason it is unreachable."""
        endpoint = self._ssh_endpoint()
        if endpoint is None:
            return None
        try:
            socket.create_connection(endpoint, timeout=timeout_s).close()
        except OSError as exc:
            why = "no answer" if isinstance(exc, TimeoutError) else (exc.strerror or first_line(exc))
            return f"ssh port {endpoint[1]} of {endpoint[0]} does not answer within {timeout_s:g} s: {why}"
        return None

    def _once(self, args: dict, task_vars: dict) -> tuple[dict, dict]:
        """One read of the node's state (see the module docstring: ``once``)."""
        try:
            off = self._probe(args["probe_timeout_s"]) if args["probe_timeout_s"] > 0 else None
            if off is not None:
                raise AnsibleConnectionFailure(off)
            return self._poll(args), {"polls": 1}
        except AnsibleConnectionFailure as exc:
            lab = bool(task_vars.get("lab_container"))
            error = host_key_changed(str(exc), lab) or first_line(exc, 1000)
            return {"state": "unreachable"}, {"polls": 1, "error": error}
        except Exception as exc:  # noqa: BLE001 - reported in the node's row, not a crash
            error = first_line(exc, 1000)
            state = "unreachable" if "unreachable" in error.lower() else "error"
            become = become_problem(getattr(self._connection, "become", None), str(exc),
                                    self._play_context.remote_user)
            if become or state == "unreachable":  # become: systemd's view would fail the same way
                return {"state": state}, {"polls": 1, "error": become or error}
            # the node answers, ddplab.status does not: systemd still knows the unit
            return {"state": "error", "unit": self._unit_from_systemd(args["unit"], task_vars)}, {
                "polls": 1, "error": error}
