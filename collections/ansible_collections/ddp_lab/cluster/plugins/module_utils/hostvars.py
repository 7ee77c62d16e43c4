"""Per-host values out of Ansible's ``hostvars``: one lookup (:func:`host_values`), the rule of a
fact that comes back from a template as a string (:func:`truthy`), and the hosts whose agent ran
when stop.yml read it (:func:`agent_ran_hosts`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def truthy(value: Any) -> bool:
    """Whether ``value`` is true as a fact from a template may be: a bool, or its string ("True",
    "true", "1", "yes"); anything else is false."""
    return str(value).strip().lower() in ("true", "1", "yes")


def host_values(hosts: Any, hostvars: Mapping[str, Any] | None, name: str,
                default: Any = None) -> dict[str, Any]:
    """Host -> its variable ``name`` (e.g. a registered result) in ``hostvars`` (Ansible's
    ``hostvars``, or a mapping host -> variables), for each of ``hosts`` (names) in order.
    ``default`` for a host without the variable and for a host ``hostvars`` does not hold (Ansible's
    hostvars gives an undefined there): no KeyError. The one home of this lookup (the fault role's
    fault_host_values is this function)."""
    hostvars = hostvars if hostvars is not None else {}
    out: dict[str, Any] = {}
    for host in hosts or ():
        vars_ = hostvars.get(host, {})
        out[str(host)] = vars_.get(name, default) if isinstance(vars_, Mapping) else default
    return out


def agent_ran_hosts(hosts: Any, hostvars: Mapping[str, Any] | None) -> list[str]:
    """The hosts of ``hosts`` (in order) whose agent ran when tasks/stop.yml read it
    (``__ddp_job_agent_runs`` true: a bool, or "True" from a template); the nodes stop.yml records
    as stopped (tasks/stopped.yml) and reset names (reset_stopped_jobs)."""
    runs = host_values(hosts, hostvars, "__ddp_job_agent_runs", False)
    return [h for h, ran in runs.items() if truthy(ran)]


def statuses_of(hosts: Any, hostvars: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Host -> its ``ddp_job_status`` (:func:`host_values`; None for a host without one), for each
    of ``hosts`` (names) in order."""
    return host_values(hosts, hostvars, "ddp_job_status")
