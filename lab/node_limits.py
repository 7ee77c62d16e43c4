"""The lab's per-laptop limits: a CPU quota for each node and every node's link shaped to a rate.

What a user gives (``make lab-up LAB_CPUS=0.6,0.6,0.3 LAB_LINK_MBIT=1000``, ``lab/lab.py up --cpus
... --link-mbit ...``, the molecule scenarios' ``DDP_LAB_MOLECULE_CPUS`` / ``_LINK_MBIT``) is parsed
here, with one-line errors that say what to give; ``lab/lab.py`` applies it with podman and reads
back what is in force. Standard library only (``lab/lab.py`` runs before the controller venv exists).

* **CPU quota**: the container's cgroup CPU bandwidth (``cpu.cfs_quota_us`` over
  ``cpu.cfs_period_us``, podman's ``--cpu-quota``/``--cpu-period``): a node gets at most that many
  CPU-seconds per second, whatever the others do. The period is :data:`CPU_PERIOD_US` (10 ms, not
  the kernel's 100 ms): a node whose quota is spent is stopped until the period ends, and in a
  synchronous step every other node waits for it, so a long period turns a slow laptop into one
  that stops for up to 70 ms at a time (0.3 CPU); with 10 ms the stops are short and the node
  runs as a slower laptop would. With shares that add up to no more than the machine's CPUs,
  every node has a known, separate speed. One value applies to every node; a list gives one per
  node, in address order. ``off`` means no quota.
* **Link**: a ``tbf`` queueing discipline on each node's egress interface (what it sends), so that
  every directed link between two nodes runs at the rate, as a port of a gigabit switch does. A
  unit inside the node applies it at every boot (``LINK_UNIT``): a node powered off and started
  again by ``kill-node.yml`` keeps its link. ``off`` (or 0) removes it.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

#: Words that switch a limit off.
OFF_WORDS = ("off", "none")
#: The smallest quota podman and the kernel accept: 1 ms of CPU per 100 ms period.
MIN_CPUS = 0.01
#: The CFS period of a node's quota, microseconds; a share so small that its quota would be under
#: the kernel's 1 ms minimum gets the longer period that makes it 1 ms (:func:`cpu_args`).
CPU_PERIOD_US = 10_000
MIN_QUOTA_US = 1_000
MAX_LINK_MBIT = 100_000
#: The lab's tbf handle: another than the bench's own (roles/bench, d1ab:), so the bench sees the
#: lab's shaping as set by someone else and leaves it alone.
QDISC_HANDLE = "1ab:"
LINK_UNIT = "ddp-lab-link.service"
LINK_UNIT_PATH = f"/etc/systemd/system/{LINK_UNIT}"
#: tbf's bucket: 8 ms at the rate, at least 128 KB (roles/bench's rule: smaller buckets lose goodput
#: on veth links); the queue holds at most 50 ms.
BURST_S = 0.008
MIN_BURST_BYTES = 128 * 1024
LATENCY_MS = 50


class LimitError(ValueError):
    """A limit the lab cannot apply; the message is one line that says what to give instead."""


def _is_off(text: str) -> bool:
    return text.strip().lower() in OFF_WORDS


def parse_cpus(text: str | None, host_cpus: int) -> tuple[float | None, ...] | None:
    """The CPU quotas of ``LAB_CPUS``: None when not given (keep what the nodes have), else one
    entry per value, None for ``off``.

    Args:
        text: ``"0.6"``, ``"0.6,0.6,0.3"``, ``"off"``, ``""`` or None.
        host_cpus: CPUs of this machine (a quota above them means nothing).

    Raises:
        LimitError: a value that is not a number of CPUs in [0.01, host_cpus] or ``off``.
    """
    if text is None or not text.strip():
        return None
    shares: list[float | None] = []
    for item in text.split(","):
        if _is_off(item):
            shares.append(None)
            continue
        try:
            value = float(item)
        except ValueError:
            value = math.nan
        if not math.isfinite(value) or not MIN_CPUS <= value <= host_cpus:
            raise LimitError(
                f"LAB_CPUS={text}: {item.strip() or '(empty)'!r} is not a CPU share between {MIN_CPUS} and "
                f"this machine's {host_cpus} CPUs; give one share per laptop (LAB_CPUS=0.6,0.6,0.3), one for "
                "all (LAB_CPUS=0.6) or off"
            )
        shares.append(round(value, 4))
    return tuple(shares)


def shares_for(shares: tuple[float | None, ...], nodes: int) -> tuple[float | None, ...]:
    """``shares`` for a lab of ``nodes`` laptops: one value is every node's.

    Raises:
        LimitError: a list whose length is not ``nodes``.
    """
    if len(shares) == 1:
        return shares * nodes
    if len(shares) != nodes:
        raise LimitError(
            f"LAB_CPUS has {len(shares)} shares for a lab of {nodes} laptops: give one per laptop, in "
            f"the order laptop-a, laptop-b, ..., or one for all"
        )
    return shares


def parse_link_mbit(text: str | None) -> int | None:
    """The link rate of ``LAB_LINK_MBIT`` in Mbit/s: None when not given (keep), 0 for off.

    Raises:
        LimitError: not a whole number of Mbit/s in [1, 100000] or ``off``.
    """
    if text is None or not text.strip():
        return None
    if _is_off(text) or text.strip() == "0":
        return 0
    value = text.strip()
    if not value.isdigit() or not 1 <= int(value) <= MAX_LINK_MBIT:
        raise LimitError(
            f"LAB_LINK_MBIT={text}: give the link rate as a whole number of Mbit/s between 1 and "
            f"{MAX_LINK_MBIT} (1000 for gigabit) or off"
        )
    return int(value)


def oversubscribed(shares: tuple[float | None, ...], host_cpus: int) -> str | None:
    """The warning for quotas that add up to more than the machine's CPUs (a node without a quota
    counts as all of them), None when they fit or no node has a quota."""
    if all(s is None for s in shares):
        return None
    total = sum(host_cpus if s is None else s for s in shares)
    if total <= host_cpus + 1e-9:
        return None
    return (
        f"warning: the laptops' CPU shares add up to {total:g} CPUs, more than this machine's {host_cpus}: "
        "they compete for the cores, so their speeds and every figure will depend on the load"
    )


def cpu_args(cpus: float) -> list[str]:
    """podman's ``run``/``update`` arguments for a quota of ``cpus`` CPUs: ``--cpu-period P
    --cpu-quota Q`` with P = :data:`CPU_PERIOD_US` (longer when Q would be under
    :data:`MIN_QUOTA_US`) and Q = round(cpus x P)."""
    period = max(CPU_PERIOD_US, math.ceil(MIN_QUOTA_US / cpus))
    return ["--cpu-period", str(period), "--cpu-quota", str(round(cpus * period))]


def same_share(a: float | None, b: float | None) -> bool:
    """Two quotas are the same to within 5e-4 CPUs (the cgroup holds whole microseconds per period)."""
    if a is None or b is None:
        return a is b
    return abs(a - b) < 5e-4


def shares_text(shares: tuple[float | None, ...] | list[float | None]) -> str:
    """``0.6/0.6/0.3``; ``-`` for a node without a quota."""
    return "/".join("-" if s is None else f"{s:g}" for s in shares)


def burst_bytes(mbit: int) -> int:
    """tbf's bucket for ``mbit``: ``BURST_S`` of traffic at the rate, at least ``MIN_BURST_BYTES``."""
    return max(MIN_BURST_BYTES, int(mbit * 1e6 / 8 * BURST_S))


def tc_argv(ifname: str, mbit: int) -> list[str]:
    """The tc command that shapes ``ifname``'s egress to ``mbit`` Mbit/s."""
    return ["/usr/sbin/tc", "qdisc", "replace", "dev", ifname, "root", "handle", QDISC_HANDLE, "tbf",
            "rate", f"{mbit}mbit", "burst", str(burst_bytes(mbit)), "latency", f"{LATENCY_MS}ms"]


def link_unit(ifname: str, mbit: int) -> str:
    """The node's unit that shapes ``ifname`` to ``mbit`` Mbit/s at every boot (and unshapes it when
    stopped)."""
    return (
        "# Written by lab/lab.py (make lab-up LAB_LINK_MBIT=...): the lab's stand-in for the laptop's\n"
        "# switch port. `make lab-up LAB_LINK_MBIT=off` removes it.\n"
        "[Unit]\n"
        f"Description=ddp-lab: {ifname} shaped to {mbit} Mbit/s (tbf)\n"
        "DefaultDependencies=no\n"
        "After=sysinit.target\n"
        "Before=network.target\n\n"
        "[Service]\n"
        "Type=oneshot\n"
        "RemainAfterExit=yes\n"
        f"ExecStart={' '.join(tc_argv(ifname, mbit))}\n"
        f"ExecStop=/usr/sbin/tc qdisc del dev {ifname} root\n\n"
        "[Install]\n"
        "WantedBy=multi-user.target\n"
    )


_RATE = re.compile(r"\brate (\d+(?:\.\d+)?)([KMG]?)bit\b")
_UNITS = {"": 1e-6, "K": 1e-3, "M": 1.0, "G": 1e3}


def shaped_mbit(qdisc_show: str) -> float | None:
    """The lab's tbf rate (Mbit/s) in ``tc qdisc show dev IF root`` output, None when the root
    queueing discipline is not the lab's tbf."""
    line = next((ln for ln in qdisc_show.splitlines() if ln.startswith(f"qdisc tbf {QDISC_HANDLE}")), None)
    found = _RATE.search(line or "")
    return None if found is None else float(found.group(1)) * _UNITS[found.group(2)]


_SENT = re.compile(r"^\s*Sent (\d+) bytes", re.M)


def qdisc_sent_bytes(qdisc_stats: str) -> int | None:
    """Bytes the root queueing discipline sent, from ``tc -s qdisc show dev IF root``."""
    found = _SENT.search(qdisc_stats)
    return None if found is None else int(found.group(1))


#: Runs in a node (``python3 -c BUSY_LOOP SECONDS WORKERS``): WORKERS processes spin for SECONDS of
#: wall time; prints the CPU-seconds they got per second of wall time (the share in force).
BUSY_LOOP = """
import os, sys, time
seconds, workers = float(sys.argv[1]), int(sys.argv[2])
t0 = time.monotonic()
pids = []
for _ in range(workers):
    pid = os.fork()
    if pid == 0:
        while time.monotonic() - t0 < seconds:
            pass
        os._exit(0)
    pids.append(pid)
for pid in pids:
    os.waitpid(pid, 0)
wall = time.monotonic() - t0
used = os.times()
print((used.children_user + used.children_system) / wall)
"""

#: Runs in the receiving node (``python3 -c RECEIVER``): listens on a free port, prints it, takes
#: one connection and prints "<bytes> <seconds from the first to the last byte>".
RECEIVER = """
import socket, time
srv = socket.socket()
srv.bind(("0.0.0.0", 0))
srv.listen(1)
print(srv.getsockname()[1], flush=True)
conn, _ = srv.accept()
total, first = 0, None
while True:
    data = conn.recv(1 << 20)
    if not data:
        break
    if first is None:
        first = time.monotonic()
    total += len(data)
print(total, time.monotonic() - (first or time.monotonic()), flush=True)
"""

#: Runs in the sending node (``python3 -c SENDER ADDRESS PORT BYTES``).
SENDER = """
import socket, sys
addr, port, nbytes = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
chunk = b"\\0" * (1 << 20)
with socket.create_connection((addr, port), timeout=60) as s:
    left = nbytes
    while left > 0:
        s.sendall(chunk[: min(left, len(chunk))])
        left -= min(left, len(chunk))
"""


@dataclass(frozen=True)
class Transfer:
    """One measured transfer between two nodes. ``payload_bytes``/``seconds`` at the receiver (first
    to last byte); ``wire_bytes``: what the sender's queueing discipline counted from before the
    connection to after it (TCP/IP and Ethernet headers included, also what tbf let through at once
    from its bucket before the receiver's clock started), None when unknown."""

    sender: str
    receiver: str
    payload_bytes: int
    seconds: float
    wire_bytes: int | None

    @property
    def payload_mbit_s(self) -> float:
        return self.payload_bytes * 8 / 1e6 / self.seconds if self.seconds > 0 else math.inf

    def line(self, shaped: float | None) -> str:
        """``laptop-a -> laptop-b: 64.0 MB in 0.55 s = 931 Mbit/s of payload; the sender's qdisc sent
        66.9 MB (headers and tbf's first bucket included) (tbf 1000 Mbit/s)``."""
        wire = self.wire_bytes
        return (
            f"{self.sender} -> {self.receiver}: {self.payload_bytes / 1e6:.1f} MB in {self.seconds:.2f} s = "
            f"{self.payload_mbit_s:.0f} Mbit/s of payload"
            + ("" if wire is None else f"; the sender's qdisc sent {wire / 1e6:.1f} MB")
            + (" (not shaped)" if shaped is None else f" (tbf {shaped:g} Mbit/s)")
        )
