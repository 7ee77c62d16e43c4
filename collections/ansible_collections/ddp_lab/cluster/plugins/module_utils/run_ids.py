"""The run id: its form (:data:`RUN_ID`), the variables that take one, a fresh id, and which run a
playbook acts on (:func:`resolve_run_id`)."""

from __future__ import annotations

import base64
import binascii
import os
import re
import secrets
from collections.abc import Iterable, Mapping
from datetime import UTC, datetime
from typing import Any

# A run id names the folder runs/<run id> on every node and on the controller, and is torchrun's
# --rdzv-id: no '/', and no leading '.' ('.', '..' and the controller's runs/.rdzv, runs/.live).
RUN_ID = re.compile(r"^[A-Za-z0-9_-][A-Za-z0-9._-]{0,63}$")
RUN_ID_RULE = "1-64 of the characters A-Z a-z 0-9 . _ -, not starting with '.'"
# The variables that take a run id: the playbooks' -e run_id and the roles' settings.
RUN_ID_VARS = ("run_id", "ddp_job_resume_run_id", "ddp_job_run_id", "collect_run_id", "fault_run_id",
               "report_run_id")
SOURCES = ("link", "nodes", "new")


def run_id_problem(value: Any, name: str = "run id") -> str:
    """'' when ``value`` is a run id (:data:`RUN_ID`) or not given ('' or None), else one line naming
    ``name`` (the variable), the value, the form and the fix."""
    text = "" if value is None else str(value).strip()
    if not text or RUN_ID.match(text):
        return ""
    return (f"{name} {text!r} is not a run id: a run id is {RUN_ID_RULE} (it names the folder"
            " runs/<run id> on the controller and on every node); fix: give the id of a run, e.g."
            " 20261201-080234-3daa (ls runs/ on the controller)")


def run_id_problems(candidates: Any, given: Mapping[str, Any] | None = None) -> list[str]:
    """One line (:func:`run_id_problem`) per bad run id among ``candidates`` (a list, or one id),
    each named by the first variable of :data:`RUN_ID_VARS` that holds it in ``given`` (a host's
    vars; else "run id")."""
    given = given if isinstance(given, Mapping) else {}
    lines = []
    for value in _listed(candidates):
        text = "" if value is None else str(value).strip()
        names = [n for n in RUN_ID_VARS if n in given and str(given.get(n) or "").strip() == text]
        lines.append(run_id_problem(text, names[0] if names else "run id"))
    return [line for line in dict.fromkeys(lines) if line]


def _listed(candidates: Any) -> list:
    """``candidates`` as a list: one id (or None) alone."""
    return [candidates] if isinstance(candidates, (str, bytes)) or candidates is None else list(candidates)


def new_run_id(now: datetime | None = None, token: str | None = None) -> str:
    """A fresh run id ``<UTC date>-<time>-<4 hex>``, e.g. ``20261129-171502-3fa1``, of ``now``
    (default the current time) and ``token`` (default 16 random bits)."""
    when = (now or datetime.now(UTC)).astimezone(UTC)
    return f"{when:%Y%m%d-%H%M%S}-{token or secrets.token_hex(2)}"


def _node_run(result: Any) -> str:
    """The run id in a ``slurp`` result of a node's ``current_run`` ('' when there is none)."""
    if not isinstance(result, Mapping) or not result.get("content"):
        return ""
    try:
        return base64.b64decode(str(result["content"])).decode("utf-8", "replace").strip()
    except (binascii.Error, ValueError):
        return ""


def resolve_run_id(candidates: Any, sources: Iterable[str] = (), link: Any = None,
                   node_results: Iterable[Any] = ()) -> str:
    """The run a playbook acts on: the first non-empty of ``candidates`` (explicit ids, highest
    priority first: e.g. ``-e run_id``, a resume id), else the first of ``sources`` that yields one:

    - ``link``: the run ``runs/current`` points at (``link``: ``ansible.builtin.stat``'s ``stat``
      of the symlink, or its target as a string; the target's basename);
    - ``nodes``: the first node's ``current_run`` (``node_results``: ``slurp`` results, any order
      of reachable, skipped or failed ones);
    - ``new``: a fresh id (:func:`new_run_id`).

    Returns '' when nothing yields one. Raises ValueError for an unknown source, or when the id found
    is not a run id (:data:`RUN_ID`).
    """
    found = next((str(c).strip() for c in _listed(candidates) if c is not None and str(c).strip()), "")
    for source in sources if not found else ():
        if source not in SOURCES:
            raise ValueError(f"ddp_lab_run_id: unknown source {source!r}; known: {', '.join(SOURCES)}")
        if source == "link":
            target = link.get("lnk_source") or link.get("lnk_target") if isinstance(link, Mapping) else link
            found = os.path.basename(str(target or "").rstrip("/"))
        elif source == "nodes":
            found = next((r for r in map(_node_run, node_results or ()) if r), "")
        else:
            found = new_run_id()
        if found:
            break
    if found and not RUN_ID.match(found):
        raise ValueError(f"run id {found!r} is not {RUN_ID_RULE}")
    return found
