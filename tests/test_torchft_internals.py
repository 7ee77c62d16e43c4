"""The torchft and torch internals the replica-group engines rely on: one test each, failing when
the attribute changes shape (it is gone, torchft stopped calling it or setting it the way ddplab
assumes). A torchft or torch upgrade runs this file as its checklist, with two tests of
test_ft_quorum.py that need a frozen lighthouse or a heal: ``Manager._quorum_future``
(test_torchft_still_keeps_a_failed_quorum_future) and ``Manager._connect_timeout``
(test_the_heal_client_gets_the_quorum_timeout_not_the_first_connect_bound). Each failure names
the ddplab code to revisit (ddplab.engines.torchft_replica, ddplab.engines.diloco); what that
code does is tested elsewhere (test_ft_quorum.py, test_per_step*.py, test_diloco*.py).
"""

from __future__ import annotations

import inspect
import signal
import threading
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path

import pytest
import test_per_step_e2e as e2e
import torch
from test_ft_quorum import make_replica  # noqa: F401 (the fixture: one Replica under a lighthouse)

lighthouse = e2e.lighthouse  # the fixture: a lighthouse process on a free port


def blocked_signals(native_id: int) -> set[int]:
    """The signals blocked in this process's thread ``native_id`` (its SigBlk mask)."""
    for line in Path(f"/proc/self/task/{native_id}/status").read_text().splitlines():
        if line.startswith("SigBlk:"):
            mask = int(line.split()[1], 16)
            return {n for n in range(1, 65) if mask >> (n - 1) & 1}
    raise AssertionError(f"no SigBlk line for thread {native_id}")


@pytest.mark.slow
def test_the_quorum_runs_on_torchfts_private_executor_started_with_the_signals_masked(
        make_replica):  # noqa: F811
    """Replica._masked_manager: one no-op task on ``Manager._executor`` starts torchft's quorum
    thread while SIGTERM/SIGINT are blocked, so they reach the main thread (a quorum wait is
    interrupted at once). Holds while torchft runs every quorum call on that executor's one thread
    and starts it at the first task."""
    replica = make_replica()
    manager = replica.manager
    assert isinstance(manager._executor, ThreadPoolExecutor)
    ran_on = []
    ask = manager._async_quorum
    manager._async_quorum = lambda **kw: (ran_on.append(threading.get_native_id()), ask(**kw))[1]
    assert replica.start_step() == (0, 1)
    assert len(ran_on) == 1 and ran_on[0] != threading.get_native_id()
    assert {signal.SIGTERM, signal.SIGINT} <= blocked_signals(ran_on[0])
    assert not {signal.SIGTERM, signal.SIGINT} & blocked_signals(threading.get_native_id())


@pytest.mark.slow
def test_the_quorum_id_is_torchfts_private_id_of_the_lighthouses_quorum(make_replica):  # noqa: F811
    """Replica.quorum_id reads ``Manager._quorum_id``: the lighthouse's id of the quorum the
    Manager configured its gloo group for (the store prefix ``.../torchft/<id>/...``), the same id
    while the members stay (Replica.follow_quorum reads a gap in the ids as quorums formed
    without this replica)."""
    replica = make_replica()
    configured = []
    configure = replica.pg.configure
    replica.pg.configure = lambda store_addr, *a, **kw: (configured.append(store_addr),
                                                         configure(store_addr, *a, **kw))[1]
    assert replica.start_step() == (0, 1)
    first = replica.quorum_id
    assert isinstance(first, int) and first >= 1 and first == replica.manager._quorum_id
    assert len(configured) == 1 and f"/torchft/{first}/" in configured[0]
    assert replica.start_step() == (0, 1)
    assert replica.quorum_id == first and len(configured) == 1  # same members: no new group


def test_the_bound_gloo_group_is_built_by_torchfts_configure():
    """BoundProcessGroupGloo overrides torchft's ``ProcessGroupGloo._create_pg(store, rank,
    world_size)`` (called by ``configure`` at every quorum change, its timeout in ``_timeout``)
    and builds the group with torch's private ``ProcessGroup._set_default_backend`` /
    ``_register_backend`` and the backend's ``_set_sequence_number_for_group``: two members
    configured as torchft configures them sum over the group."""
    import torchft
    from ddplab.engines.torchft_replica import BoundProcessGroupGloo
    from torch.distributed import AllreduceOptions, ReduceOp, TCPStore

    assert list(inspect.signature(torchft.ProcessGroupGloo._create_pg).parameters) == [
        "self", "store", "rank", "world_size"]
    assert "self._create_pg(store, rank, world_size)" in inspect.getsource(
        torchft.process_group.ProcessGroupWrapper.configure)
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    groups = [BoundProcessGroupGloo("127.0.0.1", timedelta(seconds=30)) for _ in range(2)]
    assert all(g._timeout == timedelta(seconds=30) for g in groups)
    sums, errors = {}, []

    def member(rank: int) -> None:
        try:
            groups[rank].configure(f"127.0.0.1:{store.port}/torchft/7/0", f"r{rank}", rank, 2)
            opts = AllreduceOptions()
            opts.reduceOp = ReduceOp.SUM
            tensor = torch.tensor([rank + 1.0])
            groups[rank].allreduce([tensor], opts).wait()
            sums[rank] = float(tensor)
        except Exception as exc:  # noqa: BLE001 (reported by the assertion below)
            errors.append(exc)

    threads = [threading.Thread(target=member, args=(rank,)) for rank in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert errors == [] and sums == {0: 3.0, 1: 3.0}
    assert [(g.quorum_rank, g.quorum_size) for g in groups] == [(0, 2), (1, 2)]


@pytest.mark.slow
def test_diloco_syncs_torchfts_fragment_of_the_whole_model(make_replica):  # noqa: F811
    """ddplab.engines.diloco: ``DiLoCo(manager, [model], inner, outer, sync_every=...,
    pin_memory=False, use_bucketization=True, bucket_cap_mb=<the model's size + 1>)`` holds one
    fragment (``DiLoCo._fragments``) whose ``original_parameters`` (name -> tensor) are the global
    parameters the engine checkpoints and writes back at a resume, and a sync is
    ``prepare_sync()`` (with a bucket as large as the model: one all-reduce, ``_allreduce_work``,
    for every parameter) then ``perform_sync()`` -> committed: the outer step from the global
    parameters with the pseudo-gradient global - own (outer lr 0.5: their midpoint)."""
    from torchft.local_sgd import DiLoCo

    replica = make_replica()
    model = torch.nn.Linear(3, 2)
    outer = torch.optim.SGD(model.parameters(), lr=0.5)
    diloco = DiLoCo(replica.manager, [model], torch.optim.SGD(model.parameters(), lr=0.1), outer,
                    sync_every=2, pin_memory=False, use_bucketization=True, bucket_cap_mb=1)
    (fragment,) = diloco._fragments
    names = [name for name, _ in model.named_parameters()]
    assert list(fragment.original_parameters) == names
    assert all(torch.equal(fragment.original_parameters[n], p) for n, p in model.named_parameters())
    with torch.no_grad():
        for name, p in model.named_parameters():
            fragment.original_parameters[name].copy_(torch.zeros_like(p))  # what a resume writes
            p.fill_(2.0)  # this replica's own parameters after its inner steps
    assert replica.start_step() == (0, 1)
    fragment.prepare_sync()
    assert len(fragment._allreduce_work) == 1  # weight and bias in one bucket
    assert fragment.perform_sync() is True
    for name, p in model.named_parameters():
        assert torch.equal(p.detach(), torch.ones_like(p)), name  # 0 - 0.5 * (0 - 2)
        assert torch.equal(fragment.original_parameters[name], torch.ones_like(p)), name
