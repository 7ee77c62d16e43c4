"""Bench workers join gloo the way training does: bound to DDPLAB_GLOO_ADDR when the role set it."""


import pytest
import torch.distributed as dist
from ddplab.bench import worker
from ddplab.distributed import BOUND_GLOO_BACKEND
from labharness import free_port


@pytest.fixture
def world_of_one(monkeypatch):
    """torchrun's variables for rank 0 of 1 with an env:// store on a free loopback port."""
    port = free_port()
    for name, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
                        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("DDPLAB_GLOO_ADDR", raising=False)
    yield monkeypatch
    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.mark.parametrize(("addr", "backend"), [("127.0.0.1", BOUND_GLOO_BACKEND), (None, "gloo")])
def test_init_distributed_binds_the_gloo_address(world_of_one, addr, backend):
    if addr:
        world_of_one.setenv("DDPLAB_GLOO_ADDR", addr)
    d, rank, n = worker.init_distributed(10)
    assert (rank, n) == (0, 1)
    assert d.get_backend() == backend
    group = dist.new_group([0])  # the benchmarks' subgroups take the default group's backend
    assert dist.get_backend(group) == backend


def test_bad_gloo_address_is_bad_input(world_of_one, capsys):
    world_of_one.setenv("DDPLAB_GLOO_ADDR", "eth0")
    body_ran = []
    status = worker.run("ddplab.bench.x", 10, lambda: None, lambda *a: body_ran.append(a))
    assert status == worker.EXIT_BAD_INPUT and not body_ran and not dist.is_initialized()
    assert "DDPLAB_GLOO_ADDR='eth0' is not an IP address" in capsys.readouterr().err
