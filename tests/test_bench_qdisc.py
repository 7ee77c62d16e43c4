"""The bench's check before it shapes a link (roles/bench/tasks/qdisc.yml, issue 27 item 17).

``bench.yml -e bench_shape_rate_mbit=1000`` failed on every lab laptop with "cannot shape eth0
(root qdisc: ); fix: install iproute2": iproute2 was installed, but tc (in /usr/sbin) was not on
the PATH the task ran with. The task now runs tc with ``ddp_lab_system_path`` as its PATH (the
folders where distributions put system tools), and the filter ``bench_qdisc_refusal`` names the
cause and the fix: tc not installed, tc's own error (no such device), a root qdisc someone else set.

The play runs qdisc.yml on local "laptops" (connection local, become by su as this root user) with
the sudo account's PATH over SSH, which has no sbin folder: a become method whose PATH is the
account's finds tc only through ``ddp_lab_system_path``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from ansible_collections.ddp_lab.cluster.plugins.filter.bench import bench_qdisc_refusal

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
PLAYBOOK = shutil.which("ansible-playbook", path=str(BIN)) or shutil.which("ansible-playbook")
ACCOUNT_PATH = "/usr/local/bin:/usr/bin:/bin:/usr/games"  # sshd's PATH for a non-root account (Debian)
SYSTEM_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
HANDLE = "d1ab:"


def refusal(result: dict, ifname: str = "eth0") -> str:
    return bench_qdisc_refusal(result, "laptop-a", ifname, HANDLE, SYSTEM_PATH)


@pytest.mark.parametrize("stdout", [
    "qdisc noqueue 0: root refcnt 2",
    "qdisc fq_codel 0: root refcnt 2 limit 10240p flows 1024 quantum 1514",
    "qdisc tbf d1ab: root refcnt 2 rate 1Gbit burst 131072b lat 50ms",  # the bench's own, left behind
    "",  # no root qdisc shown: nothing to replace
])
def test_a_default_or_own_root_qdisc_may_be_shaped(stdout):
    assert refusal({"rc": 0, "stdout": stdout, "stderr": "", "msg": ""}) == ""


def test_tc_not_found_says_not_installed_where_it_looked_and_the_fix():
    # what the command module registers when argv[0] is on no folder of the PATH (ansible-core 2.19)
    line = refusal({"rc": 2, "stdout": "", "stderr": "", "msg": "Error executing command.", "failed": False})
    assert line == (f"laptop-a: cannot shape eth0: tc is not installed (no tc in {SYSTEM_PATH}); fix: install"
                    " iproute2 on laptop-a (sudo apt-get install iproute2), or run without"
                    " bench_shape_rate_mbit")


def test_tc_not_executable_names_the_error():
    line = refusal({"rc": 13, "stdout": "", "stderr": "", "msg": "Error executing command."})
    assert "tc could not be executed (Permission denied); fix: reinstall iproute2 on laptop-a" in line


def test_tcs_own_error_is_named_with_the_interface_to_check():
    tc_said = {"rc": 1, "stdout": "", "stderr": 'Cannot find device "eth9"', "msg": "non-zero return code"}
    line = refusal(tc_said, "eth9")
    assert line.startswith('laptop-a: cannot shape eth9: `tc qdisc show dev eth9 root` failed (exit 1: Cannot'
                           ' find device "eth9"); fix: check that eth9 is laptop-a\'s wired interface'), line
    assert "install iproute2" not in line


def test_a_foreign_root_qdisc_is_named_with_the_command_that_removes_it():
    htb = "qdisc htb 1: root refcnt 2 r2q 10 default 0"
    line = refusal({"rc": 0, "stdout": htb, "stderr": "", "msg": ""})
    assert line == (f"laptop-a: cannot shape eth0: its root qdisc is {htb}, set by someone else; fix: remove"
                    " it (sudo tc qdisc del dev eth0 root) or run without bench_shape_rate_mbit")


def test_a_command_that_never_ran_names_its_message():
    line = refusal({"failed": True, "msg": "Missing sudo password"})
    assert line.startswith("laptop-a: cannot shape eth0: `tc qdisc show` did not run (Missing sudo password);"
                           " fix: check that the account can sudo on laptop-a"), line


PLAY = """\
- name: The bench's qdisc check alone
  hosts: trainers
  gather_facts: false
  tasks:
    - name: Check the link's queueing discipline
      ansible.builtin.include_role:
        name: bench
        tasks_from: qdisc
"""


@pytest.mark.skipif(PLAYBOOK is None, reason="ansible-playbook is not installed (make venv)")
@pytest.mark.skipif(shutil.which("tc", path=SYSTEM_PATH) is None or shutil.which("tc", path=ACCOUNT_PATH),
                    reason="needs tc installed in an sbin folder only, as Debian and Ubuntu put it")
@pytest.mark.skipif(os.geteuid() != 0, reason="become by su as root needs root")
def test_the_play_finds_tc_in_sbin_without_it_on_the_accounts_path_and_names_each_cause(tmp_path):
    base = {"ansible_connection": "local", "ansible_python_interpreter": sys.executable,
            "ansible_become_method": "su"}
    hosts = {
        "laptop-lo": {**base, "wired_network_ifname": "lo"},
        "laptop-nodev": {**base, "wired_network_ifname": "ddplabnodev0"},
        # a node without tc: no folder of its system path holds one
        "laptop-notc": {**base, "wired_network_ifname": "lo", "ddp_lab_system_path": str(tmp_path / "empty")},
    }
    (tmp_path / "empty").mkdir()
    inv = tmp_path / "hosts.yml"
    inv.write_text(json.dumps({"all": {"children": {"trainers": {"hosts": hosts}}}}))
    play = tmp_path / "qdisc.yml"
    play.write_text(PLAY)
    env = dict(os.environ, ANSIBLE_CONFIG=str(ROOT / "ansible.cfg"), ANSIBLE_NOCOLOR="1",
               ANSIBLE_LOCAL_TEMP=str(tmp_path / "tmp"), ANSIBLE_HOME=str(tmp_path / "home"),
               PATH=ACCOUNT_PATH)
    out = subprocess.run([PLAYBOOK, "-i", str(inv), str(play)], capture_output=True, text=True, env=env,
                         timeout=300, cwd=ROOT)
    text = " ".join((out.stdout + out.stderr).split())
    assert out.returncode != 0, text[-3000:]
    recap = {line.split()[0]: line for line in (out.stdout.splitlines()) if " : ok=" in line}
    # tc found in an sbin folder without it on the account's PATH; lo's root qdisc is a default one
    assert "failed=0" in recap["laptop-lo"], text[-3000:]
    assert "laptop-lo: cannot shape" not in text, text[-3000:]
    assert ('laptop-nodev: cannot shape ddplabnodev0: `tc qdisc show dev ddplabnodev0 root` failed (exit 1:'
            ' Cannot find device "ddplabnodev0"); fix: check that ddplabnodev0 is laptop-nodev\'s wired'
            ' interface') in text, text[-3000:]
    assert (f"laptop-notc: cannot shape lo: tc is not installed (no tc in {tmp_path / 'empty'}); fix: install"
            " iproute2 on laptop-notc") in text, text[-3000:]
