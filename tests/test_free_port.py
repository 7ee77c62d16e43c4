"""The test harness's ports (labharness.free_port) cannot be taken by an outgoing connection.

CI failed once when a per_step replica's worker, started seconds after two others, exited 1 before
it joined: its ports had been picked with ``bind(("127.0.0.1", 0))``, from the kernel's ephemeral
range, where the other replicas' gloo, store and gRPC connections draw their local ports too.
"""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
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
    with socket.socket() as held:
        held.bind(("127.0.0.1", port))
        held.listen()
        monkeypatch.setattr(labharness, "TEST_PORTS", range(port, port + 1))
        monkeypatch.setattr(labharness, "_handed_out", set())
        with pytest.raises(RuntimeError, match="no free TCP port"):
            labharness.free_port()
