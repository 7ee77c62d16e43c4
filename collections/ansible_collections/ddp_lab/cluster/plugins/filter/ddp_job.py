"""Filters of the ddp_job role: which worker logs ``logs.yml`` shows and the input it takes, what
attach.yml does with the run looked at, and the role's rules for its settings (:data:`SETTINGS`,
judged by module_utils/settings.py)."""

from __future__ import annotations

import re
import time
from collections.abc import Iterable, Mapping
from typing import Any

from ansible_collections.ddp_lab.cluster.plugins.module_utils.hostvars import agent_ran_hosts, statuses_of
from ansible_collections.ddp_lab.cluster.plugins.module_utils.settings import record
from ddplab import config as ddplab_config
from ddplab.engines import LIGHTHOUSE_ENGINES
from ddplab.runstate import WORDS, node_state, stop_event, stopped_at, unit_tells_run

# torchrun --log-dir D writes D/<run id>_<random>/attempt_<restart>/<local rank>/stderr.log
# (torch.distributed.elastic.multiprocessing.api: one folder per launch and per restart).
STDERR = re.compile(r"/attempt_(\d+)/(\d+)/stderr\.log$")


def local_ranks_of(workers: Iterable[Mapping[str, Any]], rank: Any = None) -> list[int]:
    """The local ranks of this node's workers (``ddplab.status`` ``workers``) that hold global
    ``rank`` now (every one when ``rank`` is None or ''); ``[]`` before any record."""
    return sorted({int(w.get("local_rank") or 0) for w in workers or []
                   if rank in (None, "") or (w.get("rank") is not None and int(w["rank"]) == int(rank))})


def newest_stderr(files: Iterable[Mapping[str, Any]], local_ranks: Iterable[int]) -> list[str]:
    """The path of the newest ``stderr.log`` (by mtime) of each of ``local_ranks`` that has one,
    from ``ansible.builtin.find``'s ``files``."""
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
    """What is wrong with ``logs.yml``'s ``-e node= rank= lines=``, one message per problem: ``node``
    one of ``hosts``, ``rank`` empty or an integer >= 0, ``lines`` a positive integer."""
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


def stdout_log_of(stderr_path: Any) -> str:
    """The ``stdout.log`` beside a torchrun worker's ``stderr.log``; ValueError for another path."""
    path = str(stderr_path)
    if not STDERR.search(path):
        raise ValueError(f"not a torchrun worker's stderr.log: {path}")
    return path[: -len("stderr.log")] + "stdout.log"


def logs_rank_problem(workers: Iterable[Mapping[str, Any]], rank: Any, host: str, run_id: str = "") -> str:
    """logs.yml's refusal when ``rank`` ('' or None: any) is held by no worker of ``host``, naming
    the ranks its workers hold; '' when it is."""
    if rank in (None, "") or local_ranks_of(workers, rank):
        return ""
    held = ", ".join(str(w["rank"]) for w in workers or [] if w.get("rank") is not None) or "none"
    return (f"rank={rank} is not held by a worker on {host} in run {run_id or '(none)'} (its workers hold "
            f"ranks {held}); fix: pick the node from `ansible-playbook status.yml`, or leave rank out")


def _worker_of(workers: Iterable[Mapping[str, Any]], path: str) -> Mapping[str, Any]:
    """The newest record (``ddplab.status`` ``workers``) of the local rank whose log is ``path``."""
    m = STDERR.search(path)
    local = int(m.group(2)) if m else None
    return next((w for w in workers or [] if int(w.get("local_rank") or 0) == local), {})


def _tail(result: Mapping[str, Any]) -> list[str] | None:
    """The lines of a ``tail`` command's registered result; None when the file could not be read."""
    if result.get("rc") is None or int(result["rc"]) != 0:
        return None
    return list(result.get("stdout_lines") or [])


def logs_worker_messages(stderr_results: Iterable[Mapping[str, Any]],
                         stdout_results: Iterable[Mapping[str, Any]], lines: Any,
                         workers: Iterable[Mapping[str, Any]] | None = None, status_line: str = "",
                         run_dir: str = "", run_id: str = "", rank: Any = "") -> list[list[str]]:
    """What logs.yml shows of each worker of the node: one message (list of lines) per worker,
    from the registered ``tail`` results of its ``stderr.log`` and ``stdout.log`` (same order).
    ``workers``: ``ddplab.status`` ``workers``; ``status_line``: the node's progress line. A rank
    other than 0 prints no progress lines: its empty stdout says where they are and gives its newest
    record and ``status_line`` instead. Without any worker log: one message saying so."""
    stdout_results = list(stdout_results or [])
    out: list[list[str]] = []
    for i, err in enumerate(stderr_results or []):
        path = str(err.get("item"))
        worker = _worker_of(workers, path)
        msg = [f"{path} (last {lines} lines):"]
        msg += _tail(err) or ["no stderr output (a healthy worker writes none)"]
        out_res = stdout_results[i] if i < len(stdout_results) else {}
        msg.append(f"{stdout_log_of(path)} (last {lines} lines):")
        text = _tail(out_res)
        if text:
            msg += text
        elif worker.get("rank") not in (None, 0):
            msg.append(
                f"{'no stdout.log' if text is None else 'no stdout output'}: rank {worker['rank']} prints no "
                "progress lines; rank 0 prints them ([ddplab] lines, also in its laptop's journal): "
                "ansible-playbook logs.yml -e node=<the laptop of rank 0 in `ansible-playbook status.yml`> "
                "-e rank=0")
            msg.append(f"rank {worker['rank']}'s newest record: {worker.get('event')} at step "
                       f"{'-' if worker.get('step') is None else worker['step']}, world size "
                       f"{worker.get('world_size')}, restart {worker.get('restart_count')}, "
                       f"{max(0.0, time.time() - float(worker.get('time') or 0)):.0f} s ago")
            if status_line:
                msg.append(f"the node's progress: {status_line.strip()}")
        else:
            msg.append("no stdout.log" if text is None else
                       "no stdout output yet (rank 0 prints its first line after the rendezvous)")
        out.append(msg)
    if not out:
        rank_part = f" for rank {rank}" if str(rank or "") else ""
        out.append([f"no worker stderr of run {run_id or '(none)'} under {run_dir}/logs{rank_part}"])
    return out


def logs_journal_message(journal_lines: Iterable[str], unit: str, lines: Any) -> list[str]:
    """logs.yml's journal message: a heading naming the command, then the journal's lines."""
    return [f"journalctl -u {unit} (last {lines} lines):", *(journal_lines or ["no journal lines"])]


def running_hosts(hosts: Any, hostvars: Mapping[str, Any] | None = None) -> list[str]:
    """The hosts among ``hosts`` whose ``ddp_job_status`` says the run looked at still runs
    (:func:`ddplab.runstate.node_state`)."""
    return [h for h, res in statuses_of(hosts, hostvars).items() if node_state(res, h) == "running"]


def attach_plan(results: Mapping[str, Any], stop: Mapping[str, Any] | None = None,
                run_id: str = "") -> dict[str, Any]:
    """What attach.yml does with the run looked at, from every trainer's ``ddp_job_status`` and the
    run's ``stop`` event: ``{states, watch, other_job, line, problem}``. ``states``: host ->
    :func:`ddplab.runstate.node_state`; ``watch``: some agent unit speaks of the run
    (:func:`ddplab.runstate.unit_tells_run`); ``other_job``: a trainer's agent runs another run;
    ``line``: when not watched, how the run ended on each node; ``problem``: the refusal when no
    trainer has a job of the run, else ''."""
    states = {h: node_state(r, h, stop) for h, r in results.items()}
    watch = any(unit_tells_run(r) for r in results.values())
    others = sorted({str((r or {}).get("current_run") or "?") for r in results.values()
                     if (r or {}).get("unit_holds_run") is False and (r or {}).get("state") == "running"})
    line = ""
    if not watch:
        nodes = ", ".join(f"{h}: {WORDS.get(s, s)}" for h, s in states.items())
        when = f"; {stopped_at(stop)}" if (stop or {}).get("time") else ""
        line = (f"run {run_id} does not run any more ({nodes}{when}): nothing to follow; it is collected now"
                + (f" (the trainers' agents run run {', '.join(others)})" if others else ""))
    problem = ""
    if all(s in ("absent", "unreachable", "error") for s in states.values()):
        named = run_id or "(none: no runs/current, no current_run on the trainers)"
        problem = (f"no job of run {named} on any trainer; fix: start one with site.yml, or name the run "
                   "with -e run_id=<run id> (see runs/)")
    return {"states": states, "watch": watch, "other_job": bool(others), "line": line, "problem": problem}


def collect_hint(run_id: Any, run_tags: Iterable[str] = ("all",), skip_tags: Iterable[str] = ()) -> str:
    """The line a watched train phase (site.yml --tags train, attach.yml --skip-tags collect) ends
    with when this play does not collect the run (``run_tags`` / ``skip_tags``: Ansible's): the
    collect command; '' when the collect play runs, or without a run id (no run was settled)."""
    run_tags, skip_tags = set(run_tags or ("all",)), set(skip_tags or ())
    if not str(run_id or "") or ("collect" not in skip_tags and ("all" in run_tags or "collect" in run_tags)):
        return ""
    return (f"run {run_id} ended and is not collected by this play (--tags/--skip-tags); collect it "
            "(summary.json, the final report): ansible-playbook playbooks/collect.yml "
            f"-e collect_run_id={run_id}")


# The --rdzv-conf keys torch 2.13 reads (dynamic_rendezvous.create_handler, c10d backend); is_host is
# always false and set by the role.
RDZV_KEYS = ("join_timeout", "last_call_timeout", "close_timeout", "heartbeat_timeout", "keep_alive_interval",
             "keep_alive_max_attempt", "read_timeout")


def _positive(value: Any) -> bool:
    try:
        return float(value) > 0
    except (TypeError, ValueError):
        return False


def rdzv_conf(host: str, conf: Any, keys: Iterable[str] = RDZV_KEYS) -> dict:
    """torchrun's ``--rdzv-conf``: only keys torch reads, every value a positive number (s or count).
    ok detail: the argument as passed (``k=v,...``)."""
    keys = list(keys)
    good = isinstance(conf, Mapping) and not set(conf) - set(keys) and all(map(_positive, conf.values()))
    problem = None if good else (
        f"{host}: ddp_job_rdzv_conf {conf} has unknown keys or values that are not > 0; fix: use keys among "
        f"{', '.join(keys)} with positive numbers (seconds or counts)")
    return record("rdzv_conf", problem, ",".join(f"{k}={v}" for k, v in (conf or {}).items()) if good else "")


def nnodes(host: str, nmin: Any, nmax: Any, trainers: int) -> dict:
    """torchrun's elastic range ``--nnodes MIN:MAX``: 1 <= MIN <= MAX <= the trainers that exist."""
    lo, hi = int(nmin), int(nmax)
    if lo < 1:
        problem = (f"{host}: ddp_job_nnodes_min={nmin} must be at least 1; fix: set ddp_job_nnodes_min"
                   " to the fewest nodes the job may continue with (1 by default)")
    elif lo > hi:
        problem = (f"{host}: ddp_job_nnodes_min={nmin} is larger than ddp_job_nnodes_max={nmax} "
                   "(torchrun --nnodes MIN:MAX); fix: set MIN <= MAX")
    elif hi > int(trainers):
        problem = (f"{host}: ddp_job_nnodes_max={nmax} but the inventory has {trainers} trainer(s):"
                   " MAX counts nodes that exist;"
                   f" fix: set ddp_job_nnodes_max to at most {trainers} (the default)")
    else:
        problem = None
    return record("nnodes", problem, f"--nnodes {nmin}:{nmax} with {trainers} trainer(s)")


def train_config(host: str, dataset_sha256: Any, overrides: Mapping[str, Any] | None = None,
                 preset: Any = None, max_steps: Any = None, threads: Any = None,
                 fault_tolerance: Any = None, sync_every: Any = None) -> dict:
    """The run configuration as the role writes it to run.json (paths, run id and lighthouse address
    as placeholders), judged by ``ddplab.config.build_config``; ``sync_every`` only with diloco."""
    config = {"run_id": "preflight", "out_dir": "/preflight", "data_path": "/preflight/input.txt",
              "data_url": None, "data_sha256": dataset_sha256}
    config.update({k: v for k, v in {"preset": preset, "max_steps": max_steps, "threads": threads}.items()
                   if v is not None})
    if fault_tolerance in LIGHTHOUSE_ENGINES:
        config.update(fault_tolerance=fault_tolerance, ft_lighthouse="http://preflight:29510")
        if fault_tolerance == "diloco" and sync_every is not None:
            config["sync_every"] = sync_every
    config.update(overrides or {})
    try:
        ddplab_config.build_config(json_values=config)
        problem = None
    except ddplab_config.ConfigError as exc:
        problem = (f"{host}: the training program refuses the run configuration: {exc}; fix: correct"
                   " ddp_job_train_overrides / ddp_job_max_steps / ddp_job_preset / ddp_job_threads /"
                   " ddp_job_sync_every (keys and ranges: python -m ddplab.train --help, docs/training.md)")
    return record("train_config", problem, "run.json accepted by ddplab.config")


def engine(host: str, fault_tolerance: Any, worker_argv: Iterable[Any], nproc_per_node: Any,
           grad_compression: Any = "none") -> dict:
    """The recovery engine: torchelastic, or a lighthouse engine with one ddplab.train worker per
    laptop (no ``worker_argv``, ``nproc_per_node`` 1) and ``grad_compression`` none."""
    good = fault_tolerance == "torchelastic" or (
        fault_tolerance in LIGHTHOUSE_ENGINES and not worker_argv and str(nproc_per_node).strip() == "1")
    problem = None if good else (
        f"{host}: ddp_job_fault_tolerance={fault_tolerance} (worker argv {list(worker_argv or [])},"
        f" nproc_per_node {nproc_per_node}); fix: torchelastic, or {' or '.join(LIGHTHOUSE_ENGINES)} with one"
        " ddplab.train worker per laptop (one torchft replica group each): leave ddp_job_worker_argv"
        " empty and ddp_job_nproc_per_node 1")
    if good and fault_tolerance != "torchelastic" and grad_compression not in (None, "none"):
        problem = (f"{host}: ddp_job_grad_compression={grad_compression} with ddp_job_fault_tolerance="
                   f"{fault_tolerance}: the compressions are hooks of the torchelastic engine's DDP"
                   f" all-reduce, {fault_tolerance} averages fp32 gradients itself; fix:"
                   " ddp_job_grad_compression none, or ddp_job_fault_tolerance torchelastic")
    return record("engine", problem, f"ddp_job_fault_tolerance {fault_tolerance}")


# The role's rules for its settings (module_utils/settings.py): ranges, then checks of several settings.
SETTINGS = [
    {"name": "ddp_job_nproc_per_node", "min": 1},
    {"name": "ddp_job_max_restarts", "min": 0},
    *({"name": f"ddp_job_{n}", "above": 0} for n in ("monitor_interval_s", "start_barrier_timeout_s",
                                                    "stop_timeout_s", "watch_interval_s", "watch_timeout_s",
                                                    "outer_lr")),
    {"name": "ddp_job_watch_max_errors", "min": 1},
    {"name": "ddp_job_journal_lines", "min": 0},
    {"name": "ddp_job_powersgd_rank", "min": 1},
    {"name": "ddp_job_sync_every", "min": 1},
    {"name": "ddp_job_powersgd_start_step", "min": 2,
     "why": "PowerSGD's error feedback needs two plain all-reduces first"},
    {"check": "rdzv_conf", "run": rdzv_conf, "reads": {"conf": "ddp_job_rdzv_conf"}},
    {"check": "nnodes", "run": nnodes, "reads": {"nmin": "ddp_job_nnodes_min", "nmax": "ddp_job_nnodes_max"},
     "trainers": True},
    {"check": "train_config", "run": train_config, "unless": "ddp_job_resume_run_id",
     "reads": {"dataset_sha256": "ddp_job_dataset_sha256", "overrides": "ddp_job_train_overrides",
               "preset": "ddp_job_preset", "max_steps": "ddp_job_max_steps", "threads": "ddp_job_threads",
               "fault_tolerance": "ddp_job_fault_tolerance", "sync_every": "ddp_job_sync_every"}},
    {"check": "engine", "run": engine,
     "reads": {"fault_tolerance": "ddp_job_fault_tolerance", "worker_argv": "ddp_job_worker_argv",
               "nproc_per_node": "ddp_job_nproc_per_node", "grad_compression": "ddp_job_grad_compression"}},
]


class FilterModule:
    """The filters above, named ddp_job_*."""

    def filters(self):
        return {
            "ddp_job_local_ranks": local_ranks_of,
            "ddp_job_newest_stderr": newest_stderr,
            "ddp_job_stdout_log": stdout_log_of,
            "ddp_job_logs_rank_problem": logs_rank_problem,
            "ddp_job_logs_worker_messages": logs_worker_messages,
            "ddp_job_logs_journal_message": logs_journal_message,
            "ddp_job_logs_input_problems": logs_input_problems,
            "ddp_job_stop_event": stop_event,
            "ddp_job_attach_plan": attach_plan,
            "ddp_job_running_hosts": running_hosts,
            "ddp_job_statuses": statuses_of,
            "ddp_job_agent_ran_hosts": agent_ran_hosts,
            "ddp_job_collect_hint": collect_hint,
        }
