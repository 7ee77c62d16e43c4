"""Filters of the ddp_job role: which worker logs ``logs.yml`` shows, the input it takes, and
whether stop.yml stopped the run the watch followed."""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from typing import Any

# torchrun --log-dir D writes D/<run id>_<random>/attempt_<restart>/<local rank>/stderr.log
# (torch.distributed.elastic.multiprocessing.api: one folder per launch and per restart).
STDERR = re.compile(r"/attempt_(\d+)/(\d+)/stderr\.log$")


def local_ranks_of(workers: Iterable[Mapping[str, Any]], rank: Any = None) -> list[int]:
    """The local ranks of this node's workers (``ddplab.status`` ``workers``: the newest record of
    each) that hold global ``rank`` now; every local rank when ``rank`` is None or ''.

    A node whose workers wrote no record yet has none: ``[]``.
    """
    out = []
    for w in workers or []:
        if rank in (None, "") or (w.get("rank") is not None and int(w["rank"]) == int(rank)):
            out.append(int(w.get("local_rank") or 0))
    return sorted(set(out))


def newest_stderr(files: Iterable[Mapping[str, Any]], local_ranks: Iterable[int]) -> list[str]:
    """The path of the newest ``stderr.log`` (by mtime) of each local rank in ``local_ranks``,
    from ``ansible.builtin.find``'s ``files`` (dicts with ``path`` and ``mtime``); a local rank
    without a log is left out."""
    wanted = {int(r) for r in local_ranks}
    best: dict[int, tuple[float, str]] = {}
    for f in files or []:
        m = STDERR.search(str(f.get("path", "")))
        if not m or int(m.group(2)) not in wanted:
            continue
        lr, key = int(m.group(2)), float(f.get("mtime") or 0.0)
        if lr not in best or key >= best[lr][0]:
            best[lr] = (key, f["path"])
    return [best[lr][1] for lr in sorted(best)]


def logs_input_problems(node: Any, hosts: Iterable[str], rank: Any = None, lines: Any = None) -> list[str]:
    """What is wrong with ``logs.yml``'s input (``-e node= rank= lines=``), one message per
    problem (``[]``: good). ``node`` must be one of ``hosts``; ``rank`` empty/None or an integer
    >= 0; ``lines`` a positive integer."""
    hosts = list(hosts)
    problems = []
    if node in (None, ""):
        problems.append(f"name the laptop: -e node=<one of {', '.join(hosts)}>")
    elif str(node) not in hosts:
        problems.append(f"node={node} is not in the group 'trainers' (one of {', '.join(hosts)})")
    if rank not in (None, "") and not re.fullmatch(r"\d+", str(rank)):
        problems.append(f"rank={rank} is not a global rank (an integer >= 0)")
    if lines is not None and not re.fullmatch(r"[1-9]\d*", str(lines).strip()):
        problems.append(f"lines={lines} is not a positive integer")
    return problems


def stop_event(events_text: Any) -> dict[str, Any]:
    """The ``kind: stop`` event stop.yml wrote for the run's newest launch, or {}.

    ``events_text``: the text of ``runs/<run_id>/events.jsonl`` (one JSON object per line; '' or
    None when the file is missing). A stop counts when it comes after the newest ``kind: launch``
    or ``kind: resume`` line in file order (the stops of earlier launches of a resumed run do not);
    torn or foreign lines are skipped.
    ddplab.controller.rundir.run_outcome labels the collected run "stopped" from the same event.
    """
    found: dict[str, Any] = {}
    for line in str(events_text or "").splitlines():
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if not isinstance(event, dict):
            continue
        if event.get("kind") in ("launch", "resume"):
            found = {}
        elif event.get("kind") == "stop":
            found = event
    return found


class FilterModule:
    """The filters above, named ddp_job_*."""

    def filters(self):
        return {
            "ddp_job_local_ranks": local_ranks_of,
            "ddp_job_newest_stderr": newest_stderr,
            "ddp_job_logs_input_problems": logs_input_problems,
            "ddp_job_stop_event": stop_event,
        }
