"""The test harness's ports (labharness.free_port) cannot be taken by an outgoing connection, nor
handed out to two test processes running at once.

CI failed once when a per_step replica's worker, started seconds after two others, exited 1 before
it joined: its ports had been picked with ``bind(("127.0.0.1", 0))``, from the kernel's ephemeral
range, where the other replicas' gloo, store and gRPC connections draw their local ports too.
A port free when one process checked it could be given to another process too before the first
bound it (pytest-xdist workers, other checkouts' suites): each port handed out is locked
machine-wide (labharness.PORT_LOCKS) for as long as the process that got it lives.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import REPO
from labharness import TEST_PORTS, free_port


def ephemeral_range() -> range:
    low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    return range(low, high + 1)


def test_ports_lie_below_the_ephemeral_range_and_are_not_handed_out_twice():
    ports = [free_port() for _ in range(200)]
    ephemeral = ephemeral_range()
    assert not [p for p in ports if p in ephemeral], "a port outgoing connections may take"
    assert len(set(ports)) == len(ports)
    assert all(p in TEST_PORTS for p in ports)


def test_a_port_held_by_a_listener_is_not_handed_out(monkeypatch):
    import labharness

    port = free_port()
    os.close(labharness._handed_out.pop(port))  # its lock released: only the listener is in the way
    with socket.socket() as held:
        held.bind(("127.0.0.1", port))
        held.listen()
        monkeypatch.setattr(labharness, "TEST_PORTS", range(port, port + 1))
        with pytest.raises(RuntimeError, match="no free TCP port"):
            labharness.free_port()
    assert labharness.free_port() == port  # nothing holds it any more


def test_a_port_another_test_process_got_is_not_handed_out_while_it_lives(monkeypatch):
    """Two processes choosing from the same ten ports at once: the other takes five and keeps
    running; this one gets only ports the other did not get (until none is left); once the other
    ended, its ports are handed out again. (A port some third process listens on is skipped by
    both, which these assertions allow.)"""
    import labharness

    low = free_port()
    for p in range(low, low + 10):  # release this process's own hold on the ten (it took one)
        if p in labharness._handed_out:
            os.close(labharness._handed_out.pop(p))
    script = textwrap.dedent(f"""\
        import sys, labharness
        labharness.TEST_PORTS = range({low}, {low + 10})
        print(*sorted(labharness.free_port() for _ in range(5)), flush=True)
        sys.stdin.read()  # hold the ports until told to end
        """)
    other = subprocess.Popen([sys.executable, "-c", script], cwd=REPO / "tests", stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    monkeypatch.setattr(labharness, "TEST_PORTS", range(low, low + 10))
    mine: set[int] = set()
    try:
        theirs = set(map(int, other.stdout.readline().split()))
        assert len(theirs) == 5, theirs
        with pytest.raises(RuntimeError, match="no free TCP port"):
            while True:
                mine.add(labharness.free_port())
        assert mine and not mine & theirs and mine <= set(range(low, low + 10))
    finally:
        other.communicate("", timeout=30)
    assert labharness.free_port() in theirs  # released when the other process ended
