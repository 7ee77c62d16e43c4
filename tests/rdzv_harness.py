"""Local elastic-rendezvous harness: N torchrun agents on this host around a supervised store.

Used by tests/test_rdzv_store.py (does recovery happen at all?) and, run as a script, as the
benchmark behind the figures in docs/rendezvous.md (how long it takes):

    .venv/bin/python tests/rdzv_harness.py --trials 3 --share both

Each agent is ``python -m ddplab.agent --nnodes 1:N --nproc-per-node 1 --rdzv-backend c10d
--rdzv-endpoint 127.0.0.1:<port> --rdzv-conf is_host=false,...`` running tests/rdzv_toy_worker.py
in a session of its own (ddplab.agent = torchrun after a start barrier, as ddp-lab starts it);
the store is ``python -m ddplab.controller.rdzv_store start``. A trial waits for
world size N, SIGKILLs the whole process tree of the agent whose worker holds rank 0 (a laptop
that vanishes), and times until the survivors' workers step at world size N-1.
Everything started is killed on exit (``ToyCluster.close``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import psutil

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
WORKER = HERE / "rdzv_toy_worker.py"

from ddplab.controller import rdzv_store  # noqa: E402  (train/ is on the venv's path: make venv)
from labharness import free_port  # noqa: E402  (tests/ is sys.path[0], script or pytest)

# The rdzv-conf ddp-lab ships (roles/ddp_job/defaults/main.yml mirrors it).
TUNED_CONF = {
    "join_timeout": 120,
    "last_call_timeout": 3,
    "close_timeout": 10,
    "keep_alive_interval": 1,
    "keep_alive_max_attempt": 3,
}
# torch's defaults (dynamic_rendezvous.py / c10d_rendezvous_backend.py), for comparison.
DEFAULT_CONF: dict[str, int] = {}


GLOG_TIME = re.compile(r"^[IWEF]\d{4} (\d\d:\d\d:\d\d\.\d+) ")


def read_log(path: Path) -> list[dict]:
    """The JSON lines of one toy worker log ([] when absent); a torn last line is skipped."""
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        with contextlib.suppress(ValueError):
            out.append(json.loads(line))
    return out


def kill_tree(pid: int) -> None:
    """SIGKILL a process and all its descendants at once (torchrun puts workers in new sessions)."""
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return
    for p in procs:
        with contextlib.suppress(psutil.Error):
            p.kill()
    psutil.wait_procs(procs, timeout=10)


def _running(pid: int) -> bool:
    try:
        return pid > 0 and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


@dataclass
class ToyCluster:
    """N local agents + a supervised store. Use as a context manager; ``close`` kills everything."""

    workdir: Path
    nnodes: int = 3
    conf: dict = field(default_factory=lambda: dict(TUNED_CONF))
    share_disabled: bool = True
    port: int = 0
    agents: list[subprocess.Popen] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.port = self.port or free_port()
        self.state_dir = self.workdir / ".rdzv"
        self.run_id = "toy-" + uuid.uuid4().hex[:8]

    def log_path(self, i: int) -> Path:
        return self.workdir / f"agent{i}.jsonl"

    def start(self, agents: list[int] | None = None) -> None:
        """Start the store and the listed agents (default: all, behind one start barrier; listed
        ones each without a barrier)."""
        rdzv_store.start("127.0.0.1", self.port, self.state_dir, wait_s=60)
        if agents is None:
            for i in range(self.nnodes):
                self.start_agent(i, self.run_id, self.nnodes)
        for i in agents or []:
            self.start_agent(i)

    def start_agent(self, i: int, barrier: str = "", barrier_nodes: int = 1) -> None:
        """Start agent ``i``; it waits at start barrier ``barrier`` (default: one of its own, i.e.
        no wait) for ``barrier_nodes`` agents."""
        conf = ",".join(["is_host=false", *(f"{k}={v}" for k, v in self.conf.items())])
        env = dict(
            os.environ,
            TOY_LOG=str(self.log_path(i)),
            GLOO_SOCKET_IFNAME="lo",
            OMP_NUM_THREADS="1",
            PYTHONUNBUFFERED="1",
            LOGLEVEL="INFO",
            PYTHONPATH=os.pathsep.join(
                p for p in (str(REPO / "train"), os.environ.get("PYTHONPATH")) if p
            ),
            DDPLAB_AGENT_BARRIER=barrier or f"{self.run_id}-{i}",
            DDPLAB_AGENT_BARRIER_NODES=str(barrier_nodes),
        )
        env.pop("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", None)
        if self.share_disabled:
            env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
        cmd = [
            sys.executable,
            "-m",
            "ddplab.agent",
            "--nnodes",
            f"1:{self.nnodes}",
            "--nproc-per-node",
            "1",
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            f"127.0.0.1:{self.port}",
            "--rdzv-id",
            self.run_id,
            "--rdzv-conf",
            conf,
            "--local-addr",
            "127.0.0.1",
            "--max-restarts",
            "5",
            "--monitor-interval",
            "0.5",
            str(WORKER),
        ]
        with open(self.workdir / f"agent{i}.out", "ab") as out:
            self.agents.append(
                subprocess.Popen(
                    cmd,
                    env=env,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    start_new_session=True,
                )
            )

    def latest(self, i: int) -> dict | None:
        recs = [r for r in read_log(self.log_path(i)) if r.get("event") == "step"]
        return recs[-1] if recs else None

    def wait_world(self, world: int, agents: list[int], timeout_s: float, after: float = 0.0) -> float | None:
        """Wait until every listed agent's worker stepped at ``world`` after ``after`` (unix s).

        Returns the time of the first such step among them (unix s), or None on timeout.
        """
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            firsts = []
            for i in agents:
                hits = [
                    r["time"]
                    for r in read_log(self.log_path(i))
                    if r.get("event") == "step" and r["world_size"] == world and r["time"] > after
                ]
                if hits:
                    firsts.append(min(hits))
            if len(firsts) == len(agents):
                return min(firsts)
            time.sleep(0.2)
        return None

    def rank0_agent(self) -> int:
        """The index of the agent whose worker holds rank 0 in the newest round."""
        ranks = {i: (self.latest(i) or {}).get("rank") for i in range(self.nnodes)}
        zero = [i for i, r in ranks.items() if r == 0]
        if len(zero) != 1:
            raise RuntimeError(f"expected exactly one rank 0, saw {ranks}")
        return zero[0]

    def kill_agent(self, i: int) -> float:
        """SIGKILL agent i with its workers; returns the kill time (unix s)."""
        t = time.time()
        kill_tree(self.agents[i].pid)
        return t

    def rdzv_complete_times(self, i: int, day: float) -> list[float]:
        """Unix times of the agent's "Rendezvous complete" log lines (glog prefix, local time of
        the day of ``day``)."""
        path = self.workdir / f"agent{i}.out"
        if not path.exists():
            return []
        base = datetime.fromtimestamp(day).date()
        out = []
        for line in path.read_text(errors="replace").splitlines():
            m = GLOG_TIME.match(line)
            if m and "Rendezvous complete" in line:
                t = datetime.strptime(m.group(1), "%H:%M:%S.%f").time()
                out.append(datetime.combine(base, t).timestamp())
        return out

    def first_failure(self, agents: list[int], after: float) -> float | None:
        times = [
            r["time"]
            for i in agents
            for r in read_log(self.log_path(i))
            if r.get("event") == "failure" and r["time"] > after
        ]
        return min(times) if times else None

    def close(self) -> None:
        for p in self.agents:
            kill_tree(p.pid)
            with contextlib.suppress(Exception):
                p.wait(timeout=5)
        rdzv_store.stop(self.port, self.state_dir)

    def __enter__(self) -> ToyCluster:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def rank0_kill_trial(
    workdir: Path,
    conf: dict,
    share_disabled: bool,
    form_timeout_s: float = 120,
    recover_timeout_s: float = 90,
) -> dict:
    """One trial: form world 3, SIGKILL the rank-0 agent, time the survivors' recovery.

    Returns ``{formed_s, detected_s, rdzv_s, worker_start_s, recovered_s, load1, steps_after,
    victim, leftover_pids}``: seconds after the start (formed) or the kill - the survivors' first
    failure record (detected), the last survivor agent's "Rendezvous complete" (rdzv), the last
    new worker's start record, i.e. after spawn, torch import and init_process_group
    (worker_start), the first step at world size 2 of every survivor (recovered; None when not
    within ``recover_timeout_s``); ``load1``: the host's 1-min load average at the kill;
    ``leftover_pids``: started processes still alive after the cluster was closed (should be []).
    """
    workdir.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    with ToyCluster(workdir, conf=conf, share_disabled=share_disabled) as c:
        formed = c.wait_world(3, [0, 1, 2], form_timeout_s)
        if formed is None:
            raise RuntimeError(f"world size 3 never formed; see {workdir}/agent*.out")
        time.sleep(2.0)  # a few steps at world size 3
        victim = c.rank0_agent()
        survivors = [i for i in range(3) if i != victim]
        load1 = os.getloadavg()[0]
        t_kill = c.kill_agent(victim)
        back = c.wait_world(2, survivors, recover_timeout_s, after=t_kill)
        failed = c.first_failure(survivors, t_kill)
        rdzv = [t for i in survivors for t in c.rdzv_complete_times(i, t_kill) if t > t_kill]
        restarted = [
            r["time"]
            for i in survivors
            for r in read_log(c.log_path(i))
            if r.get("event") == "start" and r["time"] > t_kill
        ]
        steps_after = 0
        if back is not None:
            time.sleep(1.5)
            steps_after = min(
                sum(1 for r in read_log(c.log_path(i)) if r.get("event") == "step" and r["time"] > t_kill)
                for i in survivors
            )
        started = [p.pid for p in c.agents] + [
            r["pid"] for i in range(3) for r in read_log(c.log_path(i)) if r.get("event") == "start"
        ]
        store = rdzv_store.read_state(c.state_dir, c.port)
        started += [store.supervisor_pid, store.server_pid or 0] if store else []
    leftovers = [pid for pid in started if _running(pid)]
    return {
        "formed_s": round(formed - t0, 1),
        "detected_s": None if failed is None else round(failed - t_kill, 2),
        "rdzv_s": round(max(rdzv) - t_kill, 2) if len(rdzv) >= len(survivors) else None,
        "worker_start_s": round(max(restarted) - t_kill, 2) if restarted else None,
        "recovered_s": None if back is None else round(back - t_kill, 2),
        "load1": round(load1, 1),
        "steps_after": steps_after,
        "victim": victim,
        "leftover_pids": leftovers,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description="time the survivors' recovery after the rank-0 node dies")
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument(
        "--share",
        choices=["disabled", "enabled", "both"],
        default="both",
        help="TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (disabled) or unset (enabled)",
    )
    ap.add_argument("--conf", choices=["tuned", "default", "both"], default="tuned")
    ap.add_argument("--recover-timeout", type=float, default=90)
    args = ap.parse_args()
    shares = {"disabled": [True], "enabled": [False], "both": [True, False]}[args.share]
    confs = {
        "tuned": [("tuned", TUNED_CONF)],
        "default": [("default", DEFAULT_CONF)],
        "both": [("tuned", TUNED_CONF), ("default", DEFAULT_CONF)],
    }[args.conf]
    rows = []
    with tempfile.TemporaryDirectory(prefix="ddplab-rdzv-") as tmp:
        for name, conf in confs:
            for share_disabled in shares:
                res = []
                for t in range(args.trials):
                    r = rank0_kill_trial(
                        Path(tmp) / f"{name}-{share_disabled}-{t}",
                        conf,
                        share_disabled,
                        recover_timeout_s=args.recover_timeout,
                    )
                    res.append(r)
                    print(json.dumps({"conf": name, "share_disabled": share_disabled, **r}), flush=True)
                ok = [r["recovered_s"] for r in res if r["recovered_s"] is not None]
                rows.append(
                    (
                        name,
                        share_disabled,
                        len(ok),
                        len(res),
                        statistics.median(ok) if ok else None,
                        max(ok) if ok else None,
                    )
                )
    print(
        f"\n{'conf':8} {'TORCH_DISABLE_SHARE_RDZV_TCP_STORE':36} {'recovered':>9}"
        f" {'median_s':>9} {'max_s':>7}"
    )
    for name, sd, n_ok, n, med, mx in rows:
        print(
            f"{name:8} {('1' if sd else 'unset'):36} {f'{n_ok}/{n}':>9} "
            f"{(f'{med:.1f}' if med is not None else '-'):>9} {(f'{mx:.1f}' if mx is not None else '-'):>7}"
        )
    return 0


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))
    sys.exit(main())


def killed_and_restarted(service, port: int, state_dir: Path, timeout_s: float = 60.0) -> dict:
    """SIGKILL the server process of a supervised controller service (``ddplab.controller.rdzv_store``
    or ``.lighthouse``: a module with ``status(port, state_dir)``) and wait until its supervisor has
    brought it back; returns the status then (the caller asserts on it)."""
    import psutil

    psutil.Process(service.status(port, state_dir)["server_pid"]).kill()
    deadline = time.monotonic() + timeout_s
    st = service.status(port, state_dir)
    while time.monotonic() < deadline and not (st["restarts"] == 1 and st["answering"]):
        time.sleep(0.5)
        st = service.status(port, state_dir)
    return st
