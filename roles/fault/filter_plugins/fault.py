"""Filters of the fault role: the run's recovery engine, agent command lines compared without
the options whose values differ from laptop to laptop (tasks/rejoin-launch.yml), and the check of
kill-node.yml's settings against the role's argument spec, once and in one line each."""

from __future__ import annotations

import json
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


def run_engine(events_text: str | None) -> str:
    """The recovery engine of a run from its ``events.jsonl`` text (one JSON object a line): the
    ``engine`` of the newest ``launch`` or ``resume`` event, ``torchelastic`` when none names one
    (runs launched before the engine existed). Unreadable lines are skipped. Raises ValueError on
    an engine that is not one of ``torchelastic``, ``per_step``."""
    engine = "torchelastic"
    for line in (events_text or "").splitlines():
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if isinstance(event, dict) and event.get("kind") in ("launch", "resume") and event.get("engine"):
            engine = str(event["engine"])
    if engine not in ENGINES:
        raise ValueError(f"events.jsonl names the engine {engine!r}, not one of {', '.join(ENGINES)}")
    return engine


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
                "fault_argument_problems": argument_problems, "fault_checked_settings": checked_settings}
