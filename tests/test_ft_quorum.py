"""per_step: a replica without a lighthouse rides it out in one life, against the real torchft
(issue 14, item 3). One ddplab.engines.torchft_replica.Replica in this process, its Manager under a
lighthouse process on localhost that the tests freeze (SIGSTOP: what a partition of the controller
looks like to a replica; the lab's partition drops the packets).

* A quorum call that times out: ``start_step`` returns None and the next call gets a quorum once
  the lighthouse answers again. torchft 0.2.0 keeps the failed call's future and raises its error
  again at every later ``start_quorum``; its public ``quorum_retries`` does not prevent it (the
  Manager server retries the lighthouse, but the Python call's deadline is the same quorum
  timeout). ddplab.engines.torchft_replica drops the future (``Replica._forget_failed_quorum``);
  the last test checks that torchft still needs it, so an upgrade that fixes torchft shows.
* A lighthouse out of reach when the worker starts (nothing listens on its port yet; a frozen
  lighthouse that listens would still accept the connect): torchft's own connect retries up to
  the Manager's ``connect_timeout`` (ft_quorum_timeout_s + ft_rejoin_wait_s), one line says so,
  and the Replica is built in one call once the lighthouse answers; past the bound it ends cut
  off. The heal's client keeps ft_quorum_timeout_s as its connect timeout.
* The lighthouse a test freezes is the one its replica talks to: it listens itself before the
  test starts (tests/test_per_step_e2e.py's start_lighthouse) and a freeze waits until every
  thread of it is stopped.
"""

from __future__ import annotations

import signal
import threading
import time
from datetime import timedelta

import psutil
import pytest
import test_per_step_e2e as e2e
import torch
from labharness import free_port

lighthouse = e2e.lighthouse  # the fixture: a lighthouse process on a free port

pytestmark = pytest.mark.slow


@pytest.fixture
def make_replica(lighthouse, clean_env):
    from ddplab.config import build_config
    from ddplab.engines.torchft_replica import Replica

    clean_env.setenv("DDPLAB_GLOO_ADDR", "127.0.0.1")
    clean_env.setenv("RUST_LOG", "warn")
    clean_env.delenv("DDPLAB_RDZV_ENDPOINT", raising=False)
    made = []

    def make(**overrides):
        cfg = build_config({"fault_tolerance": "per_step", "ft_lighthouse": str(lighthouse),
                            "ft_replica_id": "node0", "ft_manager_port": free_port(),
                            "ft_quorum_timeout_s": 2, "ft_rejoin_wait_s": 60, **overrides})
        model = torch.nn.Linear(2, 2)
        replica = Replica(cfg, torch.optim.SGD(model.parameters(), lr=0.1), model.state_dict,
                          model.load_state_dict)
        made.append(replica)
        return replica

    yield make
    lighthouse.proc.send_signal(signal.SIGCONT)
    for replica in made:
        replica.shutdown()


def unreachable() -> tuple[str, int]:
    """A lighthouse address where nothing listens yet (a lighthouse not up, or refused by the
    controller's firewall): the port is reserved (free_port), so nothing else takes it."""
    port = free_port()
    return f"http://127.0.0.1:{port}", port


def test_a_quorum_call_that_timed_out_is_asked_again_in_the_same_life(make_replica, lighthouse):
    replica = make_replica()
    assert replica.start_step() == (0, 1)
    first = replica.quorum_id
    lighthouse.freeze()  # this test's own lighthouse (it listens itself), every thread stopped
    t0 = time.monotonic()
    assert replica.start_step() is None  # no quorum within ft_quorum_timeout_s 2: nothing computed
    assert time.monotonic() - t0 >= 1.9
    assert replica.quorum_error.startswith("TimeoutError: ") and "Timeout expired" in replica.quorum_error
    assert "metadata" not in replica.quorum_error and replica.no_quorum_s >= 1.9
    lighthouse.thaw()
    assert replica.start_step() == (0, 1)  # asked again: the quorum came (before: TimeoutError)
    assert replica.quorum_error is None and replica.no_quorum_s < 1
    assert replica.quorum_id >= first and replica.cut_off is None


def test_the_lighthouse_a_test_freezes_is_the_one_its_replica_talks_to(tmp_path, monkeypatch):
    """The quorum test once got a quorum while "its" lighthouse was frozen: the lighthouse could
    not bind the port it was given (another process had taken it since the pick), so the replica
    talked to that process's lighthouse and the SIGSTOP went to an exited process. The test's
    lighthouse is now one that listens itself (else started on another port), and freezing an
    exited one fails. Here the first port is held by another lighthouse."""
    other = e2e.start_lighthouse(tmp_path / "other.log")
    taken = int(other.rpartition(":")[2])
    ports = iter([taken, free_port()])
    monkeypatch.setattr(e2e, "free_port", lambda: next(ports))
    mine = e2e.start_lighthouse(tmp_path / "mine.log")
    try:
        assert mine != other and mine.proc.poll() is None
        port = int(mine.rpartition(":")[2])
        assert [c.laddr.port for c in psutil.Process(mine.proc.pid).net_connections("tcp")
                if c.status == psutil.CONN_LISTEN] == [port]
        mine.freeze()
        mine.thaw()
    finally:
        for lh in (mine, other):
            lh.proc.kill()
            lh.proc.wait()
    with pytest.raises(AssertionError, match="exited"):
        mine.freeze()


def test_a_lighthouse_out_of_reach_at_start_is_waited_for_in_one_call(make_replica, tmp_path, capsys):
    # nothing listens on the lighthouse's port until 4 s after the replica starts (a frozen
    # lighthouse that listens would accept the connect: the kernel completes it)
    address, port = unreachable()
    started = []
    late = threading.Timer(4, lambda: started.append(
        e2e.start_lighthouse(tmp_path / "late.log", port=port)))
    late.start()
    try:
        t0 = time.monotonic()
        replica = make_replica(ft_timeout_s=1, ft_lighthouse=address)
        built_s = time.monotonic() - t0
        late.join()
        assert 3.5 <= built_s < 30, built_s  # torchft waited for the lighthouse (connect backoff <= 10 s)
        out = capsys.readouterr().out
        assert ("its start is taking longer than 1 s (ft_timeout_s; lighthouse at "
                f"{address}); torchft keeps trying to connect for at most 62 s") in out
        assert replica.start_step() == (0, 1)
    finally:
        late.join()
        for lh in started:
            lh.proc.kill()
            lh.proc.wait()


def test_the_heal_client_gets_the_quorum_timeout_not_the_first_connect_bound(make_replica):
    """The first connect may wait ft_quorum_timeout_s + ft_rejoin_wait_s (62 s), but the client
    that fetches a peer's state when healing is built with the Manager's connect timeout: a heal
    from a peer that was just powered off must fail within ft_quorum_timeout_s (2 s)."""
    import inspect

    import torchft.manager

    replica = make_replica()
    assert replica.manager._connect_timeout == timedelta(seconds=2)  # before: 62 s
    # torchft 0.2.0 builds the heal's client from that field; if an upgrade changes it, this shows
    assert "connect_timeout=self._connect_timeout" in inspect.getsource(
        torchft.manager.Manager._async_quorum)


def test_a_heal_fetches_the_peer_state_with_the_quorum_timeout(make_replica, monkeypatch):
    """A real heal: node1 (step 0) joins node0 (step 5) and fetches its state; the client torchft
    builds for that gets ft_quorum_timeout_s as connect timeout, not ft_quorum_timeout_s +
    ft_rejoin_wait_s. The quorum timeout is 15 s here so that a loaded machine still forms the
    quorum and finishes the heal within it (at 2 s, start_step returned None under load)."""
    import torchft.manager

    ahead = make_replica(ft_replica_id="node0", ft_min_replicas=2, ft_quorum_timeout_s=15)
    behind = make_replica(ft_replica_id="node1", ft_min_replicas=2, ft_quorum_timeout_s=15)
    ahead.manager.load_state_dict({"step": 5, "batches_committed": 0})
    real, built = torchft.manager.ManagerClient, []

    def recording(addr, connect_timeout):
        built.append(connect_timeout)
        return real(addr, connect_timeout=connect_timeout)

    monkeypatch.setattr(torchft.manager, "ManagerClient", recording)
    other = threading.Thread(target=ahead.start_step)
    other.start()
    assert behind.start_step() is not None
    other.join(30)
    assert behind.step == 5  # healed from node0
    assert built == [timedelta(seconds=15)]  # not 75 s (15 + ft_rejoin_wait_s 60)


def test_a_lighthouse_out_of_reach_past_the_bound_ends_the_replica_cut_off(make_replica):
    from ddplab.engines.torchft_replica import CutOffError

    address, _ = unreachable()
    t0 = time.monotonic()
    with pytest.raises(CutOffError) as err:
        make_replica(ft_quorum_timeout_s=1, ft_rejoin_wait_s=2, ft_lighthouse=address)
    assert 3 <= time.monotonic() - t0 < 30
    assert err.value.cut_off.quorum_id is None and err.value.cut_off.unreachable_s >= 3
    assert f"got no quorum from the lighthouse {address}" in str(err.value)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("lighthouse", [2], indirect=True)
def test_a_lighthouse_restarted_under_a_pending_call_gives_the_quorum_on_its_return(
        make_replica, lighthouse, tmp_path, monkeypatch):
    """The lighthouse killed while a quorum call waits (here: for a second replica), started again
    on its port 3 s later (what its supervisor does): the pending call gets the new lighthouse's
    quorum within seconds of its return, not after the rest of ft_quorum_timeout_s (it took the
    whole 60 s before: torchft's server dropped the call on "transport error")."""
    monkeypatch.delenv("TORCHFT_QUORUM_RETRIES", raising=False)  # torchft's override of the count
    replica = make_replica(ft_quorum_timeout_s=60)
    port = int(str(lighthouse).rsplit(":", 1)[1])
    answer: dict = {}
    pending = threading.Thread(target=lambda: answer.update(quorum=replica.start_step(),
                                                            at=time.monotonic()))
    pending.start()
    time.sleep(3)  # the call is pending: this lighthouse waits for a second replica
    assert pending.is_alive()
    lighthouse.proc.kill()
    lighthouse.proc.wait()
    time.sleep(3)
    again = e2e.start_lighthouse(tmp_path / "lighthouse-again.log", min_replicas=1, port=port)
    listening = time.monotonic()
    try:
        pending.join(90)
        assert answer.get("quorum") == (0, 1), replica.quorum_error
        assert answer["at"] - listening < 15  # was the 60 s quorum timeout
    finally:
        again.proc.kill()
        again.proc.wait()


@pytest.mark.parametrize("quorum_retries", [0, 5])
def test_torchft_still_keeps_a_failed_quorum_future(lighthouse, quorum_retries):
    """Why Replica._forget_failed_quorum touches a private field: with torchft 0.2.0, after a
    quorum call timed out, every later start_quorum raises the same TimeoutError at once, with or
    without quorum_retries. When this test fails, torchft changed: drop the reset."""
    from torch.distributed import TCPStore
    from torchft import Manager, ProcessGroupGloo

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    two = timedelta(seconds=2)
    manager = Manager(pg=ProcessGroupGloo(timeout=two), load_state_dict=lambda _: None,
                      state_dict=dict, min_replica_size=1, use_async_quorum=False, timeout=two,
                      quorum_timeout=two, connect_timeout=timedelta(seconds=10), rank=0, world_size=1,
                      store_addr="127.0.0.1", store_port=store.port, lighthouse_addr=str(lighthouse),
                      replica_id="probe", port=free_port(), hostname="127.0.0.1",
                      quorum_retries=quorum_retries)
    try:
        manager.start_quorum()
        lighthouse.freeze()
        with pytest.raises(TimeoutError):
            manager.start_quorum()  # the lighthouse frozen past the quorum timeout
        lighthouse.thaw()
        time.sleep(0.5)
        failed = manager._quorum_future
        attempts = []
        ask = manager._async_quorum
        manager._async_quorum = lambda **kw: (attempts.append(kw), ask(**kw))[1]
        with pytest.raises(TimeoutError) as again:
            manager.start_quorum()  # the lighthouse answers again, yet the old error is raised
        # the kept future's own error, without a new quorum call to the lighthouse
        assert again.value is failed.exception() and attempts == []
        manager._quorum_future = None  # what Replica._forget_failed_quorum does
        manager.start_quorum()
    finally:
        lighthouse.proc.send_signal(signal.SIGCONT)
        manager.shutdown(wait=False)
