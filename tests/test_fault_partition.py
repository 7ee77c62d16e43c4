"""The partition fault's cut (roles/fault/tasks/inject-partition.yml): one commit, timed from when it
is in place.

Before, the heal timer was scheduled before the cut and the rules went in as separate iptables
module calls (the two jumps that made the cut among them, 2-5 s each under load), so the cut was
3-10 s shorter than ``duration`` and the recorded injection time came 2-5 s before traffic
stopped (detected_s and recovered_s inflated by as much). Now the whole rule set (filter
``fault_partition_rules``) goes in with one ``iptables-restore --noflush``, the node's clock is
read after it, and the heal timer is scheduled after that, all in one command.

The task file runs on local "laptops" with stand-ins for iptables-restore, iptables and
systemd-run (they record what they were given and when; this machine's firewall is not touched).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from ansible_collections.ddp_lab.cluster.plugins.filter.fault import partition_rules

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
PLAYBOOK = shutil.which("ansible-playbook", path=str(BIN)) or shutil.which("ansible-playbook")
SYSTEM_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
CHAIN = "DDP_LAB_FAULT"
RENDEZVOUS = "192.0.2.10"  # TEST-NET-1: routed like any off-node address, never reached


def test_the_rule_set_drops_every_peer_and_the_services_then_jumps_to_the_chain_in_one_commit():
    text = partition_rules(["10.89.0.12", "10.89.0.13"], CHAIN, "all", "10.89.0.1", [29400, 29510])
    assert text.splitlines() == [
        "*filter",
        f":{CHAIN} - [0:0]",  # made, or emptied when an interrupted partition left it
        f"-A {CHAIN} -s 10.89.0.12 -j DROP", f"-A {CHAIN} -d 10.89.0.12 -j DROP",
        f"-A {CHAIN} -s 10.89.0.13 -j DROP", f"-A {CHAIN} -d 10.89.0.13 -j DROP",
        f"-A {CHAIN} -p tcp -m tcp -s 10.89.0.1 --sport 29400 -j DROP",
        f"-A {CHAIN} -p tcp -m tcp -d 10.89.0.1 --dport 29400 -j DROP",
        f"-A {CHAIN} -p tcp -m tcp -s 10.89.0.1 --sport 29510 -j DROP",
        f"-A {CHAIN} -p tcp -m tcp -d 10.89.0.1 --dport 29510 -j DROP",
        f"-I INPUT 1 -j {CHAIN}", f"-I OUTPUT 1 -j {CHAIN}",  # the jumps last: the chain is full first
        "COMMIT",
    ]


def test_scope_trainers_leaves_the_services_reachable():
    text = partition_rules(["10.89.0.12"], CHAIN, "trainers", "10.89.0.1", [29400, 29510])
    assert "--dport" not in text and "--sport" not in text and f"-A {CHAIN} -d 10.89.0.12 -j DROP" in text


@pytest.mark.parametrize("peers, scope, address", [([], "trainers", "10.89.0.1"), ([], "all", ""),
                                                   (["10.89.0.12 -j ACCEPT"], "all", "10.89.0.1")])
def test_an_empty_cut_or_a_value_that_would_break_the_rule_set_is_refused(peers, scope, address):
    with pytest.raises(ValueError, match="partition rules: "):
        partition_rules(peers, CHAIN, scope, address, [29400])


@pytest.mark.skipif(shutil.which("iptables-restore", path=SYSTEM_PATH) is None or os.geteuid() != 0,
                    reason="needs iptables-restore and root (it parses with --test, commits nothing)")
def test_iptables_restore_parses_the_rule_set_without_committing_it():
    text = partition_rules(["10.89.0.12", "10.89.0.13"], CHAIN, "all", "10.89.0.1", [29400, 29510])
    out = subprocess.run([shutil.which("iptables-restore", path=SYSTEM_PATH), "--test", "--noflush"],
                         input=text, capture_output=True, text=True, timeout=60)
    if "Permission denied" in out.stderr or "can't initialize" in out.stderr:
        pytest.skip(f"iptables-restore --test is not permitted here: {out.stderr.strip()}")
    assert out.returncode == 0, out.stderr


FAKES = {
    # the cut: takes a while under load; records its input and when it had finished
    "iptables-restore": 'cat > "{log}/rules"; echo "$@" > "{log}/restore_args"; sleep 1; '
                        'date +%s.%N > "{log}/restored_at"',
    # the iptables module's calls: a check (-C, -L: a jump or chain left over?) answers "none"
    "iptables": 'echo "$@" >> "{log}/iptables_calls"; case " $* " in *" --version "*) '
                'echo "iptables v1.8.9 (nf_tables)";; *" -C "*|*" -L "*) exit 1;; esac; exit 0',
    "systemd-run": 'date +%s.%N > "{log}/timer_at"; echo "$@" > "{log}/timer_args"; '
                   'echo "Running timer as unit: $3.timer"',
}

PLAY = """\
- name: The partition's injection alone
  hosts: trainers
  gather_facts: false
  tasks:
    - name: Settle what check.yml and resolve.yml settle before an injection
      ansible.builtin.set_fact:
        __fault_target: laptop-x
        __fault_duration: 90
        __fault_heal_unit: ddp-lab-fault-heal-test
      run_once: true
    - name: Inject the partition
      ansible.builtin.include_role:
        name: fault
        tasks_from: inject-partition
    - name: Show the injection time
      ansible.builtin.debug:
        msg: "injected at {{ __fault_injected_at }}"
      run_once: true
"""


def _source_address() -> str | None:
    """This machine's source address towards RENDEZVOUS (what wired_network discover publishes)."""
    ip = shutil.which("ip", path=SYSTEM_PATH)
    if ip is None:
        return None
    out = subprocess.run([ip, "-4", "-o", "route", "get", RENDEZVOUS], capture_output=True, text=True)
    found = re.search(r"\bsrc\s+(\S+)", out.stdout) if out.returncode == 0 else None
    return found.group(1) if found else None


@pytest.mark.skipif(PLAYBOOK is None, reason="ansible-playbook is not installed (make venv)")
@pytest.mark.skipif(os.geteuid() != 0, reason="become by su as root needs root")
@pytest.mark.skipif(_source_address() is None, reason=f"no route to {RENDEZVOUS} (wired_network discover)")
def test_the_cut_is_one_commit_timed_from_when_it_is_in_place(tmp_path):
    log, fakebin = tmp_path / "log", tmp_path / "bin"
    log.mkdir()
    fakebin.mkdir()
    for name, body in FAKES.items():
        (fakebin / name).write_text("#!/bin/sh\n" + body.replace("{log}", str(log)) + "\n")
        (fakebin / name).chmod(0o755)
    base = {"ansible_connection": "local", "ansible_python_interpreter": sys.executable,
            "ansible_become_method": "su", "ddp_lab_system_path": f"{fakebin}:{SYSTEM_PATH}"}
    inv = {"all": {"children": {
        "trainers": {"hosts": {"laptop-x": base, "laptop-y": base}},
        "rendezvous": {"hosts": {"controller": {**base, "rendezvous_address": RENDEZVOUS}}},
    }}}
    (tmp_path / "hosts.yml").write_text(json.dumps(inv))
    (tmp_path / "play.yml").write_text(PLAY)
    # the stand-ins first on every PATH a task may use: nothing real is cut or scheduled here
    env = dict(os.environ, ANSIBLE_CONFIG=str(ROOT / "ansible.cfg"), ANSIBLE_NOCOLOR="1",
               ANSIBLE_LOCAL_TEMP=str(tmp_path / "tmp"), ANSIBLE_HOME=str(tmp_path / "home"),
               PATH=f"{fakebin}:{BIN}:{os.environ.get('PATH', SYSTEM_PATH)}")
    out = subprocess.run([PLAYBOOK, "-i", str(tmp_path / "hosts.yml"), str(tmp_path / "play.yml")],
                         capture_output=True, text=True, env=env, timeout=300, cwd=ROOT)
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-4000:]
    injected_at = float(re.search(r'"msg": "injected at ([0-9.]+)"', text).group(1))
    timer_at = float((log / "timer_at").read_text())
    # the heal's timer starts after the recorded time, which is when the cut was in place
    assert injected_at <= timer_at, (injected_at, timer_at)
    calls = (log / "iptables_calls").read_text().splitlines()
    assert all(" -C " in f" {c} " or "--version" in c for c in calls), calls  # no rule went in one by one
    assert injected_at >= float((log / "restored_at").read_text())
    args = (log / "timer_args").read_text().split()
    assert args[:3] == ["--on-active=90.0", "--timer-property=AccuracySec=100ms",
                        "--unit=ddp-lab-fault-heal-test"] and args[3:] == ["iptables", "-F", CHAIN], args
    # one commit of the whole rule set: the other trainer's address (laptop-y's, from the same route)
    # and the rendezvous services (scope all, the default)
    assert (log / "restore_args").read_text().split() == ["--noflush"]
    assert (log / "rules").read_text().rstrip("\n") == partition_rules(
        [_source_address()], CHAIN, "all", RENDEZVOUS, [29400, 29510]).rstrip("\n")
