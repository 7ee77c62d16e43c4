"""roles/rendezvous starts what the recovery engine needs on the controller: the c10d store for
torchelastic, the torchft lighthouse (and no store) for per_step. The role runs on a local
controller whose interpreter is a stand-in that logs each start and answers like the services'
``start`` commands."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
PLAYBOOK = shutil.which("ansible-playbook", path=str(BIN)) or shutil.which("ansible-playbook")

FAKE_PYTHON = """#!/bin/sh
# python -m ddplab.controller.<module> start ...: logged, then a started service's answer
echo "$2" >> "$START_LOG"
echo '{"changed": true, "running": true, "answering": true}'
"""

PLAY = """
- name: Start the rendezvous role
  hosts: controller
  gather_facts: false
  roles:
    - role: rendezvous
"""


@pytest.mark.skipif(PLAYBOOK is None, reason="ansible-playbook is not installed (make venv)")
@pytest.mark.parametrize("engine, started", [
    ("torchelastic", ["ddplab.controller.rdzv_store"]),
    ("per_step", ["ddplab.controller.lighthouse"]),
])
def test_the_role_starts_only_what_the_engine_needs(tmp_path, engine, started):
    python = tmp_path / "python"
    python.write_text(FAKE_PYTHON)
    python.chmod(0o755)
    (tmp_path / "play.yml").write_text(PLAY)
    controller = {"ansible_connection": "local", "ansible_python_interpreter": sys.executable,
                  "rendezvous_address": "10.89.0.1"}
    inv = {"all": {"hosts": {"controller": controller}}}
    (tmp_path / "hosts.yml").write_text(json.dumps(inv))
    log = tmp_path / "starts.log"
    env = dict(os.environ, ANSIBLE_CONFIG=str(ROOT / "ansible.cfg"), ANSIBLE_ROLES_PATH=str(ROOT / "roles"),
               ANSIBLE_LOCAL_TEMP=str(tmp_path / "tmp"), ANSIBLE_HOME=str(tmp_path / "home"),
               START_LOG=str(log))
    out = subprocess.run(
        [PLAYBOOK, "-i", str(tmp_path / "hosts.yml"), str(tmp_path / "play.yml"),
         "-e", f"rendezvous_python={python}", "-e", f"rendezvous_state_dir={tmp_path / 'rdzv'}",
         "-e", f"ddp_job_fault_tolerance={engine}"],
        capture_output=True, text=True, env=env, timeout=300, cwd=ROOT)
    text = out.stdout + out.stderr
    assert out.returncode == 0, text
    assert log.read_text().split() == started, text
