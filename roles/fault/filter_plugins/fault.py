"""Filters of the fault role: the run's recovery engine (from the node's run.json), agent command
lines compared without the options whose values differ from laptop to laptop
(tasks/rejoin-launch.yml), and the check of kill-node.yml's settings against the role's argument
spec, once and in one line each."""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from ansible.module_utils.common.arg_spec import ArgumentSpecValidator

ENGINES = ("torchelastic", "per_step")
# what a value of an argument spec type must be, in the words of a one-line refusal
KINDS = {"int": "an integer", "float": "a number", "bool": "true or false", "dict": "a mapping",
         "list": "a list", "path": "a path", "str": "a string"}


def without_options(argv: Sequence[Any], options: Iterable[str]) -> list[str]:
    """``argv`` (strings) without each option in ``options`` and the value that follows it
    (``--opt value``) or is attached to it (``--opt=value``); everything else in order."""
    drop = set(options)
    out: list[str] = []
    skip = False
    for arg in map(str, argv):
        if skip:
            skip = False
            continue
        if arg in drop:
            skip = True
            continue
        if arg.split("=", 1)[0] in drop and "=" in arg:
            continue
        out.append(arg)
    return out


def run_engine(run_config: Mapping[str, Any] | None) -> str:
    """The recovery engine of a run from its configuration, the node's ``run.json`` (the file
    ``ddplab.train --config`` reads; ddp_job writes it at the launch and a resume): its
    ``fault_tolerance``, ``torchelastic`` when absent (ddplab.config's default: a torchelastic run's
    run.json has no engine keys). Raises ValueError on an engine that is not one of
    ``torchelastic``, ``per_step``, or when ``run_config`` is not a mapping."""
    if not isinstance(run_config, Mapping):
        raise ValueError(f"run.json is not a JSON object: {run_config!r:.80}")
    engine = str(run_config.get("fault_tolerance") or "torchelastic")
    if engine not in ENGINES:
        raise ValueError(f"run.json names the engine {engine!r}, not one of {', '.join(ENGINES)}")
    return engine


def agent_states(progress: Mapping[str, Any], stop: Mapping[str, Any] | None = None) -> dict[str, str]:
    """Host -> how kill-node.yml names its agent: ``running``; ``stopped by stop.yml at HH:MM:SS``
    for a host the run's ``kind: stop`` event names whose agent no longer runs (the event as the
    ``ddp_job_stop_event`` filter finds it: the fact status.yml and collect label the run "stopped"
    from); else the agent unit's state and sub-state (``failed``, ``inactive dead``); ``down`` for a
    host that was not read (off, unreachable).

    ``progress``: host -> its ``ddp_lab_progress`` result (skipped or unreachable: not read);
    ``stop``: the stop event ({} or None when the run was not stopped)."""
    stop = stop or {}
    stopped = set(stop.get("hosts") or [])
    when = time.strftime("%H:%M:%S", time.localtime(float(stop.get("time") or 0)))
    out: dict[str, str] = {}
    for host, res in progress.items():
        res = res if isinstance(res, Mapping) else {}
        if res.get("skipped") or res.get("unreachable") or "agent_state" not in res:
            out[host] = "down"
        elif res.get("agent_running"):
            out[host] = "running"
        elif host in stopped:
            out[host] = f"stopped by stop.yml at {when}"
        else:
            unit = dict.fromkeys(str(res.get(k) or "") for k in ("agent_state", "agent_substate"))
            out[host] = " ".join(unit).strip()
    return out


def checked_settings(options: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """The options of an argument spec that :func:`argument_problems` checks: those of type int,
    float or bool or with choices (a string from ``-e`` must convert or match). The others take
    any string, and their defaults may need the role's own variables (``role_path``)."""
    typed = ("int", "float", "bool")
    return sorted(k for k, o in options.items() if o.get("type") in typed or "choices" in o)


def argument_problems(values: Mapping[str, Any], options: Mapping[str, Mapping[str, Any]],
                      names: Mapping[str, str] | None = None) -> list[str]:
    """One line per setting in ``values`` that the argument spec ``options`` (a role's
    ``meta/argument_specs.yml`` entry point's options) refuses, e.g. ``rank=abc is not an integer;
    fix: -e rank=<an integer>`` ([] when every one passes).

    ``values``: variable name -> value (names the spec does not know are left alone); ``names``: a
    variable's name as the user gives it (``fault_rank`` -> ``rank``: kill-node.yml's -e names),
    default the variable's own. The check is Ansible's own (ArgumentSpecValidator, as a role's
    argument validation), run once by the play instead of once per host with the whole spec
    printed.
    """
    out: list[str] = []
    for var in sorted(set(values) & set(options)):
        spec = {var: {k: v for k, v in options[var].items() if k in ("type", "choices", "elements")}}
        if not ArgumentSpecValidator(spec).validate({var: values[var]}).error_messages:
            continue
        shown = (names or {}).get(var, var)
        choices = [str(c) for c in spec[var].get("choices") or []]
        if choices:
            out.append(f"{shown}={values[var]} must be one of {', '.join(choices)}; "
                       f"fix: -e {shown}=<{'|'.join(choices)}>")
            continue
        kind = KINDS.get(str(spec[var].get("type", "str")), f"of type {spec[var].get('type')}")
        out.append(f"{shown}={values[var]} is not {kind}; fix: -e {shown}=<{kind}>")
    return out


class FilterModule:
    """Ansible filter plugin entry point."""

    def filters(self) -> dict:
        return {"fault_without_options": without_options, "fault_run_engine": run_engine,
                "fault_argument_problems": argument_problems, "fault_checked_settings": checked_settings,
                "fault_agent_states": agent_states}
