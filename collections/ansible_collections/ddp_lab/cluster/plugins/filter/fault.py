"""Filters of the fault role and kill-node.yml: the run's engine, agent command lines compared
without the per-laptop options, kill-node.yml's settings against the role's argument spec, the
target and the nodes still training, and the measurement's inputs and one-line outcome."""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from ansible.module_utils.common.arg_spec import ArgumentSpecValidator
from ansible_collections.ddp_lab.cluster.plugins.module_utils.hostvars import host_values
from ddplab import engines
from ddplab.runstate import WORDS, node_states, stopped_at
from jinja2 import Environment
from jinja2.filters import do_truncate

ENGINES = tuple(engines.ENGINES)  # the registry of ddplab.engines: torchelastic, per_step, diloco
#: Jinja's own truncate filter needs an environment (its default leeway policy; Ansible's is 5)
JINJA = Environment(autoescape=False)  # noqa: S701  (plain text for a fail_msg, not HTML)
# what a value of an argument spec type must be, in the words of a one-line refusal
KINDS = {"int": "an integer", "float": "a number", "bool": "true or false", "dict": "a mapping",
         "list": "a list", "path": "a path", "str": "a string"}


def without_options(argv: Sequence[Any], options: Iterable[str]) -> list[str]:
    """``argv`` (strings) without each option in ``options`` and its value (``--opt value`` or
    ``--opt=value``); everything else in order."""
    drop, out, value_next = set(options), [], False
    for arg in map(str, argv):
        if not (value_next or arg in drop or arg.split("=", 1)[0] in drop):
            out.append(arg)
        value_next = not value_next and arg in drop  # the next word is this option's value
    return out


def run_engine(run_config: Mapping[str, Any] | None) -> str:
    """The recovery engine of a run from its ``run.json``: ``fault_tolerance``, ``torchelastic`` when
    absent (ddplab.config's default). Raises ValueError on an engine not in ``ddplab.engines`` or
    when ``run_config`` is not a mapping."""
    if not isinstance(run_config, Mapping):
        raise ValueError(f"run.json is not a JSON object: {run_config!r:.80}")
    engine = str(run_config.get("fault_tolerance") or "torchelastic")
    if engine not in ENGINES:
        raise ValueError(f"run.json names the engine {engine!r}, not one of {', '.join(ENGINES)}")
    return engine


def agent_states(progress: Mapping[str, Any], stop: Mapping[str, Any] | None = None) -> dict[str, str]:
    """Host -> how kill-node.yml names its agent: :data:`ddplab.runstate.WORDS` of its
    :func:`ddplab.runstate.node_states` state, ``stopped by stop.yml at HH:MM:SS`` for a host the
    run's ``stop`` event names, ``down`` for a host not read. ``progress``: host -> its
    ``node_status`` result (skipped: not read)."""
    words = {**WORDS, "stopped": stopped_at(stop), "unreachable": "down", "error": "down"}
    read = {h: r if isinstance(r, Mapping) and r.get("state") and not r.get("skipped")
            else {"state": "unreachable"} for h, r in progress.items()}
    return {h: words[s] for h, s in node_states(read, stop).items()}


def checked_settings(options: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """The options of an argument spec that :func:`argument_problems` checks: those of type int,
    float or bool or with choices (the others take any string from ``-e``)."""
    typed = ("int", "float", "bool")
    return sorted(k for k, o in options.items() if o.get("type") in typed or "choices" in o)


def argument_problems(values: Mapping[str, Any], options: Mapping[str, Mapping[str, Any]],
                      names: Mapping[str, str] | None = None) -> list[str]:
    """One line per setting of ``values`` that the argument spec ``options`` refuses (Ansible's
    ArgumentSpecValidator), e.g. ``rank=abc is not an integer; fix: -e rank=<an integer>``; names
    the spec does not know are left alone. ``names``: a variable's name as the user gives it
    (``fault_rank`` -> ``rank``), default its own."""
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


def resolve(progress: Mapping[str, Any], stop: Mapping[str, Any] | None, node: str, rank: Any,
            mode: str) -> dict[str, Any]:
    """Who kill-node.yml targets and who is still training, from each trainer's ``node_status``
    result (``progress``: host -> result in the inventory's order; None or skipped: not read), the
    run's ``stop`` event, ``node`` (``fault_node``, '' when the rank names the target), ``rank``
    (< 0: none) and ``mode`` (``rejoin``: a rejoining node holds no rank yet).

    Returns ``active`` (hosts whose agent runs), ``workers`` (every read host's newest worker
    records, oldest first), ``states`` (:func:`agent_states`), ``agents`` (``"host state, ..."``),
    ``rank_holders`` (active nodes whose worker holds ``rank``), ``ranks`` (``"node=rank, ..."`` of
    the active workers, or ``none``), ``target`` (``node``, else the last rank holder, else None),
    ``target_rank`` and ``world_size`` (None: unknown), ``others`` (active hosts but the target),
    ``probe`` (the first other active host, else the target) and ``finished``
    (:func:`finished_group`). Raises ValueError when ``rank`` is not an integer.
    """
    rank = int(rank)
    results = {h: r if isinstance(r, Mapping) else {} for h, r in progress.items()}
    active = [h for h, r in results.items() if (r.get("agent") or {}).get("running")]
    workers = sorted((w for r in results.values() for w in r.get("workers") or []),
                     key=lambda w: w.get("time") or 0)
    running = [w for w in workers if w.get("node") in active]
    holders = [w["node"] for w in running if rank >= 0 and w.get("rank") == rank]
    target = node or (holders[-1] if holders else None)
    mine = [w.get("rank") for w in workers if w.get("node") == target]
    states = agent_states(results, stop)
    others = [h for h in active if h != target]
    return {
        "active": active, "workers": workers, "states": states,
        "agents": ", ".join(f"{h} {s}" for h, s in states.items()),
        "rank_holders": holders,
        "ranks": ", ".join(f"{w['node']}={w.get('rank')}" for w in running) or "none",
        "target": target,
        "target_rank": None if mode == "rejoin" or not mine else mine[-1],
        "world_size": running[-1].get("world_size") if running else None,
        "others": others, "probe": (others + [target])[0],
        "finished": finished_group(results),
    }


def finished_group(progress: Mapping[str, Any]) -> dict[str, Any]:
    """``{hosts, step}``: the hosts whose ``progress.finished`` says the group finished the run
    (``progress``: host -> its ``node_status`` result), and the largest step among them (None)."""
    read = {h: r.get("progress") for h, r in progress.items() if isinstance(r, Mapping)}
    done = {h: p for h, p in read.items() if isinstance(p, Mapping) and p.get("finished")}
    steps = [int(p["step"]) for p in done.values() if isinstance(p.get("step"), int)]
    return {"hosts": list(done), "step": max(steps) if steps else None}


def finished_refusal(plan: Mapping[str, Any], mode: str, run_id: str,
                     summary: Mapping[str, Any] | None = None) -> str:
    """kill-node.yml's one line when the run is finished (``plan``: :func:`resolve`): the step its
    group ended at, that the fault has nothing to act on, every agent's state, and the fix.
    ``summary``: the ``ansible.builtin.stat`` of the run's summary.json on the controller, which
    exists once the run was collected (None: not looked at)."""
    done = plan.get("finished") or {}
    step = done.get("step")
    what = (f"a rejoin of {plan.get('target')} has nothing to join" if mode == "rejoin"
            else f"there is no training to inject {mode} into")
    collected = summary.get("path") if summary and summary.get("exists") else None
    result = (f"its result and report are collected ({collected})" if collected else
              f"collect it (playbooks/collect.yml -e collect_run_id={run_id}) for its result and report")
    return (f"run {run_id} is finished: its group ended at step {'?' if step is None else step} "
            f"({', '.join(done.get('hosts') or [])}); {what} (agents: {plan.get('agents')}); fix: "
            f"nothing to recover: {result}, or start a new run with site.yml")


def intent(plan: Mapping[str, Any], check_mode: bool, mode: str, run_id: str, duration_s: Any,
           timeout_s: Any) -> str:
    """What kill-node.yml is about to do (or would, in ``check_mode``), in one line: the fault, the
    target of ``plan`` (:func:`resolve`) with rank and world size, the run, the duration of a timed
    fault (``duration_s`` > 0), the node watched and for how long."""
    rank, size = ("?" if plan.get(k) is None else plan[k] for k in ("target_rank", "world_size"))
    lasting = f" for {duration_s} s" if float(duration_s or 0) > 0 else ""
    return (f"{'Would inject' if check_mode else 'Injecting'} {mode} into {plan['target']}"
            f" (rank {rank}, world size {size})"
            f" of run {run_id}{lasting}; watching from {plan['probe']} for up to {timeout_s} s")


def wait_timeout(mode: str, given_s: Any, default_s: Mapping[str, Any], duration_s: Any) -> int:
    """How long kill-node.yml waits for the recovery, in s: ``given_s`` when > 0, else
    ``default_s[mode]`` plus ``duration_s``. Raises KeyError for a mode without a default,
    ValueError for a non-number."""
    given = int(float(given_s or 0))
    return given if given > 0 else int(float(default_s[mode])) + int(float(duration_s or 0))


def down_hosts(up: Mapping[str, Any]) -> str:
    """The hosts that are not up (``up``: host -> bool or None), comma-separated for ``python -m
    ddplab.controller.summary faults --down``."""
    return ",".join(h for h, is_up in up.items() if not is_up)


def measured_lines(table: Sequence[str], run_dir: str, report: bool) -> list[str]:
    """The measurement's output (``table``: the lines ``summary faults`` printed), a blank line and
    where summary.json is, and report.html when it exists (``report``)."""
    where = [f"summary: {run_dir}/summary.json"] + ([f"report: {run_dir}/report.html"] if report else [])
    return [*table, "", *where]


# torchrun's "Root Cause" block, e.g. "  exitcode  : -9 (pid: 12186)  (SIGKILL)"
_ROOT_CAUSE = re.compile(r"exitcode\s+:\s*([^\n]+)")


def agent_end(host: str, unit: Mapping[str, Any] | None, journal: str | None) -> str:
    """How one agent ended: ``host: ActiveState``, ``(exit N)`` for a non-zero ExecMainStatus,
    ``torchrun gave up (no restart left)`` when its ``journal`` tail holds ChildFailedError, and the
    exit code of the last ``exitcode :`` line of torchrun's Root Cause block."""
    unit, journal = unit or {}, journal or ""
    status = str(unit.get("ExecMainStatus", "0"))
    roots = _ROOT_CAUSE.findall(journal)
    return "".join([
        f"{host}: {unit.get('ActiveState', '?')}",
        f" (exit {status})" if status != "0" else "",
        ", torchrun gave up (no restart left)" if "ChildFailedError" in journal else "",
        f", first failed worker: exit code {' '.join(roots[-1].split())}" if roots else "",
    ])


def not_recovered(progress: Mapping[str, Any], run_id: str, mode: str, target: str, target_rank: Any,
                  timeout_s: Any, ends: Mapping[str, Any], unit: str) -> str:
    """The one-line failure of a fault the job did not recover from: the run, whether it ended
    (``progress``: ``node_status``'s result, mode until) or did not recover within ``timeout_s``, the
    fault and target, each agent's end (``ends``: host -> :func:`agent_end` or None), the last
    failure record (200 characters) and the fix."""
    ended = progress.get("phase") == "ended"
    cause = str((progress.get("measure") or {}).get("cause") or "none")
    agents = "; ".join(str(end or host) for host, end in ends.items())
    rank = f" (rank {target_rank})" if target_rank is not None else ""
    # the watched node's job ended, but an agent still runs elsewhere: the job is not over
    training = [h for h, end in ends.items() if str(end or "").startswith(f"{h}: active")]
    if ended and training:
        how = "lost sight of the job"
        fix = (f"The job still runs on {', '.join(training)}: the node watched ended (another fault there?);"
               " `ansible-playbook status.yml` shows the job")
    elif ended:
        how = "ended"
        fix = ("The job is over; fix: start a new run with site.yml (more faults per run need a higher"
               " ddp_job_max_restarts)")
    else:
        how = f"did not recover within {timeout_s} s"
        fix = f"Fix: look at journalctl -u {unit} on the nodes, or wait longer (-e fault_wait_timeout_s=...)"
    return (f"run {run_id} {how} after {mode} of {target}{rank}. Agents: {agents}."
            f" Last failure record: {do_truncate(JINJA, cause, 200, leeway=5)}. {fix}")


def partition_rules(peers: Iterable[Any], chain: str, scope: str = "all", rendezvous_address: Any = "",
                    ports: Iterable[Any] = ()) -> str:
    """The rule set that cuts a node off, in ``iptables-restore`` form, applied with ``--noflush``
    as one commit (so the cut is in place at once, not rule by rule): table ``filter``; ``chain``
    declared (made, or emptied when it is left from an earlier partition); in it DROP of all
    traffic from and to each of ``peers`` (the other trainers' addresses) and, ``scope`` ``all``,
    of TCP to and from ``rendezvous_address`` on each of ``ports`` (the store's, the lighthouse's);
    then INPUT and OUTPUT jump to it first. Raises ValueError on an empty cut (no peer, and scope
    not ``all`` or no rendezvous address) or a value that would break the rule set (whitespace)."""
    peers = [str(p) for p in peers]
    ports = [str(p) for p in ports] if scope == "all" and str(rendezvous_address or "") else []
    values = [chain, *peers, *ports, *([str(rendezvous_address)] if ports else [])]
    if any(v.split() != [v] for v in values):
        raise ValueError(f"partition rules: an empty value or one with whitespace among {values}")
    if not peers and not ports:
        raise ValueError("partition rules: nothing to cut off (no peer address, no rendezvous port)")
    rules = [f"-A {chain} -{flag} {addr} -j DROP" for addr in peers for flag in ("s", "d")]
    rules += [f"-A {chain} -p tcp -m tcp -{a} {rendezvous_address} --{p} {port} -j DROP"
              for port in ports for a, p in (("s", "sport"), ("d", "dport"))]
    jumps = [f"-I {builtin} 1 -j {chain}" for builtin in ("INPUT", "OUTPUT")]
    return "\n".join(["*filter", f":{chain} - [0:0]", *rules, *jumps, "COMMIT", ""])


class FilterModule:
    """Ansible filter plugin entry point."""

    def filters(self) -> dict:
        return {"fault_without_options": without_options, "fault_run_engine": run_engine,
                "fault_argument_problems": argument_problems, "fault_checked_settings": checked_settings,
                "fault_agent_states": agent_states, "fault_host_values": host_values,
                "fault_resolve": resolve, "fault_wait_timeout": wait_timeout, "fault_down_hosts": down_hosts,
                "fault_agent_end": agent_end, "fault_not_recovered": not_recovered, "fault_intent": intent,
                "fault_measured_lines": measured_lines,
                "fault_finished_refusal": finished_refusal, "fault_partition_rules": partition_rules}
