"""ddplab.agent: workers forked from the agent (``--start-method fork``) and restarts.

* the launch plan: ``-m ddplab.train`` with fork becomes the function entrypoint with torchrun's
  own launch configuration; anything else stays torchrun's command path;
* the fork path trains under ``--standalone``, survives a SIGKILL of one worker through a restart
  (the survivor's SIGTERM still reaches the emergency checkpoint, no step lost), keeps the per-rank
  log files and exits 0; its workers are forks of the agent (same command line, no new
  interpreter);
* workers that keep failing: the agent exits non-zero after the last restart;
* a diverged run is not replayed: the restarted workers exit 3 at once.
"""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from conftest import REPO, read_metrics, subprocess_env, tiny_args
from ddplab import agent

pytestmark = pytest.mark.slow

EXIT_DIVERGED = 3


def agent_argv(out: Path, train_args: list[str], max_restarts: int, start_method: str = "fork") -> list[str]:
    return ["--standalone", "--nnodes", "1", "--nproc-per-node", "2", "--max-restarts", str(max_restarts),
            "--monitor-interval", "0.1", "--start-method", start_method, "--log-dir", str(out / "logs"),
            "--tee", "3", "-m", "ddplab.train", *train_args]


def start_agent(argv: list[str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "ddplab.agent", *argv], env=subprocess_env(), cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def finish(proc: subprocess.Popen, timeout: float = 240) -> str:
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        raise AssertionError(f"agent still running after {timeout} s:\n{output[-3000:]}") from None
    return output


def by_event(records, event, restart_count=None):
    return [r for r in records if r["event"] == event
            and (restart_count is None or r["restart_count"] == restart_count)]


def metrics_of(out: Path, local_rank: int) -> list[dict]:
    path = out / "metrics" / f"{os.uname().nodename}-local{local_rank}.jsonl"
    return read_metrics(out, local_rank) if path.exists() else []


def signal_worker_at(proc: subprocess.Popen, out: Path, local_rank: int, restart_count: int, at_step: int,
                     sig: int = signal.SIGKILL, timeout: float = 180) -> tuple[list[str], int]:
    """Send ``sig`` to ``local_rank``'s worker of ``restart_count`` (pid from its ``start``
    record) once rank 0 logged ``at_step``; returns the worker's command line and parent pid."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        starts = by_event(metrics_of(out, local_rank), "start", restart_count)
        steps = by_event(metrics_of(out, 0), "step", restart_count)
        if starts and steps and steps[-1]["step"] >= at_step:
            worker = psutil.Process(starts[-1]["pid"])
            seen = (worker.cmdline(), worker.ppid())
            worker.send_signal(sig)
            return seen
        time.sleep(0.02)
    raise AssertionError(f"rank 0 never reached step {at_step} (agent exit {proc.poll()})")


def test_launch_plan_forks_only_the_training_module_under_fork():
    import torch.distributed.run as torchrun
    from ddplab import train

    args = torchrun.parse_args(agent_argv(Path("/tmp/x"), ["--preset", "tiny"], 4))
    assert agent.forks_worker(args)
    config, entrypoint, worker_args = agent.fork_launch(args)
    assert entrypoint is train.worker and worker_args == ("--preset", "tiny")
    assert config.start_method == "fork" and config.max_restarts == 4 and config.nproc_per_node == 2
    assert config.rdzv_backend == "c10d" and config.rdzv_endpoint == "localhost:0"  # --standalone
    assert config.monitor_interval == 0.1 and config.logs_specs.root_log_dir == "/tmp/x/logs"
    for other in (agent_argv(Path("/tmp/x"), [], 0, start_method="spawn"),
                  ["--nproc-per-node", "2", "--start-method", "fork", "-m", "other.module"],
                  ["--nproc-per-node", "2", "--start-method", "fork", "train.py"]):
        assert not agent.forks_worker(torchrun.parse_args(other))


def test_forked_workers_survive_a_killed_worker_with_no_step_lost(tmp_path, data_path):
    """SIGKILL of rank 1 at step 15, then SIGTERM of the restarted rank 1 at step 35 (what the
    agent sends when it stops a group): both restarts resume at the last step."""
    out = tmp_path / "run"
    train_args = tiny_args(out, data_path, max_steps=60, warmup_steps=5, eval_interval=1000,
                           ckpt_interval=1000, sample_chars=0)
    proc = start_agent(agent_argv(out, train_args, max_restarts=2))
    try:
        killed_cmdline, killed_ppid = signal_worker_at(proc, out, 1, restart_count=0, at_step=15)
        agent_cmdline = psutil.Process(proc.pid).cmdline()
        signal_worker_at(proc, out, 1, restart_count=1, at_step=35, sig=signal.SIGTERM)
    finally:
        output = finish(proc)
    assert proc.returncode == 0, output[-3000:]
    # a fork of the agent: its child with the agent's command line (no new interpreter)
    assert killed_ppid == proc.pid and killed_cmdline == agent_cmdline
    assert "workers forked from the agent (fork)" in output

    records = read_metrics(out, local_rank=0)
    starts = by_event(records, "start")
    assert [(s["restart_count"], s["world_size"]) for s in starts] == [(0, 2), (1, 2), (2, 2)]
    steps = [[r["step"] for r in by_event(records, "step", n)] for n in (0, 1, 2)]
    assert steps[0][-1] >= 15 and steps[1][-1] >= 35
    assert [s["resumed_from_step"] for s in starts] == [None, steps[0][-1], steps[1][-1]]
    assert steps[0] + steps[1] + steps[2] == list(range(1, 61))  # none lost, none repeated
    # the survivor saved the last step (after its failed collective or the agent's SIGTERM)
    assert [(f["saved"], f["step"]) for f in by_event(records, "failure", 0)] == [(True, steps[0][-1])]
    # SIGTERM in a forked worker reaches its SignalGuard: emergency checkpoint, then exit 143
    # (its last completed step: rank 0's last, or one before when the signal came after rank 1 had
    # joined the next step's all-reduce, which rank 0 then completed; seen once in the full suite)
    term = by_event(read_metrics(out, local_rank=1), "failure", 1)
    assert [(f["cause"], f["saved"]) for f in term] == [("signal", True)]
    assert steps[1][-1] - 1 <= term[0]["step"] <= steps[1][-1]
    assert "SIGTERM" in term[0]["error"]
    assert by_event(records, "end", 2)
    # per-rank log files where ddp_job / logs.yml read them: <log-dir>/<run>/attempt_<n>/<local_rank>/
    for attempt in (0, 1, 2):
        for local_rank in (0, 1):
            logs = list((out / "logs").glob(f"*/attempt_{attempt}/{local_rank}/stdout.log"))
            assert len(logs) == 1 and logs[0].with_name("stderr.log").is_file()
    assert "[ddplab] done: step 60" in next((out / "logs").glob("*/attempt_2/0/stdout.log")).read_text()


def test_workers_that_keep_failing_make_the_agent_fail(tmp_path, data_path):
    out = tmp_path / "run"
    bad = tiny_args(out, data_path, max_steps=10, warmup_steps=30)  # rejected: warmup >= max_steps
    proc = start_agent(agent_argv(out, bad, max_restarts=1))
    output = finish(proc)
    assert proc.returncode != 0, output[-3000:]
    assert "ChildFailedError" in output and "exitcode  : 2" in output
    for attempt in (0, 1):  # restarted once, then given up
        err = next((out / "logs").glob(f"*/attempt_{attempt}/0/stderr.log")).read_text()
        assert "warmup_steps" in err


def test_a_diverged_run_is_not_replayed_by_the_restarts(tmp_path, data_path):
    """``base_lr`` 50 diverges in restart 0; restarts 1 and 2 resume from the same state with the
    same settings, so they stop at once (exit 3, one line) instead of training into it again."""
    out = tmp_path / "run"
    train_args = tiny_args(out, data_path, max_steps=200, warmup_steps=3, eval_interval=1000,
                           ckpt_interval=1000, sample_chars=0, base_lr=50)
    proc = start_agent(agent_argv(out, train_args, max_restarts=2))
    output = finish(proc)
    assert proc.returncode != 0, output[-3000:]
    assert f"exitcode  : {EXIT_DIVERGED}" in output
    for local_rank in (0, 1):
        records = read_metrics(out, local_rank)
        failures = by_event(records, "failure")
        assert [(f["restart_count"], f["cause"]) for f in failures] == [
            (0, "divergence"), (1, "divergence"), (2, "divergence")]
        first = failures[0]
        assert all(f["failed_step"] == first["failed_step"] and f["config_sha256"] == first["config_sha256"]
                   for f in failures)
        assert "restart 1 would repeat it" in failures[1]["error"]
        assert by_event(records, "step", 0) and not by_event(records, "step", 1)
        assert not by_event(records, "step", 2)
    stderr = next((out / "logs").glob("*/attempt_1/0/stderr.log")).read_text()
    assert "restart 1 would repeat it" in stderr and "Traceback" not in stderr


def test_the_final_exit_code_is_the_trainers_and_the_agent_reads_it_without_torch():
    """agent.py hard-coded 4 for the trainer's EXIT_CUT_OFF (now the per_step engine's cut-off
    code, ddplab.engines.per_step); both read ddplab.exit_codes."""
    from ddplab.engines import per_step

    assert set(agent.FINAL_EXIT_CODES) == {per_step.EXIT_CUT_OFF}
    code = "import sys, ddplab.agent; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], env=subprocess_env(), check=False).returncode == 0
