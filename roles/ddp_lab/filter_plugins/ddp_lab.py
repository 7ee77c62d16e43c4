"""Filters of the ddp_lab defaults role: which run a playbook acts on (``tasks/run_id.yml``)."""

from __future__ import annotations

import base64
import binascii
import os
import re
import secrets
from collections.abc import Iterable, Mapping
from datetime import UTC, datetime
from typing import Any

# A run id names a folder on every node and on the controller, and is torchrun's --rdzv-id.
RUN_ID = re.compile(r"^[A-Za-z0-9._-]{1,64}$")
SOURCES = ("link", "nodes", "new")


def new_run_id(now: datetime | None = None, token: str | None = None) -> str:
    """A fresh run id ``<UTC date>-<time>-<4 hex>``, e.g. ``20261129-171502-3fa1``.

    ``now`` (aware or naive-UTC datetime) and ``token`` (4 hex digits) are for tests; by default the
    current UTC time and 16 random bits (``secrets.token_hex(2)``).
    """
    when = (now or datetime.now(UTC)).astimezone(UTC)
    return f"{when:%Y%m%d-%H%M%S}-{token or secrets.token_hex(2)}"


def _node_run(result: Any) -> str:
    """The run id in a ``slurp`` result of a node's ``current_run`` ('' when skipped, unreadable,
    unreachable or not base64)."""
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
    is not 1-64 of ``[A-Za-z0-9._-]`` (it names folders and the rendezvous).
    """
    if isinstance(candidates, (str, bytes)) or candidates is None:
        candidates = [candidates]
    found = next((str(c).strip() for c in candidates if c is not None and str(c).strip()), "")
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
        raise ValueError(f"run id {found!r} is not 1-64 of the characters A-Z a-z 0-9 . _ -")
    return found


class FilterModule:
    """ddp_lab filters."""

    def filters(self):
        return {"ddp_lab_run_id": resolve_run_id, "ddp_lab_new_run_id": new_run_id}
