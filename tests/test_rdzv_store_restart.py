"""torchelastic survives a restart of the controller's rendezvous store (issue 27 item 13).

The store process SIGKILLed mid-run, its supervisor starts it again on its port (empty): every
agent's next store call failed (``RendezvousConnectionError`` from ``num_nodes_waiting``) and each
agent died within the second. ddplab.agent's watched handler reconnects to the restarted store
(:class:`ddplab.agent.StoreReconnect`): the workers train on, untouched, and a later membership
change forms its group through the new store.
"""

from __future__ import annotations

import time

import pytest
import rdzv_harness as h
from ddplab.controller import rdzv_store

pytestmark = pytest.mark.slow


def test_agents_ride_out_a_restarted_store_and_rendezvous_through_it(tmp_path):
    with h.ToyCluster(tmp_path, nnodes=2) as cluster:
        assert cluster.wait_world(2, [0, 1], timeout_s=120) is not None, "no world of 2"
        st = h.killed_and_restarted(rdzv_store, cluster.port, cluster.state_dir)
        assert st["restarts"] == 1 and st["answering"], st
        restarted = time.time()
        time.sleep(8)  # many monitor intervals (0.5 s) and heartbeats (1 s) on the new store
        alive = [p.poll() is None for p in cluster.agents]
        assert alive == [True, True], [(tmp_path / f"agent{i}.out").read_text()[-3000:] for i in (0, 1)]
        assert cluster.wait_world(2, [0, 1], timeout_s=30, after=restarted) is not None
        assert all(cluster.latest(i)["restart_count"] == 0 for i in (0, 1))  # the workers never restarted
        out = "".join((tmp_path / f"agent{i}.out").read_text() for i in (0, 1))
        assert "reconnected to the rendezvous store" in out

        survivor = 1 - cluster.rank0_agent()
        killed = cluster.kill_agent(1 - survivor)  # a membership change: the new store forms it
        assert cluster.wait_world(1, [survivor], timeout_s=120, after=killed) is not None
        assert cluster.agents[survivor].poll() is None
