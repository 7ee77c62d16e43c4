"""Bytes on the wire: what this node's NIC sent and received during the training steps, beside
what the ring all-reduce model predicts (docs/training.md "Bytes on the wire").

The NIC is the one gloo uses: the interface holding ``DDPLAB_GLOO_ADDR`` (the node's address on
the route to the rendezvous host, which gloo binds), else ``GLOO_SOCKET_IFNAME``; none is known
outside the ddp_job unit (a local run), and the counts are then null. The counters are psutil's
``net_io_counters(pernic=True)`` for that interface: every byte the interface carried, Ethernet/IP/
TCP headers and TCP acknowledgements included, also any other traffic in the same interval (an
SSH session of the controller's watch: a few KB per poll).

The model: a ring all-reduce of ``D`` bytes moves ``2(N-1)/N * D`` bytes out of and into every rank
(:func:`ddplab.bench.costmodel.ring_factor`); ``D`` is what the step's gradient all-reduces hand to
the ring (:func:`ddplab.compression.payload_bytes`).
"""

from __future__ import annotations

import os
import socket
from typing import Any

import psutil

from ddplab.bench.costmodel import ring_factor


def interface_of(addr: str | None, ifname: str | None = None) -> str | None:
    """The interface that holds address ``addr`` (psutil.net_if_addrs; of a labelled address
    ``eth0:1`` its device ``eth0``, which the counters name), else ``ifname`` when such an interface
    exists, else None."""
    nics = psutil.net_if_addrs()
    if addr:
        for name, addrs in nics.items():
            if any(a.family in (socket.AF_INET, socket.AF_INET6) and a.address.split("%")[0] == addr
                   for a in addrs):
                return name.split(":")[0]  # a labelled address (eth0:1) is counted by its device
    return ifname if ifname and ifname in nics else None


def gloo_interface(gloo_addr: str | None, environ: dict[str, str] | None = None) -> str | None:
    """The interface gloo uses on this node: the one holding ``gloo_addr`` (DDPLAB_GLOO_ADDR), else
    ``GLOO_SOCKET_IFNAME`` of ``environ`` (default the process environment); None when neither
    names an interface of this host."""
    env = os.environ if environ is None else environ
    return interface_of(gloo_addr, env.get("GLOO_SOCKET_IFNAME") or None)


def model_bytes(payload: int, world_size: int) -> int:
    """Bytes a rank sends (and receives) in a ring all-reduce of ``payload`` bytes among
    ``world_size`` ranks: ``2(N-1)/N * payload`` (0 alone)."""
    return round(ring_factor(world_size) * payload)


class NicMeter:
    """Counts the bytes ``nic`` sent and received between :meth:`begin` and :meth:`end` of each
    step, beside the bytes the model predicts for it; :meth:`fields` gives the means per step
    since the fields were last taken.

    ``nic`` None (no interface known): only the model is counted, the NIC fields are null.
    """

    def __init__(self, nic: str | None) -> None:
        self.nic = nic
        self._at: tuple[int, int] | None = None
        self._clear()

    def _clear(self) -> None:
        self.sent = self.recv = self.counted = self.steps = 0
        self.payload = self.model = 0

    def _read(self) -> tuple[int, int] | None:
        counters = psutil.net_io_counters(pernic=True).get(self.nic) if self.nic else None
        return None if counters is None else (counters.bytes_sent, counters.bytes_recv)

    def begin(self) -> None:
        """The step starts: read the counters."""
        self._at = self._read()

    def end(self, payload: int, world_size: int) -> None:
        """The step ended, its all-reduces handed ``payload`` bytes to a ring of ``world_size``
        ranks: add those, and what the interface carried since :meth:`begin` (not when begin was
        not called or the interface is gone)."""
        now, before, self._at = self._read(), self._at, None
        self.steps += 1
        self.payload += payload
        self.model += model_bytes(payload, world_size)
        if now is None or before is None:
            return
        self.sent += now[0] - before[0]
        self.recv += now[1] - before[1]
        self.counted += 1

    def fields(self) -> dict[str, Any]:
        """The step record's fields, means per step since the last call, and start anew: ``nic``;
        ``nic_sent_bytes``, ``nic_recv_bytes`` over the ``nic_steps`` steps the NIC was read (null
        when none); ``grad_bytes`` (D) and ``wire_model_bytes`` (:func:`model_bytes` of it) over
        every step ended (null when none)."""
        def mean(total: int, steps: int) -> int | None:
            return round(total / steps) if steps else None

        out: dict[str, Any] = {
            "nic": self.nic, "nic_steps": self.counted,
            "nic_sent_bytes": mean(self.sent, self.counted), "nic_recv_bytes": mean(self.recv, self.counted),
            "grad_bytes": mean(self.payload, self.steps), "wire_model_bytes": mean(self.model, self.steps),
        }
        self._clear()
        return out
