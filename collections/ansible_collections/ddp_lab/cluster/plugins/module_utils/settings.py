"""Settings judged by their roles' own contracts, one line per problem: the role's argument spec
(``meta/argument_specs.yml``, entry point ``main``) and the ``SETTINGS`` rules of its filter module
(``ansible_collections.ddp_lab.cluster.plugins.filter.<role>``), for the action ``settings``.

A rule is a range ``{name, min?, above?, max?, why?}`` (``min``/``max`` inclusive, ``above``
exclusive) or a check of settings together ``{check, run, reads, trainers?, unless?}``:
``run(host, **args)`` returns a record, each argument the value of the variable ``reads`` names
for it, plus ``trainers`` (how many the inventory has; 0: the check is left out) with
``trainers: true``; the check is left out while the variable ``unless`` is set.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping, Sequence
from typing import Any

from ansible.module_utils.common.arg_spec import ArgumentSpecValidator
from ansible_collections.ddp_lab.cluster.plugins.module_utils import run_ids

FIX = "fix: correct it in the inventory, group_vars or -e"
EXTRA = "-e"


def record(check: str, problem: str | None, ok_detail: str, status: str = "fail") -> dict:
    """``{check, status, detail}``: ``status`` with ``problem`` as detail, else ok with ``ok_detail``."""
    return {"check": check, "status": status if problem else "ok", "detail": problem or ok_detail}


def _main(spec: Mapping[str, Any]) -> dict[str, Any]:
    """The options of a parsed argument_specs.yml's ``main`` entry point."""
    return spec["argument_specs"]["main"].get("options") or {}


def spec_options(specs: Mapping[str, Any]) -> dict[str, tuple[str, dict]]:
    """``{variable: (role, option)}`` of every role's ``main`` options (``specs``: ``{role: parsed
    argument_specs.yml}``), without default, description and ``required``; sub-options alike."""
    def strip(option: Mapping[str, Any]) -> dict:
        out = {k: v for k, v in option.items()
               if k not in ("default", "description", "version_added", "required")}
        if isinstance(out.get("options"), dict):
            out["options"] = {name: strip(sub) for name, sub in out["options"].items()}
        return out

    return {name: (role, strip(option)) for role, spec in specs.items()
            for name, option in _main(spec).items()}


def spec_defaults(specs: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """``{role: {variable: default}}`` of the ``main`` options that have one (templates unrendered)."""
    return {role: {name: option["default"] for name, option in _main(spec).items() if "default" in option}
            for role, spec in specs.items()}


def role_rules(roles: Sequence[str]) -> list[dict]:
    """The ``SETTINGS`` of each role's filter module, in the order of ``roles`` (none without)."""
    rules: list[dict] = []
    for role in roles:
        try:
            module = importlib.import_module(f"ansible_collections.ddp_lab.cluster.plugins.filter.{role}")
        except ModuleNotFoundError:
            continue
        rules += getattr(module, "SETTINGS", [])
    return rules


def rule_names(rules: Sequence[Mapping[str, Any]]) -> set[str]:
    """Every variable ``rules`` read (a range's name, a check's ``reads`` and ``unless``)."""
    return {n for r in rules for n in [r.get("name"), r.get("unless"), *(r.get("reads") or {}).values()] if n}


def _want(option: Mapping[str, Any]) -> str:
    want = option.get("type", "str")
    if option.get("elements"):
        want += f" of {option['elements']}"
    if option.get("choices"):
        want += " among " + ", ".join(map(str, option["choices"]))
    return want


def type_problem(name: str, value: Any, options: Mapping[str, tuple[str, dict]]) -> str:
    """'' or what is wrong with ``value`` of ``name`` and the fix: its form for a run id
    (module_utils/run_ids.py), else Ansible's own words on its type (``ArgumentSpecValidator``)."""
    if name in run_ids.RUN_ID_VARS:
        problem = run_ids.run_id_problem(value, name)
        if problem:  # "<name> '<value>' is not a run id: <form>; fix: ..." without the name
            return "not a run id: " + problem.split(" is not a run id: ", 1)[1]
    if name not in options:
        return ""
    role, option = options[name]
    result = ArgumentSpecValidator({name: dict(option)}).validate({name: value})
    error = " ".join(" ".join(str(m).split()) for m in result.error_messages)
    return error and f"{error}; fix: give {name} a {_want(option)} (roles/{role}/README.md)"


def range_problems(values: Mapping[str, Any], rules: Sequence[Mapping[str, Any]],
                   skip: Sequence[str] = ()) -> list[str]:
    """Range violations, one text each: ``"ddp_job_stop_timeout_s = 0 must be > 0"``, or ``... is not
    a number``; names missing from ``values`` (or None there) or in ``skip`` are left out."""
    out = []
    for rule in rules:
        name = rule.get("name")
        if name is None or name in skip or values.get(name) is None:
            continue
        value = values[name]
        try:
            if isinstance(value, bool):
                raise ValueError
            number = float(value)
        except (TypeError, ValueError):
            out.append(f"{name} = {value!r} is not a number")
            continue
        limits = [(number >= rule["min"], f">= {rule['min']}")] if "min" in rule else []
        limits += [(number > rule["above"], f"> {rule['above']}")] if "above" in rule else []
        limits += [(number <= rule["max"], f"<= {rule['max']}")] if "max" in rule else []
        if not all(ok for ok, _ in limits):
            why = f" ({rule['why']})" if rule.get("why") else ""
            out.append(f"{name} = {value} must be {' and '.join(text for _, text in limits)}{why}")
    return out


def left_out(rule: Mapping[str, Any], values: Mapping[str, Any], bad: Sequence[str], trainers: int) -> bool:
    """Whether the check ``rule`` is left out: a setting it reads is in ``bad`` (its type failed),
    it needs the trainers and ``trainers`` is 0, or its ``unless`` variable is set."""
    failed_type = set(rule["reads"].values()) & set(bad)
    return bool(failed_type or (rule.get("trainers") and not trainers) or values.get(rule.get("unless")))


def run_check(host: str, rule: Mapping[str, Any], values: Mapping[str, Any], trainers: int) -> dict:
    """The record of the check ``rule`` on ``values`` (see the module docstring)."""
    args = {arg: values.get(name) for arg, name in rule["reads"].items()}
    return rule["run"](host, **args, **({"trainers": trainers} if rule.get("trainers") else {}))


def judge(host: str, values: Mapping[str, Any], rules: Sequence[Mapping[str, Any]], trainers: int = 0,
          bad: Sequence[str] = ()) -> list[dict]:
    """One host's ``values`` against ``rules``: one ``ranges`` record per violation (else one ok
    record), then each check's record; ``bad``: settings whose type failed, left out."""
    found = [record("ranges", f"{host}: {p}; {FIX}", "") for p in range_problems(values, rules, bad)]
    out = found or [record("ranges", None, "ports in 1024-65535; timeouts, intervals and counts in range")]
    return out + [run_check(host, r, values, trainers) for r in rules
                  if "check" in r and not left_out(r, values, bad, trainers)]


def host_records(host: str, given: Mapping[str, Any], values: Mapping[str, Any],
                 options: Mapping[str, tuple[str, dict]], rules: Sequence[Mapping[str, Any]],
                 trainers: int = 0) -> list[dict]:
    """One host's rows: the types of the settings it is ``given`` (one fail record with ``name`` per
    problem, else one ok record), then :func:`judge` of ``values`` (given, else the defaults)."""
    bad = {n: p for n in sorted(given) if (p := type_problem(n, given[n], options))}
    types = [{"check": "types", "status": "fail", "name": n, "detail": f"{host}: {n}={given[n]!r}: {p}"}
             for n, p in bad.items()]
    ok = f"{len(given)} setting(s) given; their types match the roles' argument specs"
    return (types or [record("types", None, ok)]) + judge(host, values, rules, trainers, list(bad))


def given(options: Mapping[str, tuple[str, dict]], rules: Sequence[Mapping[str, Any]],
          hosts: Mapping[str, Mapping[str, Any]], extra: Mapping[str, Any],
          defaults: Mapping[str, Any] | None = None, trainers: int = 0,
          per_host_e: Sequence[str] = ()) -> list[dict]:
    """The settings given, judged once before any role starts: ``extra`` (-e, the same on every
    host) and ``hosts`` (``{host: {variable: value}}`` from the inventory; ``per_host_e``: -e
    templates each host renders its own way, named "-e, as rendered there"), with ``options``
    (:func:`spec_options`), ``rules``, ``defaults`` (rendered) and ``trainers``.

    Returns one fail record (check ``given``) per problem: an -e value once (``-e NAME=VALUE: ...``)
    against its type or run id form, its range and each check it alone decides (every setting the
    check reads given with -e or set on no host); an inventory value of the wrong type once for the
    hosts that share it (``t-a, t-b: NAME=VALUE (inventory): ...``). Else one ok record.
    """
    names = set(options) | set(run_ids.RUN_ID_VARS)
    failed, bad = [], set()
    for name in sorted(set(extra) & names):
        if problem := type_problem(name, extra[name], options):
            bad.add(name)
            failed.append(f"{EXTRA} {name}={extra[name]!r}: {problem}")
    shared: dict[tuple[str, str, str], list[str]] = {}
    for host, values in hosts.items():
        for name in sorted((set(values) & names) - set(extra)):
            if problem := type_problem(name, values[name], options):
                shared.setdefault((name, repr(values[name]), problem), []).append(host)
    for (name, shown, problem), where in shared.items():
        origin = "-e, as rendered there" if name in per_host_e else "inventory"
        failed.append(f"{', '.join(where)}: {name}={shown} ({origin}): {problem}")
    mine = {n: v for n, v in extra.items() if n not in bad}
    failed += [f"{EXTRA}: {p}; {FIX}" for p in range_problems(mine, rules)]
    set_somewhere = {n for values in hosts.values() for n in values}
    everyone = {**(defaults or {}), **mine}
    anywhere = {**everyone, **{n: v for values in hosts.values() for n, v in values.items() if v}}
    for rule in (r for r in rules if "check" in r):
        reads = set(rule["reads"].values())
        if (reads & set(mine) and not (reads - set(extra)) & set_somewhere
                and not left_out(rule, anywhere, sorted(bad), trainers)):
            found = run_check(EXTRA, rule, everyone, trainers)
            failed += [found["detail"]] if found["status"] == "fail" else []
    ok = f"{len(extra)} setting(s) given with -e, {len(set_somewhere)} in the inventory: accepted"
    return [record("given", d, "") for d in failed] or [record("given", None, ok)]
