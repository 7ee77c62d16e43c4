"""The controller-hosted rendezvous store: supervisor lifecycle, and "rendezvous survives any laptop".

The slow tests run three real torchrun agents on this host (tests/rdzv_harness.py) and SIGKILL the
one whose worker holds rank 0; timing figures come from the harness run as a benchmark
(docs/rendezvous.md), the tests only check what happens.
"""

import json
import time

import psutil
import pytest
import rdzv_harness as h
from ddplab.controller import rdzv_store as rs


def test_store_lifecycle(tmp_path, capsys):
    port = h.free_port()
    sd = tmp_path / ".rdzv"
    try:
        first = rs.start("127.0.0.1", port, sd, wait_s=60)
        assert first["changed"] and first["answering"] and first["restarts"] == 0
        again = rs.start("127.0.0.1", port, sd, wait_s=60)
        assert not again["changed"] and again["supervisor_pid"] == first["supervisor_pid"]
        # the same port for another address: refused, nothing changed
        assert rs.main(["start", "--host", "127.0.0.2", "--port", str(port), "--state-dir", str(sd)]) == 2
        assert "stop --port" in json.loads(capsys.readouterr().out)["error"]
        # the store process dies: the supervisor brings it back
        st = h.killed_and_restarted(rs, port, sd)
        assert st["restarts"] == 1 and st["answering"], st
        assert st["server_pid"] != first["server_pid"]
        assert (sd / f"store-{port}.log").read_text().count("TCPStore serving") == 2
    finally:
        stopped = rs.stop(port, sd)
    assert stopped["changed"]
    assert (
        not psutil.pid_exists(first["supervisor_pid"])
        or psutil.Process(first["supervisor_pid"]).status() == psutil.STATUS_ZOMBIE
    )
    assert not (sd / f"store-{port}.json").exists()
    assert rs.stop(port, sd)["changed"] is False
    assert rs.main(["status", "--port", str(port), "--state-dir", str(sd)]) == 3


def test_bad_port(capsys):
    assert rs.main(["status", "--port", "70000"]) == 2
    assert "1..65535" in capsys.readouterr().out


@pytest.mark.slow
def test_rendezvous_survives_rank0_node(tmp_path):
    """SIGKILL the node holding rank 0: the two others train again at world size 2."""
    r = h.rank0_kill_trial(tmp_path, h.TUNED_CONF, share_disabled=True, recover_timeout_s=120)
    assert r["recovered_s"] is not None, r
    assert r["steps_after"] > 0
    assert r["detected_s"] is not None and r["detected_s"] < 30  # the survivors' collective failed fast
    assert r["leftover_pids"] == [], "processes left behind"


@pytest.mark.slow
def test_torch_defect_without_disable_share(tmp_path):
    """Canary for the torch 2.13 defect ddp-lab works around with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1:
    with the agent-store sharing on, a survivor keeps the dead rank 0's store address and the group
    does not re-form. If this fails, torch fixed it: revisit docs/rendezvous.md."""
    r = h.rank0_kill_trial(tmp_path, h.TUNED_CONF, share_disabled=False, recover_timeout_s=40)
    assert r["recovered_s"] is None, r
    assert r["leftover_pids"] == [], "processes left behind"


def test_agent_start_barrier(tmp_path):
    """ddplab.agent's start barrier: agents of one launch leave together; a lone launch does not wait."""
    import threading

    from ddplab import agent

    port = h.free_port()
    sd = tmp_path / ".rdzv"
    rs.start("127.0.0.1", port, sd, wait_s=60)
    try:
        endpoint = f"127.0.0.1:{port}"
        results = {}

        def arrive(i: int, delay: float) -> None:
            time.sleep(delay)
            results[i] = agent.barrier(endpoint, "launch-1", 3, timeout_s=30)

        threads = [threading.Thread(target=arrive, args=(i, 0.5 * i)) for i in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert sorted(r[0] for r in results.values()) == [3, 3, 3]
        assert results[0][1] >= 0.9  # the first waited for the last (1 s later)
        alone, waited = agent.barrier(endpoint, "launch-2", 1, timeout_s=30)
        assert alone == 1 and waited < 5
        short, waited = agent.barrier(endpoint, "launch-3", 2, timeout_s=1.0)
        assert short == 1 and 0.9 < waited < 10  # timed out: the caller starts anyway
    finally:
        rs.stop(port, sd)


def test_agent_bad_barrier_setting(monkeypatch, capsys):
    from ddplab import agent

    monkeypatch.setenv("DDPLAB_AGENT_BARRIER", "x")
    monkeypatch.setenv("DDPLAB_AGENT_BARRIER_NODES", "zero")
    assert agent.main(["--nnodes", "1", "--rdzv-endpoint", "127.0.0.1:1", "script.py"]) == 2
    assert "DDPLAB_AGENT_BARRIER_NODES" in capsys.readouterr().err
