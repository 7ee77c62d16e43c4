"""Action plugin ``ddp_job_status_table``: the cluster's state as one table (``status.yml``).

Runs on the controller, once. Takes what ``node_status`` (mode once) read on every trainer
and the rendezvous store's ``python -m ddplab.controller.rdzv_store status`` document, prints one
row per laptop (agent state, run id, step / max steps, train and val loss, world size, rank,
tokens/s, restarts, seconds since the last step, last failure) under a heading that names the run
and its recovery engine (one line per node at the default width; a last failure too long for its
cell is printed whole under the table, ``<node>: <reason>``), then the store's line and (per_step
engine, or when it runs) the torchft lighthouse's, and fails (one line) when a node is unreachable,
its state could not be read, or its job failed. A node whose agent stop.yml stopped (it is named
in the run's ``kind: stop`` event, the ``ddp_job_stop_event`` filter: the one home the watch and
collect read too) reads ``stopped``, not failed, and is well.

Options: ``nodes`` (inventory name -> the registered ``node_status`` result; a skipped or
missing result means no run to look at), ``store`` (the store document, {} when not read),
``lighthouse`` (``python -m ddplab.controller.lighthouse status``, {} when not read), ``run_id``
(the run looked at, for the heading), ``width`` (columns of the table, default 160), ``stop``
(the run's stop event, ``ddp_job_stop_event`` of its events.jsonl; {} when it was not stopped),
``state_dir`` (the folder the store's and lighthouse's state was read in: said under the table,
with a line for each service the run's launch recorded elsewhere: :func:`where_lines`).

Returns ``rows`` (one dict per node: see :func:`row_of`), ``store_line``, ``lighthouse_line``
("" when not shown), ``engine``, ``bad`` (the nodes that make it fail: then only ``msg``, one
line) and ``table`` (the text printed).
"""

from __future__ import annotations

import io
from collections.abc import Mapping, Sequence
from typing import Any

from ansible.plugins.action import ActionBase
from ansible.utils.display import Display
from ddplab.engines import replica_groups
from ddplab.runstate import BAD_STATES, WORDS, node_state, node_states, stopped_at
from rich import box
from rich.console import Console
from rich.table import Table
from rich.text import Text

display = Display()


ARGS = {
    "nodes": {"type": "dict", "required": True},
    "store": {"type": "dict", "default": {}},
    "lighthouse": {"type": "dict", "default": {}},
    "run_id": {"type": "str", "default": ""},
    "width": {"type": "int", "default": 160},
    "stop": {"type": "dict", "default": {}},
    "state_dir": {"type": "str", "default": ""},
}

# the words of the node states that make status.yml exit non-zero
BAD = tuple(WORDS[s] for s in BAD_STATES)
COLUMNS = ("node", "agent", "run", "step", "loss", "val", "ws", "rank", "tok/s", "restarts",
           "last step s", "last failure")


def _f(v: Any, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def row_of(host: str, res: Mapping[str, Any] | None, stop: Mapping[str, Any] | None = None,
           state: str | None = None) -> dict[str, Any]:
    """One table row from a node's ``node_status`` result (mode once), in state ``state`` (default
    :func:`ddplab.runstate.node_state`; :func:`rows_of` gives every node's, ``cut_off`` too).

    ``res`` None or skipped: no run to look at (``no job``). ``stop``: the run's stop event (the
    ``ddp_job_stop_event`` filter's result): a failed node it names, or an absent one (its unit
    dropped), was stopped by stop.yml (the SIGTERM ended its agent), as the watch (tasks/watch.yml)
    and collect label it. Returns ``{node,
    agent, run, step, loss, val, ws, rank, tok/s, restarts, last step s, last failure, engine}``,
    all strings (``engine``: the node's recovery engine, "" when unknown); ``agent`` is the state's
    word (:data:`ddplab.runstate.WORDS`).
    """
    res = res or {}
    state = state or node_state(res, host, stop)
    p = res.get("progress") or {}
    failure = p.get("failure") or ""
    if state == "stopped":
        failure = stopped_at(stop)
    if state == "failed" and not failure:  # ended without a failure record (killed, OOM, ...)
        unit = res.get("unit") or {}
        failure = f"agent unit {unit.get('Result', '?')}, exit status {unit.get('ExecMainStatus', '?')}"
    if state in ("unreachable", "error"):
        # the cause is at the end of a connection error ("... reached over ssh: ssh: connect to host
        # 10.89.0.14 port 22: No route to host"): keep that part
        failure = str(res.get("error") or res.get("msg") or state).strip().splitlines()[0]
        failure = failure.rsplit("reached over ssh: ", 1)[-1]
    total = p.get("max_steps") or "?"
    step = "-" if p.get("step") is None else f"{p['step']}/{total}"
    if state == "running" and p.get("step") is None:  # right after a launch: rendezvous, data, model
        step = "no step yet" if p.get("run_id") else "starting"
    return {
        "node": host,
        "agent": WORDS.get(state, state),
        "run": p.get("run_id") or "-",
        "step": step,
        "loss": _f(p.get("loss"), ".3f"),
        "val": _f(p.get("val_loss"), ".3f"),
        "ws": _f(p.get("world_size"), "d"),
        "rank": _f(p.get("rank"), "d"),
        "tok/s": _f(p.get("tokens_per_s"), ",.0f"),
        "restarts": _f(p.get("restart_count"), "d"),
        "last step s": _f(p.get("step_age_s"), ".0f"),
        "last failure": str(failure).strip().splitlines()[0] if str(failure).strip() else "",
        "engine": str(p.get("engine") or ""),
    }


def service_line(label: str, doc: Mapping[str, Any], more: str = "") -> str:
    """A supervised controller service (``ddplab.controller.supervisor`` status document) in one
    line, e.g. ``rendezvous store: running on port 29400 at 10.89.0.1 (answering, supervisor pid
    123, restarts 0, serving run R)`` or ``rendezvous store: stopped (port 29400)``; ``serving run``
    when the run is known (``run_id``: :func:`with_served_run`); ``more`` is appended inside the
    brackets of a running one, then the ``note`` of one found by its port (no pidfile: whose it
    is); a port another program (or checkout) holds reads ``not running; port P is held by ...``."""
    if not doc:
        return f"{label}: not read"
    port = doc.get("port", "?")
    if doc.get("error"):
        return f"{label}: unknown on port {port} ({doc['error']})"
    if not doc.get("running"):
        if doc.get("held_by"):  # not this service, but the port serves: never "stopped" then
            return f"{label}: not running; port {port} is held by {doc['held_by']}"
        return f"{label}: stopped (port {port})"
    answer = "answering" if doc.get("answering") else "NOT answering"
    restarts = "?" if doc.get("restarts") is None else doc["restarts"]
    run = f", serving run {doc['run_id']}" if doc.get("run_id") else ""
    # found by its port, not by a pidfile: whose it is (ddplab.controller.supervisor.holder_text)
    found = f"; {doc['note']}" if doc.get("note") else ""
    return (f"{label}: running on port {port} at {doc.get('host', '?')} ({answer}, "
            f"supervisor pid {doc.get('supervisor_pid') or '-'}, restarts {restarts}{run}{more}{found})")


def with_served_run(doc: Mapping[str, Any], nodes: Mapping[str, Any], key: str, run_id: str = ""
                    ) -> dict[str, Any]:
    """``doc`` (a running service's status document) with the run it serves: its run record's
    (``run_id``, ddplab.controller.supervisor.served_run), else ``run_id`` (the run looked at) when
    a trainer runs it with its agents pointed at the service's port (ddplab.status ``endpoints``
    ``key``: ``store`` or ``lighthouse``, as the launch that started them recorded it). Unchanged
    when neither tells."""
    if not doc.get("running") or doc.get("run_id") or not run_id:
        return dict(doc)
    port = doc.get("port")
    if port is None:
        return dict(doc)
    pointed = [h for h, r in nodes.items() if node_state(r, h) == "running"
               and _port(str(((r or {}).get("endpoints") or {}).get(key) or "")) == int(port)]
    return {**doc, "run_id": run_id} if pointed else dict(doc)


def store_line(store: Mapping[str, Any], owner: str = "") -> str:
    """The rendezvous store in one line (:func:`service_line`); ``owner`` (:func:`services_owner`)
    says whose it is after the label."""
    return service_line("rendezvous store" + (f" ({owner})" if owner else ""), store)


def lighthouse_line(lighthouse: Mapping[str, Any], owner: str = "") -> str:
    """The torchft lighthouse in one line (:func:`service_line`), with the quorum when it answers:
    ``, quorum id 4, participants laptop-a, laptop-b``. A participant is named by its replica id
    without the ``:<uuid>`` torchft's Manager appends to it (the node's name). ``owner``: as for
    :func:`store_line`."""
    more = ""
    if lighthouse.get("quorum_id") is not None:
        names = [str(p.get("replica_id")).split(":", 1)[0] for p in lighthouse.get("participants") or []]
        more = f", quorum id {lighthouse['quorum_id']}, participants {', '.join(names) or 'none'}"
    return service_line("torchft lighthouse" + (f" ({owner})" if owner else ""), lighthouse, more)


def services_owner(nodes: Mapping[str, Any], run_id: str = "") -> str:
    """Whose store and lighthouse the lines show when the run looked at is not the laptops'
    current job (``status.yml -e run_id=<older run>``: an agent unit belongs to another run,
    ddplab.status ``unit_holds_run`` False; the controller keeps one store and one lighthouse, the
    current job's): ``the laptops' current job's, run R2; not run R1's``. "" otherwise."""
    current = sorted({str((r or {}).get("current_run") or "another run") for r in nodes.values()
                      if (r or {}).get("unit_holds_run") is False})
    if not current:
        return ""
    return f"the laptops' current job's, run {', '.join(current)}; not run {run_id or '?'}'s"


def engine_of(rows: Sequence[Mapping[str, str]]) -> str:
    """The recovery engine the nodes report (``torchelastic``, ``per_step``; several joined by
    ``/``; "" when no node has started)."""
    return "/".join(sorted({r.get("engine", "") for r in rows} - {""}))


def lighthouse_engine(engine: str) -> bool:
    """Whether the nodes' engine(s) (:func:`engine_of`, several joined by ``/``) include one under
    the torchft lighthouse (per_step, diloco), which uses no controller store."""
    return any(replica_groups(name) for name in engine.split("/"))


def render(rows: Sequence[Mapping[str, str]], store: Mapping[str, Any], run_id: str = "",
           width: int = 160, lighthouse: Mapping[str, Any] | None = None, owner: str = "") -> str:
    """The table (``rich``, plain text without colour codes; one line per node) under a heading
    naming the run and its engine, then ``<node>: <last failure>`` whole for every node whose
    failure was too long for its cell, the store's line below it (per_step: only when a store runs)
    and the lighthouse's when the engine is per_step or it runs; ``owner`` (:func:`services_owner`)
    says in both lines whose they are when the run is not the laptops' current job."""
    engine = engine_of(rows)
    title = (f"run {run_id}" if run_id else "no run") + (f" (engine {engine})" if engine else "")
    table = Table(box=box.SIMPLE_HEAD, title=title, title_justify="left", pad_edge=False)
    # one line per node where the width allows: the failure's cell gets what the other columns
    # leave (3 characters between columns, 2 at the edges) and cuts; a cut failure is printed whole
    # below the table
    others = sum(max([len(c), *(len(str(r[c])) for r in rows)]) + 3 for c in COLUMNS[:-1])
    for c in COLUMNS:
        last = c == "last failure"
        table.add_column(c, justify="right" if c in ("step", "loss", "val", "ws", "rank", "tok/s",
                                                     "restarts", "last step s") else "left",
                         overflow="ellipsis" if last else "fold", no_wrap=last,
                         max_width=max(12, width - others - 2) if last else None)
    for r in rows:  # cells as Text: a failure line like "[/…/pair.cc:553] …" is not rich markup
        table.add_row(*(Text(str(r[c])) for c in COLUMNS))
    buf = io.StringIO()
    console = Console(file=buf, width=width, color_system=None, force_terminal=False, legacy_windows=False)
    console.print(table)
    shown = buf.getvalue().splitlines()
    for r in rows:  # the whole reason of each row whose cell cut it, one line each (not wrapped)
        failure = r["last failure"]
        if failure and not any(line.startswith(f" {r['node']} ") and failure in line for line in shown):
            console.print(Text(f"{r['node']}: {failure}"), soft_wrap=True)
    if not lighthouse_engine(engine) or store.get("running"):  # they use no controller store
        console.print(store_line(store, owner), markup=False, highlight=False)
    if lighthouse_engine(engine) or (lighthouse or {}).get("running"):
        console.print(lighthouse_line(lighthouse or {}, owner), markup=False, highlight=False)
    return "\n".join(line.rstrip() for line in buf.getvalue().splitlines()).strip("\n")


def _port(endpoint: str) -> int | None:
    """The port of ``host:port`` or ``http://host:port`` (None when there is none)."""
    tail = str(endpoint).rstrip("/").rsplit(":", 1)
    return int(tail[1]) if len(tail) == 2 and tail[1].isdigit() else None


def where_lines(nodes: Mapping[str, Any], store: Mapping[str, Any], lighthouse: Mapping[str, Any],
                state_dir: str = "", run_id: str = "") -> list[str]:
    """Where the store's and lighthouse's state was read (the supervisor's state folder on this
    controller, ``state_dir``), and a line for each service the run's launch recorded elsewhere
    (ddplab.status ``endpoints``: the lighthouse of its run.json, the store of its agent's command
    line) or that the folder says is not running while the run runs: it was started with other
    settings or from another checkout, whose folder holds its state."""
    lines = [f"store and lighthouse state read in {state_dir or '?'} on this controller"]
    running = any(node_state(r, h) == "running" for h, r in nodes.items())
    for key, label, doc, var in (("store", "store", store, "rendezvous_port"),
                                 ("lighthouse", "lighthouse", lighthouse, "rendezvous_lighthouse_port")):
        seen = {str(e): h for h, r in nodes.items() if (e := ((r or {}).get("endpoints") or {}).get(key))}
        for endpoint, host in sorted(seen.items()):
            port, read = _port(endpoint), doc.get("port")
            what = f"run {run_id or '?'}'s {label} {endpoint} (recorded on {host})"
            fix = "-e rendezvous_state_dir=<the checkout that launched it>/runs/.rdzv"
            if port is not None and read is not None and port != int(read):
                lines.append(f"{what} is not the one read here (port {read}); "
                             f"fix: -e {var}={port} (and {fix})")
            elif running and doc and not doc.get("running") and not doc.get("error"):
                lines.append(f"{what} runs, but {state_dir or '?'} has no running one: launched from another "
                             f"checkout? fix: {fix}")
    return lines


def other_run_note(nodes: Mapping[str, Any], run_id: str = "") -> str:
    """One line when the run looked at is not the one the laptops' agent units belong to (an
    older run: ``status.yml -e run_id=<older run>``), naming the run each of those laptops runs
    (ddplab.status ``current_run``); "" otherwise."""
    others: dict[str, list[str]] = {}
    for host, res in nodes.items():
        if (res or {}).get("unit_holds_run") is False:
            others.setdefault(str(res.get("current_run") or "another run"), []).append(host)
    if not others:
        return ""
    where = "; ".join(f"{', '.join(hosts)}: run {run}" for run, hosts in sorted(others.items()))
    return (f"run {run_id or '?'} is not the laptops' current job (their agent unit belongs to {where}): "
            "its rows are read from its own records (ended, failed, interrupted, stopped)")


def rows_of(nodes: Mapping[str, Any], stop: Mapping[str, Any] | None = None) -> list[dict[str, Any]]:
    """The table's rows (:func:`row_of`) of ``nodes`` (host -> ``node_status`` result), each in its
    state by :func:`ddplab.runstate.node_states`: a per_step replica cut off from a group that
    finished the run reads ``cut off`` (well), as kill-node.yml names it."""
    return [row_of(h, nodes[h], stop, s) for h, s in node_states(nodes, stop).items()]


def bad_nodes(rows: Sequence[Mapping[str, str]]) -> list[str]:
    """``node: agent`` of every row whose state makes status.yml fail (failed, unreachable, error)."""
    return [f"{r['node']}: {r['agent']}" for r in rows if r["agent"] in BAD]


class ActionModule(ActionBase):
    """See the module docstring."""

    TRANSFERS_FILES = False
    _requires_connection = False

    def run(self, tmp=None, task_vars=None):
        result = super().run(tmp, task_vars)
        _, args = self.validate_argument_spec(argument_spec=ARGS)
        rows = rows_of(args["nodes"], args["stop"])
        args["store"] = with_served_run(args["store"], args["nodes"], "store", args["run_id"])
        args["lighthouse"] = with_served_run(args["lighthouse"], args["nodes"], "lighthouse", args["run_id"])
        owner = services_owner(args["nodes"], args["run_id"])
        text = render(rows, args["store"], args["run_id"], args["width"], args["lighthouse"], owner)
        note = other_run_note(args["nodes"], args["run_id"])
        text += f"\n{note}" if note else ""
        where = where_lines(args["nodes"], args["store"], args["lighthouse"], args["state_dir"],
                            args["run_id"])
        text += "\n" + "\n".join(where)
        display.display(text)
        bad = bad_nodes(rows)
        if bad:  # one line under the table: the failed result carries nothing else
            result.update({"changed": False, "failed": True,
                           "msg": f"not every laptop is well: {', '.join(bad)} (the table above says why)"})
            return result
        shown = lighthouse_engine(engine_of(rows)) or args["lighthouse"].get("running")
        result.update({"changed": False, "rows": rows, "store_line": store_line(args["store"], owner),
                       "lighthouse_line": lighthouse_line(args["lighthouse"], owner) if shown else "",
                       "engine": engine_of(rows), "bad": bad, "table": text})
        return result
