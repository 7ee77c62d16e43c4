"""Filters of the reset role: the job the reset stops (named, also under --check) and the line that
says what happened to each trainer."""

from __future__ import annotations

import runpy
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

#: the ddp_job role's filter plugin, run from its file (role plugins are files, not packages): its
#: agent_ran_hosts is the one rule of "whose agent ran" (tasks/stop.yml, tasks/stopped.yml)
DDP_JOB = runpy.run_path(str(Path(__file__).resolve().parents[2] / "ddp_job/filter_plugins/ddp_job.py"))


def _true(value: Any) -> bool:
    """A fact that may come back from a template as a string ("True") or a bool."""
    return str(value).strip().lower() in ("true", "1", "yes")


def reset_stopped_jobs(hosts: Iterable[str], hostvars: Mapping[str, Any], check: Any = False) -> list[str]:
    """One line per run whose agent ran on some of ``hosts`` when the reset stopped it (ddp_job's
    ddp_job filter agent_ran_hosts; the run: the node's ``ddp_job_status`` run id, else
    ``ddp_lab_run_id``), e.g. ``would stop run R on laptop-a, laptop-b (--check: nothing was
    stopped)`` under ``check``, else ``stopped run R on laptop-a, laptop-b (SIGTERM: emergency
    checkpoints, removed with the state folder unless collected before)``; [] when none ran."""
    runs: dict[str, list[str]] = {}
    for host in DDP_JOB["agent_ran_hosts"](hosts, hostvars):
        vars_ = hostvars.get(host, {})
        status = vars_.get("ddp_job_status") or {}
        run = (((status.get("progress") or {}).get("run_id") or status.get("current_run")
                or vars_.get("ddp_lab_run_id")) or "(run id not found)")
        runs.setdefault(str(run), []).append(str(host))
    out = []
    for run, where in sorted(runs.items()):
        if _true(check):
            out.append(f"would stop run {run} on {', '.join(where)} (--check: nothing was stopped)")
        else:
            out.append(f"stopped run {run} on {', '.join(where)} (SIGTERM: emergency checkpoints, removed "
                       "with the state folder unless collected before)")
    return out


def reset_outcome(host: str, check: Any = False) -> str:
    """The last line of a trainer's reset: what was (or, under ``check``, would be) done."""
    if _true(check):
        return (f"{host}: would be reset (--check: nothing changed; the changed items above are what reset "
                "removes or restores)")
    return (f"{host}: reset to its state before provisioning (the packages provisioning installed stay: "
            "see docs/roles.md)")


class FilterModule:
    """The filters above."""

    def filters(self):
        return {"reset_stopped_jobs": reset_stopped_jobs, "reset_outcome": reset_outcome}
