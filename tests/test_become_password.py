"""A laptop whose sudo asks a password, and no -K (issue 27 item 7): ``site.yml --tags provision``
ran a minute of checks and failed on the first become task with Ansible's "Missing sudo password";
``make status`` crashed in roles/ddp_job/tasks/held.yml ("object of type 'dict' has no attribute
'run_dir'"). Now validate/doctor check become up front (a module run with become, no prompt: as
``sudo -n true``) and say in one line to pass -K; status.yml prints the table with that laptop's
reason.

The laptops are local (tests/test_status_table.py's harness); laptop-pw's become runs a stand-in
sudo (``ansible_become_exe``) that answers as sudo -n does for an account that needs a password.
ANSIBLE_BECOME_ALLOW_SAME_USER: the tests run as root and become root; without it Ansible skips
become altogether."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from test_status_table import PLAYBOOK, _case, _play

pytestmark = pytest.mark.skipif(PLAYBOOK is None, reason="ansible-playbook is not installed (make venv)")

FAKE_SUDO = "#!/bin/sh\necho 'sudo: a password is required' >&2\nexit 1\n"


def _password_case(tmp_path: Path) -> tuple[Path, dict]:
    inv, env = _case(tmp_path, {"laptop-run": "running", "laptop-pw": "running"}, unreachable=False)
    sudo = tmp_path / "bin" / "needs-password-sudo"
    sudo.write_text(FAKE_SUDO)
    sudo.chmod(0o755)
    data = json.loads(inv.read_text())
    data["all"]["children"]["trainers"]["hosts"]["laptop-pw"].update(
        {"ansible_become_method": "sudo", "ansible_become_exe": str(sudo)})
    inv.write_text(json.dumps(data))
    return inv, dict(env, ANSIBLE_BECOME_ALLOW_SAME_USER="1")


MISSING = ("sudo asks the connecting account for a password and none was given; fix: pass -K"
           " (--ask-become-pass) to ansible-playbook")


def test_status_prints_the_table_with_the_laptops_reason(tmp_path):
    inv, env = _password_case(tmp_path)
    out = _play(inv, env, "status.yml")
    text = out.stdout + out.stderr
    assert out.returncode != 0, text
    assert "has no attribute 'run_dir'" not in text, text  # the crash in held.yml
    rows = {line.split()[0]: line for line in text.splitlines() if line.startswith(" laptop-")}
    assert rows["laptop-run"].split()[1] == "running", text
    assert rows["laptop-pw"].split()[1] == "error", text
    assert f"laptop-pw: {MISSING}" in text, text
    assert "not every laptop is well: laptop-pw: error" in text, text


def test_doctor_names_the_missing_become_password_in_one_line(tmp_path):
    inv, env = _password_case(tmp_path)
    out = _play(inv, env, "doctor.yml")
    text = out.stdout + out.stderr
    assert out.returncode != 0, text
    # the doctor's table rows: "check | status | detail" (one line each)
    assert re.search(r'"become +\| FAIL +\| laptop-pw: ' + re.escape(MISSING), text), text[-4000:]
    assert re.search(r'"become +\| OK +\| su works without a prompt"', text), text[-4000:]
