"""Action plugin ``settings``: settings judged by their roles' own contracts (module_utils/settings.py),
one line per problem.

Options: ``roles`` (whose settings; specs in ``<roles_dir>/<role>/meta/argument_specs.yml``),
``roles_dir`` (default: the folder of the calling role), ``trainers`` (how many the inventory has;
0: the checks that count them are left out), ``mode``:

- ``host`` (default): this host's settings as given (inventory, group_vars, -e), else their roles'
  defaults: ``records`` (types, ranges, each check); with ``fail: true`` every problem fails the
  task in one line instead.
- ``given``: every -e value (read from ansible-playbook's command line) once, and the values of each
  host of ``hosts``: ``records`` (:func:`settings.given`).

Both return ``defaults``: each setting's default by its role's spec, rendered (None when it cannot be).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import yaml
from ansible.errors import AnsibleActionFail, AnsibleError
from ansible.module_utils.parsing.convert_bool import boolean
from ansible.plugins.action import ActionBase
from ansible.template import trust_as_template
from ansible.utils.vars import load_extra_vars
from ansible_collections.ddp_lab.cluster.plugins.module_utils import settings

_UNSET = object()


def _value(found: Any, name: str) -> Any:
    """``found[name]`` (``found``: ``hostvars[host]``) rendered for that host, as plain data;
    :data:`_UNSET` when the host has no such variable or cannot render it yet."""
    try:
        return json.loads(json.dumps(found[name])) if name in found else _UNSET
    except (AnsibleError, TypeError, ValueError):
        return _UNSET


def _trusted(value: Any) -> Any:
    """``value`` (a default read from a spec file) with every string trusted as a template."""
    if isinstance(value, str):
        return trust_as_template(value)
    if isinstance(value, dict):
        return {k: _trusted(v) for k, v in value.items()}
    return [_trusted(v) for v in value] if isinstance(value, list) else value


class ActionModule(ActionBase):
    """See the module docstring."""

    _requires_connection = False

    def _defaults(self, raw: dict[str, dict[str, Any]], roles_dir: Path, task_vars: dict) -> dict:
        """Every role's spec defaults rendered as its own run would (its ``role_path``; given settings
        win over the defaults they template from)."""
        chained = {n: _trusted(v) for defaults in raw.values() for n, v in defaults.items()}
        out = {}
        for role, defaults in raw.items():
            env = {**chained, **task_vars, "role_path": str(roles_dir / role)}
            templar = self._templar.copy_with_new_env(available_variables=env)
            for name, value in defaults.items():
                try:
                    out[name] = json.loads(json.dumps(templar.template(_trusted(value))))
                except (AnsibleError, TypeError, ValueError):
                    out[name] = None
        return out

    def run(self, tmp=None, task_vars=None):
        task_vars = task_vars or {}
        result = super().run(tmp, task_vars)
        args = self._task.args
        roles = list(args.get("roles") or [])
        here = Path(task_vars.get("role_path", ".")).parent  # the calling role's folder's
        roles_dir = Path(os.path.abspath(args.get("roles_dir") or here))
        specs = {r: yaml.safe_load((roles_dir / r / "meta/argument_specs.yml").read_text()) for r in roles}
        options, rules = settings.spec_options(specs), settings.role_rules(roles)
        defaults = self._defaults(settings.spec_defaults(specs), roles_dir, task_vars)
        trainers = int(args.get("trainers") or 0)
        hv = task_vars["hostvars"]
        if args.get("mode", "host") == "given":
            everywhere = list(args.get("hosts") or []) or [task_vars["inventory_hostname"]]
            records = self._given(options, rules, defaults, trainers, hv, everywhere)
        else:
            mine = hv[task_vars["inventory_hostname"]]
            given = {n: v for n in options if (v := _value(mine, n)) is not _UNSET}
            values = {n: self._templar.template(task_vars[n]) if n in task_vars else defaults.get(n)
                      for n in settings.rule_names(rules)}
            records = settings.host_records(task_vars["inventory_hostname"], given, values, options, rules,
                                            trainers)
            problems = [r["detail"] for r in records if r["status"] == "fail"]
            if problems and boolean(args.get("fail", False), strict=False):
                raise AnsibleActionFail("; ".join(problems))
        result.update({"changed": False, "records": records, "defaults": defaults})
        return result

    def _given(self, options: dict, rules: list, defaults: dict, trainers: int, hv: Any,
               everywhere: list[str]) -> list[dict]:
        """:func:`settings.given` of the -e values (``load_extra_vars``) and of each host of
        ``everywhere``; a value each host renders its own way is judged per host."""
        names = sorted(set(options) | set(settings.run_ids.RUN_ID_VARS))
        hosts: dict[str, dict[str, Any]] = {h: {} for h in everywhere}
        extra: dict[str, Any] = {}
        given_with_e = set(load_extra_vars(self._loader))
        host_vars = {h: hv[h] for h in everywhere}  # each one's variables, gathered once
        for name in names:
            seen = {h: v for h in everywhere if (v := _value(host_vars[h], name)) is not _UNSET}
            first = next(iter(seen.values()), None)
            if name in given_with_e and seen and all(v == first for v in seen.values()):
                extra[name] = first
            else:  # set in the inventory, or an -e template each host renders its own way: per host
                for h, v in seen.items():
                    hosts[h][name] = v
        return settings.given(options, rules, hosts, extra, defaults, trainers,
                              sorted(given_with_e - set(extra)))
