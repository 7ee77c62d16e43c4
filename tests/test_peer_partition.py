"""torchelastic: a peer cut off from the network fails the collective as a crashed one does; a
frozen peer is still waited for.

Two network namespaces made here (``ip netns``), joined by a veth pair, play two laptops; one
rank runs in each (tests/peer_partition_worker.py: the group joined through the torchelastic
engine's ``connect`` with the default run configuration, ``pg_timeout_s`` aside). Rank 0 (it also serves the env://
store, as the rank-0 worker does under torchrun) is on laptop-b.

* partition: laptop-b's link goes down (a pulled cable: no reset reaches laptop-a, nothing
  answers) while both ranks all-reduce. With ``pg_timeout_s`` far beyond the test's wait, only
  ``peer_timeout_s`` can end laptop-a's wait: its collective must fail while laptop-b is still
  cut off, and laptop-b's own collective must fail too (no rank hangs). Before
  ``peer_timeout_s`` the survivor waited for the process-group timeout, or for TCP's
  retransmission back-off after the link came back.
* freeze: rank 0's process is stopped (SIGSTOP) for several ``peer_timeout_s`` while laptop-a
  all-reduces; its kernel still acknowledges and answers keepalive probes, so laptop-a waits,
  and both complete the all-reduce once rank 0 continues (a freeze is ridden out up to
  ``pg_timeout_s``, as before).

The waits below are harness bounds on a loaded machine, not measured figures. Without namespaces:
the socket options ``bound_unanswered`` sets, read back from a loopback connection.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import uuid
from pathlib import Path

import pytest
from conftest import subprocess_env
from ddplab.config import TrainConfig
from ddplab.distributed import KEEPALIVE_PROBES, bound_unanswered, tcp_connections

WORKER = Path(__file__).with_name("peer_partition_worker.py")
PEER_TIMEOUT_S = TrainConfig.peer_timeout_s  # the default: what every torchelastic run gets
PG_TIMEOUT_S = 900  # longer than any wait here: only peer_timeout_s can end a collective early
START_S = 180  # torch import + group, two processes on a loaded 2-core machine
WAIT_S = 120  # for an answer that peer_timeout_s makes come within seconds


def test_bound_unanswered_sets_user_timeout_and_keepalive_in_place():
    with socket.create_server(("127.0.0.1", 0)) as server:
        before = tcp_connections()
        client = socket.create_connection(server.getsockname())
        accepted, _ = server.accept()
        with client, accepted:
            new = tcp_connections() - before
            assert new == {client.fileno(), accepted.fileno()}, new
            bound_unanswered(new, 5)
            for sock in (client, accepted):
                assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT) == 5000
                assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
                assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE) == 5 - KEEPALIVE_PROBES
                assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL) == 1
                assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT) == KEEPALIVE_PROBES
            client.sendall(b"still open")  # used in place, not closed
            assert accepted.recv(16) == b"still open"
    read, write = os.pipe()  # a listed descriptor that is no TCP socket any more: skipped
    try:
        bound_unanswered({read}, 5)
        os.write(write, b"x")
        assert os.read(read, 1) == b"x"
    finally:
        os.close(read)
        os.close(write)


def ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


@pytest.fixture
def two_laptops():
    """Namespaces for laptop-a (192.168.77.11) and laptop-b (192.168.77.12) joined by a veth;
    yields ``{side: {ns, ifname, addr}}``; the namespaces are deleted afterwards."""
    tag = uuid.uuid4().hex[:6]
    sides = {s: {"ns": f"pp-{s}-{tag}", "ifname": f"p{s}{tag}", "addr": f"192.168.77.1{i}"}
             for i, s in enumerate("ab", start=1)}
    made: list[str] = []
    try:
        for side in sides.values():
            try:
                ip("netns", "add", side["ns"])
            except subprocess.CalledProcessError as err:
                pytest.skip(f"network namespaces are not permitted here (ip netns add: {err.stderr.strip()})")
            made.append(side["ns"])
        a, b = sides["a"], sides["b"]
        ip("link", "add", a["ifname"], "netns", a["ns"], "type", "veth",
           "peer", "name", b["ifname"], "netns", b["ns"])
        for side in sides.values():
            ip("-n", side["ns"], "addr", "add", f"{side['addr']}/24", "dev", side["ifname"])
            ip("-n", side["ns"], "link", "set", "lo", "up")
            ip("-n", side["ns"], "link", "set", side["ifname"], "up")
        yield sides
    finally:
        for name in made:
            subprocess.run(["ip", "netns", "del", name], check=False, capture_output=True)


class Rank:
    """One worker process; its JSON lines arrive on a queue (a reader thread)."""

    def __init__(self, side: dict, rank: int, master: str, port: int) -> None:
        env = subprocess_env(RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR=master, MASTER_PORT=str(port),
                             DDPLAB_GLOO_ADDR=side["addr"])
        self.proc = subprocess.Popen(
            ["ip", "netns", "exec", side["ns"], sys.executable, str(WORKER), f"pg_timeout_s={PG_TIMEOUT_S}"],
            env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.lines: queue.Queue[dict] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            if line.startswith("{"):
                self.lines.put(json.loads(line))

    def next(self, timeout_s: float) -> dict | None:
        """The worker's next record, or None when none came within ``timeout_s``."""
        try:
            return self.lines.get(timeout=timeout_s)
        except queue.Empty:
            return None

    def all_reduce(self) -> None:
        self.proc.stdin.write("all-reduce\n")
        self.proc.stdin.flush()

    def pid(self) -> int:
        """The worker's own pid (``ip netns exec`` execs it in place)."""
        return self.proc.pid

    def stop(self) -> str:
        """Kill the worker (continued first if stopped); its stderr."""
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGCONT)
            self.proc.kill()
        self.proc.wait(timeout=30)
        return self.proc.stderr.read()[-2000:]


@pytest.fixture
def pair(two_laptops):
    """Rank 0 on laptop-b, rank 1 on laptop-a, both past their first all-reduce."""
    with socket.socket() as s:  # any port: the namespaces have their own port space
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    b, a = two_laptops["b"], two_laptops["a"]
    ranks = {"b": Rank(b, 0, b["addr"], port), "a": Rank(a, 1, b["addr"], port)}
    try:
        for side, rank in ranks.items():
            ready = rank.next(START_S)
            assert ready == {"event": "ready"}, f"laptop-{side} did not join: {ready}, {rank.stop()}"
        yield two_laptops, ranks
    finally:
        for rank in ranks.values():
            rank.stop()


@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0, reason="ip netns needs root (CAP_SYS_ADMIN)")
def test_a_cut_off_peer_fails_the_collective_while_the_partition_lasts(pair):
    laptops, ranks = pair
    b = laptops["b"]
    ip("-n", b["ns"], "link", "set", b["ifname"], "down")  # laptop-b (rank 0, the store) cut off
    try:
        ranks["a"].all_reduce()
        ranks["b"].all_reduce()
        survivor, cut_off = ranks["a"].next(WAIT_S), ranks["b"].next(WAIT_S)
    finally:
        ip("-n", b["ns"], "link", "set", b["ifname"], "up")
    waited = f"laptop-a still waits for its cut-off peer after {WAIT_S} s (pg_timeout_s {PG_TIMEOUT_S})"
    assert survivor is not None and survivor["event"] == "error", f"{waited}: {survivor}"
    assert "Timed out" not in survivor["error"], survivor  # ended by peer_timeout_s, not gloo's timeout
    assert cut_off is not None and cut_off["event"] == "error", f"laptop-b's rank hung: {cut_off}"
    assert ranks["a"].proc.wait(timeout=30) == 1 and ranks["b"].proc.wait(timeout=30) == 1


@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0, reason="ip netns needs root (CAP_SYS_ADMIN)")
def test_a_frozen_peer_is_waited_for(pair):
    _laptops, ranks = pair
    os.kill(ranks["b"].pid(), signal.SIGSTOP)
    try:
        ranks["a"].all_reduce()
        early = ranks["a"].next(4 * PEER_TIMEOUT_S)  # nothing can complete while rank 0 is stopped
    finally:
        os.kill(ranks["b"].pid(), signal.SIGCONT)
    assert early is None, f"laptop-a gave up on a frozen peer (its kernel still answers): {early}"
    ranks["b"].all_reduce()
    for side in "ab":
        done = ranks[side].next(WAIT_S)
        assert done is not None and done["event"] == "done" and done["sum"] == 2.0, (side, done)
