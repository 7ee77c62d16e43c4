"""Filters of the fault role: the run's recovery engine, and agent command lines compared without
the options whose values differ from laptop to laptop (tasks/rejoin-launch.yml)."""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from typing import Any

ENGINES = ("torchelastic", "per_step")


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


class FilterModule:
    """Ansible filter plugin entry point."""

    def filters(self) -> dict:
        return {"fault_without_options": without_options, "fault_run_engine": run_engine}
