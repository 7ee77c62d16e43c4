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
the command failed there, with ``error`` holding the one-line reason. With ``probe_timeout_s`` > 0
and a plain ssh connection (no ProxyJump/ProxyCommand in what ``ssh -G`` resolves), the node's SSH
port is first probed from the controller (a TCP connect): a node that does not answer within that
time is ``unreachable`` without an ssh attempt, which would wait for ssh's ConnectTimeout (10 s) or,
through a ControlPersist master whose node was powered off, until ServerAlive ends the master.

Live report (``report_dir``: the run's folder on the controller): each poll also brings the node's
metrics lines written since the last one (``ddplab.status --chunks-from``), which are appended to
``<report_dir>/.watch/<label>/metrics/`` on the controller (:class:`LiveReport`); every interval
one of the trainers' watches (a file lock decides which) rewrites ``<report_dir>/report.html`` from
those copies in the background (``python -m ddplab.controller.report --metrics .watch --live``:
the page reloads itself and says "live, step S of M, updated HH:MM:SS"). A watch waits for its
report build before it returns, so the final report (collect) is never overwritten by a live one.
"""

from __future__ import annotations

import ast
import json
import os
import shlex
import socket
import subprocess
import time
from pathlib import Path

import filelock
from ansible.errors import AnsibleActionFail, AnsibleConnectionFailure, AnsibleError
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
    "probe_timeout_s": {"type": "float", "default": 0.0},  # once: TCP probe of the SSH port first; 0 = none
    # live report (see the module docstring); "" = none
    "report_dir": {"type": "str", "default": ""},
    "report_python": {"type": "str", "default": ""},
    "report_pythonpath": {"type": "str", "default": ""},
}
REPORT_WAIT_S = 120.0  # how long a returning watch waits for its live report build


# ddplab.status of this checkout: its UNIT_PROPS (the agent unit's properties the job state is read
# from) are read from systemd directly when ddplab.status cannot run on the node.
STATUS_PY = Path(__file__).resolve().parents[3] / "train" / "ddplab" / "status.py"


def unit_props(status_py: Path = STATUS_PY) -> tuple[str, ...]:
    """``ddplab.status.UNIT_PROPS``, read from ``status_py`` without importing it (ddplab is not
    installed on the controller): the assignment's literal, parsed with ``ast``. Raises AnsibleError
    when the file cannot be read or assigns no literal UNIT_PROPS."""
    try:
        tree = ast.parse(status_py.read_text(encoding="utf-8"))
    except (OSError, SyntaxError) as exc:
        raise AnsibleError(f"cannot read UNIT_PROPS from {status_py}: {first_line(exc)}") from exc
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "UNIT_PROPS" for t in node.targets):
            try:
                return tuple(str(p) for p in ast.literal_eval(node.value))
            except ValueError as exc:
                raise AnsibleError(f"UNIT_PROPS of {status_py} is not a literal: {first_line(exc)}") from exc
    raise AnsibleError(f"{status_py} assigns no UNIT_PROPS")


class LiveReport:
    """The controller's copy of one node's metrics, and the live report built from all copies.

    ``run_dir``: the run's folder on the controller; ``host``: the node's folder name in it;
    ``python`` / ``pythonpath``: the interpreter and PYTHONPATH that run ``ddplab.controller.report``;
    ``interval_s``: at most one build per interval (and the page's reload interval).
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

    def argv(self) -> list[str]:
        """The command that writes the live page."""
        return [self.python, "-m", "ddplab.controller.report", str(self.run_dir), "--metrics",
                str(self.watch_dir), "--live", str(max(1, round(self.interval_s)))]

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

    def maybe_build(self, now: float | None = None) -> bool:
        """Start a build in the background when none runs (here or in another trainer's watch) and
        report.html is older than 0.8 interval; returns whether one was started."""
        if not self._reap():
            return False
        now = time.time() if now is None else now
        try:
            age = now - (self.run_dir / "report.html").stat().st_mtime
        except OSError:
            age = float("inf")
        if age < 0.8 * self.interval_s:
            return False
        try:
            self.lock.acquire(timeout=0)
        except filelock.Timeout:
            return False  # another trainer's watch is building it
        env = dict(os.environ, PYTHONPATH=self.pythonpath) if self.pythonpath else None
        try:
            with open(self.watch_dir / "report.log", "w", encoding="utf-8") as log:
                self.child = subprocess.Popen(self.argv(), stdout=subprocess.DEVNULL, stderr=log, env=env)
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

    TRANSFERS_FILES = False
    _requires_connection = True

    def _poll(self, args: dict, task_vars: dict, live: LiveReport | None = None) -> dict:
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
        ] + (["--chunks-from", json.dumps(live.offsets)] if live is not None else [])
        # The command itself over the connection (as the become user), not the command module: no
        # module payload to ship and start in a second Python on the node. Measured on molecule
        # containers at load ~9: 1.8 s vs 5.3 s for `ansible -m raw|command` on 3 nodes.
        res = self._low_level_execute_command(shlex.join(argv), sudoable=True)
        if res.get("rc") == 127:  # the shell's "not found"
            raise AnsibleActionFail("progress command failed: the venv's python is not there (exit 127; "
                                    "not provisioned? site.yml)")
        if res.get("rc", 1) != 0:
            err = (res.get("stderr") or res.get("stdout") or "").strip().splitlines()
            raise AnsibleActionFail(f"progress command failed: {err[-1] if err else res.get('rc')}")
        try:
            return json.loads(res["stdout"].strip().splitlines()[-1])
        except (ValueError, IndexError) as exc:
            raise AnsibleActionFail(f"progress command printed no JSON: {first_line(exc)}") from exc

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
        live = None
        if args["report_dir"]:
            live = LiveReport(args["report_dir"], args["label"], args["report_python"] or "python3",
                              args["report_pythonpath"], args["interval_s"])
        while True:
            polls += 1
            try:
                last = self._poll(args, task_vars, live)
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
        if live is not None:
            live.close()
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
        """The agent unit's ``systemctl show`` properties (:func:`unit_props`) read by
        ansible.builtin.systemd_service (no state: a read) when ``ddplab.status`` cannot run on
        the node (the node runtime not installed yet, or broken): a running agent is still seen,
        so stop.yml and reset.yml stop it. ``{}`` when systemd cannot be asked either."""
        res = self._execute_module(
            module_name="ansible.builtin.systemd_service", module_args={"name": unit}, task_vars=task_vars
        )
        status = res.get("status") or {}
        return {k: str(status[k]) for k in unit_props() if k in status} if not res.get("failed") else {}

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

    def _once(self, result: dict, args: dict, task_vars: dict) -> dict:
        """One read of the node's state (see the module docstring: ``once``)."""
        start = time.monotonic()
        try:
            off = self._probe(args["probe_timeout_s"]) if args["probe_timeout_s"] > 0 else None
            if off is not None:
                raise AnsibleConnectionFailure(off)
            doc = self._poll(args, task_vars)
            state, error = doc["state"], None
        except AnsibleConnectionFailure as exc:
            doc, state, error = {}, "unreachable", first_line(exc, 1000)
        except Exception as exc:  # noqa: BLE001 - reported in the node's row, not a crash
            doc, error = {}, first_line(exc, 1000)
            state = "unreachable" if "unreachable" in error.lower() else "error"
            if state == "error":  # the node answers, ddplab.status does not: systemd still knows the unit
                doc["unit"] = self._unit_from_systemd(args["unit"], task_vars)
        progress = doc.get("progress", {})
        result.update({"changed": False, "state": state, "error": error, "polls": 1,
                       "elapsed_s": round(time.monotonic() - start, 1), "progress": progress,
                       "unit": doc.get("unit", {}), "line": doc.get("line", ""),
                       "workers": doc.get("workers", []), "stop_cause": progress.get("stop_cause"),
                       "run_dir": doc.get("run_dir"),  # None: not known (node not read)
                       # the run's own state when the unit is another run's or gone (ddplab.status)
                       "unit_holds_run": doc.get("unit_holds_run"), "run_state": doc.get("run_state"),
                       "current_run": doc.get("current_run"), "endpoints": doc.get("endpoints") or {}})
        return result
