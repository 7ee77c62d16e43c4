"""Per-host values out of Ansible's ``hostvars`` (:func:`host_values`), the hosts whose value
differs from the most common one (:func:`odd_ones`), and a fact that may come back from a template
as a string (:func:`truthy`)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from typing import Any


def truthy(value: Any) -> bool:
    """Whether ``value`` is true as a fact from a template may be: a bool, or its string ("True",
    "true", "1", "yes"); anything else is false."""
    return str(value).strip().lower() in ("true", "1", "yes")


def host_values(hosts: Any, hostvars: Mapping[str, Any] | None, name: str,
                default: Any = None) -> dict[str, Any]:
    """Host -> its variable ``name`` in ``hostvars`` (Ansible's, or a mapping host -> variables), for
    each of ``hosts`` in order; ``default`` for a host without it or not in ``hostvars``."""
    hostvars = hostvars if hostvars is not None else {}
    out: dict[str, Any] = {}
    for host in hosts or ():
        vars_ = hostvars.get(host, {})
        out[str(host)] = vars_.get(name, default) if isinstance(vars_, Mapping) else default
    return out


def agent_ran_hosts(hosts: Any, hostvars: Mapping[str, Any] | None) -> list[str]:
    """The hosts of ``hosts`` (in order) whose agent ran when ddp_job's tasks/stop.yml read it
    (``__ddp_job_agent_runs`` :func:`truthy`)."""
    runs = host_values(hosts, hostvars, "__ddp_job_agent_runs", False)
    return [h for h, ran in runs.items() if truthy(ran)]


def statuses_of(hosts: Any, hostvars: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Host -> its ``ddp_job_status`` (:func:`host_values`; None without one)."""
    return host_values(hosts, hostvars, "ddp_job_status")


def odd_ones(values: dict) -> dict:
    """``{reference, odd}``: the most common value of ``{host: value}`` (None ignored; a tie goes
    to the value seen first; None when every value is None) and the hosts that differ from it."""
    counts = Counter(v for v in values.values() if v is not None)
    reference = counts.most_common(1)[0][0] if counts else None
    return {"reference": reference, "odd": [h for h, v in values.items() if v is not None and v != reference]}
