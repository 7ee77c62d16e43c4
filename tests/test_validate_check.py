"""The validate role's checks in Python (action plugin ddp_lab.cluster.validate_check) and the roles'
settings rules it judges early (module_utils/settings.py with each role's SETTINGS: action
ddp_lab.cluster.settings): one record each, and the one-line messages the bad-input matrices assert."""

from __future__ import annotations

import base64
import re
from pathlib import Path

import pytest
import yaml
from ansible_collections.ddp_lab.cluster.plugins.action import validate_check as vc
from ansible_collections.ddp_lab.cluster.plugins.filter import ddp_job as job
from ansible_collections.ddp_lab.cluster.plugins.filter import python_env as pyenv
from ansible_collections.ddp_lab.cluster.plugins.module_utils import settings as st

ROLES = Path(__file__).resolve().parents[1] / "roles"
ROLE = ROLES / "validate"

KEYS = ["join_timeout", "last_call_timeout", "close_timeout", "keep_alive_interval", "keep_alive_max_attempt"]


def test_rdzv_conf_ok_gives_the_argument_and_a_bad_one_the_fix():
    ok = job.rdzv_conf("t-a", {"join_timeout": 120, "last_call_timeout": 3}, KEYS)
    assert ok == {"check": "rdzv_conf", "status": "ok", "detail": "join_timeout=120,last_call_timeout=3"}
    bad = job.rdzv_conf("t-a", {"join_timeout": 0, "last_call_timeout": 3}, KEYS)
    assert bad["status"] == "fail"
    assert bad["detail"] == (
        "t-a: ddp_job_rdzv_conf {'join_timeout': 0, 'last_call_timeout': 3} has unknown keys or values"
        " that are not > 0; fix: use keys among " + ", ".join(KEYS)
        + " with positive numbers (seconds or counts)")
    assert job.rdzv_conf("t-a", {"heartbeat": 1}, KEYS)["status"] == "fail"
    assert job.rdzv_conf("t-a", {"join_timeout": "soon"}, KEYS)["status"] == "fail"
    assert job.rdzv_conf("t-a", "join_timeout=1", KEYS)["status"] == "fail"
    assert job.rdzv_conf("t-a", {"read_timeout": 60})["status"] == "ok"  # the role's keys: job.RDZV_KEYS


@pytest.mark.parametrize(("nmin", "nmax", "start"), [
    (0, 3, "t-a: ddp_job_nnodes_min=0 must be at least 1; fix: set ddp_job_nnodes_min to the fewest"),
    (3, 2, "t-a: ddp_job_nnodes_min=3 is larger than ddp_job_nnodes_max=2 (torchrun --nnodes MIN:MAX); fix"),
    (1, 5, "t-a: ddp_job_nnodes_max=5 but the inventory has 3 trainer(s): MAX counts nodes that exist;"
           " fix: set ddp_job_nnodes_max to at most 3 (the default)"),
])
def test_nnodes_problems(nmin, nmax, start):
    rec = job.nnodes("t-a", nmin, nmax, 3)
    assert rec["status"] == "fail" and rec["detail"].startswith(start)


def test_nnodes_ok():
    ok = {"check": "nnodes", "status": "ok", "detail": "--nnodes 1:3 with 3 trainer(s)"}
    assert job.nnodes("t-a", 1, 3, 3) == ok


PINS = {"torch": "2.13.0", "numpy": "2.4.6"}


def test_versions_odd_one_pin_and_missing_venv():
    v13 = {"python": "3.11.2", "packages": {"torch": "2.13.0+cpu", "numpy": "2.4.6", "pip": "24.0"}}
    v12 = {"python": "3.11.2", "packages": {"torch": "2.12.0+cpu", "numpy": "2.4.6", "pip": "25.0"}}
    everyone = {h: vc.venv_versions(v) for h, v in {"a": v13, "b": v13, "c": v12}.items()}
    odd = vc.versions("c", everyone, PINS, "/opt/v", provision=False)
    assert odd["status"] == "fail"
    assert odd["detail"] == (
        "c: torch 2.12.0+cpu here, 2.13.0+cpu on a, b (/opt/v): mismatched versions hang silently in the"
        " first collective; fix: re-run the provisioning (ansible-playbook site.yml --tags provision"
        " --limit c) so that every node has the pinned packages")
    assert vc.versions("c", everyone, PINS, "/opt/v", provision=True)["status"] == "warn"
    assert vc.versions("a", everyone, PINS, "/opt/v", provision=False) == {
        "check": "versions", "status": "ok", "detail": ("Python 3.11.2, torch 2.13.0+cpu, numpy 2.4.6"
            " (same on every trainer, as pinned)")}
    pinned = vc.versions("a", everyone, {**PINS, "torch": "2.12.0"}, "/opt/v", provision=False)
    assert pinned["status"] == "fail" and pinned["detail"].startswith(
        "a: torch 2.13.0+cpu (pinned 2.12.0) in /opt/v; fix: provision"), pinned
    flat = vc.venv_versions({"python": "3.11.2", "torch": "2.13.0", "numpy": "2.4.6"})  # python_env_versions
    assert vc.versions("a", {"a": flat}, PINS, "/opt/v", provision=False)["status"] == "ok"
    missing = vc.versions("a", {"a": None, "b": everyone["b"]}, PINS, "/opt/v", provision=False)
    assert missing["status"] == "fail" and missing["detail"].startswith("a: no training venv (/opt/v); fix:")
    assert vc.versions("a", {"a": None}, PINS, "/opt/v", provision=True)["status"] == "skip"


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
    return vc.port("localhost", what, "controller", "10.89.0.1", number, rc, state or {}, "", list(held),
                   holder, parent, "")


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


# --------------------------------------------------------------------------- the inventory's shape

def test_trainers_and_rendezvous_hosts():
    assert vc.trainers("localhost", ["a", "b"], "trainers", "inv.yml") == {
        "check": "trainers", "status": "ok", "detail": "2 trainer(s): a, b"}
    none = vc.trainers("localhost", [], "trainers", "inv.yml")
    assert none["status"] == "fail" and none["detail"] == (
        "inventory inv.yml: no host in the group 'trainers'; fix: list the laptops under"
        " all.children.trainers.hosts (see inventory/laptops/hosts.yml)")
    assert vc.rendezvous("localhost", ["controller"], "rendezvous", "inv.yml")["detail"] == (
        "rendezvous host controller")
    two = vc.rendezvous("localhost", ["c", "d"], "rendezvous", "inv.yml")
    assert two["status"] == "fail" and two["detail"].startswith(
        "inventory inv.yml: 2 rendezvous hosts (c, d); fix: put exactly one host in the group 'rendezvous'"
        " with rendezvous_address set")
    assert vc.rendezvous("localhost", [], "rendezvous", "inv.yml")["detail"].startswith(
        "inventory inv.yml: no rendezvous host; fix:")


TARGETS = {"t-a": "192.0.2.11", "t-b": "192.0.2.12"}


@pytest.mark.parametrize(("address", "start"), [
    ("", "c: rendezvous_address '' is not an IPv4 address; fix: set it to the address the trainers reach"),
    (None, "c: rendezvous_address '' is not an IPv4 address"),
    ("ctl.lan", "c: rendezvous_address 'ctl.lan' is not an IPv4 address"),
    (" 192.0.2.10", "c: rendezvous_address ' 192.0.2.10' is not an IPv4 address"),
    ("300.0.0.1", "c: rendezvous_address '300.0.0.1' is not an IPv4 address"),
    ("127.0.1.1", "c: rendezvous_address 127.0.1.1 is a loopback address: every trainer would dial itself"
                  " instead of the store; fix: set it to the controller's address on the laptops' wired LAN"),
    ("192.0.2.12", "c: rendezvous_address 192.0.2.12 is the address of trainer t-b: the store would live on"
                   " a laptop whose loss ends the job; fix: use the controller's LAN address"),
])
def test_rendezvous_address_problems(address, start):
    rec = vc.rendezvous_address("localhost", "c", address, TARGETS)
    assert rec["status"] == "fail" and rec["detail"].startswith(start), rec


def test_rendezvous_address_ok():
    assert vc.rendezvous_address("localhost", "c", "192.0.2.10", TARGETS) == {
        "check": "rendezvous_address", "status": "ok", "detail": "c at 192.0.2.10"}


def test_unique_hosts_and_names():
    assert vc.unique_hosts("localhost", TARGETS)["detail"] == "every trainer has its own ansible_host"
    same = vc.unique_hosts("localhost", {"a": "192.0.2.11", "A": "192.0.2.11", "b": "b"})
    assert same == {"check": "unique_hosts", "status": "fail", "detail": (
        "a and A share 192.0.2.11 as ansible_host: one machine would run two agents;"
        " fix: give each trainer its own address (or remove the duplicate)")}
    assert vc.unique_names("localhost", ["a", "b"])["status"] == "ok"
    case = vc.unique_names("localhost", ["laptop-a", "Laptop-A"])
    assert case["status"] == "fail" and case["detail"] == (
        "trainers laptop-a, Laptop-A: two names differ only in letter case, which collide in"
        " runs/<run_id>/<host>/; fix: rename one")


# --------------------------------------------------------------------------- the controller's dataset

SUM = "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed"
URL = "https://example.org/input.txt"


def _dataset(src="", stat=None, sha=SUM):
    return vc.dataset("localhost", sha, src, "/cache/input.txt", URL, stat or {"exists": False})


def test_dataset_ok_cached_and_not_cached_yet():
    good = {"exists": True, "isreg": True, "checksum": SUM}
    assert _dataset(stat=good)["detail"] == "/cache/input.txt: sha256 matches"
    assert _dataset(src="/d/in.txt", stat=good)["detail"] == "/d/in.txt: sha256 matches"
    assert _dataset() == {"check": "dataset", "status": "ok", "detail": (
        f"not cached yet: the job downloads {URL} and checks its sha256")}


@pytest.mark.parametrize("url", ["", "  ", "not-a-url", "ftp:/input.txt", "file:///d/input.txt", "http://"])
def test_a_dataset_url_nothing_can_download_from_is_refused_when_no_copy_is_given_or_cached(url):
    """An empty or malformed ddp_job_dataset_url failed only at the download, after provisioning."""
    detail = vc.dataset("localhost", SUM, "", "/cache/input.txt", url, {"exists": False})["detail"]
    assert detail.startswith("controller: ddp_job_dataset_url ") and "no copy of the dataset" in detail
    assert detail.endswith("fix: set it to the dataset's URL, or give a local copy: make demo"
                           " DATASET=/path/to/input.txt, or -e ddp_job_dataset_src=/path/to/input.txt")
    assert ("is empty" in detail) == (not url.strip())
    # a copy given or cached needs no URL
    assert vc.dataset("localhost", SUM, "", "/c", url, {"exists": True, "isreg": True, "checksum": SUM})[
        "status"] == "ok"
    assert vc.dataset("localhost", SUM, "/d/in.txt", "/c", url,
                      {"exists": True, "isreg": True, "checksum": SUM})["status"] == "ok"


@pytest.mark.parametrize("url", ["https://example.org/input.txt", "http://10.0.0.1:8080/in.txt", "ftp://m/in"])
def test_a_dataset_url_with_a_server_is_taken(url):
    assert vc.dataset("localhost", SUM, "", "/cache/input.txt", url, {"exists": False})["status"] == "ok"


def test_dataset_problems():
    assert _dataset(sha="ABC")["detail"] == (
        "controller: ddp_job_dataset_sha256 'ABC' is not a sha256 (64 lowercase hex digits);"
        " fix: set it to the dataset's checksum (sha256sum FILE)")
    assert _dataset(src="/d/nope.txt")["detail"] == (
        "controller: the dataset ddp_job_dataset_src=/d/nope.txt does not exist; fix: point"
        f' ddp_job_dataset_src at a copy of the dataset (or set it to "" to download {URL})')
    folder = _dataset(src="/d", stat={"exists": True, "isreg": False})
    assert folder["status"] == "fail"
    assert folder["detail"].startswith("controller: the dataset /d is not a file")
    bad = {"exists": True, "isreg": True, "checksum": "0" * 64}
    assert _dataset(src="/d/in.txt", stat=bad)["detail"] == (
        f"controller: the dataset /d/in.txt has sha256 {'0' * 64}, expected {SUM} (ddp_job_dataset_sha256);"
        " fix: point ddp_job_dataset_src at an intact copy (or set ddp_job_dataset_sha256 to the checksum of"
        " the dataset you mean)")
    assert "fix: delete this cached copy to download it again" in _dataset(stat=bad)["detail"]


# --------------------------------------------------------------------------- one trainer's settings

SPECS = {"ddp_job": {"argument_specs": {"main": {"options": {
    "ddp_job_max_restarts": {"type": "int", "default": 3}}}}}}


def test_types_one_record_per_error_or_one_ok():
    options = st.spec_options(SPECS)
    assert st.host_records("t-a", {"ddp_job_max_restarts": 4}, {}, options, [])[0] == {
        "check": "types", "status": "ok",
        "detail": "1 setting(s) given; their types match the roles' argument specs"}
    (bad, ranges) = st.host_records("t-a", {"ddp_job_max_restarts": "many"}, {}, options, [])
    assert bad["status"] == "fail" and bad["name"] == "ddp_job_max_restarts" and ranges["status"] == "ok"
    assert bad["detail"].startswith(
        "t-a: ddp_job_max_restarts='many': argument 'ddp_job_max_restarts' is of type str")
    assert bad["detail"].endswith("; fix: give ddp_job_max_restarts a int (roles/ddp_job/README.md)")


def test_ranges_one_record_per_violation_or_one_ok():
    rules = [{"name": "rendezvous_port", "min": 1024, "max": 65535},
             {"name": "ddp_job_stop_timeout_s", "above": 0}]
    assert st.judge("t-a", {"rendezvous_port": 29400}, rules) == [{"check": "ranges", "status": "ok",
        "detail": "ports in 1024-65535; timeouts, intervals and counts in range"}]
    found = st.judge("t-a", {"rendezvous_port": 80, "ddp_job_stop_timeout_s": 0}, rules)
    assert [r["detail"] for r in found] == [
        "t-a: rendezvous_port = 80 must be >= 1024 and <= 65535;"
        " fix: correct it in the inventory, group_vars or -e",
        "t-a: ddp_job_stop_timeout_s = 0 must be > 0; fix: correct it in the inventory, group_vars or -e"]
    assert st.judge("t-a", {"rendezvous_port": "x"}, rules, bad=["rendezvous_port"])[0]["status"] == "ok"


def test_train_config_by_the_training_programs_rules():
    assert job.train_config("t-a", SUM, {}, preset="tiny") == {
        "check": "train_config", "status": "ok", "detail": "run.json accepted by ddplab.config"}
    bad = job.train_config("t-a", SUM, {"per_rank_batch_size": 0})
    assert bad["status"] == "fail" and bad["detail"].startswith(
        "t-a: the training program refuses the run configuration: config key 'per_rank_batch_size' = 0:")
    assert bad["detail"].endswith("(keys and ranges: python -m ddplab.train --help, docs/training.md)")
    assert job.train_config("t-a", SUM, None, max_steps=0)["status"] == "fail"


def test_torch_version():
    for good in ("2.13.0", "2.13", "2.13.0+cpu", "2.14.0rc1", 2.13):
        assert pyenv.torch_version("t-a", good)["status"] == "ok", good
    assert pyenv.torch_version("t-a", "2.13.0")["detail"] == "python_env_torch_version 2.13.0"
    for bad in ("torch==2.13.0", "latest", "2", "2.13.0\n"):
        rec = pyenv.torch_version("t-a", bad)
        assert rec["status"] == "fail" and rec["detail"].startswith(
            f"t-a: python_env_torch_version '{bad}' is not a version (like 2.13.0); fix:"), bad


# --------------------------------------------------------------------------- on the node

SHOW_OK = ("LoadState=loaded\nExecStart={ path=/opt/v/bin/python ; argv[]=/opt/v/bin/python -m ddplab.agent"
           " --nnodes 1:3 --local-addr 10.89.0.11 --rdzv-endpoint 10.89.0.1:29400 ddplab.train ;"
           " ignore_errors=no }\nEnvironment=GLOO_SOCKET_IFNAME=eth0 DDPLAB_GLOO_ADDR=10.89.0.11\n")
SHOW_NAMES = SHOW_OK.replace("10.89.0.11 --rdzv", "laptop-a --rdzv").replace("10.89.0.1:29400", "ctl:29400")
SHOW_NONE = "LoadState=not-found\nExecStart=\nEnvironment=\n"
ROUTE = {"dev": "eth0", "src": "10.89.0.11"}


def test_reachable_answers_or_not():
    assert vc.reachable("n0", {"hostname": "laptop-a", "system": "Linux"}) == {
        "check": "reachable", "status": "ok", "detail": "answers: laptop-a, Linux"}
    assert vc.reachable("n0", {"hostname": "a", "distribution": "Ubuntu", "system": "Linux"})["detail"] == (
        "answers: a, Ubuntu")
    down = vc.reachable("n0", None, "Failed to connect to the host via ssh: timed out\n")
    assert down["status"] == "fail" and down["detail"] == (
        "n0 does not answer (Failed to connect to the host via ssh: timed out); fix: power it on,"
        " plug it into the switch and check ansible_host / SSH access")


def test_hosts_file_loopback_name_is_a_warning():
    ok = vc.hosts_file("n0", "laptop-a", ["10.89.0.11"], ROUTE, "10.89.0.1", 29400, SHOW_NONE)
    assert ok == {"check": "hosts_file", "status": "ok", "detail": "laptop-a resolves to 10.89.0.11"}
    assert vc.hosts_file("n0", "laptop-a", [], ROUTE, "10.89.0.1", 29400, "")["detail"] == (
        "laptop-a resolves to nothing (not needed: ddp-lab passes addresses)")
    warn = vc.hosts_file("n0", "laptop-a", ["127.0.1.1"], ROUTE, "10.89.0.1", 29400, SHOW_OK)
    assert warn["status"] == "warn"
    assert warn["detail"].startswith(
        "n0: its hostname laptop-a resolves to 127.0.1.1 (loopback: the '127.0.1.1"
        " <hostname>' line Ubuntu writes to /etc/hosts)")
    assert ("the next one passes torchrun --local-addr 10.89.0.11, GLOO_SOCKET_IFNAME=eth0 and"
            " --rdzv-endpoint 10.89.0.1:29400 (the last launch on this node passed the same); nothing to fix"
            ) in warn["detail"]
    never = vc.hosts_file("n0", "laptop-a", ["127.0.1.1"], ROUTE, "10.89.0.1", 29400, SHOW_NONE)
    assert "10.89.0.1:29400; nothing to fix" in never["detail"]


def test_hosts_file_says_when_the_last_launch_passed_other_addresses():
    """Review: the warning said "as the last launch on this node did" beside values the last launch
    did not pass (another rendezvous port, another route, names instead of addresses)."""
    for show, port, route, differ in [
        (SHOW_OK, 29411, ROUTE, "--rdzv-endpoint 10.89.0.1:29400"),
        (SHOW_OK, 29400, {"dev": "eth1", "src": "10.89.0.12"}, "--local-addr 10.89.0.11"),
        (SHOW_NAMES, 29400, ROUTE, "--local-addr laptop-a"),
    ]:
        detail = vc.hosts_file("n0", "laptop-a", ["127.0.1.1"], route, "10.89.0.1", port, show)["detail"]
        assert "the same" not in detail and "as the last launch" not in detail, detail
        assert f"(the last launch on this node passed {vc._launch_words(vc._filters.unit_launch(show))}:" \
            " not these); nothing to fix" in detail, detail
        assert differ in detail, detail


def test_launch_explicit_names_or_none_yet():
    assert vc.launch("n0", SHOW_NONE) == {"check": "launch", "status": "skip", "detail": (
        "no agent launched on this node yet; ddp_job passes --local-addr, GLOO_SOCKET_IFNAME and an IP"
        " --rdzv-endpoint")}
    assert vc.launch("n0", SHOW_OK) == {"check": "launch", "status": "ok", "detail": (
        "last launch: --local-addr 10.89.0.11, GLOO_SOCKET_IFNAME=eth0, --rdzv-endpoint 10.89.0.1:29400")}
    names = vc.launch("n0", SHOW_NAMES)
    assert names["status"] == "warn" and names["detail"] == (
        "n0: the last agent launch passed no explicit address (--local-addr laptop-a,"
        " GLOO_SOCKET_IFNAME=eth0, --rdzv-endpoint ctl:29400), so gloo may have used the hostname's"
        " (loopback) address; fix: launch"
        " with ddp-lab (site.yml or playbooks/train.yml), which passes them")
    for change in (("10.89.0.11 --rdzv", "127.0.0.1 --rdzv"),
                   ("GLOO_SOCKET_IFNAME=eth0", "GLOO_SOCKET_IFNAME=lo"), ("GLOO_SOCKET_IFNAME=eth0 ", "")):
        assert vc.launch("n0", SHOW_OK.replace(*change))["status"] == "warn", change


def test_unique_address_and_name_across_the_play():
    addresses = {"a": "10.89.0.11", "b": "10.89.0.11", "c": "10.89.0.13", "d": ""}
    shared = vc.unique_address("a", addresses)
    assert shared == {"check": "unique_address", "status": "fail", "detail": (
        "a and b share the address 10.89.0.11 towards the rendezvous host (cloned machines or a static IP"
        " used twice); gloo cannot tell them apart; fix: give each laptop its own address"
        " (DHCP reservation)")}
    assert vc.unique_address("c", addresses)["detail"] == "10.89.0.13 is this node's alone"
    names = {"a": "ubuntu", "b": "ubuntu", "c": "laptop-c"}
    same = vc.unique_name("b", names)
    assert same["status"] == "warn" and same["detail"] == (
        "b and a share the hostname ubuntu: their records in the metrics (field host) look alike;"
        " fix: sudo hostnamectl set-hostname <unique name>")
    assert vc.unique_name("c", names) == {"check": "unique_name", "status": "ok",
                                          "detail": "hostname laptop-c is unique"}


def _comm(name: str) -> dict:
    return {"content": base64.b64encode(f"{name}\n".encode()).decode()}


def test_dpkg_lock_free_waited_and_held():
    assert vc.dpkg_lock("n0", [], [], 1, 5, 600, True) == {
        "check": "dpkg_lock", "status": "ok", "detail": "apt/dpkg locks free"}
    assert vc.dpkg_lock("n0", [], [], 3, 5, 600, True)["detail"] == "apt/dpkg locks free (waited 10.0 s)"
    holders = [{"path": "/var/lib/dpkg/lock-frontend", "pid": 812},
               {"path": "/var/lib/dpkg/lock", "pid": 813}]
    held = vc.dpkg_lock("n0", holders, [_comm("unattended-upgr"), {"failed": True}], 121, 5, 600, True)
    assert held == {"check": "dpkg_lock", "status": "fail", "detail": (
        "n0: apt/dpkg is busy: unattended-upgr (pid 812) holds /var/lib/dpkg/lock-frontend; ? (pid 813) holds"
        " /var/lib/dpkg/lock and did not finish within validate_dpkg_lock_wait_s=600 s; fix: let it finish"
        " (after boot unattended-upgrades runs for a while: systemctl status unattended-upgrades)"
        " and run again")}
    doctor = vc.dpkg_lock("n0", holders[:1], [_comm("apt-get")], 1, 5, 600, False)
    assert doctor["status"] == "warn"
    assert ("apt-get (pid 812) holds /var/lib/dpkg/lock-frontend (the provisioning waits up to 600 s"
            " for it);") in doctor["detail"]


# --------------------------------------------------------------------------- the plugin's dispatch

def test_the_plugin_runs_every_check_by_name_and_reads_peers_from_hostvars():
    action = vc.ActionModule.__new__(vc.ActionModule)
    task_vars = {"inventory_hostname": "a", "ansible_play_hosts": ["a", "b"],
                 "hostvars": {"a": {"__validate_address": "10.0.0.1", "__validate_hostname": "x"},
                              "b": {"__validate_address": "10.0.0.1", "__validate_hostname": "y"}}}
    assert action._one("unique_address", {}, task_vars)["status"] == "fail"
    assert action._one("unique_name", {}, task_vars)["status"] == "ok"
    clock = {"measured": {"offset_s": 0.0, "uncertainty_s": 0.1, "beyond_s": 0}, "max_skew_s": 2}
    assert action._one("clock", clock, task_vars)["status"] == "ok"
    with pytest.raises(vc.AnsibleActionFail, match="unknown check 'nope'"):
        action._one("nope", {}, task_vars)
    with pytest.raises(TypeError):
        action._one("clock", {"max_skew_s": 2}, task_vars)


def test_validate_tasks_build_no_record_in_jinja():
    """Every check record comes from the plugin: no ``{% %}`` block in roles/validate/tasks."""
    tasks = ROLE / "tasks"
    blocks = {p.name: p.read_text().count("{%") for p in sorted(tasks.glob("*.yml"))}
    assert not any(blocks.values()), blocks


SHARED = ("ddp_job_fault_tolerance", "ddp_job_ft_manager_port", "ddp_job_ft_store_port")


def test_shared_engine_settings_have_one_home():
    """The recovery engine and its per_step ports are defined in roles/ddp_lab only, and no role
    reads them with a fall-back of its own."""
    import yaml

    roles = ROLES
    for name in SHARED:
        homes = [p.parent.parent.name for p in roles.glob("*/defaults/main.yml")
                 if name in (yaml.safe_load(p.read_text()) or {})]
        assert homes == ["ddp_lab"], (name, homes)
        own = re.compile(rf"(?<![.\w]){name} \| default\(")  # not hostvars[...].name | default(name)
        fallbacks = [str(p.relative_to(roles)) for p in roles.rglob("*") if p.suffix in (".yml", ".j2", ".py")
                     and own.search(p.read_text())]
        assert not fallbacks, (name, fallbacks)


def test_engine_per_step_is_one_ddplab_train_worker_per_laptop():
    assert job.engine("t-a", "torchelastic", ["-m", "mine"], 4) == {
        "check": "engine", "status": "ok", "detail": "ddp_job_fault_tolerance torchelastic"}
    assert job.engine("t-a", "per_step", [], 1)["status"] == "ok"
    assert job.engine("t-a", "diloco", [], 1)["status"] == "ok"
    for engine in ("per_step", "diloco"):
        for argv, nproc in ((["-m", "mine"], 1), ([], 2)):
            bad = job.engine("t-a", engine, argv, nproc)
            assert bad["status"] == "fail" and bad["detail"] == (
                f"t-a: ddp_job_fault_tolerance={engine} (worker argv {argv}, nproc_per_node {nproc});"
                " fix: torchelastic, or per_step or diloco with one ddplab.train worker per laptop (one"
                " torchft replica group each): leave ddp_job_worker_argv empty and ddp_job_nproc_per_node 1")
    assert job.engine("t-a", "bogus", [], 1)["status"] == "fail"


def test_engine_per_step_takes_no_gradient_compression():
    """ddp_job_grad_compression is a DDP hook of torchelastic: with per_step it is one line before
    anything starts (none, or torchelastic with any compression, passes)."""
    for compression in ("none", "fp16", "bf16", "powersgd"):
        assert job.engine("t-a", "torchelastic", [], 1, compression)["status"] == "ok"
    assert job.engine("t-a", "per_step", [], 1, "none")["status"] == "ok"
    bad = job.engine("t-a", "per_step", [], 1, "bf16")
    assert bad["status"] == "fail" and bad["detail"] == (
        "t-a: ddp_job_grad_compression=bf16 with ddp_job_fault_tolerance=per_step: the compressions are"
        " hooks of the torchelastic engine's DDP all-reduce, per_step averages fp32 gradients itself;"
        " fix: ddp_job_grad_compression none, or ddp_job_fault_tolerance torchelastic")


# `ip -o addr show dev h3xa` in a namespace: a first address off the route, the routed one
# labelled h3xa:1, an IPv6 one (issue 12's two cases in one interface).
IP_ADDR_SHOW = (
    "3: h3xa    inet 192.168.1.23/24 scope global h3xa\\       valid_lft forever preferred_lft forever\n"
    "3: h3xa    inet 192.168.50.11/24 scope global h3xa:1\\       valid_lft forever preferred_lft forever\n"
    "3: h3xa    inet6 fd00::1/64 scope global nodad \\       valid_lft forever preferred_lft forever\n"
    "3: h3xa    inet6 fe80::9899:b6ff:fe2f:a883/64 scope link \\       valid_lft forever\n"
)
GLOO_ROUTE = {"dev": "h3xa", "src": "192.168.50.11"}


def test_gloo_ifname_address_is_the_first_address_under_that_exact_name():
    addrs = vc._filters.interface_addresses(IP_ADDR_SHOW)
    assert [a["label"] for a in addrs] == ["h3xa", "h3xa:1", "h3xa", "h3xa"]
    assert vc._filters.gloo_ifname_address(addrs, "h3xa") == "192.168.1.23"
    only_labelled = [a for a in addrs if a["address"] != "192.168.1.23"]
    assert vc._filters.gloo_ifname_address(only_labelled, "h3xa") == "fd00::1"  # the "10 vs 2" case


def test_gloo_row_warns_for_a_launch_that_bound_the_interface_and_passes_the_route_address():
    old = "LoadState=loaded\nEnvironment=GLOO_SOCKET_IFNAME=h3xa OMP_NUM_THREADS=1\n"
    row = vc.gloo("laptop-a", GLOO_ROUTE, old, IP_ADDR_SHOW)
    assert row["status"] == "warn"
    assert "gloo binds 192.168.1.23" in row["detail"] and "not 192.168.50.11" in row["detail"]
    new = "LoadState=loaded\nEnvironment=GLOO_SOCKET_IFNAME=h3xa DDPLAB_GLOO_ADDR=192.168.50.11\n"
    row = vc.gloo("laptop-a", GLOO_ROUTE, new, IP_ADDR_SHOW)
    assert row["status"] == "ok" and row["detail"].startswith("binds 192.168.50.11 (DDPLAB_GLOO_ADDR")
    assert "also holds 192.168.1.23, fd00::1" in row["detail"]
    never = vc.gloo("laptop-a", GLOO_ROUTE, "LoadState=not-found\nEnvironment=\n", IP_ADDR_SHOW)
    assert never["status"] == "ok" and "the next launch binds 192.168.50.11" in never["detail"]
    assert vc.gloo("laptop-a", {"dev": None, "src": None}, "", "")["status"] == "skip"


def test_types_names_the_variable_its_role_and_type():
    import yaml

    spec = yaml.safe_load((ROLES / "ddp_job/meta/argument_specs.yml").read_text())
    options = st.spec_options({"ddp_job": spec})
    problem = st.type_problem("ddp_job_nnodes_min", "two", options)
    assert problem.startswith("argument 'ddp_job_nnodes_min' is of type str and we were unable to convert")
    assert problem.endswith("fix: give ddp_job_nnodes_min a int (roles/ddp_job/README.md)")
    assert st.type_problem("ddp_job_nnodes_min", 2, options) == ""
    assert st.type_problem("not_a_setting", "x", options) == ""


ROLES_JUDGED = ("ddp_lab", "ddp_job", "cpu_governor")
SPECS = {r: yaml.safe_load((ROLES / r / "meta" / "argument_specs.yml").read_text()) for r in ROLES_JUDGED}
OPTIONS = st.spec_options(SPECS)
# the spec defaults as the action renders them (ddp_job_nnodes_max: the trainers of the inventory)
DEFAULTS = {**{n: v for d in st.spec_defaults(SPECS).values() for n, v in d.items()}, "ddp_job_nnodes_max": 3}
RULES = st.role_rules(ROLES_JUDGED)


def _given(hosts, extra, per_host_e=()):
    return [r["detail"] for r in st.given(OPTIONS, RULES, hosts, extra, DEFAULTS, 3, per_host_e)
            if r["status"] == "fail"]


def test_given_e_values_once_and_inventory_values_per_host_group():
    """An -e value is judged once (it is the same on every host): type, run id form, range, and the
    checks it alone decides; an inventory value's type once for the hosts sharing it."""
    hosts = {"t-a": {"ddp_job_max_steps": "abc"}, "t-b": {"ddp_job_max_steps": "abc"},
             "t-c": {"ddp_job_max_steps": 10, "ddp_job_run_id": ".."}}
    extra = {"ddp_job_nnodes_min": "x", "rendezvous_port": 80, "ddp_job_resume_run_id": "../etc",
             "ddp_job_fault_tolerance": "per_step", "ddp_job_nproc_per_node": 2}
    lines = _given(hosts, extra)
    assert lines[0].startswith("-e ddp_job_nnodes_min='x': argument 'ddp_job_nnodes_min' is of type str")
    assert lines[1].startswith("-e ddp_job_resume_run_id='../etc': not a run id: a run id is 1-64")
    assert lines[2].startswith("t-a, t-b: ddp_job_max_steps='abc' (inventory): argument 'ddp_job_max_steps'")
    assert lines[2].endswith("fix: give ddp_job_max_steps a int (roles/ddp_job/README.md)")
    assert lines[3].startswith("t-c: ddp_job_run_id='..' (inventory): not a run id")
    assert lines[4].startswith("-e: rendezvous_port = 80 must be >= 1024 and <= 65535")
    assert lines[5].startswith("-e: ddp_job_fault_tolerance=per_step (worker argv [], nproc_per_node 2)")
    assert len(lines) == 6, lines  # nnodes is not judged: its min failed its type


def test_given_leaves_a_joint_check_to_each_host_when_the_inventory_sets_one_of_its_inputs():
    extra = {"ddp_job_fault_tolerance": "per_step"}
    assert _given({"t-a": {"ddp_job_nproc_per_node": 2}}, extra) == []  # t-a's own: judged per host
    assert _given({"t-a": {}}, {**extra, "ddp_job_nproc_per_node": "2"})[0].startswith("-e: ddp_job_fault")
    assert _given({"t-a": {}}, {"ddp_job_nnodes_max": 5})[0].startswith(
        "-e: ddp_job_nnodes_max=5 but the inventory has 3 trainer(s)")
    assert _given({"t-a": {}}, {"ddp_job_train_overrides": {"per_rank_batch_size": 0}})[0].startswith(
        "-e: the training program refuses the run configuration")
    # a resume's configuration is the run's merged with these: tasks/resume.yml judges it
    assert _given({"t-a": {}}, {"ddp_job_train_overrides": {"per_rank_batch_size": 0},
                                "ddp_job_resume_run_id": "r1"}) == []


def test_given_gradient_compression_settings_each_one_line():
    """-e ddp_job_grad_compression outside its choices, a PowerSGD start step below 2 (the role's own
    range rules), and a compression with per_step: one line each, before any role starts."""
    (choice,) = _given({"t-a": {}}, {"ddp_job_grad_compression": "int8"})
    assert choice.startswith("-e ddp_job_grad_compression='int8': ")
    assert "none, fp16, bf16, powersgd" in choice
    (start,) = _given({"t-a": {}}, {"ddp_job_grad_compression": "powersgd", "ddp_job_powersgd_start_step": 1})
    assert start.startswith("-e: ddp_job_powersgd_start_step = 1 must be >= 2 (PowerSGD's error feedback")
    (engine,) = _given({"t-a": {}}, {"ddp_job_fault_tolerance": "per_step",
                                     "ddp_job_grad_compression": "powersgd"})
    assert engine.startswith("-e: ddp_job_grad_compression=powersgd with ddp_job_fault_tolerance=per_step")
    assert _given({"t-a": {}}, {"ddp_job_grad_compression": "bf16"}) == []


def test_given_good_settings_are_one_ok_record():
    (ok,) = st.given(OPTIONS, RULES, {"t-a": {"ddp_job_max_steps": 10}},
                     {"cpu_governor_governor": "powersave"}, DEFAULTS, 3)
    assert ok == {"check": "given", "status": "ok",
                  "detail": "1 setting(s) given with -e, 1 in the inventory: accepted"}


def test_given_names_an_e_template_each_host_renders_its_own_way():
    lines = _given({"t-a": {"ddp_job_max_steps": "abc"}}, {}, ["ddp_job_max_steps"])
    assert lines[0].startswith("t-a: ddp_job_max_steps='abc' (-e, as rendered there): argument"), lines


# --------------------------------------------------------------------------- one home of the rules

def test_a_trainers_rows_leave_out_what_another_check_judges():
    """A check is left out when a setting it reads failed its type (its one line says so), when it
    counts the trainers and the inventory's shape failed (``trainers`` 0), and the run configuration
    on a resume (tasks/resume.yml judges the run's merged with the given)."""
    values = {n: DEFAULTS.get(n) for n in st.rule_names(RULES)}
    every = ["types", "ranges", "rdzv_conf", "nnodes", "train_config", "engine"]

    def rows(given=None, trainers=3, **changed):
        return [r["check"] for r in st.host_records("t-a", given or {}, {**values, **changed}, OPTIONS, RULES,
                                                    trainers)]
    assert rows() == every
    assert rows({"ddp_job_nnodes_min": "two"}) == ["types", "ranges", "rdzv_conf", "train_config", "engine"]
    assert "nnodes" not in rows(trainers=0)
    assert "train_config" not in rows(ddp_job_resume_run_id="r1")
    records = st.host_records("t-a", {"rendezvous_port": "x"}, {**values, "rendezvous_port": "x"}, OPTIONS,
                              RULES, 3)
    (rng,) = [r for r in records if r["check"] == "ranges"]
    assert rng["status"] == "ok", rng  # its type's line says it


def test_validate_reads_no_other_roles_files():
    """validate loaded five roles' defaults and vars files and kept other roles' ranges and
    --rdzv-conf keys in its vars (issue 24): each role's settings are judged by its own contract
    (argument spec, SETTINGS), which the action ``settings`` reads; validate's tasks name no other
    role's folder."""
    texts = {p.name: p.read_text() for p in sorted((ROLE / "tasks").glob("*.yml"))}
    texts["vars/main.yml"] = (ROLE / "vars" / "main.yml").read_text()
    others = [r.name for r in ROLES.iterdir() if r.is_dir() and r.name != "validate"]
    found = {n: [o for o in others if re.search(rf"/{o}/(defaults|vars|meta)\b", t)]
             for n, t in texts.items()}
    assert not any(found.values()), found
    assert not [n for n, t in texts.items() if "include_vars" in t and n != "given.yml"]
    (own,) = [t for t in yaml.safe_load(texts["given.yml"]) if "ansible.builtin.include_vars" in t]
    assert own["ansible.builtin.include_vars"]["file"].endswith("/validate/vars/main.yml")
    assert "__validate_ranges" not in texts["vars/main.yml"]


@pytest.mark.parametrize("role", yaml.safe_load((ROLE / "vars" / "main.yml").read_text())["__validate_roles"])
def test_the_spec_defaults_are_the_roles_defaults(role):
    """validate takes a setting nobody set from its role's argument spec (the role's contract): where
    the spec gives a default, it is the role's own (defaults/main.yml)."""
    spec = yaml.safe_load((ROLES / role / "meta/argument_specs.yml").read_text())
    (defaults,) = st.spec_defaults({role: spec}).values()
    own = yaml.safe_load((ROLES / role / "defaults/main.yml").read_text()) or {}
    assert {n: (v, own[n]) for n, v in defaults.items() if n in own and own[n] != v} == {}
