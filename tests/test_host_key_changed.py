"""Issue 27 item 8: a laptop whose SSH host key changed (reinstalled) made ``make status``'s reason
OpenSSH's "@@@@@..." banner cut to the cell, with neither "host key changed", the known_hosts file
nor the fix anywhere. Now one line names the laptop, the key it offers, the known_hosts line and the
fix: for a lab node ``make lab-up`` (it reads the nodes' keys again), for a laptop the ``ssh-keygen
-R`` line OpenSSH gives. Ansible's ssh connection runs a stand-in ``ssh`` here that prints what
OpenSSH prints and exits 255, as ssh does when strict checking refuses the key."""

from __future__ import annotations

import json
import re

import pytest
from ansible_collections.ddp_lab.cluster.plugins.action import validate_check as vc
from ansible_collections.ddp_lab.cluster.plugins.module_utils.ssh import LAB_FIX, host_key_changed
from test_status_table import PLAYBOOK, _case, _play

# What OpenSSH 9.2 (ssh(1): sshconnect.c) prints when the key differs from known_hosts (OpenSSH 8
# quotes the ssh-keygen arguments with double quotes).
BANNER = """@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@
@    WARNING: REMOTE HOST IDENTIFICATION HAS CHANGED!     @
@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@
IT IS POSSIBLE THAT SOMEONE IS DOING SOMETHING NASTY!
Someone could be eavesdropping on you right now (man-in-the-middle attack)!
It is also possible that a host key has just been changed.
The fingerprint for the ED25519 key sent by the remote host is
SHA256:4nGhY8hRS7F1JUW7NF0/98yG1Sz/0726EWncvn6/PzQ.
Please contact your system administrator.
Add correct host key in /home/me/.ssh/known_hosts to get rid of this message.
Offending ED25519 key in /home/me/.ssh/known_hosts:3
  remove with:
  ssh-keygen -f '/home/me/.ssh/known_hosts' -R '192.0.2.7'
Host key for 192.0.2.7 has changed and you have requested strict checking.
Host key verification failed.
"""
KEY = "ED25519 key SHA256:4nGhY8hRS7F1JUW7NF0/98yG1Sz/0726EWncvn6/PzQ"
LAPTOP = (f"SSH host key changed (the node now offers {KEY}; known_hosts: /home/me/.ssh/known_hosts line 3); "
          "fix: if the laptop was reinstalled, ssh-keygen -f '/home/me/.ssh/known_hosts' -R '192.0.2.7', "
          "then accept its new key at the next login; if not, do not connect (someone may be in between)")


def test_the_banner_becomes_one_line_with_the_key_the_file_and_the_fix():
    assert host_key_changed(BANNER) == LAPTOP
    double = BANNER.replace("'/home/me/.ssh/known_hosts' -R '192.0.2.7'",
                            '"/home/me/.ssh/known_hosts" -R "192.0.2.7"')
    assert 'ssh-keygen -f "/home/me/.ssh/known_hosts" -R "192.0.2.7"' in host_key_changed(double)
    assert host_key_changed(BANNER, lab=True).endswith(f"; fix: {LAB_FIX}")
    assert host_key_changed("ssh: connect to host 192.0.2.7 port 22: No route to host") == ""


def test_validate_names_the_changed_key_not_the_banner():
    rec = vc.reachable("laptop-k", None, f"Failed to connect to the host via ssh: {BANNER}")
    assert rec["status"] == "fail" and rec["detail"] == f"laptop-k: {LAPTOP}"


# Ansible's ssh connection calls `ssh`: this one refuses as OpenSSH does on a changed key.
FAKE_SSH = "#!/bin/sh\ncat >&2 <<'EOF'\n" + BANNER + "EOF\nexit 255\n"


@pytest.mark.skipif(PLAYBOOK is None, reason="ansible-playbook is not installed (make venv)")
@pytest.mark.parametrize("lab", [False, True])
def test_status_names_the_laptop_the_changed_key_and_the_fix_in_one_line(tmp_path, lab):
    inv, env = _case(tmp_path, {"laptop-run": "running"}, unreachable=False)
    (tmp_path / "bin" / "ssh").write_text(FAKE_SSH)
    (tmp_path / "bin" / "ssh").chmod(0o755)
    data = json.loads(inv.read_text())
    node = {"ansible_host": "192.0.2.7", "ansible_connection": "ssh"}
    hosts = data["all"]["children"]["trainers"]["hosts"]
    hosts["laptop-k"] = {**node, "lab_container": "laptop-k"} if lab else node
    inv.write_text(json.dumps(data))
    out = _play(inv, env, "status.yml")
    text = out.stdout + out.stderr
    assert out.returncode != 0, text
    want = f"laptop-k: {host_key_changed(BANNER, lab)}"
    assert want in text.splitlines(), text
    assert "@@@" not in text and "not every laptop is well: laptop-k: unreachable" in text, text
    row = next(line for line in text.splitlines() if line.startswith(" laptop-k"))
    assert re.search(r"laptop-k\s+unreachable", row), row
