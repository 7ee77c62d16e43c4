"""Action plugin ``ddp_job_status_table``: the cluster's state as one table (``status.yml``).

Runs on the controller, once. Prints one row per laptop (:func:`row_of`) under a heading naming
the run and its engine, each last failure too long for its cell whole under the table, then the
rendezvous store's line and (under a lighthouse engine, or when it runs) the torchft lighthouse's,
then where their state was read (:func:`where_lines`). Fails (one line) when a node's state is
one of :data:`ddplab.runstate.BAD_STATES`.

Options: ``nodes`` (inventory name -> its ``node_status`` result, mode once; skipped or missing:
no run to look at), ``store`` / ``lighthouse`` (``python -m ddplab.controller.<rdzv_store|lighthouse>
status`` documents, {} when not read), ``run_id`` (the run looked at), ``width`` (columns,
default 160), ``stop`` (the run's stop event, filter ``ddp_job_stop_event``; {} when not stopped),
``state_dir`` (the folder the services' state was read in).

Returns ``rows``, ``store_line``, ``lighthouse_line`` ("" when not shown), ``engine``, ``bad`` and
``table`` (the text printed); when it fails, only ``msg``.
"""

from __future__ import annotations

import io
from collections.abc import Mapping, Sequence
from typing import Any

from ansible.plugins.action import ActionBase
from ansible.utils.display import Display
from ddplab.engines import replica_groups
from ddplab.runstate import BAD_STATES, WORDS, node_state, node_states, stopped_at
from ddplab.status import fmt
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


def row_of(host: str, res: Mapping[str, Any] | None, stop: Mapping[str, Any] | None = None,
           state: str | None = None) -> dict[str, Any]:
    """One table row from a node's ``node_status`` result (None or skipped: ``no job``) in state
    ``state`` (default :func:`ddplab.runstate.node_state` with the run's ``stop`` event).

    Returns ``{node, agent, run, step, loss, val, ws, rank, tok/s, restarts, last step s, last
    failure, engine}``, all strings: ``agent`` the state's word (:data:`ddplab.runstate.WORDS`),
    ``engine`` the node's recovery engine ("" when unknown).
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
    if state in ("unreachable", "error"):  # keep the cause after "... reached over ssh: "
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
        "loss": fmt(p.get("loss"), ".3f"),
        "val": fmt(p.get("val_loss"), ".3f"),
        "ws": fmt(p.get("world_size"), "d"),
        "rank": fmt(p.get("rank"), "d"),
        "tok/s": fmt(p.get("tokens_per_s"), ",.0f"),
        "restarts": fmt(p.get("restart_count"), "d"),
        "last step s": fmt(p.get("step_age_s"), ".0f"),
        "last failure": str(failure).strip().splitlines()[0] if str(failure).strip() else "",
        "engine": str(p.get("engine") or ""),
    }


def service_line(label: str, doc: Mapping[str, Any], more: str = "") -> str:
    """A supervised controller service (``ddplab.controller.supervisor`` status document) in one
    line, e.g. ``rendezvous store: running on port 29400 at 10.89.0.1 (answering, supervisor pid
    123, restarts 0, serving run R)``, ``... stopped (port 29400)`` or ``... not running; port P is
    held by ...``; ``more`` goes inside the brackets of a running one, before its ``note``."""
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
    found = f"; {doc['note']}" if doc.get("note") else ""
    return (f"{label}: running on port {port} at {doc.get('host', '?')} ({answer}, "
            f"supervisor pid {doc.get('supervisor_pid') or '-'}, restarts {restarts}{run}{more}{found})")


def with_served_run(doc: Mapping[str, Any], nodes: Mapping[str, Any], key: str, run_id: str = ""
                    ) -> dict[str, Any]:
    """``doc`` (a running service's status document) with the run it serves: its own ``run_id``,
    else ``run_id`` (the run looked at) when a node runs it with its agents pointed at the service's
    port (ddplab.status ``endpoints[key]``, ``key`` store or lighthouse)."""
    port = doc.get("port")
    if not doc.get("running") or doc.get("run_id") or not run_id or port is None:
        return dict(doc)
    pointed = [h for h, r in nodes.items() if node_state(r, h) == "running"
               and _port(str(((r or {}).get("endpoints") or {}).get(key) or "")) == int(port)]
    return {**doc, "run_id": run_id} if pointed else dict(doc)


def store_line(store: Mapping[str, Any], owner: str = "") -> str:
    """The rendezvous store in one line (:func:`service_line`), ``owner`` after the label."""
    return service_line("rendezvous store" + (f" ({owner})" if owner else ""), store)


def lighthouse_line(lighthouse: Mapping[str, Any], owner: str = "") -> str:
    """The torchft lighthouse in one line (:func:`service_line`), ``owner`` after the label, with
    the quorum when it has one (``quorum id 4, participants laptop-a, laptop-b``: replica ids
    without torchft's ``:<uuid>``)."""
    more = ""
    if lighthouse.get("quorum_id") is not None:
        names = [str(p.get("replica_id")).split(":", 1)[0] for p in lighthouse.get("participants") or []]
        more = f", quorum id {lighthouse['quorum_id']}, participants {', '.join(names) or 'none'}"
    return service_line("torchft lighthouse" + (f" ({owner})" if owner else ""), lighthouse, more)


def _other_runs(nodes: Mapping[str, Any]) -> dict[str, list[str]]:
    """Run -> the hosts whose agent unit belongs to it when that is not the run looked at
    (ddplab.status ``unit_holds_run`` False, ``current_run``)."""
    others: dict[str, list[str]] = {}
    for host, res in nodes.items():
        if (res or {}).get("unit_holds_run") is False:
            others.setdefault(str(res.get("current_run") or "another run"), []).append(host)
    return dict(sorted(others.items()))


def services_owner(nodes: Mapping[str, Any], run_id: str = "") -> str:
    """Whose store and lighthouse the lines show when the run looked at is not the laptops'
    current job: ``the laptops' current job's, run R2; not run R1's``; "" otherwise."""
    current = _other_runs(nodes)
    if not current:
        return ""
    return f"the laptops' current job's, run {', '.join(current)}; not run {run_id or '?'}'s"


def engine_of(rows: Sequence[Mapping[str, str]]) -> str:
    """The recovery engine(s) the nodes report, joined by ``/``; "" when no node has started."""
    return "/".join(sorted({r.get("engine", "") for r in rows} - {""}))


def lighthouse_engine(engine: str) -> bool:
    """Whether :func:`engine_of` names an engine under the torchft lighthouse (no controller store)."""
    return any(replica_groups(name) for name in engine.split("/"))


def render(rows: Sequence[Mapping[str, str]], store: Mapping[str, Any], run_id: str = "",
           width: int = 160, lighthouse: Mapping[str, Any] | None = None, owner: str = "") -> str:
    """The table as plain text (``rich``, one line per node; see the module docstring); ``owner``
    (:func:`services_owner`) goes in the services' lines."""
    engine = engine_of(rows)
    title = (f"run {run_id}" if run_id else "no run") + (f" (engine {engine})" if engine else "")
    table = Table(box=box.SIMPLE_HEAD, title=title, title_justify="left", pad_edge=False)
    # the failure's cell gets what the other columns leave (3 characters between, 2 at the edges)
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
    """Where the services' state was read (``state_dir``), and a line with the fix for each service
    the run's launch recorded on another port (ddplab.status ``endpoints``) or that ``state_dir``
    says is not running while the run runs (started from another checkout)."""
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
    """One line when the run looked at is not the one the laptops' agent units belong to, naming
    the run each of those laptops runs; "" otherwise."""
    others = _other_runs(nodes)
    if not others:
        return ""
    where = "; ".join(f"{', '.join(hosts)}: run {run}" for run, hosts in others.items())
    return (f"run {run_id or '?'} is not the laptops' current job (their agent unit belongs to {where}): "
            "its rows are read from its own records (ended, failed, interrupted, stopped)")


def rows_of(nodes: Mapping[str, Any], stop: Mapping[str, Any] | None = None) -> list[dict[str, Any]]:
    """The table's rows (:func:`row_of`) of ``nodes``, each in its state by
    :func:`ddplab.runstate.node_states` (which also knows ``cut_off``)."""
    return [row_of(h, nodes[h], stop, s) for h, s in node_states(nodes, stop).items()]


def bad_nodes(rows: Sequence[Mapping[str, str]]) -> list[str]:
    """``node: agent`` of every row whose state makes status.yml fail (failed, unreachable, error)."""
    return [f"{r['node']}: {r['agent']}" for r in rows if r["agent"] in BAD]


class ActionModule(ActionBase):
    """See the module docstring."""

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
