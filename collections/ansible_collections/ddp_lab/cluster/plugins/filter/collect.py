"""Filters of the collect role: where the run to collect comes from, whether a trainer or the
controller holds it (the role's one-line refusal of a run nobody holds), the journal command of
the run's invocations, the newest checkpoints, and the lines collect prints."""

from __future__ import annotations

import base64
import binascii
import time
from collections.abc import Iterable, Mapping
from typing import Any

from ansible_collections.ddp_lab.cluster.plugins.module_utils.hostvars import host_values, truthy
from ddplab.runstate import node_state


def collect_source(collect_run_id: Any, launched_run_id: Any = "") -> str:
    """How the run to collect was named: ``-e collect_run_id``, ``the run this play launched or
    followed`` (``launched_run_id``), else ``runs/current``."""
    if str(collect_run_id or ""):
        return "-e collect_run_id"
    if str(launched_run_id or ""):
        return "the run this play launched or followed"
    return "runs/current"


def collect_missing_run(node_dirs: Mapping[str, Any], home_dir: Mapping[str, Any] | None, run_id: str,
                        base_dir: str, runs_dir: str) -> str:
    """The refusal when no reachable trainer and not the controller holds run ``run_id``; '' when
    one does. ``node_dirs``: host -> its ``ansible.builtin.stat`` of ``<base_dir>/runs/<run_id>``;
    ``home_dir``: the ``stat`` of ``<runs_dir>/<run_id>`` on the controller."""
    stats = [(r or {}).get("stat") or {} for r in [home_dir, *node_dirs.values()]]
    if any(stat.get("isdir") for stat in stats):
        return ""
    unreached = [h for h, r in node_dirs.items() if (r or {}).get("unreachable")]
    reached = [h for h in node_dirs if h not in unreached]
    where = ", ".join(reached) or "any trainer"
    return (f"no trainer and not the controller holds run {run_id} (no {base_dir}/runs/{run_id} on {where}"
            + (f"; not reached: {', '.join(unreached)}" if unreached else "")
            + f"; no {runs_dir}/{run_id} here); fix: name a run of {runs_dir} or of the trainers' "
            f"{base_dir}/runs with -e collect_run_id=<run id>"
            + (", or bring the laptops not reached back" if unreached else ""))


def collect_registered(hosts: Iterable[str], hostvars: Mapping[str, Any], name: str) -> dict[str, Any]:
    """:func:`host_values` with {} for a host without the variable."""
    return host_values(hosts, hostvars, name, {})


def collect_journal_argv(invocations_b64: Any, unit: str) -> list[str]:
    """The ``journalctl`` command of the run's part of the agent's journal: the entries of the run's
    invocations (``invocations_b64``: the ``slurp`` of its ``invocations`` file, one InvocationID
    a line), the unit's own or systemd's about it; without any, the whole journal of ``unit``."""
    try:
        text = base64.b64decode(str(invocations_b64 or "")).decode("utf-8", "replace")
    except (ValueError, binascii.Error):
        text = ""
    ids = text.split()
    argv = ["journalctl", "--no-pager", "-o", "short-iso"]
    if not ids:
        return [*argv, "-u", unit]
    return [*argv, *(f"_SYSTEMD_INVOCATION_ID={i}" for i in ids), "+", *(f"INVOCATION_ID={i}" for i in ids)]


def collect_newest(files: Iterable[Mapping[str, Any]], count: Any) -> list[str]:
    """The paths of the ``count`` newest checkpoints among ``ansible.builtin.find``'s ``files`` (last
    by name); [] for ``count`` <= 0. ValueError (one line) when ``count`` is not a whole number."""
    try:
        n = int(str(count).strip())
    except ValueError:
        raise ValueError(f"collect_checkpoints must be a whole number of checkpoints to bring home, "
                         f"got {count!r}; fix: -e collect_checkpoints=<n> (0: none)") from None
    return sorted(str(f["path"]) for f in files or [])[-n:] if n > 0 else []


def collect_pack_paths(run_dir: str, files: Iterable[str], newest: Iterable[str]) -> list[str]:
    """What collect packs on a node, as absolute paths: ``run_dir``'s ``logs`` and ``metrics``, the
    ``files`` (relative to ``run_dir``), and each of the ``newest`` checkpoints with its ``.sha256``."""
    base = str(run_dir).rstrip("/")
    out = [f"{base}/logs", f"{base}/metrics", *(f"{base}/{f}" for f in files or ())]
    for ckpt in newest or ():
        out += [str(ckpt), f"{ckpt}.sha256"]
    return out


def collect_snapshot_hosts(running: Iterable[str], snapshot: Any) -> str:
    """summary build's ``--running``: ``running`` comma-separated under ``snapshot``, else ''."""
    return ",".join(running or []) if truthy(snapshot) else ""


def collect_summary_lines(summary_lines: Iterable[str], run_dir: str, report: Any) -> list[str]:
    """What collect prints at its end: the summary's lines, then the report's path (``report``)."""
    tail = [f"report: {run_dir}/report.html"] if truthy(report) else []
    return [*(summary_lines or []), *tail]


def collect_unread(statuses: Mapping[str, Any]) -> list[str]:
    """The trainers whose ``ddp_job_status`` is missing, unreachable or error: not brought home
    (``summary build --unread``)."""
    return sorted(h for h, r in statuses.items() if (r or {}).get("state") in (None, "unreachable", "error"))


def collect_partial_warning(statuses: Mapping[str, Any], run_id: str) -> str:
    """The warning of a partial collect, naming each unread trainer, why, and the fix; "" else."""
    unread = [h for h, r in statuses.items() if (r or {}).get("state") in (None, "unreachable", "error")]
    if not unread:
        return ""
    why = "; ".join(f"{h}: {(statuses.get(h) or {}).get('error') or 'not read'}" for h in unread)
    names = ", ".join(unread)
    return (f"WARNING: the summary of run {run_id} is partial: {names} could not be read ({why});"
            f" summary.json and the report say so; fix: bring {names} back and run playbooks/collect.yml"
            " again")


def collect_run_over(statuses: Mapping[str, Any], run_id: str, now: float | None = None) -> dict[str, Any]:
    """Whether run ``run_id`` is over on every trainer (``statuses``: host -> its
    ``ddp_job_status``), so that collect may end its store and lighthouse: ``{over, why,
    last_record}``. Not over when a trainer was not read, the run still runs on one, or one
    belongs to another run already (its running unit or its ``current_run``). ``why``: one
    clause; ``last_record``: unix time of the run's newest record on any trainer (None)."""
    now = time.time() if now is None else float(now)
    ages = [float(a) for r in statuses.values()
            if (a := (((r or {}).get("progress") or {}).get("age_s"))) is not None]
    last = now - min(ages) if ages else None
    unread = [h for h, r in statuses.items() if (r or {}).get("state") in (None, "unreachable", "error")]
    running = [h for h, r in statuses.items() if node_state(r, h) == "running"]
    other = sorted({f"{h} (run {(r or {}).get('current_run') or '?'})" for h, r in statuses.items()
                    if ((r or {}).get("unit_holds_run") is False and (r or {}).get("state") == "running")
                    or ((r or {}).get("current_run") not in (None, "", run_id))})
    if not statuses:
        why = "no trainer was read"
    elif unread:
        why = f"not read on {', '.join(unread)} (it may still run there)"
    elif running:
        why = f"it still runs on {', '.join(running)}"
    elif other:
        why = f"a later launch holds {', '.join(other)}"
    else:
        return {"over": True, "why": "it ended on every trainer", "last_record": last}
    return {"over": False, "why": why, "last_record": last}


def collect_services_of_run(store: Mapping[str, Any] | None, lighthouse: Mapping[str, Any] | None,
                            last_record: Any = None, over: Any = True, why: str = "") -> dict[str, Any]:
    """Whether the running store and lighthouse (supervisor status documents; {} when not read) are
    the run's, so that collect ends them: ``{stop, line}``. ``stop`` False when none runs, when the
    run is not ``over`` (``why``), has no record (``last_record`` None) or one started after
    ``last_record`` (a later launch's). ``line``: what collect says ('' when none runs)."""
    docs = (("rendezvous store", store or {}), ("torchft lighthouse", lighthouse or {}))
    running = {name: doc for name, doc in docs if doc.get("running")}
    if not running:
        return {"stop": False, "line": ""}
    names = " and ".join(f"{n} on port {d.get('port', '?')}" for n, d in running.items())
    if not truthy(over):
        return {"stop": False, "line": (f"{names} left running: the run is not over on every trainer ({why});"
                                        " fix: collect again once it is, or end them with"
                                        " `ansible-playbook playbooks/stop.yml` when no run uses them")}
    if last_record is None:  # nothing ties them to the run: a later launch may hold them already
        return {"stop": False, "line": (f"{names} left running: the run has no record on any trainer to "
                                        "tell its services from a later launch's; fix: end them with "
                                        "`ansible-playbook playbooks/stop.yml` when no run uses them")}
    later = [n for n, d in running.items() if float(d.get("started_at") or 0.0) > float(last_record) + 1.0]
    if later:
        return {"stop": False, "line": (f"{names} left running: the {' and '.join(later)} started after "
                                        "the run's last record (a later launch's)")}
    return {"stop": True, "line": f"the run ended on every trainer: stopping its {names}"}


# The role's rule for its settings (module_utils/settings.py).
SETTINGS = [{"name": "collect_checkpoints", "min": 0}]


class FilterModule:
    """The filters above."""

    def filters(self):
        return {
            "collect_source": collect_source,
            "collect_missing_run": collect_missing_run,
            "collect_registered": collect_registered,
            "collect_journal_argv": collect_journal_argv,
            "collect_newest": collect_newest,
            "collect_pack_paths": collect_pack_paths,
            "collect_snapshot_hosts": collect_snapshot_hosts,
            "collect_summary_lines": collect_summary_lines,
            "collect_run_over": collect_run_over,
            "collect_unread": collect_unread,
            "collect_partial_warning": collect_partial_warning,
            "collect_services_of_run": collect_services_of_run,
        }
