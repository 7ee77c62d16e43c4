"""A powered-off laptop reads unreachable within ddp_job_state_probe_timeout_s (newcomer, 2026-12-01:
status.yml with a powered-off lab node took 11.9 s, ssh's 10 s timeout on the node's stale ARP entry;
measured 12.1-12.7 s before and 5.0-5.2 s after on the lab, docs/running.md). The node_status
plugin (once) probes the SSH port that `ssh -G` resolves before it runs ssh; a proxied connection is
not probed."""

import json
import socket

import pytest
from ansible_collections.ddp_lab.cluster.plugins.action import node_status
from test_status_table import PLAYBOOK, _case, _play


def _watch():
    return node_status


class FakeConnection:
    def __init__(self, transport="ssh", **options):
        self.transport = transport
        self.options = {"host": "192.0.2.7", "port": None, "ssh_args": "", "ssh_common_args": "",
                        "ssh_extra_args": "", **options}

    def get_option(self, name):
        return self.options[name]


class FakeAction:
    def __init__(self, conn):
        self._connection = conn
        self._play_context = None


def _endpoint(conn):
    mod = _watch()
    return mod.ActionModule._ssh_endpoint(FakeAction(conn))


def test_ssh_endpoint_is_what_ssh_would_dial():
    assert _endpoint(FakeConnection()) == ("192.0.2.7", 22)
    assert _endpoint(FakeConnection(port=2222)) == ("192.0.2.7", 2222)
    assert _endpoint(FakeConnection(ssh_common_args="-o Port=2200")) == ("192.0.2.7", 2200)
    # through a proxy or another transport: a direct probe would say nothing
    assert _endpoint(FakeConnection(ssh_common_args="-o ProxyJump=bastion")) is None
    assert _endpoint(FakeConnection(ssh_extra_args="-o ProxyCommand='nc %h %p'")) is None
    assert _endpoint(FakeConnection(transport="local")) is None


def test_probe_names_a_port_that_does_not_answer():
    with socket.socket() as s:  # a free port on this machine, closed again: refused
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mod = _watch()
    action = FakeAction(FakeConnection(host="127.0.0.1", port=port))
    action._ssh_endpoint = lambda: mod.ActionModule._ssh_endpoint(action)
    why = mod.ActionModule._probe(action, 2.0)
    assert why.startswith(f"ssh port {port} of 127.0.0.1 does not answer within 2 s: ") and "refused" in why
    with socket.socket() as srv:  # a port that answers
        srv.bind(("127.0.0.1", 0))
        srv.listen()
        action._connection.options["port"] = srv.getsockname()[1]
        assert mod.ActionModule._probe(action, 2.0) is None


@pytest.mark.skipif(PLAYBOOK is None, reason="ansible-playbook is not installed (make venv)")
def test_status_reports_a_laptop_whose_ssh_port_does_not_answer_without_ssh(tmp_path):
    inv, env = _case(tmp_path, {"laptop-run": "running"})
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    data = json.loads(inv.read_text())
    data["all"]["children"]["trainers"]["hosts"]["laptop-off"] = {
        "ansible_host": "127.0.0.1", "ansible_port": port, "ansible_connection": "ssh"}
    inv.write_text(json.dumps(data))
    out = _play(inv, env, "status.yml")
    text = " ".join((out.stdout + out.stderr).split())
    assert out.returncode != 0, text
    assert f"ssh port {port} of 127.0.0.1 does not answer within 3 s" in text, text
    assert "not every laptop is well: laptop-off: unreachable" in text, text

    out = _play(inv, env, "status.yml", "ddp_job_state_probe_timeout_s=0")  # no probe: ssh's own error
    text = " ".join((out.stdout + out.stderr).split())
    assert "does not answer within" not in text and "laptop-off: unreachable" in text, text
