"""gloo binds the address on the route to the rendezvous host, whatever else the NIC holds.

Two network namespaces made here (``ip netns``), joined by a veth pair, play laptop-a and
laptop-b on 192.168.50.0/24. laptop-a's interface also holds either a second IPv4 address added
*before* its own (gloo's "first address of GLOO_SOCKET_IFNAME" is then unreachable for the
peer), or its own address only under a label (``veth:1``) next to an IPv6 one (the interface
name then matches the IPv6 address only: "ss1.ss_family == ss2.ss_family. 10 vs 2"). Two ranks,
one per namespace, form a gloo group and all-reduce: with ``GLOO_SOCKET_IFNAME`` alone they
fail; with ``DDPLAB_GLOO_ADDR`` (what the ddp_job role passes) they succeed. Only addresses in
the test's own namespaces are used; the namespaces are deleted afterwards.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from conftest import subprocess_env
from ddplab.distributed import BOUND_GLOO_BACKEND, DistEnv, all_reduce_scalar, register_bound_gloo

WORKER = Path(__file__).with_name("gloo_bind_worker.py")
PG_TIMEOUT_S = 8  # the failing variant fails at connect or at this timeout
RUN_TIMEOUT_S = 60  # torch import + group + all-reduce, on a loaded 2-core machine


def ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


@pytest.fixture
def two_laptops():
    """Namespaces ``a`` (rank 1, laptop-a) and ``b`` (rank 0, the store host) joined by a veth.

    Yields a function ``setup(kind)`` that gives laptop-a's interface its addresses for ``kind``
    (``second-first`` or ``labelled``) and returns ``{ns, ifname, addr}`` per side.
    """
    tag = uuid.uuid4().hex[:6]
    ns = {"a": f"h3-a-{tag}", "b": f"h3-b-{tag}"}
    made: list[str] = []
    try:
        for name in ns.values():
            try:
                ip("netns", "add", name)
            except subprocess.CalledProcessError as err:
                pytest.skip(f"network namespaces are not permitted here (ip netns add: {err.stderr.strip()})")
            made.append(name)
        ifs = {"a": f"va{tag}", "b": f"vb{tag}"}
        ip("link", "add", ifs["a"], "netns", ns["a"], "type", "veth",
           "peer", "name", ifs["b"], "netns", ns["b"])
        for side in "ab":
            ip("-n", ns[side], "link", "set", "lo", "up")

        def setup(kind: str) -> dict:
            a, b = ifs["a"], ifs["b"]
            if kind == "second-first":
                ip("-n", ns["a"], "addr", "add", "192.168.1.23/24", "dev", a)  # added first, no route to b
                ip("-n", ns["a"], "addr", "add", "192.168.50.11/24", "dev", a)
            else:  # labelled: the routed address is a's only IPv4 one, under a:1; plus an IPv6 one
                ip("-n", ns["a"], "addr", "add", "fd00:50::11/64", "dev", a, "nodad")
                ip("-n", ns["a"], "addr", "add", "192.168.50.11/24", "dev", a, "label", f"{a}:1")
            ip("-n", ns["b"], "addr", "add", "192.168.50.12/24", "dev", b)
            for side in "ab":
                ip("-n", ns[side], "link", "set", ifs[side], "up")
            return {"a": {"ns": ns["a"], "ifname": a, "addr": "192.168.50.11"},
                    "b": {"ns": ns["b"], "ifname": b, "addr": "192.168.50.12"}}

        yield setup
    finally:
        for name in made:
            subprocess.run(["ip", "netns", "del", name], check=False, capture_output=True)


def run_pair(sides: dict, bind: str) -> dict[str, subprocess.CompletedProcess | str]:
    """Rank 0 in ``b`` (hosts the env:// store), rank 1 in ``a``; ``bind``: ``ifname`` (the old
    launch, GLOO_SOCKET_IFNAME) or ``addr`` (DDPLAB_GLOO_ADDR). Returns each side's result, or
    ``"timeout"`` for a rank killed after RUN_TIMEOUT_S."""
    with socket.socket() as s:  # any port: the namespaces have their own port space
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    procs = {}
    for side, rank in (("b", 0), ("a", 1)):
        extra = {"RANK": str(rank), "WORLD_SIZE": "2", "MASTER_ADDR": sides["b"]["addr"], "MASTER_PORT": port}
        if bind == "ifname":
            extra["GLOO_SOCKET_IFNAME"] = sides[side]["ifname"]
        else:
            extra["DDPLAB_GLOO_ADDR"] = sides[side]["addr"]
        env = subprocess_env(**extra)
        env.pop("DDPLAB_GLOO_ADDR" if bind == "ifname" else "GLOO_SOCKET_IFNAME", None)
        procs[side] = subprocess.Popen(
            ["ip", "netns", "exec", sides[side]["ns"], sys.executable, str(WORKER), str(PG_TIMEOUT_S)],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
    results: dict[str, subprocess.CompletedProcess | str] = {}
    try:
        for side, proc in procs.items():
            try:
                out, err = proc.communicate(timeout=RUN_TIMEOUT_S)
                results[side] = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
            except subprocess.TimeoutExpired:
                results[side] = "timeout"
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return results


def succeeded(result) -> bool:
    return not isinstance(result, str) and result.returncode == 0 and "sum=3" in result.stdout


# What the old launch (GLOO_SOCKET_IFNAME alone) ends in, as reported in issue 12.
OLD_FAILURE = {
    "second-first": "connect: Network is unreachable",  # b dials a's first address, 192.168.1.23
    "labelled": "ss1.ss_family == ss2.ss_family",  # a listens on IPv6, b on IPv4
}


def test_dist_env_reads_the_gloo_address():
    assert DistEnv.from_environ({"DDPLAB_GLOO_ADDR": "fd00:0:0::11"}).gloo_addr == "fd00::11"
    assert DistEnv.from_environ({}).gloo_addr is None
    with pytest.raises(ValueError, match="DDPLAB_GLOO_ADDR='eth0' is not an IP address"):
        DistEnv.from_environ({"DDPLAB_GLOO_ADDR": "eth0"})


def test_bound_gloo_is_a_gloo_group_on_that_address(tmp_path):
    """In-process world of one: the registered backend is gloo, and it reduces."""
    backend = register_bound_gloo("127.0.0.1")
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group(backend=backend, store=store, rank=0, world_size=1)
    try:
        assert dist.get_backend() == BOUND_GLOO_BACKEND
        group = dist.distributed_c10d._get_default_group()
        assert isinstance(group._get_backend(torch.device("cpu")), dist.ProcessGroupGloo)
        assert all_reduce_scalar(2.5) == 2.5
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0, reason="ip netns needs root (CAP_SYS_ADMIN)")
@pytest.mark.parametrize("kind", ["second-first", "labelled"])
def test_gloo_binds_the_routed_address(two_laptops, kind):
    sides = two_laptops(kind)
    old = run_pair(sides, "ifname")
    assert not any(succeeded(r) for r in old.values()), f"{kind}: GLOO_SOCKET_IFNAME alone worked: {old}"
    assert any(OLD_FAILURE[kind] in r.stderr for r in old.values() if not isinstance(r, str)), old
    new = run_pair(sides, "addr")
    for side, result in new.items():
        assert succeeded(result), f"{kind}: rank on laptop-{side} with DDPLAB_GLOO_ADDR: {result}"
