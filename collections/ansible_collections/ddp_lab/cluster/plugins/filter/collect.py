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
    """How the run to collect was named, for collect's lines: ``-e collect_run_id`` when given,
    ``the run this play launched or followed`` when the play settled one (``ddp_lab_run_id``),
    else ``runs/current``."""
    if str(collect_run_id or ""):
        return "-e collect_run_id"
    if str(launched_run_id or ""):
        return "the run this play launched or followed"
    return "runs/current"


def collect_missing_run(node_dirs: Mapping[str, Any], home_dir: Mapping[str, Any] | None, run_id: str,
                        base_dir: str, runs_dir: str) -> str:
    """The refusal when no reachable trainer and not the controller holds run ``run_id``; '' when
    one does. ``node_dirs``: host -> its registered ``ansible.builtin.stat`` of
    ``<base_dir>/runs/<run_id>`` (``unreachable`` when the trainer was not reached; missing or
    skipped: not read); ``home_dir``: the ``stat`` result of ``<runs_dir>/<run_id>`` on the
    controller."""
    if ((home_dir or {}).get("stat") or {}).get("isdir"):
        return ""
    held = [h for h, r in node_dirs.items() if (((r or {}).get("stat") or {}).get("isdir"))]
    if held:
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
    """Host -> the value of its variable ``name`` (a registered result) in ``hostvars``, for each
    host of ``hosts`` in order ({} for a host without it): ddp_job's ``host_values``, the one home
    of this lookup, with {} as the default."""
    return host_values(hosts, hostvars, name, {})


def collect_journal_argv(invocations_b64: Any, unit: str) -> list[str]:
    """The ``journalctl`` command of the run's part of the agent's journal: the entries of the run's
    invocations (``invocations_b64``: the base64 ``content`` of the run's ``invocations`` file,
    ``ansible.builtin.slurp``; one systemd InvocationID a line, the launch records each), by the
    unit's own messages (``_SYSTEMD_INVOCATION_ID``) or those systemd wrote about it
    (``INVOCATION_ID``); without any: the whole journal of ``unit``."""
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
    """The paths of the ``count`` newest checkpoints among ``ansible.builtin.find``'s ``files``
    (``ckpt-<step>.pt``, zero-padded: newest = last by name); [] for ``count`` <= 0.

    Raises ValueError (one line naming ``collect_checkpoints``) when ``count`` is not a whole
    number, e.g. ``-e collect_checkpoints=two``."""
    try:
        n = int(str(count).strip())
    except ValueError:
        raise ValueError(f"collect_checkpoints must be a whole number of checkpoints to bring home, "
                         f"got {count!r}; fix: -e collect_checkpoints=<n> (0: none)") from None
    return sorted(str(f["path"]) for f in files or [])[-n:] if n > 0 else []


def collect_pack_paths(run_dir: str, files: Iterable[str], newest: Iterable[str]) -> list[str]:
    """What collect packs on a node, as absolute paths under the node's run folder ``run_dir``: its
    ``logs`` and ``metrics`` folders, the small ``files`` (names relative to ``run_dir``), and each of
    the ``newest`` checkpoints (:func:`collect_newest`) with its ``.sha256`` beside it."""
    base = str(run_dir).rstrip("/")
    out = [f"{base}/logs", f"{base}/metrics", *(f"{base}/{f}" for f in files or ())]
    for ckpt in newest or ():
        out += [str(ckpt), f"{ckpt}.sha256"]
    return out


def collect_snapshot_hosts(running: Iterable[str], snapshot: Any) -> str:
    """summary build's ``--running``: the trainers where the run still runs, comma-separated, when
    collect takes a snapshot of it (``snapshot`` true); '' otherwise."""
    return ",".join(running or []) if truthy(snapshot) else ""


def collect_summary_lines(summary_lines: Iterable[str], run_dir: str, report: Any) -> list[str]:
    """What collect prints at its end: the human summary's lines, then the report's path when it
    wrote one (``report`` true)."""
    tail = [f"report: {run_dir}/report.html"] if truthy(report) else []
    return [*(summary_lines or []), *tail]




def collect_unread(statuses: Mapping[str, Any]) -> list[str]:
    """The trainers whose state this collect could not read (``ddp_job_status`` missing,
    unreachable or error: a laptop powered off): their folders are not brought home, so the
    summary is partial (``summary build --unread``)."""
    return sorted(h for h, r in statuses.items() if (r or {}).get("state") in (None, "unreachable", "error"))


def collect_partial_warning(statuses: Mapping[str, Any], run_id: str) -> str:
    """The marked warning of a partial collect (:func:`collect_unread` not empty), naming each
    unread trainer with why it could not be read and the fix; "" when every trainer was read."""
    unread = collect_unread(statuses)
    if not unread:
        return ""
    why = "; ".join(f"{h}: {(statuses.get(h) or {}).get('error') or 'not read'}" for h in unread)
    names = ", ".join(unread)
    return (f"WARNING: the summary of run {run_id} is partial: {names} could not be read ({why});"
            f" summary.json and the report say so; fix: bring {names} back and run playbooks/collect.yml"
            " again")


def collect_run_over(statuses: Mapping[str, Any], run_id: str, now: float | None = None) -> dict[str, Any]:
    """Whether run ``run_id`` is over on every trainer, so that collect may end its rendezvous store
    and lighthouse (site.yml -e ddp_job_watch=false leaves them to whoever collects the run):
    ``{over, why, last_record}``. ``statuses``: host -> its ``ddp_job_status`` (ddplab.status read
    by ddp_job tasks/state.yml). Not over when a trainer could not be read (it may still train),
    the run still runs on one (:func:`ddplab.runstate.node_state`), or a trainer belongs to another run
    already: its agent unit runs another run, or its ``current_run`` names another (a later
    launch shipped; the services are that launch's). ``why``: the reason, one clause;
    ``last_record``: unix time of the run's newest record on any trainer (``now`` minus the
    smallest ``progress.age_s``; None without records), which the services' start times are
    compared with (:func:`collect_services_of_run`)."""
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
    """Whether the running store and lighthouse (``ddplab.controller.supervisor`` status documents;
    {} when not read) are the run's, so that collect ends them: ``{stop, line}``. ``stop`` False
    when none runs, when the run has no record on any trainer (``last_record`` None: nothing proves
    they are the run's, a later launch that started its store but has not shipped ``current_run``
    yet may hold them), or when one started (``started_at``) after the run's newest record
    (``last_record``, unix s, :func:`collect_run_over`): a later launch's. ``line``: what collect
    says. ``over`` False (:func:`collect_run_over`: a trainer not read, the run still running
    somewhere): they stay, and ``line`` says so with ``why``, never without a word."""
    docs = (("rendezvous store", store or {}), ("torchft lighthouse", lighthouse or {}))
    running = {name: doc for name, doc in docs if doc.get("running")}
    if not running:
        return {"stop": False, "line": ""}
    names = " and ".join(f"{n} on port {d.get('port', '?')}" for n, d in running.items())
    if str(over).lower() not in ("true", "1", "yes"):
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
