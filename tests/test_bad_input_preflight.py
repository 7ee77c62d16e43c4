"""Bad input to the preflight (roles/validate, playbooks/validate.yml, doctor.yml): every problem
is one line naming host, cause and fix, nothing changes anywhere, and the doctor prints a table
per node without stopping at the first problem.

Three layers, fastest first:

- the validate role's filters, on captured or constructed input (no Ansible run);
- controller-side cases (inventory shape, types, ranges, elastic range, run configuration,
  dataset, rendezvous port): ``playbooks/validate.yml`` on a temporary inventory whose trainers
  are never contacted (``validate_node_checks=false``; their addresses are TEST-NET and would
  not answer). They need no node and run everywhere, CI's ``make test-unit`` included;
- node cases (route, loopback name, interface, clock, disk, dpkg lock, versions, store reachable,
  the doctor's tables): against real nodes found by tests/labharness.py (``molecule verify`` of
  the default scenario in CI, the lab or ``DDP_LAB_TEST_INVENTORY`` elsewhere). The problems are
  staged on the nodes once per scenario and several cases share one ansible run; every staged
  change is undone afterwards.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import re
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
import yaml
from ansible_collections.ddp_lab.cluster.plugins.filter import ddp_job as job_filters
from ansible_collections.ddp_lab.cluster.plugins.filter import firewall as firewall_filters
from ansible_collections.ddp_lab.cluster.plugins.filter import validate as val
from ansible_collections.ddp_lab.cluster.plugins.module_utils import settings
from ansible_collections.ddp_lab.cluster.plugins.module_utils.hostvars import odd_ones
from labharness import (
    REPO,
    Lab,
    ansible_env,
    assert_stopped_before_changes,
    assert_unchanged,
    errors,
    free_port,
    lab_or_skip,
    local_controller,
    node_exec,
    nodes_untouched,
    recap,
    render_agent_launch,
    run_playbooks,
    run_playbooks_watching,
    sigterm_as_interrupt,
    skip_or_fail,
    write_inventory,
)

VALIDATE = str(REPO / "playbooks" / "validate.yml")
PROVISION = str(REPO / "playbooks" / "provision.yml")
DOCTOR = str(REPO / "doctor.yml")
FACT_FILE = yaml.safe_load((REPO / "roles/wired_network/defaults/main.yml").read_text())[
    "wired_network_fact_file"
]
TEST_DIR = "/run/ddp-lab-test"  # scratch space on a node (tmpfs, gone at reboot)
SKEW_S = 120.0




def _not_twice() -> None:
    """Cases that need no node run in ``make test-unit``; ``molecule verify`` (which lists this file
    for its node cases) need not repeat them."""
    if os.environ.get("MOLECULE_INVENTORY_FILE"):
        pytest.skip("needs no node: run by `make test-unit`; molecule verify runs the node cases")


# --------------------------------------------------------------------------- filters


def test_lock_holders_match_device_and_inode():
    dev = os.makedev(0, 0xB8)
    files = [
        {"path": "/var/lib/dpkg/lock-frontend", "dev": dev, "inode": 1640641},
        {"path": "/var/lib/dpkg/lock", "dev": dev, "inode": 1640640},
    ]
    locks = (
        "1: POSIX  ADVISORY  WRITE 812 00:b8:1640641 0 EOF\n"
        "1: -> POSIX  ADVISORY  WRITE 900 00:b8:1640641 0 EOF\n"
        "2: FLOCK  ADVISORY  WRITE 77 00:b9:1640640 0 EOF\n"
    )
    assert val.lock_holders(locks, files) == [{"path": "/var/lib/dpkg/lock-frontend", "pid": 812}]
    assert val.lock_holders("", files) == []


def test_clock_offset_only_counts_what_lies_outside_the_interval():
    facts = {"iso8601_micro": "2026-11-29T18:00:00.500000Z"}
    node = 1795975200.5
    inside = val.clock_offset(facts, node - 1, node + 1)
    assert inside["beyond_s"] == 0 and inside["offset_s"] == 0 and inside["uncertainty_s"] == 1
    ahead = val.clock_offset(facts, node - 121, node - 120)
    assert ahead["beyond_s"] == pytest.approx(120) and ahead["offset_s"] == pytest.approx(120.5)
    behind = val.clock_offset(facts, node + 10, node + 12)
    assert behind["beyond_s"] == pytest.approx(10) and behind["offset_s"] < 0


def test_unit_launch_reads_the_real_systemctl_show_output():
    show = (
        "ExecStart={ path=/opt/ddp-lab/venv/bin/python ; argv[]=/opt/ddp-lab/venv/bin/python -m ddplab.agent "
        "--nnodes 1:3 --rdzv-backend c10d --rdzv-endpoint 10.89.0.1:29400 --rdzv-id r1 --rdzv-conf "
        "is_host=false,join_timeout=120 --local-addr 10.89.0.5 --max-restarts 10 -m ddplab.train --config "
        "/var/lib/ddp-lab/runs/r1/run.json ; ignore_errors=no ; start_time=[Sun 2026-11-29 18:00:56 UTC] ; "
        "stop_time=[n/a] ; pid=21306 ; code=(null) ; status=0/0 }\n"
        "Environment=GLOO_SOCKET_IFNAME=eth0 TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 OMP_NUM_THREADS=1\n"
        "LoadState=loaded\n"
    )
    assert val.unit_launch(show) == {
        "loaded": True,
        "local_addr": "10.89.0.5",
        "rdzv_endpoint": "10.89.0.1:29400",
        "gloo_socket_ifname": "eth0",
    }
    assert val.unit_launch("Environment=\nLoadState=not-found\n")["loaded"] is False


def test_route_and_loopback_helpers():
    assert val.route_info("10.89.0.1 dev eth0 src 10.89.0.5 uid 0 \\    cache") == {
        "dev": "eth0",
        "src": "10.89.0.5",
    }
    assert val.path_chain("/var/lib/ddp-lab") == ["/var/lib/ddp-lab", "/var/lib", "/var", "/"]
    assert val.loopbacks(["127.0.1.1", "10.0.0.2", "::1", "x"]) == ["127.0.1.1", "::1"]


def test_odd_ones_and_sharing_keys():
    assert odd_ones({"a": "2.13", "b": "2.12", "c": "2.13"}) == {"reference": "2.13", "odd": ["b"]}
    assert odd_ones({"a": None}) == {"reference": None, "odd": []}
    assert val.sharing_keys({"a": "x", "b": "x", "c": "y", "d": ""}) == {"a": ["b"], "b": ["a"]}


def test_spec_options_drop_unrendered_defaults_and_name_the_role():
    specs = {"ddp_job": yaml.safe_load((REPO / "roles/ddp_job/meta/argument_specs.yml").read_text())}
    role, option = settings.spec_options(specs)["ddp_job_nnodes_max"]
    assert role == "ddp_job" and "default" not in option and option["type"] == "int"
    # the types record that names the variable: tests/test_validate_check.py


def test_range_problems_and_train_config():
    rules = [{"name": "p", "min": 1024, "max": 65535, "why": "root"}, {"name": "t", "above": 0}]
    assert settings.range_problems({"p": 80, "t": 0}, rules) == [
        "p = 80 must be >= 1024 and <= 65535 (root)",
        "t = 0 must be > 0",
    ]
    assert settings.range_problems({"p": 80}, rules, skip=["p"]) == []
    assert job_filters.train_config("t-a", None, {"per_rank_batch_size": 0})["detail"].startswith(
        "t-a: the training program refuses the run configuration: config key 'per_rank_batch_size' = 0:"
        " must be a positive integer (> 0)"
    )
    assert job_filters.train_config("t-a", None, {"max_steps": 100})["status"] == "ok"


def test_check_table_aligns_columns():
    table = val.check_table(
        [
            {"check": "clock", "status": "ok", "detail": "offset +0.001 s"},
            {"check": "hosts_file", "status": "warn", "detail": "a\n  b"},
        ],
        "laptop-a",
    )
    assert table.splitlines() == [
        "== laptop-a ==",
        "check      | status | detail",
        "-----------|--------|----------------",
        "clock      | OK     | offset +0.001 s",
        "hosts_file | WARN   | a b",
    ]


# --------------------------------------------------------------------------- the launch


def test_launch_passes_explicit_addresses(tmp_path: Path):
    """ddp_job's systemd-run + torchrun argv (rendered by Ansible from the role's own defaults and
    vars) passes --local-addr, GLOO_SOCKET_IFNAME, DDPLAB_GLOO_ADDR (the address gloo binds) and an
    IP rendezvous endpoint, runs as the unprivileged user and with a umask that keeps the run's
    files private."""
    _not_twice()
    argv, _, _ = render_agent_launch(tmp_path)
    assert argv[argv.index("--local-addr") + 1] == "192.168.50.11"
    assert argv[argv.index("--rdzv-endpoint") + 1] == "192.168.50.10:29400"
    assert (
        "GLOO_SOCKET_IFNAME=enp3s0" in argv
        and argv[argv.index("GLOO_SOCKET_IFNAME=enp3s0") - 1] == "--setenv"
    )
    assert (
        "DDPLAB_GLOO_ADDR=192.168.50.11" in argv
        and argv[argv.index("DDPLAB_GLOO_ADDR=192.168.50.11") - 1] == "--setenv"
    )
    # ddplab is installed into the venv as a wheel: no source folder on the workers' path
    assert not [a for a in argv if a.startswith("PYTHONPATH=")], argv
    assert argv[argv.index("--uid") + 1] == "ddp" and argv[argv.index("--gid") + 1] == "ddp"
    assert "UMask=0027" in argv and argv[argv.index("UMask=0027") - 1] == "--property"


# --------------------------------------------------------------------------- controller-side cases


@pytest.fixture
def controller_case(tmp_path: Path):
    """Write a temporary inventory (three TEST-NET trainers that are never contacted, the
    controller as rendezvous host on a free port with its own store state folder) and run
    validate.yml on it with ``validate_node_checks=false``. Returns ``run(inventory_changes, *args)``."""
    _not_twice()

    def run(trainers: dict | None = None, rendezvous: dict | None = None, *args: str) -> tuple[int, str, str]:
        hosts = (
            trainers
            if trainers is not None
            else {f"t-{c}": {"ansible_host": f"192.0.2.{i + 11}"} for i, c in enumerate("abc")}
        )
        for hostvars in hosts.values():
            hostvars.setdefault("ansible_connection", "ssh")
        children: dict = {"trainers": {"hosts": hosts}}
        if rendezvous is None or rendezvous:
            children["rendezvous"] = {
                "hosts": rendezvous or local_controller(tmp_path)
            }
        path = tmp_path / "hosts.yml"
        path.write_text(yaml.safe_dump({"all": {"children": children}}, sort_keys=False))
        rc, out = run_playbooks(
            ansible_env(), str(path), [VALIDATE], "-e", "validate_node_checks=false", *args, timeout=300
        )
        return rc, out, str(path)

    return run


def test_inventory_without_trainers(controller_case):
    rc, out, inventory = controller_case({})
    assert_stopped_before_changes(rc, out)
    (line,) = errors(out)
    assert line.startswith(f"inventory {inventory}: no host in the group 'trainers'; fix: list the laptops")


def test_inventory_with_two_rendezvous_hosts(controller_case):
    two = {
        name: {"ansible_connection": "local", "rendezvous_address": f"192.0.2.{n}"}
        for n, name in ((10, "controller"), (20, "spare"))
    }
    rc, out, inventory = controller_case(None, two)
    assert_stopped_before_changes(rc, out, ["t-a", "t-b", "t-c"], contacted=False)
    (line,) = errors(out)
    assert line.startswith(
        f"inventory {inventory}: 2 rendezvous hosts (controller, spare); fix: put exactly one host"
    )


def test_rendezvous_address_on_loopback(controller_case):
    rdzv = {"controller": {"ansible_connection": "local", "rendezvous_address": "127.0.1.1"}}
    rc, out, _ = controller_case(None, rdzv)
    assert_stopped_before_changes(rc, out, ["t-a"], contacted=False)
    (line,) = errors(out)
    assert line.startswith(
        "controller: rendezvous_address 127.0.1.1 is a loopback address: every trainer would dial"
    )
    assert "fix: set it to the controller's address on the laptops' wired LAN" in line


def test_rendezvous_address_of_a_trainer(controller_case):
    rdzv = {"controller": {"ansible_connection": "local", "rendezvous_address": "192.0.2.12"}}
    rc, out, _ = controller_case(None, rdzv)
    assert_stopped_before_changes(rc, out)
    (line,) = errors(out)
    assert line.startswith("controller: rendezvous_address 192.0.2.12 is the address of trainer t-b:")


def test_duplicate_machines_and_names(controller_case):
    trainers = {"laptop-a": {"ansible_host": "192.0.2.11"}, "Laptop-A": {"ansible_host": "192.0.2.11"}}
    rc, out, _ = controller_case(trainers)
    assert_stopped_before_changes(rc, out)
    lines = errors(out)
    assert len(lines) == 2, lines
    assert lines[0].startswith(
        "laptop-a and Laptop-A share 192.0.2.11 as ansible_host: one machine would run two"
    )
    assert lines[1].startswith("trainers laptop-a, Laptop-A: two names differ only in letter case")


def test_port_held_by_another_program_and_corrupt_dataset(controller_case, tmp_path: Path):
    """Both controller-side state problems in one run: a program listening on the rendezvous port,
    and a dataset whose checksum is wrong."""
    bad = tmp_path / "input.txt"
    bad.write_text("not tiny shakespeare\n")
    port = free_port()
    rdzv = local_controller(tmp_path, port)
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", port))
        listener.listen()
        rc, out, _ = controller_case(None, rdzv, "-e", f"ddp_job_dataset_src={bad}")
    assert_stopped_before_changes(rc, out, ["t-a"], contacted=False)
    lines = errors(out)
    assert len(lines) == 2, lines
    assert lines[0].startswith(
        f"controller: TCP port {port} is in use by another program (it accepts connections at 127.0.0.1; "
    )
    # the holder's command line: this very test process listens there (a pytest-xdist worker's
    # command line is execnet's, not pytest's)
    assert f"; {' '.join(psutil.Process().cmdline())}), so the" in lines[0]
    assert "fix: stop that program or set rendezvous_port to a free port" in lines[0]
    assert lines[1].startswith(f"controller: the dataset {bad} has sha256 ")
    assert (
        "expected 86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed (ddp_job_dataset_sha256); "
        "fix: point ddp_job_dataset_src at an intact copy" in lines[1]
    )


@contextlib.contextmanager
def _store(address: str, port: int, state_dir: Path) -> Iterator[None]:
    """A ddp-lab rendezvous store on the controller (ddplab.controller.rdzv_store) at ``address:port`` with
    its state in ``state_dir``, stopped afterwards."""
    env = {**os.environ, "PYTHONPATH": str(REPO / "train")}
    base = [sys.executable, "-m", "ddplab.controller.rdzv_store"]
    started = subprocess.run(
        [
            *base,
            "start",
            "--host",
            address,
            "--port",
            str(port),
            "--state-dir",
            str(state_dir),
            "--wait",
            "90",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    try:
        assert started.returncode == 0, started.stdout + started.stderr
        yield
    finally:  # also when the start failed half-way: no supervisor is left behind
        subprocess.run(
            [*base, "stop", "--port", str(port), "--state-dir", str(state_dir)],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )


def test_port_held_by_a_store_this_checkout_does_not_manage(controller_case, tmp_path: Path):
    """A ddp-lab store started from elsewhere (another state folder) holds the port: named as
    such, with the command that stops it."""
    port = free_port()
    elsewhere = tmp_path / "other-checkout-rdzv"
    rdzv = local_controller(tmp_path, port)
    with _store("127.0.0.1", port, elsewhere):
        rc, out, _ = controller_case(None, rdzv)
    assert_stopped_before_changes(rc, out, ["t-a"], contacted=False)
    (line,) = errors(out)
    assert line.startswith(
        f"controller: TCP port {port} is held by a ddp-lab store this checkout does not manage ("
    )
    assert f"state folder {elsewhere})" in line
    assert (f"fix: stop it (python -m ddplab.controller.rdzv_store stop --port {port} "
            f"--state-dir {elsewhere})") in line


def test_missing_dataset(controller_case, tmp_path: Path):
    rc, out, _ = controller_case(None, None, "-e", f"ddp_job_dataset_src={tmp_path}/nope.txt")
    assert_stopped_before_changes(rc, out)
    (line,) = errors(out)
    assert line.startswith(
        f"controller: the dataset ddp_job_dataset_src={tmp_path}/nope.txt does not exist; fix:"
    )


def test_a_dataset_url_nothing_can_download_from(controller_case, tmp_path: Path):
    """No copy given or cached and a URL that is not one: refused before provisioning (it failed at
    the download, after it)."""
    rc, out, _ = controller_case(None, None, "-e", "ddp_job_dataset_url=not-a-url", "-e",
                                 f"ddp_job_dataset_cache_dir={tmp_path}/empty")
    assert_stopped_before_changes(rc, out)
    (line,) = errors(out)
    assert line.startswith("controller: ddp_job_dataset_url 'not-a-url' is not an http, https or ftp URL")


def test_types_ranges_and_run_config_given_with_e_once_before_any_host_task(controller_case):
    """Wrong types (argument specs), out-of-range ports/timeouts/rdzv_conf and batch 0 given with -e:
    all reported together, one line each, once (they were one line per trainer), and no trainer's
    task runs (recap: the controller's play alone)."""
    extra = {
        "rendezvous_port": 80,
        "ddp_job_stop_timeout_s": 0,
        "ddp_job_max_restarts": "many",
        "ddp_job_watch": "perhaps",
        "ddp_job_rdzv_conf": {"join_timeout": 0, "last_call_timeout": 3},
        "ddp_job_train_overrides": {"per_rank_batch_size": 0},
        "validate_port_timeout_s": 0,
    }
    rc, out, _ = controller_case(None, None, "-e", json.dumps(extra))
    assert_stopped_before_changes(rc, out, ["t-a", "t-b", "t-c"], contacted=False)
    lines = errors(out)
    assert len(lines) == 7, lines
    assert all(line.startswith("-e") for line in lines), lines
    text = "\n".join(lines)
    assert "-e ddp_job_max_restarts='many': argument 'ddp_job_max_restarts' is of type str" in text
    assert "fix: give ddp_job_max_restarts a int (roles/ddp_job/README.md)" in text
    assert "-e ddp_job_watch='perhaps': " in text and "fix: give ddp_job_watch a bool" in text
    assert (
        "-e: rendezvous_port = 80 must be >= 1024 and <= 65535 (below 1024 needs root; "
        "the store runs unprivileged); fix: correct it"
    ) in text
    assert "-e: ddp_job_stop_timeout_s = 0 must be > 0" in text
    assert "-e: validate_port_timeout_s = 0 must be > 0" in text
    assert "-e: ddp_job_rdzv_conf {'join_timeout': 0, 'last_call_timeout': 3} has unknown keys" in text
    assert (
        "-e: the training program refuses the run configuration: config key "
        "'per_rank_batch_size' = 0: must be a positive integer (> 0); fix: correct "
        "ddp_job_train_overrides"
    ) in text


def test_inventory_values_one_line_per_host_naming_variable_value_and_what_is_allowed(controller_case):
    """A bad value in host_vars (ddp_job_max_steps: abc, a governor Linux does not know, an engine
    ddp_lab does not know) printed ddp_lab's whole argument spec (KBs) or two lines for one value:
    now one line each, before any role starts, naming the host(s), variable, value and what is
    allowed; hosts that share a bad value share the line."""
    trainers = {
        "t-a": {"ansible_host": "192.0.2.11", "ddp_job_max_steps": "abc", "cpu_governor_governor": "turbo"},
        "t-b": {"ansible_host": "192.0.2.12", "ddp_job_fault_tolerance": "bogus",
                "cpu_governor_governor": "turbo"},
        "t-c": {"ansible_host": "192.0.2.13", "ddp_job_run_id": "../etc"},
    }
    rc, out, _ = controller_case(trainers)
    assert_stopped_before_changes(rc, out, list(trainers), contacted=False)
    assert "argument_spec_data" not in out and len(out) < 12000, len(out)
    lines = errors(out)
    assert sorted(lines) == sorted([
        "t-a, t-b: cpu_governor_governor='turbo' (inventory): value of cpu_governor_governor must be one of:"
        " performance, powersave, ondemand, conservative, schedutil, userspace, got: turbo; fix: give"
        " cpu_governor_governor a str among performance, powersave, ondemand, conservative, schedutil,"
        " userspace (roles/cpu_governor/README.md)",
        "t-a: ddp_job_max_steps='abc' (inventory): argument 'ddp_job_max_steps' is of type str and we were"
        " unable to convert to int: \"'abc'\" cannot be converted to an int; fix: give ddp_job_max_steps"
        " a int (roles/ddp_job/README.md)",
        "t-b: ddp_job_fault_tolerance='bogus' (inventory): value of ddp_job_fault_tolerance must be one of:"
        " torchelastic, per_step, diloco, got: bogus; fix: give ddp_job_fault_tolerance a str among"
        " torchelastic, per_step, diloco (roles/ddp_lab/README.md)",
        "t-c: ddp_job_run_id='../etc' (inventory): not a run id: a run id is 1-64 of the characters"
        " A-Z a-z 0-9 . _ -, not starting with '.' (it names the folder runs/<run id> on the controller and"
        " on every node); fix: give the id of a run, e.g. 20261201-080234-3daa (ls runs/ on the controller)",
    ]), lines


def test_batch_balance_is_off_or_speed_before_any_role_starts(controller_case):
    """ddp_job_batch_balance: an unknown mode is one line naming the choices, nothing contacted;
    ``off`` unquoted in YAML (the boolean false) is off (Ansible's choices and ddplab.config)."""
    trainers = {
        "t-a": {"ansible_host": "192.0.2.11", "ddp_job_batch_balance": False},
        "t-b": {"ansible_host": "192.0.2.12", "ddp_job_batch_balance": "fast"},
        "t-c": {"ansible_host": "192.0.2.13", "ddp_job_batch_balance": "speed"},
    }
    rc, out, _ = controller_case(trainers)
    assert_stopped_before_changes(rc, out, list(trainers), contacted=False)
    lines = errors(out)
    assert lines == ["t-b: ddp_job_batch_balance='fast' (inventory): value of ddp_job_batch_balance must be"
                     " one of: off, speed, None, got: fast; fix: give ddp_job_batch_balance a str among off,"
                     " speed, None (roles/ddp_job/README.md)"], lines


def test_an_e_template_of_a_host_fact_is_judged_per_host(controller_case):
    """molecule nodes5 gives -e ddp_job_max_steps='{{ molecule_nodes5_steps }}', a fact of the
    trainers only: the early check renders it per host (the controller cannot), judges it there."""
    trainers = {
        "t-a": {"ansible_host": "192.0.2.11", "steps": 60},
        "t-b": {"ansible_host": "192.0.2.12", "steps": "abc"},
        "t-c": {"ansible_host": "192.0.2.13", "steps": 70},
    }
    rc, out, _ = controller_case(trainers, None, "-e", json.dumps({"ddp_job_max_steps": "{{ steps }}"}))
    assert_stopped_before_changes(rc, out, list(trainers), contacted=False)
    (line,) = errors(out)
    assert line.startswith("t-b: ddp_job_max_steps='abc' (-e, as rendered there): argument"), line
    for good in (60, 70):
        trainers["t-b"]["steps"] = good
        rc, out, _ = controller_case(trainers, None, "-e", json.dumps({"ddp_job_max_steps": "{{ steps }}"}))
        assert rc == 0 and not errors(out), out[-3000:]


def test_ranges_and_elastic_range_of_inventory_values_per_host(controller_case):
    """Values of the right type whose range or elastic range is wrong on some hosts: one line per
    host that has it, after the settings given passed."""
    trainers = {
        "t-a": {"ansible_host": "192.0.2.11", "ddp_job_nnodes_min": 3, "ddp_job_nnodes_max": 2},
        "t-b": {"ansible_host": "192.0.2.12", "ddp_job_nnodes_max": 5, "ddp_job_stop_timeout_s": 0},
        "t-c": {"ansible_host": "192.0.2.13"},
    }
    rc, out, _ = controller_case(trainers)
    assert_stopped_before_changes(rc, out)
    lines = errors(out)
    assert len(lines) == 3, lines
    assert any(
        line.startswith("t-a: ddp_job_nnodes_min=3 is larger than ddp_job_nnodes_max=2") for line in lines
    )
    assert any(
        line.startswith("t-b: ddp_job_nnodes_max=5 but the inventory has 3 trainer(s)") for line in lines
    )
    assert "t-b: ddp_job_stop_timeout_s = 0 must be > 0; fix: correct it" in "\n".join(lines)


def test_doctor_refuses_a_bad_setting_in_one_line_and_stays_read_only(tmp_path: Path):
    """doctor.yml had no early check: -e ddp_job_fault_tolerance=bogus printed ddp_lab's whole spec."""
    _not_twice()
    trainers = {"t-a": {"ansible_host": "192.0.2.11", "ansible_connection": "ssh"}}
    path = tmp_path / "hosts.yml"
    path.write_text(yaml.safe_dump({"all": {"children": {
        "trainers": {"hosts": trainers}, "rendezvous": {"hosts": local_controller(tmp_path)}}}}))
    for bad, start in [("ddp_job_fault_tolerance=bogus", "-e ddp_job_fault_tolerance='bogus': value of"),
                       ("run_id=../etc", "-e run_id='../etc': not a run id")]:
        rc, out = run_playbooks(ansible_env(), str(path), [DOCTOR], "-e", bad, timeout=300)
        assert_stopped_before_changes(rc, out, ["t-a"], contacted=False)
        (line,) = errors(out)
        assert line.startswith(start), line
        assert "argument_spec_data" not in out


def test_good_settings_pass_without_touching_anything(controller_case):
    """The same inventory with good settings passes: rc 0, changed=0 (a local dataset copy when
    the tests have one)."""
    from conftest import dataset_path

    data = dataset_path()
    args = ("-e", f"ddp_job_dataset_src={data}") if data.is_file() else ()
    rc, out, _ = controller_case(None, None, *args)
    assert rc == 0, out[-4000:]
    assert_unchanged(out)
    assert not errors(out)


# --------------------------------------------------------------------------- node cases


@pytest.fixture(scope="module")
def lab() -> Lab:
    found = lab_or_skip()
    if len(found.trainers) < 2:
        skip_or_fail("the node cases need at least two trainers")
    return found


def _sh(lab: Lab, host: str, script: str, check: bool = True) -> subprocess.CompletedProcess:
    done = node_exec(lab, host, "sh", "-c", script)
    if check:
        assert done.returncode == 0, (host, script, done.stdout, done.stderr)
    return done


SITECUSTOMIZE = f"""\
# ddp-lab test: this interpreter's clock runs {SKEW_S} s ahead (time.time, hence the date_time facts).
import time as _time
_real_time = _time.time
_time.time = lambda: _real_time() + {SKEW_S}
"""

LOCK_HOLDER = """\
import fcntl, sys, time
with open('/proc/self/comm', 'w') as comm:
    comm.write('unattended-upgr')
lock = open('/var/lib/dpkg/lock-frontend', 'w')
fcntl.lockf(lock, fcntl.LOCK_EX)
open(sys.argv[2], 'w').write('held')
time.sleep(float(sys.argv[1]))
"""


@contextlib.contextmanager
def _lock_held(lab: Lab, host: str, seconds: float) -> Iterator[None]:
    """A process named like Ubuntu's unattended-upgrades holds dpkg's frontend lock for ``seconds``."""
    node_exec(
        lab,
        host,
        "sh",
        "-c",
        f"mkdir -p {TEST_DIR} && rm -f {TEST_DIR}/held && cat > {TEST_DIR}/lockholder.py",
        stdin=LOCK_HOLDER,
    )
    _sh(
        lab,
        host,
        f"nohup python3 {TEST_DIR}/lockholder.py {seconds} {TEST_DIR}/held >/dev/null 2>&1 & "
        f"echo $! > {TEST_DIR}/lockholder.pid",
    )
    deadline = time.monotonic() + 30
    while _sh(lab, host, f"test -e {TEST_DIR}/held", check=False).returncode != 0:
        assert time.monotonic() < deadline, f"{host}: the lock holder did not start"
        time.sleep(0.2)
    try:
        yield
    finally:
        _sh(
            lab,
            host,
            f"kill $(cat {TEST_DIR}/lockholder.pid) 2>/dev/null; rm -f {TEST_DIR}/lockholder.*",
            check=False,
        )


@contextlib.contextmanager
def _loopback_hostname(lab: Lab, host: str) -> Iterator[None]:
    """Put Ubuntu's ``127.0.1.1 <hostname>`` line first in the node's /etc/hosts (restored after)."""
    original = node_exec(lab, host, "cat", "/etc/hosts").stdout
    # /etc/hosts is a bind mount in podman containers: rewrite it in place, never replace it.
    _sh(
        lab,
        host,
        'printf "127.0.1.1\\t%s\\n" "$(hostname)" > /tmp/hosts.new && cat /etc/hosts >> /tmp/hosts.new '
        "&& cat /tmp/hosts.new > /etc/hosts && rm /tmp/hosts.new",
    )
    try:
        yield
    finally:
        node_exec(lab, host, "sh", "-c", "cat > /etc/hosts", stdin=original)


@contextlib.contextmanager
def _skewed_interpreter(lab: Lab, host: str) -> Iterator[str]:
    """A Python wrapper on the node whose clock reads SKEW_S ahead; yields its path."""
    node_exec(
        lab,
        host,
        "sh",
        "-c",
        f"mkdir -p {TEST_DIR}/skew && cat > {TEST_DIR}/skew/sitecustomize.py",
        stdin=SITECUSTOMIZE,
    )
    wrapper = f"{TEST_DIR}/python3-skewed"
    node_exec(
        lab,
        host,
        "sh",
        "-c",
        f"cat > {wrapper} && chmod 755 {wrapper}",
        stdin=f'#!/bin/sh\nPYTHONPATH={TEST_DIR}/skew exec /usr/bin/python3 "$@"\n',
    )
    try:
        yield wrapper
    finally:
        _sh(lab, host, f"rm -rf {TEST_DIR}/skew {wrapper}", check=False)


@contextlib.contextmanager
def _other_torch(lab: Lab, host: str) -> Iterator[str]:
    """A second venv on the node whose torch reports another version; yields its prefix."""
    prefix = f"{TEST_DIR}/venv-torch-2.12"
    _sh(
        lab,
        host,
        f"rm -rf {prefix} && python3 -m venv --without-pip {prefix} && "
        f"site=$({prefix}/bin/python -c 'import sysconfig; print(sysconfig.get_paths()[\"purelib\"])') && "
        "mkdir -p $site/torch-2.12.0.dist-info && "
        "printf 'Metadata-Version: 2.1\\nName: torch\\nVersion: 2.12.0\\n' "
        "> $site/torch-2.12.0.dist-info/METADATA",
    )
    try:
        yield prefix
    finally:
        _sh(lab, host, f"rm -rf {prefix}", check=False)


@contextlib.contextmanager
def _firewalled(lab: Lab, host: str, port: int) -> Iterator[None]:
    """The node rejects its own TCP connections to the store's port (a firewall in the way)."""
    address = lab.rendezvous_address
    rule = f"OUTPUT -p tcp -d {address} --dport {port} -j REJECT --reject-with tcp-reset"
    _sh(lab, host, f"iptables -I {rule}")
    try:
        yield
    finally:
        _sh(lab, host, f"iptables -D {rule}", check=False)


def _rendezvous_vars(tmp_path: Path) -> dict:
    """A free port and a private store state folder, so that no other job's store interferes."""
    return {"rendezvous_port": free_port(), "rendezvous_state_dir": str(tmp_path / "rdzv")}


def _tables(out: str) -> dict[str, dict[str, tuple[str, str]]]:
    """The doctor's tables: {host: {check: (STATUS, detail)}}."""
    tables: dict[str, dict[str, tuple[str, str]]] = {}
    current = None
    for raw in out.splitlines():
        line = raw.strip().strip('",')
        head = re.fullmatch(r"== (\S+) ==", line)
        if head:
            current = tables.setdefault(head.group(1), {})
            continue
        cells = [c.strip() for c in line.split(" | ", 2)]
        if current is not None and len(cells) == 3 and cells[0] != "check":
            current[cells[0]] = (cells[1], cells[2])
    return tables


@pytest.fixture(scope="class")
def staged(lab: Lab, tmp_path_factory) -> Iterator[dict]:
    """Problems staged on the nodes for the runs below: node 0 names its interface '^lo', node 1
    reads its clock 120 s ahead, the last node has Ubuntu's 127.0.1.1 line and a process holding
    the dpkg lock; every node lacks disk (validate_min_free_disk_mb far above any disk)."""
    tmp = tmp_path_factory.mktemp("preflight")
    n0, n1, nlast = lab.trainers[0], lab.trainers[1], lab.trainers[-1]
    with contextlib.ExitStack() as stack:
        stack.enter_context(sigterm_as_interrupt())
        wrapper = stack.enter_context(_skewed_interpreter(lab, n1))
        stack.enter_context(_loopback_hostname(lab, nlast))
        stack.enter_context(_lock_held(lab, nlast, 900))
        inventory = write_inventory(
            lab,
            tmp / "hosts.yml",
            {n0: {"wired_network_ifname": "^lo"}, n1: {"ansible_python_interpreter": wrapper}},
            rendezvous_vars=_rendezvous_vars(tmp),
        )
        args = (
            "-e",
            "validate_min_free_disk_mb=100000000",
            "-e",
            "validate_dpkg_lock_wait_s=3",
            "-e",
            "validate_dpkg_lock_poll_s=1",
        )
        with nodes_untouched(lab, FACT_FILE):
            t0 = time.monotonic()
            rc, out = run_playbooks(lab.env, inventory, [VALIDATE, PROVISION], *args)
            print(f"preflight run with the staged problems: {time.monotonic() - t0:.1f} s")
            assert_stopped_before_changes(rc, out, lab.trainers, contacted=True)
        t0 = time.monotonic()
        drc, dout = run_playbooks(lab.env, inventory, [DOCTOR], *args)
        print(f"doctor run with the staged problems: {time.monotonic() - t0:.1f} s")
        yield {
            "n0": n0,
            "n1": n1,
            "nlast": nlast,
            "rc": rc,
            "out": out,
            "errors": errors(out),
            "doctor_rc": drc,
            "doctor_out": dout,
        }


def _line(staged: dict, host: str, prefix: str) -> str:
    found = [
        e for e in staged["errors"] if e.startswith(f"{host}: {prefix}") or e.startswith(f"{host} {prefix}")
    ]
    assert len(found) == 1, (host, prefix, staged["errors"])
    return found[0]


class TestStagedProblems:
    """The cases that share the staged problems (undone when the class is done, before the cases
    that need a clean cluster)."""

    def test_interface_pattern_is_refused(self, staged):
        line = _line(staged, staged["n0"], "wired_network_ifname '^lo' is not an interface of this node")
        assert "GLOO_SOCKET_IFNAME takes interface names, not patterns like ^lo or eth*" in line
        assert "fix: set it to the wired interface (" in line

    def test_clock_ahead_is_refused(self, staged):
        line = _line(staged, staged["n1"], "its clock is ")
        seconds = float(re.search(r"its clock is ([0-9.]+) s ahead of the controller's", line).group(1))
        assert SKEW_S - 15 < seconds < SKEW_S + 15, line
        assert (
            "fix: turn on time sync on every node and the controller (sudo timedatectl set-ntp true)" in line
        )

    def test_disk_too_small_is_refused_on_every_node(self, staged, lab):
        for host in lab.trainers:
            line = _line(staged, host, "only ")
            assert re.search(
                r"MiB free on \S+, where the checkpoints go \(/var/lib/ddp-lab\), below "
                r"validate_min_free_disk_mb=100000000; fix: free space there",
                line,
            ), line

    def test_dpkg_lock_waited_for_then_refused(self, staged):
        out = staged["out"]
        assert f"RETRYING: [{staged['nlast']}]: Wait for the lock holders to finish" in out
        line = _line(staged, staged["nlast"], "apt/dpkg is busy: ")
        assert re.search(
            r"apt/dpkg is busy: unattended-upgr \(pid \d+\) holds /var/lib/dpkg/lock-frontend and did not "
            r"finish within validate_dpkg_lock_wait_s=3 s; fix: let it finish",
            line,
        ), line

    def test_loopback_hostname_is_a_warning_not_a_refusal(self, staged):
        nlast = staged["nlast"]
        assert not [e for e in staged["errors"] if "127.0.1.1" in e]
        warnings = [
            w for w in re.findall(r'"msg": "WARNING: (.*)"', staged["out"]) if w.startswith(f"{nlast}:")
        ]
        (warning,) = warnings
        assert re.search(
            r"its hostname \S+ resolves to 127\.0\.1\.1 \(loopback: the '127\.0\.1\.1 <hostname>' line",
            warning,
        )
        assert re.search(
            r"every launch passes explicit addresses; the next one passes torchrun --local-addr [0-9.]+, "
            r"GLOO_SOCKET_IFNAME=\S+ and --rdzv-endpoint [0-9.]+:\d+"
            r"(;| \(the last launch on this node passed)",
            warning,
        ), warning
        assert "nothing to fix" in warning

    def test_no_other_problem_is_reported(self, staged, lab):
        """Exactly the staged problems fail: one line each, nothing about the healthy checks."""
        expected = 3 + len(lab.trainers)  # interface, clock, dpkg lock + disk on every node
        assert len(staged["errors"]) == expected, staged["errors"]

    def test_doctor_reports_every_check_on_every_node(self, staged, lab):
        out = staged["doctor_out"]
        assert staged["doctor_rc"] != 0
        assert_unchanged(out)
        tables = _tables(out)
        assert set(tables) >= {"controller", *lab.trainers}, tables.keys()
        node_checks = {
            "reachable",
            "types",
            "ranges",
            "rdzv_conf",
            "nnodes",
            "train_config",
            "torch_version",
            "route",
            "hosts_file",
            "launch",
            "clock",
            "disk",
            "versions",
            "unique_address",
            "unique_name",
            "dpkg_lock",
        }
        for host in lab.trainers:
            assert node_checks <= set(tables[host]), (host, tables[host])
        assert {"trainers", "rendezvous", "rendezvous_address", "rendezvous_port", "dataset"} <= set(
            tables["controller"]
        )
        n0, n1, nlast = staged["n0"], staged["n1"], staged["nlast"]
        assert tables[n0]["interface"][0] == "FAIL"
        assert tables[n1]["clock"][0] == "FAIL"
        assert tables[nlast]["hosts_file"][0] == "WARN" and tables[nlast]["dpkg_lock"][0] == "WARN"
        assert "(the provisioning waits up to 3 s for it)" in tables[nlast]["dpkg_lock"][1]
        for host in lab.trainers:
            assert tables[host]["disk"][0] == "FAIL"
            for check in (
                "reachable",
                "route",
                "versions",
                "unique_address",
                "types",
                "ranges",
                "nnodes",
                "train_config",
            ):
                assert tables[host][check][0] == "OK", (host, check, tables[host][check])
        assert re.search(r"doctor: checks failed on (\S+, )*\S+; the tables above name each problem", out)


def test_torch_mismatch_and_unreachable_store_refused_for_training(lab, tmp_path: Path):
    """--tags train (no provisioning in this run): one node's venv has another torch, another
    node's firewall rejects the running store's port. Both refused, nothing else."""
    n0, nlast = lab.trainers[0], lab.trainers[-1]
    rdzv = _rendezvous_vars(tmp_path)
    with contextlib.ExitStack() as stack:
        stack.enter_context(sigterm_as_interrupt())
        prefix = stack.enter_context(_other_torch(lab, nlast))
        store_dir = Path(rdzv["rendezvous_state_dir"])
        stack.enter_context(_store(lab.rendezvous_address, rdzv["rendezvous_port"], store_dir))
        stack.enter_context(_firewalled(lab, n0, rdzv["rendezvous_port"]))
        inventory = write_inventory(
            lab, tmp_path / "hosts.yml", {nlast: {"python_env_prefix": prefix}}, rendezvous_vars=rdzv
        )
        t0 = time.monotonic()
        rc, out = run_playbooks(lab.env, inventory, [VALIDATE], "--tags", "train")
        print(f"preflight run (--tags train), torch mismatch and firewall: {time.monotonic() - t0:.1f} s")
    assert_stopped_before_changes(rc, out, lab.trainers, contacted=True)
    lines = errors(out)
    assert len(lines) == 2, lines
    versions = next(e for e in lines if e.startswith(f"{nlast}: "))
    # every pinned package is compared (issue 27 item 9): this venv holds torch 2.12.0 and nothing else
    assert re.search(r": torch 2\.12\.0 here, \S+ on .*; numpy not installed here, \S+ on ",
                     versions), versions
    assert (
        "mismatched versions hang silently in the first collective; fix: re-run the provisioning "
        f"(ansible-playbook site.yml --tags provision --limit {nlast})"
    ) in versions
    reach = next(e for e in lines if e.startswith(f"{n0} "))
    assert reach.startswith(f"{n0} cannot reach the rendezvous store at ")
    assert f"fix: allow TCP {rdzv['rendezvous_port']} from the trainers' subnet" in reach


def test_healthy_cluster_preflight_waits_for_dpkg_then_passes(lab, tmp_path: Path):
    """A clean cluster passes the full preflight (validate.yml) with changed=0; a dpkg lock held
    when the preflight looks is waited for (the holder ends once the play reports waiting)."""
    inventory = write_inventory(lab, tmp_path / "hosts.yml", rendezvous_vars=_rendezvous_vars(tmp_path))
    host = lab.trainers[0]
    waiting = f"RETRYING: [{host}]: Wait for the lock holders to finish"
    with sigterm_as_interrupt(), _lock_held(lab, host, 900):

        def release_when_waiting(line: str) -> None:
            if waiting in line:
                _sh(lab, host, f"kill $(cat {TEST_DIR}/lockholder.pid)", check=False)

        t0 = time.monotonic()
        rc, out = run_playbooks_watching(
            lab.env,
            inventory,
            [VALIDATE],
            "-e",
            "validate_dpkg_lock_poll_s=1",
            "-e",
            "validate_dpkg_lock_wait_s=300",
            on_line=release_when_waiting,
        )
        print(f"healthy preflight run: {time.monotonic() - t0:.1f} s")
    assert rc == 0, "\n".join(errors(out)) or out[-4000:]
    assert_unchanged(out)
    assert waiting in out
    assert set(recap(out)) >= set(lab.trainers)


def test_healthy_cluster_doctor_prints_ok_tables(lab, tmp_path: Path):
    inventory = write_inventory(lab, tmp_path / "hosts.yml", rendezvous_vars=_rendezvous_vars(tmp_path))
    t0 = time.monotonic()
    rc, out = run_playbooks(lab.env, inventory, [DOCTOR])
    print(f"healthy doctor run: {time.monotonic() - t0:.1f} s")
    assert rc == 0, out[-4000:]
    assert_unchanged(out)
    tables = _tables(out)
    for host in lab.trainers:
        statuses = {check: status for check, (status, _) in tables[host].items()}
        # A node as Ubuntu installs it (and the lab image) names itself 127.0.1.1 in /etc/hosts:
        # doctor warns that a program finding its address by name gets loopback; not a problem.
        if statuses.get("hosts_file") == "WARN":
            assert "127.0.1.1" in tables[host]["hosts_file"][1], tables[host]["hosts_file"]
            del statuses["hosts_file"]
        assert set(statuses.values()) <= {"OK", "SKIP"}, (host, statuses)
    assert "doctor: 0 host(s) with problems" in out


# --------------------------------------------------------------------------- least privilege: ufw


def test_firewall_subnet_and_ufw_state_from_facts():
    fw = firewall_filters
    facts = {
        "interfaces": ["lo", "enp3s0", "wlp2s0"],
        "lo": {"ipv4": {"address": "127.0.0.1", "netmask": "255.0.0.0"}},
        "enp3s0": {
            "ipv4": {"address": "192.168.50.11", "netmask": "255.255.255.0"},
            "ipv4_secondaries": [{"address": "10.0.0.5", "netmask": "255.255.0.0"}],
        },
        "wlp2s0": {},
    }
    assert fw.subnet_of(facts, "192.168.50.11") == "192.168.50.0/24"
    assert fw.subnet_of(facts, "10.0.0.5") == "10.0.0.0/16"
    with pytest.raises(ValueError):
        fw.subnet_of(facts, "192.0.2.1")
    assert fw.ufw_enabled("# comment\nENABLED=yes\nLOGLEVEL=low\n") is True
    assert fw.ufw_enabled("ENABLED=no\n") is False
    assert fw.ufw_enabled("") is False


FIREWALL_PLAY = [
    {
        "name": "Firewall (the provisioning's order: the gloo address first)",
        "hosts": "trainers",
        "gather_facts": False,
        "tasks": [
            {
                "name": "Find the gloo interface",
                "ansible.builtin.include_role": {"name": "wired_network", "tasks_from": "discover"},
            },
            {"name": "Open the ports", "ansible.builtin.include_role": {"name": "firewall"}},
        ],
    }
]


def _can_connect(lab: Lab, src: str, address: str, port: int) -> str:
    """From node ``src``: 'refused' (the packet got through), 'timeout' (dropped) or 'connected'."""
    probe = (
        "import socket\ntry:\n"
        f"    socket.create_connection(({address!r}, {port}), timeout=3).close(); print('connected')\n"
        "except ConnectionRefusedError:\n    print('refused')\nexcept OSError:\n    print('timeout')\n"
    )
    return node_exec(lab, src, "python3", "-c", probe).stdout.strip()


def test_firewall_without_ufw_enabled_changes_nothing(lab, tmp_path: Path):
    """ufw absent or disabled (every lab node): the role says so and changes nothing."""
    play = tmp_path / "firewall.yml"
    play.write_text(yaml.safe_dump(FIREWALL_PLAY, sort_keys=False))
    rc, out = run_playbooks(lab.env, lab.inventory, [str(play)])
    assert rc == 0, out[-3000:]
    assert_unchanged(out)
    for host in lab.trainers:
        installed = node_exec(lab, host, "test", "-e", "/etc/ufw/ufw.conf").returncode == 0
        why = "ufw is installed but not enabled" if installed else "ufw is not installed"
        assert f'"msg": "{host}: {why}: nothing to open"' in out, out[-3000:]


def test_firewall_opens_only_the_cluster_subnet_when_ufw_is_enabled(lab, tmp_path: Path):
    """One node turns ufw on (default deny incoming): the check mode changes nothing, the role
    then allows TCP from the cluster's subnet only (a peer gets through again), a second run
    changes nothing; as the rendezvous host it opens the store's and the lighthouse's ports only;
    a trainer also gets the per_step engine's fixed ports (torchft manager and store) by name."""
    target, peer = lab.trainers[-1], lab.trainers[0]
    if node_exec(lab, target, "test", "-x", "/usr/sbin/ufw").returncode != 0:
        skip_or_fail(f"{target} has no ufw: the node image predates it (rebuild: make image)")
    address = node_exec(lab, target, "sh", "-c", "ip -4 -o route get 192.0.2.1").stdout
    address = re.search(r"\bsrc\s+(\S+)", address).group(1)
    play = tmp_path / "firewall.yml"
    play.write_text(yaml.safe_dump(FIREWALL_PLAY, sort_keys=False))
    port = 5555
    with sigterm_as_interrupt():
        try:
            _sh(
                lab,
                target,
                # SSH stays open, as on a laptop Ansible reaches over SSH.
                "ufw --force reset >/dev/null && ufw default deny incoming >/dev/null"
                " && ufw allow 22/tcp >/dev/null && ufw --force enable",
            )
            assert _can_connect(lab, peer, address, port) == "timeout"
            rc, out = run_playbooks(lab.env, lab.inventory, [str(play)], "--limit", target, "--check")
            assert rc == 0 and recap(out)[target]["changed"] == 2, out[-3000:]
            assert "ddp-lab" not in node_exec(lab, target, "ufw", "status").stdout
            rc, out = run_playbooks(lab.env, lab.inventory, [str(play)], "--limit", target)
            assert rc == 0 and recap(out)[target]["changed"] == 2, out[-3000:]
            status = node_exec(lab, target, "ufw", "status").stdout
            subnet = re.search(r"ALLOW\s+(\d+\.\d+\.\d+\.\d+/\d+)/tcp\s+# ddp-lab trainers", status)
            assert subnet and ipaddress.ip_address(address) in ipaddress.ip_network(subnet.group(1)), status
            assert re.search(r"29520/tcp\s+ALLOW\s+\S+\s+# ddp-lab torchft manager", status), status
            assert re.search(r"29521/tcp\s+ALLOW\s+\S+\s+# ddp-lab torchft store", status), status
            assert _can_connect(lab, peer, address, port) == "refused"
            rc, out = run_playbooks(lab.env, lab.inventory, [str(play)], "--limit", target)
            assert rc == 0 and recap(out)[target]["changed"] == 0, out[-3000:]
            _sh(
                lab,
                target,
                # SSH stays open, as on a laptop Ansible reaches over SSH.
                "ufw --force reset >/dev/null && ufw default deny incoming >/dev/null"
                " && ufw allow 22/tcp >/dev/null && ufw --force enable",
            )
            rc, out = run_playbooks(
                lab.env,
                lab.inventory,
                [str(play)],
                "--limit",
                target,
                "-e",
                json.dumps(
                    {"firewall_open": "rendezvous", "firewall_address": address, "rendezvous_port": 29555}
                ),
            )
            assert rc == 0 and recap(out)[target]["changed"] == 1, out[-3000:]
            status = node_exec(lab, target, "ufw", "status").stdout
            assert re.search(r"29555/tcp\s+ALLOW\s+\S+\s+# ddp-lab rendezvous", status), status
            assert re.search(r"29510/tcp\s+ALLOW\s+\S+\s+# ddp-lab lighthouse", status), status
            assert "# ddp-lab trainers" not in status
            assert _can_connect(lab, peer, address, port) == "timeout"
        finally:
            _sh(lab, target, "ufw --force reset >/dev/null; ufw --force disable", check=False)


# --------------------------------------------------------------------------- least privilege: static


def test_no_blanket_become_and_examples_keep_host_key_checking():
    """No play and no config turns become on for everything (each task that needs root says so);
    SSH host keys are checked; the example inventory holds no secrets."""
    import configparser

    cfg = configparser.ConfigParser()
    cfg.read(REPO / "ansible.cfg")
    assert cfg.getboolean("defaults", "host_key_checking") is True
    assert not cfg.has_section("privilege_escalation") or not cfg.getboolean(
        "privilege_escalation", "become", fallback=False
    )
    for path in sorted([*REPO.glob("*.yml"), *(REPO / "playbooks").glob("*.yml")]):
        for play in yaml.safe_load(path.read_text()) or []:
            assert "become" not in play, f"{path.name}: play {play.get('name')!r} sets become for every task"
    secret = re.compile(r"(ansible_(ssh_)?pass(word)?|ansible_become_pass(word)?|\$ANSIBLE_VAULT)", re.I)
    for path in (REPO / "inventory" / "laptops").rglob("*"):
        if path.is_file():
            for line in path.read_text().splitlines():
                code = line.split("#", 1)[0]
                assert not secret.search(code), f"{path}: {line.strip()}"
