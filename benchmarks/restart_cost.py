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
  ``--kills`` of them per run (median reported, all listed).

Times are the metrics records' ``time`` fields (unix s) and ``time.time()`` here; the load average
(``os.getloadavg()``) is sampled beside every figure. Not a test: figures for docs/faults.md.

Usage: .venv/bin/python benchmarks/restart_cost.py [--kills 3] [--data PATH] [--json out.json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "train"))

from ddplab.metrics import read_jsonl  # noqa: E402

DEFAULT_DATA = os.environ.get("DDP_LAB_DATA") or str(REPO.parent / "shared/data/tinyshakespeare/input.txt")
START_METHODS = ("spawn", "fork")


def agent_cmd(start_method: str, out_dir: Path, data: Path, max_restarts: int, max_steps: int,
              extra: list[str] = ()) -> list[str]:
    """``python -m ddplab.agent --standalone`` with 2 local workers of the tiny preset."""
    return [sys.executable, "-m", "ddplab.agent", "--standalone", "--nnodes", "1",
            "--nproc-per-node", "2", "--max-restarts", str(max_restarts), "--monitor-interval", "0.1",
            "--start-method", start_method, "--log-dir", str(out_dir / "logs"), "--tee", "3",
            "-m", "ddplab.train", "--preset", "tiny", "--out-dir", str(out_dir),
            "--data-path", str(data), "--data-url", "null", "--max-steps", str(max_steps),
            "--warmup-steps", "5", "--eval-interval", "100000", "--ckpt-interval", "100000",
            "--log-interval", "1", "--sample-chars", "0", "--threads", "1", *extra]


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
    return read_jsonl(path) if path.exists() else []


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


def table(results: list[dict]) -> str:
    """Markdown table: one row per start method (median of the recoveries, every one listed)."""
    lines = ["| workers | first start → first step | load | kill rank 1 → first step after "
             "restart (median) | each | load |", "|---|---|---|---|---|---|"]
    for r in results:
        rec = r["recoveries"]
        med = statistics.median(x["recovered_s"] for x in rec)
        each = ", ".join(f"{x['recovered_s']:.2f}" for x in rec)
        loads = ", ".join(f"{x['load']:.1f}" for x in rec)
        how = {"spawn": "new interpreter (`-m ddplab.train`, spawn)",
               "fork": "forked from the agent (fork)"}.get(r["start_method"], r["start_method"])
        lines.append(f"| {how} | {r['first_step_s']:.2f} s | {r['first_step_load']:.1f} | "
                     f"{med:.2f} s | {each} | {loads} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kills", type=int, default=3, help="SIGKILLs (restarts) per start method")
    parser.add_argument("--data", type=Path, default=Path(DEFAULT_DATA), help="tiny-shakespeare input.txt")
    parser.add_argument("--json", type=Path, help="also write the raw figures here")
    args = parser.parse_args(argv)
    if not args.data.is_file():
        parser.error(f"dataset not found: {args.data} (set --data or DDP_LAB_DATA)")
    if args.kills < 1:
        parser.error("--kills must be >= 1")
    with tempfile.TemporaryDirectory(prefix="restart-cost-") as tmp:
        results = [measure(method, args.data, args.kills, Path(tmp)) for method in START_METHODS]
    print(table(results))
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
