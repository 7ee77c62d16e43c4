"""The supervised torchft lighthouse (ddplab.controller.lighthouse) of the per_step engine, and the
supervisor it shares with the rendezvous store (ddplab.controller.supervisor)."""

import json
import socket
import sys
from datetime import timedelta

import psutil
import pytest
import rdzv_harness as h
from ddplab.controller import lighthouse as lh
from ddplab.controller import rdzv_store, supervisor

# torchft 0.2.0's GET /status after one quorum of laptop-a and a heartbeat of laptop-b (trimmed).
PAGE = """
Current quorum_id: 3 <br>
Next quorum status: New quorum not ready, only have 0 participants, need min_replicas 1 [2 heartbeating]
<h3>Previous Quorum</h3>
Previous quorum id: 3 <br>
Num participants: 2 <br>
<div class="member
">
  <b>laptop-a</b> <br/>
  Step: 7 <br/>
  Manager: http://10.0.0.1:29520 <br/>
</div>
<div class="member
">
  <b>laptop-c</b> <br/>
  Step: 7 <br/>
</div>
<h2>Heartbeats</h2>
<ul>
  <li class="heartbeat
  ">
    laptop-a: seen 0.368848915s ago
  </li>
  <li class="heartbeat
  ">
    laptop-b: seen 12.5ms ago
  </li>
</ul>
"""


def test_parse_status():
    st = lh.parse_status(PAGE)
    assert st["quorum_id"] == 3
    assert st["participants"] == [{"replica_id": "laptop-a", "step": 7},
                                  {"replica_id": "laptop-c", "step": 7}]
    assert st["heartbeats"] == {"laptop-a": 0.369, "laptop-b": 0.013}
    assert st["next_quorum"].startswith("New quorum not ready")
    assert lh.parse_status("nothing here") == {"quorum_id": None, "participants": [], "heartbeats": {},
                                               "next_quorum": None}


def test_lighthouse_lifecycle(tmp_path, capsys):
    from torchft._torchft import LighthouseClient

    port = h.free_port()
    sd = tmp_path / ".rdzv"
    first = None
    try:
        first = lh.start("127.0.0.1", port, sd, wait_s=60)
        assert first["changed"] and first["answering"] and first["restarts"] == 0
        assert first["quorum_id"] == 0 and first["participants"] == []
        cmd = psutil.Process(first["server_pid"]).cmdline()
        assert cmd[-10:] == ["--bind", f"127.0.0.1:{port}", "--min_replicas", "1", "--quorum_tick_ms", "100",
                           "--join_timeout_ms", "1000", "--heartbeat_timeout_ms", "5000"]
        again = lh.start("127.0.0.1", port, sd, wait_s=60)
        assert not again["changed"] and again["supervisor_pid"] == first["supervisor_pid"]
        # the same port with other settings: refused (one line), not silently reused
        assert lh.main(["start", "--host", "127.0.0.1", "--port", str(port), "--state-dir", str(sd),
                        "--join-timeout-ms", "30000"]) == 2
        err = json.loads(capsys.readouterr().out)["error"]
        assert "other settings: --join_timeout_ms 30000 (runs 1000);" in err and "\n" not in err, err
        assert lh.start("127.0.0.1", port, sd, wait_s=60)["supervisor_pid"] == first["supervisor_pid"]
        # the same port for another address: refused, nothing changed
        assert lh.main(["start", "--host", "127.0.0.2", "--port", str(port), "--state-dir", str(sd)]) == 2
        err = json.loads(capsys.readouterr().out)["error"]
        assert f"ddplab.controller.lighthouse stop --port {port}" in err
        # a replica asks for a quorum: the status shows it
        client = LighthouseClient(f"http://127.0.0.1:{port}", timedelta(seconds=5))
        client.quorum("laptop-a", timedelta(seconds=10), address="http://127.0.0.1:1",
                      store_address="127.0.0.1:2", step=5, world_size=1)
        assert lh.main(["status", "--port", str(port), "--state-dir", str(sd)]) == 0
        st = json.loads(capsys.readouterr().out)
        assert st["quorum_id"] == 1 and st["participants"] == [{"replica_id": "laptop-a", "step": 5}]
        assert "laptop-a" in st["heartbeats"]
        # the lighthouse dies: the supervisor brings it back (its quorum state is gone)
        st = h.killed_and_restarted(lh, port, sd)
        assert st["restarts"] == 1 and st["answering"], st
        assert st["server_pid"] != first["server_pid"] and st["quorum_id"] == 0
    finally:
        stopped = lh.stop(port, sd)
    assert stopped["changed"]
    server = first["server_pid"]
    assert not psutil.pid_exists(server) or psutil.Process(server).status() == psutil.STATUS_ZOMBIE
    assert not (sd / f"lighthouse-{port}.json").exists()
    assert lh.stop(port, sd)["changed"] is False
    assert lh.main(["status", "--port", str(port), "--state-dir", str(sd)]) == 3
    assert json.loads(capsys.readouterr().out) == {"running": False, "answering": False, "port": port}


def test_lighthouse_and_store_side_by_side(tmp_path):
    """One state folder holds both services, each with its own pidfile; stopping one leaves the other."""
    sport, lport = h.free_port(), h.free_port()
    sd = tmp_path / ".rdzv"
    try:
        rdzv_store.start("127.0.0.1", sport, sd, wait_s=60)
        lh.start("127.0.0.1", lport, sd, wait_s=60)
        assert (sd / f"store-{sport}.json").exists() and (sd / f"lighthouse-{lport}.json").exists()
        assert lh.stop(lport, sd)["changed"]
        assert rdzv_store.status(sport, sd)["answering"]
        # the store's port is not a lighthouse: no lighthouse pidfile, and its ping says no
        assert lh.status(sport, sd)["running"] is False and not lh.ping("127.0.0.1", sport, 2.0)
    finally:
        lh.stop(lport, sd)
        rdzv_store.stop(sport, sd)


@pytest.mark.parametrize(("service", "name", "setting"), [(lh, "lighthouse", "rendezvous_lighthouse_port"),
                                                          (rdzv_store, "store", "rendezvous_port")])
def test_port_held_by_another_program(tmp_path, service, name, setting):
    """Either service on a port another program holds: exit code 2 naming the setting, no pidfile."""
    with socket.socket() as s:
        s.bind(("0.0.0.0", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(supervisor.ServiceError) as err:
            service.start("127.0.0.1", port, tmp_path, wait_s=5)
    assert err.value.code == 2
    assert f", not a ddp-lab {name}: free it" in str(err.value), err.value
    assert f"or choose another {setting}" in str(err.value)
    assert not (tmp_path / f"{name}-{port}.json").exists()


def test_bad_input(tmp_path, capsys, monkeypatch):
    assert lh.main(["status", "--port", "0"]) == 2
    assert "1..65535" in capsys.readouterr().out
    assert lh.main(["start", "--host", "127.0.0.1", "--port", "29599", "--min-replicas", "0",
                    "--state-dir", str(tmp_path)]) == 2
    assert "min_replicas=0 must be >= 1" in json.loads(capsys.readouterr().out)["error"]
    # torchft missing: a one-line error naming the fix, nothing started
    monkeypatch.setattr(sys, "executable", str(tmp_path / "bin" / "python"))
    monkeypatch.setenv("PATH", str(tmp_path))
    assert lh.main(["start", "--host", "127.0.0.1", "--port", "29599", "--state-dir", str(tmp_path)]) == 2
    assert "install torchft==0.2.0" in json.loads(capsys.readouterr().out)["error"]
    assert list(tmp_path.iterdir()) == []


def test_supervisor_gives_up_on_a_crash_loop(tmp_path, monkeypatch):
    """A service that keeps dying is not restarted forever: exit 1, pidfile removed."""
    monkeypatch.setattr(supervisor, "RESTART_BACKOFF_S", 0.05)
    crash = [sys.executable, "-c", "raise SystemExit(7)"]
    code = supervisor.supervise("crash", "127.0.0.1", 1, tmp_path, crash)
    assert code == 1 and not (tmp_path / "crash-1.json").exists()


def test_settings_compare_by_flag_and_by_the_program_they_resolve_to(tmp_path):
    """A running service's command line is the asked one when its flags hold the same values in
    any order, and its program is the same file under another name (python -> python3)."""
    from ddplab.controller.supervisor import _flags

    real = tmp_path / "python3"
    real.write_text("")
    (tmp_path / "python").symlink_to(real)
    asked = [str(tmp_path / "python"), "--bind", "h:1", "--join_timeout_ms", "1000"]
    assert _flags([str(real), "--join_timeout_ms", "1000", "--bind", "h:1"]) == _flags(asked)
    assert _flags([str(real), "--join_timeout_ms", "30000", "--bind", "h:1"]) != _flags(asked)
