"""Cost of a torchelastic restart: workers started as new interpreters vs forked from the agent.

One run, both start methods side by side, on this machine: ``python -m ddplab.agent --standalone
--nnodes 1 --nproc-per-node 2 --max-restarts K`` with the tiny preset, once with
``--start-method spawn`` (the worker is a new ``python -m ddplab.train`` process: today's command
path, each start imports torch) and once with ``--start-method fork`` (ddplab.agent forks the
workers from itself, torch already imported). For each:

* ``first_step_s``: from the agent's start to rank 0's first ``step`` record (import, rendezvous,
  process group, setup, one step);
* ``recovered_s``: from the SIGKILL of rank 1 to rank 0's first ``step`` record of the next
  restart (``restart_count`` one higher): detection (``--monitor-interval``), the survivor's
  emergency checkpoint, the new workers' start, rendezvous, checkpoint agreement, one step.
  ``--kills`` of them per run (median reported, all listed);
* ``kill_agent_s`` (``--kill-agent``, off by default): two agents as two "laptops" (``--nnodes 1:2``,
  one worker each, c10d on a supervised ``ddplab.controller.rdzv_store``, ddp-lab's rendezvous
  settings, the start barrier): SIGKILL of agent B's whole process tree (``kill-agent``) → agent
  A's first ``step`` record at world size 1. This adds the rendezvous round (dead keep-alive
  3 s, last call 3 s) that the single-agent figure has not. ``--kills`` fresh trials each.

Times are the metrics records' ``time`` fields (unix s) and ``time.time()`` here; the load average
(``os.getloadavg()``) is sampled beside every figure. Not a test: figures for docs/faults.md.

Writes the table to ``benchmarks/results/restart_cost.md`` (:mod:`ddplab.bench.results`).

Usage: .venv/bin/python benchmarks/restart_cost.py [--kills 3] [--kill-agent] [--data PATH] [--json out.json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO / "train"), str(REPO / "benchmarks")]

from benchcli import add_results_dir, first_sentence  # noqa: E402  (benchmarks/benchcli.py)
from ddplab.bench import results as results_file  # noqa: E402
from ddplab.controller import rdzv_store  # noqa: E402
from ddplab.records import read_jsonl  # noqa: E402

DEFAULT_DATA = os.environ.get("DDP_LAB_DATA") or str(REPO.parent / "shared/data/tinyshakespeare/input.txt")
START_METHODS = ("spawn", "fork")
#: ddp-lab's rendezvous settings (roles/ddp_job defaults; docs/rendezvous.md).
RDZV_CONF = ("is_host=false,join_timeout=120,last_call_timeout=3,close_timeout=10,keep_alive_interval=1,"
             "keep_alive_max_attempt=3")


def agent_cmd(start_method: str, out_dir: Path, data: Path, max_restarts: int, max_steps: int,
              launch: list[str] = ("--standalone", "--nnodes", "1", "--nproc-per-node", "2",
                                   "--monitor-interval", "0.1")) -> list[str]:
    """``python -m ddplab.agent <launch>`` (default: ``--standalone`` with 2 local workers) of
    the tiny preset."""
    return [sys.executable, "-m", "ddplab.agent", *launch, "--max-restarts", str(max_restarts),
            "--start-method", start_method, "--log-dir", str(out_dir / "logs"), "--tee", "3",
            "-m", "ddplab.train", "--preset", "tiny", "--out-dir", str(out_dir),
            "--data-path", str(data), "--data-url", "null", "--max-steps", str(max_steps),
            "--warmup-steps", "5", "--eval-interval", "100000", "--ckpt-interval", "100000",
            "--log-interval", "1", "--sample-chars", "0", "--threads", "1"]


def agent_env() -> dict[str, str]:
    """The agent's environment as ddp_job gives it (package on PYTHONPATH, one thread per worker)."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                        "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT")}
    env["PYTHONPATH"] = str(REPO / "train") + os.pathsep + env.get("PYTHONPATH", "")
    env.update(TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    return env


def records(out_dir: Path, local_rank: int) -> list[dict]:
    path = out_dir / "metrics" / f"{os.uname().nodename}-local{local_rank}.jsonl"
    return read_jsonl(path)[0] if path.exists() else []


def wait_for(proc: subprocess.Popen, what: str, test, timeout_s: float):
    """Poll ``test()`` every 20 ms until it returns something truthy; raise when the agent
    ended or ``timeout_s`` passed."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = test()
        if found:
            return found
        if proc.poll() is not None:
            raise RuntimeError(f"the agent exited ({proc.returncode}) before {what}")
        time.sleep(0.02)
    raise TimeoutError(f"no {what} within {timeout_s:.0f} s")


def steps_of(out_dir: Path, restart_count: int) -> list[dict]:
    """Rank 0's ``step`` records of one restart."""
    return [r for r in records(out_dir, 0)
            if r["event"] == "step" and r["restart_count"] == restart_count]


def worker_pid(out_dir: Path, local_rank: int, restart_count: int) -> int | None:
    """The pid in the ``start`` record of ``local_rank`` at ``restart_count`` (None: not yet)."""
    starts = [r for r in records(out_dir, local_rank)
              if r["event"] == "start" and r["restart_count"] == restart_count]
    return starts[-1]["pid"] if starts else None


def steps_at_world(out_dir: Path, world_size: int, after: float) -> list[dict]:
    """Rank-0-of-this-agent ``step`` records at ``world_size`` written after ``after``."""
    return [r for r in records(out_dir, 0)
            if r["event"] == "step" and r["world_size"] == world_size and r["time"] > after]


def kill_tree(pid: int) -> None:
    """SIGKILL ``pid`` and all its descendants (the workers may sit in sessions of their own)."""
    with contextlib.suppress(psutil.NoSuchProcess):
        family = psutil.Process(pid).children(recursive=True) + [psutil.Process(pid)]
        for proc in family:
            with contextlib.suppress(psutil.NoSuchProcess):
                proc.kill()


def measure_kill_agent(start_method: str, data: Path, work: Path, timeout_s: float = 180) -> dict:
    """One kill-agent trial: store + agents A and B, B's tree SIGKILLed once A logged step 5 at
    world size 2; returns ``recovered_s`` (until A's first step at world size 1) and the load."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    token = uuid.uuid4().hex[:8]
    rdzv_store.start("127.0.0.1", port, work / "store", wait_s=60)
    env = dict(agent_env(), DDPLAB_AGENT_BARRIER=token, DDPLAB_AGENT_BARRIER_NODES="2")
    launch = ["--nnodes", "1:2", "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint",
              f"127.0.0.1:{port}", "--rdzv-id", "bench-" + token, "--rdzv-conf", RDZV_CONF,
              "--local-addr", "127.0.0.1", "--monitor-interval", "1"]
    agents = [subprocess.Popen(agent_cmd(start_method, work / name, data, 3, 100000, launch), env=env,
                               cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                               start_new_session=True) for name in ("a", "b")]
    try:
        wait_for(agents[0], "step 5 at world size 2",
                 lambda: [r for r in steps_at_world(work / "a", 2, 0) if r["step"] >= 5], timeout_s)
        t_kill = time.time()
        kill_tree(agents[1].pid)
        step = wait_for(agents[0], "a step at world size 1",
                        lambda: steps_at_world(work / "a", 1, t_kill), timeout_s)[0]
        return {"recovered_s": step["time"] - t_kill, "load": os.getloadavg()[0]}
    finally:
        for agent in agents:
            stop(agent)
        rdzv_store.stop(port, work / "store")


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM the agent's session (the agent stops its workers), SIGKILL after 30 s."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def measure(start_method: str, data: Path, kills: int, work: Path, steps_between: int = 5,
            timeout_s: float = 180) -> dict:
    """One agent run: the first start, then ``kills`` SIGKILLs of rank 1, each after rank 0 logged
    ``steps_between`` steps of the current restart. Returns the figures with the load averages."""
    out = work / start_method
    t0 = time.time()
    proc = subprocess.Popen(agent_cmd(start_method, out, data, kills, 100000), env=agent_env(),
                            cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    try:
        first = wait_for(proc, "the first step", lambda: steps_of(out, 0), timeout_s)[0]
        result = {"start_method": start_method, "first_step_s": first["time"] - t0,
                  "first_step_load": os.getloadavg()[0], "recoveries": []}
        for k in range(1, kills + 1):
            wait_for(proc, f"{steps_between} steps of restart {k - 1}",
                     lambda k=k: len(steps_of(out, k - 1)) >= steps_between, timeout_s)
            pid = wait_for(proc, "rank 1's pid", lambda k=k: worker_pid(out, 1, k - 1), timeout_s)
            t_kill = time.time()
            os.kill(pid, signal.SIGKILL)
            step = wait_for(proc, f"a step of restart {k}", lambda k=k: steps_of(out, k), timeout_s)[0]
            result["recoveries"].append({"restart_count": k, "recovered_s": step["time"] - t_kill,
                                         "resumed_at_step": step["step"], "load": os.getloadavg()[0]})
    finally:
        stop(proc)
    return result


def _figures(trials: list[dict]) -> str:
    """``median s | each | loads`` cells of a list of ``recovered_s``/``load`` trials."""
    med = statistics.median(x["recovered_s"] for x in trials)
    each = ", ".join(f"{x['recovered_s']:.2f}" for x in trials)
    loads = ", ".join(f"{x['load']:.1f}" for x in trials)
    return f"{med:.2f} s | {each} | {loads}"


def table(results: list[dict]) -> str:
    """Markdown table: one row per start method (medians, every trial listed)."""
    kill_agent = any(r.get("kill_agent") for r in results)
    head = ("| workers | first start → first step | load | kill rank 1 → first step after restart "
            "(median) | each | load |")
    rule = "|---|---|---|---|---|---|"
    if kill_agent:
        head += " kill-agent (2 agents) → first step at world size 1 (median) | each | load |"
        rule += "---|---|---|"
    lines = [head, rule]
    for r in results:
        how = {"spawn": "new interpreter (`-m ddplab.train`, spawn)",
               "fork": "forked from the agent (fork)"}.get(r["start_method"], r["start_method"])
        row = (f"| {how} | {r['first_step_s']:.2f} s | {r['first_step_load']:.1f} | "
               f"{_figures(r['recoveries'])} |")
        if kill_agent:
            row += f" {_figures(r['kill_agent'])} |"
        lines.append(row)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=first_sentence(__doc__))
    parser.add_argument("--kills", type=int, default=3, help="SIGKILLs (restarts) per start method")
    parser.add_argument("--data", type=Path, default=Path(DEFAULT_DATA), help="tiny-shakespeare input.txt")
    parser.add_argument("--kill-agent", action="store_true",
                        help="also time kill-agent with two agents around a rendezvous store")
    parser.add_argument("--json", type=Path, help="also write the raw figures here")
    add_results_dir(parser)
    args = parser.parse_args(argv)
    if not args.data.is_file():
        parser.error(f"dataset not found: {args.data} (set --data or DDP_LAB_DATA)")
    if args.kills < 1:
        parser.error("--kills must be >= 1")
    load_before = results_file.loadavg()
    with tempfile.TemporaryDirectory(prefix="restart-cost-") as tmp:
        results = [measure(method, args.data, args.kills, Path(tmp)) for method in START_METHODS]
        if args.kill_agent:  # alternating, so that a change of load hits both
            for trial in range(args.kills):
                for r in results:
                    work = Path(tmp) / f"kill-agent-{r['start_method']}-{trial}"
                    r.setdefault("kill_agent", []).append(
                        measure_kill_agent(r["start_method"], args.data, work))
    print(table(results))
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    path = results_file.write(
        "restart_cost", f"tiny preset, 2 workers, {args.kills} SIGKILLs of rank 1 per start method; "
        "load = 1-minute load average beside each figure\n\n" + table(results),
        title="Cost of a torchelastic restart: spawned vs forked workers", load_before=load_before,
        out_dir=args.results_dir)
    print(f"results: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
