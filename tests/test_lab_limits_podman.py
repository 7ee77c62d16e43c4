"""The lab's CPU quotas and shaped links on real containers of the lab image: what is in force.

Two containers of the lab image (systemd, CAP_NET_ADMIN as the lab gives) on a network of their
own get ``lab/lab.py limits --cpus 0.6,0.3 --link-mbit 200`` (the molecule scenarios' prepare step,
and what ``make lab-up LAB_CPUS=... LAB_LINK_MBIT=...`` applies to a running lab). Checked inside
each container: the cgroup's ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us``, the share and threads the
training program's rule reads there (ddplab.cpushare), the root qdisc ``tc`` shows, and that the
link check's bytes went through that qdisc; after a restart of a container the link is shaped
again (the node's unit). The measured rates (busy loop, transfer) are printed, not asserted: they
depend on the machine's load. Needs podman, root and the lab image (``make image``); skipped
otherwise (a failure with ``DDP_LAB_TEST_REQUIRE_NODES=1``). About 30 s.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import node_limits
import pytest
from labharness import REPO, lab_image_or_skip

LAB_PY = REPO / "lab" / "lab.py"

pytestmark = pytest.mark.lab


@pytest.fixture(scope="module")
def nodes():
    """Two running containers of the lab image on a network of their own; removed afterwards."""
    lab = lab_image_or_skip()
    tag = f"ddp-lab-limits-{os.getpid()}"
    names = [f"{tag}-a", f"{tag}-b"]
    lab.podman("network", "create", tag)
    try:
        for name in names:
            lab.podman("run", "--detach", "--name", name, "--hostname", name, "--network", tag,
                       "--systemd=always", "--cap-add", "NET_ADMIN,NET_RAW", lab.NODE_IMAGE)
        for name in names:
            lab.wait_for_systemd(name)
        yield lab, names
    finally:
        for name in names:
            lab.podman("rm", "--force", "--time", "5", name, check=False)
        lab.podman("network", "rm", "--force", tag, check=False)


def _cat(lab, name: str, path: str) -> str:
    return lab.out(lab.podman("exec", name, "cat", path))


def test_limits_are_in_force_inside_the_containers(nodes):
    lab, names = nodes
    proc = subprocess.run([sys.executable, str(LAB_PY), "limits", "--cpus", "0.6,0.3", "--link-mbit", "200",
                           *names], capture_output=True, text=True, env=lab.podman_env(), timeout=600)
    print(proc.stdout, proc.stderr)
    assert proc.returncode == 0, proc.stderr
    for name, cpus in zip(names, (0.6, 0.3), strict=True):
        period, quota = (int(v) for v in node_limits.cpu_args(cpus)[1::2])
        assert _cat(lab, name, "/sys/fs/cgroup/cpu/cpu.cfs_quota_us") == str(quota)
        assert _cat(lab, name, "/sys/fs/cgroup/cpu/cpu.cfs_period_us") == str(period)
        share = lab.node_share(name)
        assert (share["quota"], share["threads"]) == (cpus, 1)
        assert share["share"] == cpus
        qdisc = lab.out(lab.podman("exec", name, "tc", "qdisc", "show", "dev", "eth0", "root"))
        assert re.match(r"qdisc tbf 1ab: root .*rate 200Mbit", qdisc), qdisc
    busy = re.search(r"CPU in force: (.*)", proc.stdout)
    assert busy and f"{names[0]} quota 0.6 (1 thread(s)), a busy loop got" in busy.group(1)
    moved = re.findall(r"link: (\S+) -> (\S+): (\d+\.\d) MB in .* Mbit/s of payload; the sender's qdisc "
                       r"sent (\d+\.\d) MB \(tbf 200 Mbit/s\)", proc.stdout)
    assert [(a, b) for a, b, *_ in moved] == [(names[0], names[1]), (names[1], names[0])], proc.stdout
    assert all(float(mb) == 64.0 and float(wire) >= 64.0 for _, _, mb, wire in moved)  # all, through tbf


def test_a_restarted_node_is_shaped_again_and_unshaped_on_request(nodes):
    lab, names = nodes
    lab.podman("restart", "--time", "5", names[1])
    lab.wait_for_systemd(names[1])
    assert lab.node_link_mbit(names[1], "eth0") == 200.0
    sent = lab.qdisc_sent(names[1], "eth0")
    transfer = lab.measure_link(names[1], names[0], lab.container_address(names[0]), "eth0", 8_000_000)
    print(transfer.line(200.0))
    assert transfer.payload_bytes == 8_000_000
    assert transfer.wire_bytes >= 8_000_000 and lab.qdisc_sent(names[1], "eth0") > sent
    proc = subprocess.run([sys.executable, str(LAB_PY), "limits", "--link-mbit", "off", *names],
                          capture_output=True, text=True, env=lab.podman_env(), timeout=600)
    assert proc.returncode == 0, proc.stderr
    for name in names:
        assert lab.node_link_mbit(name, "eth0") is None
        unit = lab.podman("exec", name, "test", "-e", lab.node_limits.LINK_UNIT_PATH, check=False)
        assert unit.returncode == 1
    assert lab.node_share(names[0])["quota"] == 0.6  # the CPU quota stays
