"""per_step engine end to end: a torchft lighthouse and replica groups as local processes, each
started as the ddp_job unit starts it on a laptop (``python -m ddplab.agent --nnodes 1
--nproc-per-node 1 --rdzv-backend c10d --rdzv-endpoint ADDR:PORT --rdzv-conf is_host=true ...
--start-method fork -m ddplab.train``, ``DDPLAB_GLOO_ADDR=127.0.0.1``).

* two replicas train to the end on a non-loopback address of this host: both hold the same
  weights (same validation losses), every committed step's samples are distinct and none is
  skipped, result.json names the engine, and every socket of the workers (gloo, store, Manager)
  is on DDPLAB_GLOO_ADDR, none on the host name's address;
* three replicas, one SIGKILLed (agent and worker): the survivors commit the next step at 2
  participants, lose no step and are not restarted; the killed replica started again (no
  checkpoint of its own) gets its state from a live peer and the group is back to 3 participants
  with the same weights;
* three replicas, one worker frozen (SIGSTOP) then thawed, then SIGKILLed alone: the survivors go
  on at 2 participants each time, the thawed worker and the one torchrun restarted
  (``--max-restarts 1``, same Manager port) rejoin with their peers' weights;
* a restart of the whole cluster: each replica resumes from its own checkpoint;
* a diverging run: every replica stops on the same step, unapplied, without a checkpoint of it.
The recovery times are printed with the load average (docs/training.md).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from conftest import REPO, subprocess_env, tiny_args
from labharness import free_port

pytestmark = pytest.mark.slow

LIGHTHOUSE = Path(sys.executable).parent / "torchft_lighthouse"


class LighthouseAddress(str):
    """The lighthouse's http address; ``proc`` is its process (a test may freeze it)."""

    proc: subprocess.Popen

    def freeze(self, timeout: float = 30) -> None:
        """SIGSTOP the lighthouse and return once every thread of it is stopped (what a partition
        of the controller looks like to a replica). AssertionError when its process has ended: a
        test would then freeze nothing while its replica's calls went elsewhere."""
        assert self.proc.poll() is None, f"lighthouse {self} exited ({self.proc.returncode})"
        self.proc.send_signal(signal.SIGSTOP)
        wait_stopped([self.proc.pid], f"lighthouse {self}", timeout)

    def thaw(self) -> None:
        """SIGCONT: the lighthouse answers again."""
        self.proc.send_signal(signal.SIGCONT)


def wait_stopped(pids: list[int], what: str, timeout: float = 30) -> None:
    """Return once every thread of the processes ``pids`` is stopped (a SIGSTOP sent to them has
    landed everywhere: nothing of them runs, heartbeats or writes any more); AssertionError after
    ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            threads = [psutil.Process(t.id) for pid in pids for t in psutil.Process(pid).threads()]
            if all(t.status() == psutil.STATUS_STOPPED for t in threads):
                return
        except psutil.NoSuchProcess:
            pass
        time.sleep(0.01)
    raise AssertionError(f"{what} not stopped {timeout:g} s after SIGSTOP")


def start_lighthouse(log_path: Path, min_replicas: int = 1, attempts: int = 5,
                     timeout: float = 60, port: int | None = None) -> LighthouseAddress:
    """Start a lighthouse on a :func:`free_port` (or on ``port``) with the contract's settings and
    return once its own process listens there (its output appended to ``log_path``).

    A port can still be taken between the pick and the bind by a process that does not take its
    ports from free_port; the lighthouse then exits, and a test that went on would talk to
    whatever holds the port (a test froze "its" dead lighthouse and still got a quorum from
    another test's). Such a start is retried on another port, up to ``attempts`` times (once on
    a given ``port``: the replicas were told it).

    Raises:
        RuntimeError: no start listened (the log's tail says why).
    """
    given = port
    for _ in range(1 if given else attempts):
        port = given or free_port()
        with open(log_path, "a") as log:
            proc = subprocess.Popen([str(LIGHTHOUSE), "--bind", f"127.0.0.1:{port}",
                                     "--min_replicas", str(min_replicas),
                                     "--quorum_tick_ms", "100", "--join_timeout_ms", "1000"],
                                    stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while proc.poll() is None and time.monotonic() < deadline:
            try:
                conns = psutil.Process(proc.pid).net_connections("tcp")
            except psutil.Error:
                conns = []
            if any(c.status == psutil.CONN_LISTEN and c.laddr.port == port for c in conns):
                address = LighthouseAddress(f"http://127.0.0.1:{port}")
                address.proc = proc
                return address
            time.sleep(0.05)
        proc.kill()
        proc.wait()
    raise RuntimeError(f"no lighthouse listened in {1 if given else attempts} start(s): "
                       f"{log_path.read_text()[-2000:]}")


@pytest.fixture
def lighthouse(tmp_path, request):
    """A lighthouse of this test (:func:`start_lighthouse`, ``--min_replicas`` 1 or the test's
    indirect parameter); yields its http address (:class:`LighthouseAddress`)."""
    address = start_lighthouse(tmp_path / "lighthouse.log", getattr(request, "param", 1))
    yield address
    address.proc.send_signal(signal.SIGCONT)  # a test may have frozen it
    address.proc.kill()
    address.proc.wait()


class Replica:
    """One replica group: an agent process (own session) with its out_dir and ports (``engine``:
    a lighthouse engine, per_step or diloco). ``AGENT``: how the agent is run (a test's harness
    may wrap ddplab.agent); ``env``: more environment."""

    AGENT = ["-m", "ddplab.agent"]

    def __init__(self, root: Path, name: str, lighthouse: str, data: Path, addr: str = "127.0.0.1",
                 max_restarts: int = 0, engine: str = "per_step", env: dict[str, str] | None = None,
                 **overrides) -> None:
        self.name, self.out, self.addr, self.max_restarts = name, root / name, addr, max_restarts
        self.rdzv_port, self.manager_port = free_port(), free_port()
        self.args = tiny_args(self.out, data, fault_tolerance=engine, ft_lighthouse=lighthouse,
                              ft_replica_id=name, ft_manager_port=self.manager_port, **overrides)
        self.proc: subprocess.Popen | None = None
        self.started = 0.0
        self.nice = 0  # > 0: the agent and its worker run under ``nice -n``
        self.env = env or {}

    def start(self) -> None:
        argv = [sys.executable, *self.AGENT, "--nnodes", "1", "--nproc-per-node", "1",
                "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{self.addr}:{self.rdzv_port}",
                "--rdzv-id", f"test-{self.name}", "--rdzv-conf", "is_host=true",
                "--local-addr", self.addr, "--max-restarts", str(self.max_restarts),
                "--monitor-interval", "0.1",
                "--start-method", "fork", "--log-dir", str(self.out / "logs"), "--tee", "3",
                "-m", "ddplab.train", *self.args]
        if self.nice:
            argv = ["nice", "-n", str(self.nice), *argv]
        env = subprocess_env(DDPLAB_GLOO_ADDR=self.addr, RUST_LOG="warn", **self.env)
        self.log = open(self.out.parent / f"{self.name}.log", "a")  # noqa: SIM115
        self.started = time.time()
        self.proc = subprocess.Popen(argv, env=env, cwd=REPO, stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=True)

    def records(self) -> list[dict]:
        path = self.out / "metrics" / f"{os.uname().nodename}-local0.jsonl"
        if not path.exists():
            return []
        return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]

    def committed(self, since: float = 0.0) -> list[dict]:
        return [r for r in self.records() if r["event"] == "step" and r.get("committed")
                and r["time"] >= since]

    def signal(self, sig: int) -> None:
        if self.proc and self.proc.poll() is None:
            os.killpg(self.proc.pid, sig)

    def freeze(self, timeout: float = 30) -> None:
        """SIGSTOP the agent and its worker; return once every thread of both is stopped (its
        records, its quorum requests and its heartbeats have stopped where they were)."""
        assert self.proc.poll() is None, f"replica {self.name} exited ({self.proc.returncode})"
        agent = psutil.Process(self.proc.pid)
        self.signal(signal.SIGSTOP)
        wait_stopped([agent.pid, *(c.pid for c in agent.children(recursive=True))],
                     f"replica {self.name}", timeout)

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout)
        finally:
            self.log.close()

    def output(self, tail: int = 4000) -> str:
        return (self.out.parent / f"{self.name}.log").read_text()[-tail:]


def wait_until(what: str, predicate, replicas: list[Replica], timeout: float) -> float:
    """Poll ``predicate()`` until it returns a truthy time; fail with the replicas' logs."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = predicate()
        if found:
            return found
        dead = [r.name for r in replicas if r.proc.poll() is not None]
        if dead:
            break
        time.sleep(0.05)
    # a replica that died first and with its whole log tail (its traceback); CI shows only the
    # start of a long failure message
    ended = sorted(replicas, key=lambda r: r.proc.poll() is None)
    logs = "\n".join(f"--- {r.name} (exit {r.proc.poll()})\n"
                     f"{r.output(tail=8000 if r.proc.poll() is not None else 1500)}" for r in ended)
    what = f"{what}; ended: {[r.name for r in ended if r.proc.poll() is not None] or 'none'}"
    raise AssertionError(f"timed out waiting for {what}\n{logs}")


def first_at(replicas: list[Replica], participants: int, since: float) -> float | None:
    """Time of the first committed step at ``participants`` after ``since`` (any replica)."""
    times = [r["time"] for rep in replicas for r in rep.committed(since) if r["participants"] == participants]
    return min(times) if times else None


def assert_samples_distinct(replicas: list[Replica], faults: int = 1) -> int:
    """Every sample index is taken by at most one participant of one committed step; every
    committed step whose participants all logged it covers its block without a gap; at most
    ``faults`` committed steps lack a participant's record (per fault one: a replica killed
    between its commit and its record, or one whose vote failed, frozen in it, while its peers
    committed: it is healed from them at the next quorum). Returns the number of committed steps
    checked."""
    by_step: dict[int, list[dict]] = {}
    for rep in replicas:
        for r in rep.committed():
            by_step.setdefault(r["step"], []).append(r)
    seen: set[int] = set()
    incomplete = 0
    for step, records in sorted(by_step.items()):
        participants = {r["participants"] for r in records}
        assert len(participants) == 1, f"step {step}: participants differ {records}"
        ranks = sorted(r["rank"] for r in records)
        assert len(ranks) == len(set(ranks)), f"step {step}: two records of one rank {records}"
        for r in records:
            block = set(range(*r["samples"]))
            assert not block & seen, f"step {step}: samples {r['samples']} seen before"
            seen |= block
        if len(records) == participants.pop():
            end = records[0]["samples_seen"]
            covered = sorted(i for r in records for i in range(*r["samples"]))
            assert covered == list(range(end - records[0]["global_batch_size"], end)), step
        else:
            incomplete += 1  # the killed replica died between its commit and its record
    assert incomplete <= faults, f"{incomplete} committed steps lack a participant's record"
    return len(by_step)


def routed_address() -> str:
    """An IPv4 address of this host other than loopback (the host name resolves to 127.0.0.1
    here, so a socket on it would be wrong), else 127.0.0.1."""
    for name, addrs in sorted(psutil.net_if_addrs().items()):
        stats = psutil.net_if_stats().get(name)
        for a in addrs:
            if a.family == socket.AF_INET and not a.address.startswith("127.") and stats and stats.isup:
                return a.address
    return "127.0.0.1"


def worker_sockets(reps: list[Replica], lighthouse_port: int) -> set[tuple[str, str]]:
    """(status, local ip) of the TCP sockets of the replicas' workers, sampled until they end;
    the connections to the lighthouse (on 127.0.0.1 in this test) are left out."""
    seen: set[tuple[str, str]] = set()
    while any(rep.proc.poll() is None for rep in reps):
        for rep in reps:
            for start in (r for r in rep.records() if r["event"] == "start"):
                try:
                    conns = psutil.Process(start["pid"]).net_connections("tcp")
                except psutil.Error:
                    continue
                seen |= {(c.status, c.laddr.ip) for c in conns
                         if not (c.raddr and c.raddr.port == lighthouse_port)}
        time.sleep(0.02)
    return seen


def val_losses(rep: Replica) -> dict[int, float]:
    return {r["step"]: r["val_loss"] for r in rep.records() if r["event"] == "val"}


def evaluated_by_both(a: Replica, b: Replica, after: int) -> dict[int, tuple[float, float]]:
    """{step: (a's val_loss, b's val_loss)} for the steps > ``after`` both replicas evaluated. Each
    writes its own val record: one may have written it while the other is still evaluating."""
    va, vb = val_losses(a), val_losses(b)
    return {s: (va[s], vb[s]) for s in sorted(va.keys() & vb.keys()) if s > after}


# both from the first step: alone, the first replica could finish the 60 tiny steps before the
# second has imported torch (it would then train alone too, with no live peer to join)
@pytest.mark.parametrize("lighthouse", [2], indirect=True, ids=["min_replicas_2"])
@pytest.mark.parametrize(("policy", "batch"), [
    ("keep_per_rank", {}),  # global batch = participants x 4: 8 at 2 participants (Goyal LR x8/12)
    ("keep_global", {"global_batch_size": 9}),  # 9 at any count: 5 + 4 samples at 2 participants
])
def test_two_replicas_train_to_the_end_in_step(tmp_path, data_path, lighthouse, policy, batch):
    addr = routed_address()
    reps = [Replica(tmp_path, f"node{i}", lighthouse, data_path, addr=addr, max_steps=60,
                    eval_interval=20, ckpt_interval=30, batch_policy=policy, **batch)
            for i in range(2)]
    for rep in reps:
        rep.start()
    sockets = worker_sockets(reps, int(lighthouse.rpartition(":")[2]))
    codes = [rep.wait(90) for rep in reps]
    assert codes == [0, 0], "\n".join(rep.output() for rep in reps)
    # gloo's listener, the store and Manager connections: all on DDPLAB_GLOO_ADDR (the Manager's
    # gRPC server listens on every address, "::")
    assert ("LISTEN", addr) in sockets and ("ESTABLISHED", addr) in sockets, sockets
    assert {ip for _, ip in sockets} <= {addr, "::", f"::ffff:{addr}"}, sockets
    results = [json.loads((rep.out / "result.json").read_text()) for rep in reps]
    assert [r["steps"] for r in results] == [60, 60]
    assert {r["engine"] for r in results} == {"per_step"}
    # same weights at every evaluation both made (a replica that started late joined mid-run)
    common = val_losses(reps[0]).keys() & val_losses(reps[1]).keys()
    assert 60 in common and all(val_losses(reps[0])[s] == val_losses(reps[1])[s] for s in common)
    assert results[0]["final_val_loss"] == results[1]["final_val_loss"]
    assert assert_samples_distinct(reps) == 60
    for rep in reps:
        steps = [r["step"] for r in rep.committed()]
        assert steps == sorted(set(steps)) and steps[-1] == 60
        start = [r for r in rep.records() if r["event"] == "start"]
        assert len(start) == 1 and start[0]["engine"] == "per_step"
        assert start[0]["ft_addr"] == addr and start[0]["ft_store_port"] == rep.rdzv_port
        # periodic checkpoints stay (a replica that joined after step 30 has only the last)
        assert {"ckpt-00000060.pt"} <= {p.name for p in (rep.out / "checkpoints").glob("*.pt")} <= {
            "ckpt-00000030.pt", "ckpt-00000060.pt"}
    # Goyal: the LR scale is the global batch over the reference batch (12)
    both = [r for rep in reps for r in rep.committed() if r["participants"] == 2]
    want = batch.get("global_batch_size", 8)
    scale = round(want / 12, 9)  # as recorded
    assert both and all(r["global_batch_size"] == want and r["lr_scale"] <= scale for r in both)
    assert {r["lr_scale"] for r in both if r["step"] > 40} == {scale}  # after the ramp


def test_kill_one_of_three_then_rejoin_from_a_peer(tmp_path, data_path, lighthouse):
    # no periodic checkpoint within the run: the restarted replica can only get its state live
    reps = [Replica(tmp_path, f"node{i}", lighthouse, data_path, max_steps=100000, eval_interval=50,
                    ckpt_interval=100000) for i in range(3)]
    for rep in reps:
        rep.start()
    survivors, victim = reps[:2], reps[2]
    t_three = wait_until("3 participants", lambda: first_at(reps, 3, 0.0), reps, 60)
    wait_until("20 steps at 3", lambda: len([r for r in victim.committed(t_three)]) >= 20, reps, 30)

    kill_time = time.time()
    victim.signal(signal.SIGKILL)
    victim.wait(10)
    recovered = wait_until("a commit at 2 participants", lambda: first_at(survivors, 2, kill_time),
                           survivors, 30)
    recovered_s = recovered - kill_time
    load_kill = Path("/proc/loadavg").read_text().split()[:3]

    victim.start()
    back = wait_until("back to 3 participants", lambda: first_at(reps, 3, victim.started), reps, 60)
    rejoin_s = back - victim.started
    load_rejoin = Path("/proc/loadavg").read_text().split()[:3]
    wait_until("an evaluation after the rejoin by the victim and a survivor",
               lambda: any(evaluated_by_both(victim, survivors[0], r["step"])
                           for r in victim.committed(victim.started)[:1]), reps, 60)
    for rep in reps:
        rep.signal(signal.SIGTERM)
    for rep in reps:
        rep.wait(30)
    worker_start = [r for r in victim.records() if r["event"] == "start"][-1]["time"]
    print(f"\nper_step, 3 tiny replicas on this machine: kill -> commit at 2 participants "
          f"{recovered_s:.2f} s (load {' '.join(load_kill)}); rejoin -> 3 participants "
          f"{rejoin_s:.2f} s from the new agent's start, {back - worker_start:.2f} s from its "
          f"worker's start record (load {' '.join(load_rejoin)})")

    # the survivors: one worker each from start to end, no step committed twice, none lost. A
    # survivor whose vote on the step of the kill failed while its peer committed it is healed
    # from that peer at the next quorum (torchft votes per replica group): the group lost nothing.
    for rep in survivors:
        starts = [r for r in rep.records() if r["event"] == "start"]
        assert len(starts) == 1 and starts[0]["restart_count"] == 0, rep.name
        steps = [r["step"] for r in rep.committed()]
        assert steps == sorted(set(steps)), f"{rep.name}: a step committed twice"
        assert [r for r in rep.committed(kill_time) if r["participants"] == 2], rep.name
        # stopped with SIGTERM at the end: the emergency checkpoint of the last committed step
        failure = [r for r in rep.records() if r["event"] == "failure"]
        assert len(failure) == 1 and failure[0]["cause"] == "signal" and failure[0]["saved"], failure
        assert (rep.out / "checkpoints" / f"ckpt-{failure[0]['step']:08d}.pt").exists()
    steps = sorted({r["step"] for rep in reps for r in rep.committed()})
    assert steps == list(range(1, steps[-1] + 1)), "a step lost"
    killed_last = max(r["step"] for r in victim.committed() if r["time"] < kill_time)
    survivor_steps = {r["step"] for rep in survivors for r in rep.committed()}
    assert killed_last in survivor_steps  # what the victim committed, the survivors kept
    # the restarted victim: no checkpoint to read, state and step from a live peer
    starts = [r for r in victim.records() if r["event"] == "start"]
    assert len(starts) == 2 and starts[1]["resumed_from_step"] is None
    rejoined = [r for r in victim.committed(victim.started)]
    assert rejoined[0]["step"] > killed_last and rejoined[0]["participants"] == 3
    assert "received from a live peer" in victim.output(tail=0)
    # same weights as the peers: identical validation losses at every evaluation after the rejoin
    after = evaluated_by_both(victim, survivors[0], rejoined[0]["step"] - 1)
    assert after and all(mine == theirs for mine, theirs in after.values()), after
    assert assert_samples_distinct(reps) >= 40


def worker_pid(rep: Replica) -> int:
    return [r for r in rep.records() if r["event"] == "start"][-1]["pid"]


def test_freeze_thaw_and_a_local_worker_restart(tmp_path, data_path, lighthouse):
    reps = [Replica(tmp_path, f"node{i}", lighthouse, data_path, max_restarts=1, max_steps=100000,
                    eval_interval=50, ckpt_interval=100000, ft_timeout_s=2) for i in range(3)]
    for rep in reps:
        rep.start()
    survivors, victim = reps[:2], reps[2]
    load = lambda: " ".join(Path("/proc/loadavg").read_text().split()[:3])  # noqa: E731
    t_three = wait_until("3 participants", lambda: first_at(reps, 3, 0.0), reps, 60)
    wait_until("10 steps at 3", lambda: len(victim.committed(t_three)) >= 10, reps, 30)

    frozen = time.time()
    os.kill(worker_pid(victim), signal.SIGSTOP)
    at_two = wait_until("a commit at 2 participants", lambda: first_at(survivors, 2, frozen),
                        survivors, 30)
    figures = [f"freeze -> commit at 2 participants {at_two - frozen:.2f} s (load {load()})"]
    time.sleep(2)
    thawed = time.time()
    os.kill(worker_pid(victim), signal.SIGCONT)
    back = wait_until("back to 3 after the thaw", lambda: first_at(reps, 3, thawed), reps, 30)
    figures.append(f"thaw -> 3 participants {back - thawed:.2f} s")

    killed, first_pid = time.time(), worker_pid(victim)
    os.kill(first_pid, signal.SIGKILL)  # the worker only: its agent restarts it (a fork: fast)
    restarted = wait_until("the restarted worker", lambda: next(
        (r for r in victim.records() if r["event"] == "start" and r["pid"] != first_pid), None),
        reps, 60)
    back = wait_until("the restarted worker in a commit at 3",
                      lambda: first_at([victim], 3, restarted["time"]), reps, 60)
    # the survivors go on at 2 participants, or at 3 at once when the restarted worker is in the
    # next quorum already (seen under load: no commit at 2 at all)
    going_on = min((r for rep in survivors for r in rep.committed(killed)), key=lambda r: r["time"])
    figures.append(f"worker SIGKILL -> survivors' next commit {going_on['time'] - killed:.2f} s at "
                   f"{going_on['participants']} participants, restarted worker -> 3 participants "
                   f"{back - restarted['time']:.2f} s after its start record (load {load()})")
    wait_until("an evaluation after the restart by the victim and a survivor",
               lambda: any(evaluated_by_both(victim, survivors[0], r["step"])
                           for r in victim.committed(restarted["time"])[:1]), reps, 60)
    for rep in reps:
        rep.signal(signal.SIGTERM)
    for rep in reps:
        rep.wait(30)
    print("\nper_step, 3 tiny replicas, ft_timeout_s 2: " + "; ".join(figures))

    assert restarted["restart_count"] == 1 and restarted["pid"] != first_pid
    for rep in survivors:
        starts = [r for r in rep.records() if r["event"] == "start"]
        assert len(starts) == 1, rep.name
        assert len([r for r in rep.committed(frozen) if r["participants"] == 2]) >= 2
    steps = sorted({r["step"] for rep in reps for r in rep.committed()})
    assert steps == list(range(1, steps[-1] + 1)), "a step lost"
    rejoined = victim.committed(restarted["time"])[0]["step"]
    after = evaluated_by_both(victim, survivors[0], rejoined)
    assert after and all(mine == theirs for mine, theirs in after.values()), after
    assert assert_samples_distinct(reps, faults=2) >= 40  # a freeze and a kill


def test_whole_cluster_restart_resumes_from_the_nodes_checkpoints(tmp_path, data_path, lighthouse):
    # ft_min_replicas 2: the first replica up joins quorums but commits nothing until the second
    for max_steps in (30, 50):  # the same replicas (folders, names) stopped at 30, started again
        reps = [Replica(tmp_path, f"node{i}", lighthouse, data_path, max_steps=max_steps,
                        eval_interval=10, ckpt_interval=10, ft_min_replicas=2) for i in range(2)]
        for rep in reps:
            rep.start()
        assert [rep.wait(90) for rep in reps] == [0, 0], "\n".join(rep.output() for rep in reps)
    for rep in reps:
        starts = [r for r in rep.records() if r["event"] == "start"]
        assert [s["resumed_from_step"] for s in starts] == [None, 30], rep.name
        steps = [r["step"] for r in rep.committed()]
        assert steps == list(range(1, 51)), rep.name  # every step once, across the restart
        assert {r["participants"] for r in rep.committed()} == {2}
        assert json.loads((rep.out / "result.json").read_text())["steps"] == 50
    assert val_losses(reps[0]) == val_losses(reps[1]) and len(val_losses(reps[0])) == 5
    assert assert_samples_distinct(reps) == 50


@pytest.mark.parametrize("lighthouse", [2], indirect=True, ids=["min_replicas_2"])
def test_divergence_stops_every_replica_on_the_same_step(tmp_path, data_path, lighthouse):
    reps = [Replica(tmp_path, f"node{i}", lighthouse, data_path, max_steps=200, base_lr=50.0,
                    ckpt_interval=5, max_restarts=1) for i in range(2)]
    for rep in reps:
        rep.start()
    codes = [rep.wait(90) for rep in reps]
    assert all(code != 0 for code in codes), codes
    failures = [[r for r in rep.records() if r["event"] == "failure"] for rep in reps]
    # torchrun restarted each worker once; the restart refused to replay the divergence at once
    assert all(len(f) == 2 and {r["cause"] for r in f} == {"divergence"} and not f[0]["saved"]
               and "would repeat it" in f[1]["error"] for f in failures), failures
    assert failures[0][0]["failed_step"] == failures[1][0]["failed_step"]  # same sums, same decision
    for rep, failure in zip(reps, failures, strict=True):
        steps = [r["step"] for r in rep.committed()]
        assert steps[-1] == failure[0]["failed_step"] - 1  # the diverged step was not applied
        # no checkpoint of a diverged state: none newer than the last step before the divergence
        saved = [int(p.stem.split("-")[1]) for p in (rep.out / "checkpoints").glob("*.pt")]
        assert all(s < failure[0]["failed_step"] for s in saved)


@pytest.mark.parametrize("lighthouse", [2], indirect=True, ids=["min_replicas_2"])
def test_sigterm_while_waiting_for_a_quorum_saves_and_leaves_at_once(tmp_path, data_path, lighthouse):
    reps = [Replica(tmp_path, f"node{i}", lighthouse, data_path, max_steps=100000,
                    ckpt_interval=100000, ft_quorum_timeout_s=120) for i in range(2)]
    for rep in reps:
        rep.start()
    waiting, gone = reps
    wait_until("10 steps at 2", lambda: len(waiting.committed()) >= 10, reps, 60)
    gone.signal(signal.SIGKILL)
    gone.wait(10)
    time.sleep(2)  # the lighthouse forms no quorum of 1 (--min_replicas 2): the survivor waits
    last = waiting.committed()[-1]["step"]
    pid = worker_pid(waiting)
    sent = time.time()
    os.kill(pid, signal.SIGTERM)
    assert waiting.wait(20) != 0
    left_s = time.time() - sent
    failure = [r for r in waiting.records() if r["event"] == "failure"]
    assert len(failure) == 1 and failure[0]["cause"] == "signal" and failure[0]["saved"], failure
    assert failure[0]["step"] == last and failure[0]["time"] - sent < 5, (failure, left_s)
    assert (waiting.out / "checkpoints" / f"ckpt-{last:08d}.pt").exists()
