"""Shared fixtures for the ddplab tests: the dataset, tiny run configs, and runners.

The dataset is tiny-shakespeare from ``$DDP_LAB_DATA`` or, by default, ``../shared/data/
tinyshakespeare/input.txt`` relative to the repository (no network in tests).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

# torch._dynamo (imported lazily by the optimizers' first step) wraps sys.intern when it is first
# imported, and fails if ansible got there first: importing ansible.module_utils (the role modules
# and plugins tested in this process) replaces sys.intern with an object, and every later training
# step in the same pytest process raised "substitute_in_graph expects a function". Import it before
# any test module can import ansible.
import torch._dynamo  # noqa: E402, F401, I001  (order matters, see above)

REPO = Path(__file__).resolve().parent.parent
TRAIN_DIR = REPO / "train"
VENV_BIN = Path(sys.executable).parent
TINYSHAKESPEARE_SHA256 = "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed"


def dataset_path() -> Path:
    """Where the tests find tiny-shakespeare (``DDP_LAB_DATA`` overrides the default)."""
    env = os.environ.get("DDP_LAB_DATA")
    return Path(env) if env else (REPO / ".." / "shared" / "data" / "tinyshakespeare" / "input.txt").resolve()


@pytest.fixture(scope="session", autouse=True)
def results_dir(tmp_path_factory) -> Path:
    """The benchmarks' results files of this session (``DDPLAB_RESULTS_DIR``, read by
    ddplab.bench.results, inherited by child processes): never the checkout's benchmarks/results."""
    folder = tmp_path_factory.mktemp("results")
    os.environ["DDPLAB_RESULTS_DIR"] = str(folder)
    return folder


@pytest.fixture(scope="session")
def data_path() -> Path:
    path = dataset_path()
    if not path.is_file():
        pytest.fail(
            f"tiny-shakespeare not found at {path}: set DDP_LAB_DATA to a copy of input.txt "
            f"(sha256 {TINYSHAKESPEARE_SHA256})"
        )
    return path


@pytest.fixture
def clean_env(monkeypatch):
    """A process environment without torchrun variables (world size 1)."""
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "TORCHELASTIC_RESTART_COUNT",
                "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK"):
        monkeypatch.delenv(var, raising=False)
    return monkeypatch


def tiny_args(out_dir: Path, data: Path, **overrides) -> list[str]:
    """CLI arguments of a tiny, fast run (2 layers x 32 dims, block 32, batch 4, 1 thread)."""
    values = {
        "preset": "tiny", "out_dir": str(out_dir), "data_path": str(data),
        "data_sha256": TINYSHAKESPEARE_SHA256, "data_url": "null", "max_steps": 20, "warmup_steps": 3,
        "eval_interval": 10, "eval_iters": 2, "ckpt_interval": 10, "keep_checkpoints": 2,
        "log_interval": 1, "sample_chars": 20, "threads": 1, "base_lr": 3e-3, "reference_batch_size": 12,
    }
    values.update(overrides)
    args: list[str] = []
    for key, value in values.items():
        args += [f"--{key.replace('_', '-')}", str(value)]
    return args


@pytest.fixture
def tiny():
    return tiny_args


def subprocess_env(**extra: str) -> dict[str, str]:
    """Environment for a child training process: the package on PYTHONPATH, no torchrun vars,
    and one bootstrap store per rendezvous round (see docs/training.md)."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                        "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT")}
    env["PYTHONPATH"] = str(TRAIN_DIR) + os.pathsep + env.get("PYTHONPATH", "")
    env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    env["OMP_NUM_THREADS"] = "1"
    env.update(extra)
    return env


def torchrun_cmd(nproc: int, args: list[str], max_restarts: int = 0, script: Path | None = None,
                 ) -> list[str]:
    """``torchrun --standalone`` with ``nproc`` local workers running ``python -m ddplab.train``,
    or the harness ``script`` (e.g. tests/step_kill.py) that wraps it."""
    entry = [str(script)] if script else ["-m", "ddplab.train"]
    return [str(VENV_BIN / "torchrun"), "--standalone", f"--nproc-per-node={nproc}",
            f"--max-restarts={max_restarts}", "--monitor-interval=0.1", *entry, *args]


def run_torchrun(nproc: int, args: list[str], max_restarts: int = 0, timeout: float = 240,
                 ) -> subprocess.CompletedProcess:
    return subprocess.run(torchrun_cmd(nproc, args, max_restarts), env=subprocess_env(),
                          capture_output=True, text=True, timeout=timeout, cwd=REPO)


def read_metrics(out_dir: Path, local_rank: int = 0) -> list[dict]:
    """Records of one local rank's metrics file (this host)."""
    path = Path(out_dir) / "metrics" / f"{os.uname().nodename}-local{local_rank}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def snapshot(folder: Path) -> dict[str, bytes]:
    """File name -> bytes of every file in ``folder`` (to prove nothing was overwritten)."""
    return {p.name: p.read_bytes() for p in sorted(Path(folder).iterdir()) if p.is_file()}


def wait_for_steps(proc: subprocess.Popen, out_dir: Path, steps: int, timeout: float = 120) -> None:
    """Wait until rank 0's metrics hold ``steps`` step records (or the process ended)."""
    import time

    metrics = Path(out_dir) / "metrics" / f"{os.uname().nodename}-local0.jsonl"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        if metrics.exists() and metrics.read_text().count('"event":"step"') >= steps:
            return
        time.sleep(0.05)
