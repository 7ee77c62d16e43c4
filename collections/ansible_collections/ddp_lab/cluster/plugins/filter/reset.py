"""Filters of the reset role: the job the reset stops (named, also under --check) and the line that
says what happened to each trainer."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from ansible_collections.ddp_lab.cluster.plugins.module_utils.hostvars import agent_ran_hosts, truthy


def reset_stopped_jobs(hosts: Iterable[str], hostvars: Mapping[str, Any], check: Any = False) -> list[str]:
    """One line per run whose agent ran on some of ``hosts`` when the reset stopped it
    (``agent_ran_hosts``; the run: the node's ``ddp_job_status`` run id, else ``ddp_lab_run_id``),
    ``stopped run R on laptop-a, laptop-b (...)`` or, under ``check``, ``would stop ...``."""
    runs: dict[str, list[str]] = {}
    for host in agent_ran_hosts(hosts, hostvars):
        vars_ = hostvars.get(host, {})
        status = vars_.get("ddp_job_status") or {}
        run = (((status.get("progress") or {}).get("run_id") or status.get("current_run")
                or vars_.get("ddp_lab_run_id")) or "(run id not found)")
        runs.setdefault(str(run), []).append(str(host))
    out = []
    for run, where in sorted(runs.items()):
        if truthy(check):
            out.append(f"would stop run {run} on {', '.join(where)} (--check: nothing was stopped)")
        else:
            out.append(f"stopped run {run} on {', '.join(where)} (SIGTERM: emergency checkpoints, removed "
                       "with the state folder unless collected before)")
    return out


def reset_outcome(host: str, check: Any = False) -> str:
    """The last line of a trainer's reset: what was (or, under ``check``, would be) done."""
    if truthy(check):
        return (f"{host}: would be reset (--check: nothing changed; the changed items above are what reset "
                "removes or restores)")
    return (f"{host}: reset to its state before provisioning (the packages provisioning installed stay: "
            "see docs/roles.md)")


class FilterModule:
    """The filters above."""

    def filters(self):
        return {"reset_stopped_jobs": reset_stopped_jobs, "reset_outcome": reset_outcome}
