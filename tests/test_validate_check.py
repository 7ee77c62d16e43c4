"""The validate role's checks in Python (roles/validate/action_plugins/validate_check.py): one record
each, and the one-line messages the bad-input matrices assert."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

PATH = Path(__file__).resolve().parents[1] / "roles" / "validate" / "action_plugins" / "validate_check.py"
_spec = importlib.util.spec_from_file_location("validate_check_plugin", PATH)
vc = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(vc)

KEYS = ["join_timeout", "last_call_timeout", "close_timeout", "keep_alive_interval", "keep_alive_max_attempt"]


def test_rdzv_conf_ok_gives_the_argument_and_a_bad_one_the_fix():
    ok = vc.rdzv_conf("t-a", {"join_timeout": 120, "last_call_timeout": 3}, KEYS)
    assert ok == {"check": "rdzv_conf", "status": "ok", "detail": "join_timeout=120,last_call_timeout=3"}
    bad = vc.rdzv_conf("t-a", {"join_timeout": 0, "last_call_timeout": 3}, KEYS)
    assert bad["status"] == "fail"
    assert bad["detail"] == (
        "t-a: ddp_job_rdzv_conf {'join_timeout': 0, 'last_call_timeout': 3} has unknown keys or values"
        " that are not > 0; fix: use keys among " + ", ".join(KEYS)
        + " with positive numbers (seconds or counts)")
    assert vc.rdzv_conf("t-a", {"heartbeat": 1}, KEYS)["status"] == "fail"
    assert vc.rdzv_conf("t-a", {"join_timeout": "soon"}, KEYS)["status"] == "fail"
    assert vc.rdzv_conf("t-a", "join_timeout=1", KEYS)["status"] == "fail"


@pytest.mark.parametrize(("nmin", "nmax", "start"), [
    (0, 3, "t-a: ddp_job_nnodes_min=0 must be at least 1; fix: set ddp_job_nnodes_min to the fewest"),
    (3, 2, "t-a: ddp_job_nnodes_min=3 is larger than ddp_job_nnodes_max=2 (torchrun --nnodes MIN:MAX); fix"),
    (1, 5, "t-a: ddp_job_nnodes_max=5 but the inventory has 3 trainer(s): MAX counts nodes that exist;"
           " fix: set ddp_job_nnodes_max to at most 3 (the default)"),
])
def test_nnodes_problems(nmin, nmax, start):
    rec = vc.nnodes("t-a", nmin, nmax, 3)
    assert rec["status"] == "fail" and rec["detail"].startswith(start)


def test_nnodes_ok():
    ok = {"check": "nnodes", "status": "ok", "detail": "--nnodes 1:3 with 3 trainer(s)"}
    assert vc.nnodes("t-a", 1, 3, 3) == ok


def test_versions_odd_one_pin_and_missing_venv():
    v13 = {"python": "3.11.2", "torch": "2.13.0+cpu"}
    v12 = {"python": "3.11.2", "torch": "2.12.0+cpu"}
    everyone = {"a": v13, "b": v13, "c": v12}
    odd = vc.versions("c", everyone, "2.13.0", "/opt/v", provision=False)
    assert odd["status"] == "fail"
    assert odd["detail"] == (
        "c: Python 3.11.2 / torch 2.12.0+cpu here, but Python 3.11.2 / torch 2.13.0+cpu on a, b: mismatched "
        "versions hang silently in the first collective; fix: re-run the provisioning"
        " (ansible-playbook site.yml --tags provision) so that every node has the same torch")
    assert vc.versions("c", everyone, "2.13.0", "/opt/v", provision=True)["status"] == "warn"
    assert vc.versions("a", everyone, "2.13.0", "/opt/v", provision=False) == {
        "check": "versions", "status": "ok", "detail": ("Python 3.11.2, torch 2.13.0+cpu"
            " (same on every trainer)")}
    pinned = vc.versions("a", {"a": v13, "b": v13}, "2.12.0", "/opt/v", provision=False)
    assert pinned["status"] == "warn" and "python_env_torch_version is 2.12.0" in pinned["detail"]
    missing = vc.versions("a", {"a": None, "b": v13}, "2.13.0", "/opt/v", provision=False)
    assert missing["status"] == "fail" and missing["detail"].startswith("a: no training venv (/opt/v); fix:")
    assert vc.versions("a", {"a": None}, "2.13.0", "/opt/v", provision=True)["status"] == "skip"


DF = "Filesystem 1-blocks Used Available Capacity Mounted on\n/dev/vda2 1000 10 536870912 1% /var\n"


def test_disk_reads_df_of_the_path_and_its_parents():
    assert vc.df_avail(DF) == {"avail_mb": 512.0, "mount": "/var"}
    with pytest.raises(ValueError):
        vc.df_avail("df: /x: No such file or directory\n")
    ok = vc.disk("t-a", DF, "/var/lib/ddp-lab", 256)
    assert ok == {"check": "disk", "status": "ok", "detail": "512 MiB free on /var for /var/lib/ddp-lab"}
    bad = vc.disk("t-a", DF, "/var/lib/ddp-lab", 100000000)
    assert bad["status"] == "fail" and bad["detail"] == (
        "t-a: only 512 MiB free on /var, where the checkpoints go (/var/lib/ddp-lab), below "
        "validate_min_free_disk_mb=100000000; fix: free space there or"
        " set ddp_lab_base_dir to a folder on a larger disk")


def test_reach_store_and_lighthouse():
    ok = vc.reach("n0", "store", "10.89.0.1", 29400, 5, None)
    assert ok["detail"] == "reaches the store at 10.89.0.1:29400"
    bad = vc.reach("n0", "store", "10.89.0.1", 29400, 5, "Timeout when waiting for 10.89.0.1:29400\n")
    assert bad["status"] == "fail" and bad["detail"].startswith(
        "n0 cannot reach the rendezvous store at 10.89.0.1:29400 within 5 s"
        " (Timeout when waiting for 10.89.0.1:29400); fix: allow TCP 29400 from the trainers' subnet")
    lh = vc.reach("n0", "lighthouse", "10.89.0.1", 29510, 5, "refused")
    assert lh["check"] == "lighthouse_reach" and "the torchft lighthouse at 10.89.0.1:29510" in lh["detail"]
    assert "ddp_job_fault_tolerance=per_step" in lh["detail"]


def test_route_missing_loopback_and_ok():
    none = vc.route("n0", "10.89.0.1", 2, "RTNETLINK answers: Network is unreachable\n", None, None)
    assert none["status"] == "fail" and none["detail"].startswith(
        "n0 has no route to the rendezvous host 10.89.0.1 (RTNETLINK answers: Network is unreachable); fix:")
    lo = vc.route("n0", "10.89.0.5", 0, "", "lo", "10.89.0.5")
    assert lo["status"] == "fail" and "over loopback (lo, source 10.89.0.5)" in lo["detail"]
    ok = vc.route("n0", "10.89.0.1", 0, "", "eth0", "10.89.0.11")
    assert ok["detail"] == (
        "to 10.89.0.1 via eth0 from 10.89.0.11 (GLOO_SOCKET_IFNAME; --local-addr, DDPLAB_GLOO_ADDR)")


def test_clock_ahead_and_within():
    ahead = vc.clock("n1", {"offset_s": 120.5, "uncertainty_s": 0.5, "beyond_s": 120.0}, 2.0)
    assert ahead["status"] == "fail" and ahead["detail"].startswith(
        "n1: its clock is 120.5 s ahead of the controller's (more than validate_clock_max_skew_s=2.0)")
    ok = vc.clock("n1", {"offset_s": 0.0012, "uncertainty_s": 0.25, "beyond_s": 0}, 2.0)
    assert ok == {"check": "clock", "status": "ok",
                  "detail": "offset +0.001 s (+/- 0.25 s) from the controller"}


def test_interface_pattern_lo_wrong_address_and_ok():
    facts = {"interfaces": ["lo", "eth0"], "eth0": {"ipv4": {"address": "10.89.0.11"}}, "lo": {}}
    pattern = vc.interface("n0", "^lo", facts, "eth0", None)
    assert pattern["status"] == "fail" and pattern["detail"].startswith(
        "n0: wired_network_ifname '^lo' is not an interface of this node (it has eth0, lo):"
        " GLOO_SOCKET_IFNAME takes interface names, not patterns like ^lo or eth*;"
        " fix: set it to the wired interface (eth0 routes")
    lo = vc.interface("n0", "lo", facts, "eth0", None)
    assert lo["detail"].startswith("n0: wired_network_ifname is lo")
    wrong = vc.interface("n0", "eth0", facts, "eth0", "10.89.0.99")
    assert wrong["status"] == "fail"
    assert "wired_network_address 10.89.0.99 is not the address of eth0" in wrong["detail"]
    assert vc.interface("n0", "eth0", facts, "eth0", "10.89.0.11")["detail"] == (
        "wired_network_ifname eth0 exists (10.89.0.11)")


def _port(what, rc, state=None, held=(), holder="", parent="", number=29400):
    return vc.port(what, "controller", "10.89.0.1", number, rc, state or {}, "", list(held), holder, parent,
                   "")


def test_port_free_held_foreign_store_and_own_service():
    free = _port("store", 3)
    assert free["status"] == "ok" and not free["up"]
    assert free["detail"] == "port 29400 free on controller; the store starts with the job"
    other = _port("store", 3, held=["127.0.0.1"], holder="nc -l 29400")
    assert other["status"] == "fail" and other["detail"] == (
        "controller: TCP port 29400 is in use by another program (it accepts connections at 127.0.0.1;"
        " nc -l 29400), so the rendezvous store cannot listen there; fix: stop that program or set"
        " rendezvous_port to a free port")
    foreign = _port("lighthouse", 3, held=["10.89.0.1"], number=29510,
                    holder="python -m ddplab.controller.lighthouse serve",
                    parent="supervisor --state-dir /x/.rdzv --port 1")
    assert foreign["check"] == "lighthouse_port" and "--state-dir /x/.rdzv" in foreign["detail"]
    assert "set rendezvous_lighthouse_port to another free port" in foreign["detail"]
    mine = _port("store", 0, {"host": "10.89.0.1", "supervisor_pid": 7})
    assert mine["status"] == "ok" and mine["up"]
    assert mine["detail"].startswith("store running (supervisor pid 7)")
    another_inventory = _port("store", 0, {"host": "10.9.9.9"})
    assert another_inventory["status"] == "fail" and not another_inventory["up"]
    assert _port("store", -1, number="x")["detail"].startswith(
        "controller: TCP port x: rendezvous_port is not a TCP port number")
