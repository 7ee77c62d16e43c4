"""roles/fault rejoin: the killed agent's unit is done stopping in seconds, not at TimeoutStopSec.

After a kill-agent on a cgroup-v1 container (the lab, molecule) the unit can stay "deactivating"
with no process left: systemd entered stop-sigterm while the SIGKILLed workers were still being torn
down and is never told that the cgroup became empty. It ends the stop only at TimeoutStopSec
(ddp_job_stop_timeout_s, 90 s; a lab rejoin play spent 65 s of 98 s there) or when a daemon reload
makes it look at the cgroup again. Reproduced on the lab image (systemd 252): 3 of 3 kills of an
agent whose workers hold 1.5 GB stayed deactivating until the timeout; a daemon-reload ended it at
once.

Here ``systemctl`` and ``pgrep`` are stand-ins on PATH that behave like that systemd: the unit
stays deactivating for ``STUCK_S`` unless ``daemon-reload`` runs once no process is left; the
agent's processes are gone ``PROCS_S`` after the kill. roles/fault's rejoin-unit-stopped.yml runs
on localhost. The role reads the unit with ``ansible.builtin.systemd_service`` (``systemctl show
UNIT``, its ``status`` return); the stand-in answers nothing else, so a task that ran its own
``systemctl show --property=...`` fails here.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
PLAYBOOK = shutil.which("ansible-playbook", path=str(BIN)) or shutil.which("ansible-playbook")

STUCK_S = 60.0  # the unit's stop timeout as the stand-in systemd applies it

FAKE_SYSTEMCTL = """#!{python}
import json, sys, time
path = {state!r}
st = json.load(open(path))
now = time.time()
procs_left = now < st["killed_at"] + st["procs_s"]
args = sys.argv[1:]
if args[:1] == ["daemon-reload"]:
    st["reloads"].append(now)
    if not procs_left and st["state"] == "deactivating":
        st["state"] = "failed"
    json.dump(st, open(path, "w"))
    sys.exit(0)
if args[:1] == ["show"] and len(args) == 2:  # ansible.builtin.systemd_service: every property
    if st["state"] == "deactivating" and now >= st["killed_at"] + st["stuck_s"]:
        st["state"] = "failed"  # TimeoutStopSec: systemd kills what is left (nothing) and gives up
        json.dump(st, open(path, "w"))
    st["shows"] = st.get("shows", 0) + 1
    json.dump(st, open(path, "w"))
    for line in (f"Id={{args[1]}}.service", "LoadState=loaded", "ActiveState=" + st["state"]):
        print(line)
    sys.exit(0)
print("unexpected systemctl call: " + " ".join(args), file=sys.stderr)
sys.exit(1)
"""

FAKE_PGREP = """#!{python}
import json, sys, time
st = json.load(open({state!r}))
if time.time() < st["killed_at"] + st["procs_s"]:
    print(4242)
    sys.exit(0)
sys.exit(1)
"""

PLAY = """
- name: Wait for the previous agent unit as the rejoin does
  hosts: node
  gather_facts: false
  tasks:
    - name: The rejoin's wait
      ansible.builtin.include_role:
        name: fault
        tasks_from: rejoin-unit-stopped
"""


def _run(tmp_path: Path, *, state: str, procs_s: float
         ) -> tuple[subprocess.CompletedProcess[str], dict, float]:
    bindir = tmp_path / "bin"
    bindir.mkdir()
    state_file = tmp_path / "unit.json"
    state_file.write_text(json.dumps({"state": state, "killed_at": time.time(), "procs_s": procs_s,
                                      "stuck_s": STUCK_S, "reloads": []}))
    for name, text in (("systemctl", FAKE_SYSTEMCTL), ("pgrep", FAKE_PGREP)):
        (bindir / name).write_text(text.format(python=sys.executable, state=str(state_file)))
        (bindir / name).chmod(0o755)
    (tmp_path / "play.yml").write_text(PLAY)
    inv = {"all": {"hosts": {"node": {
        "ansible_connection": "local", "ansible_python_interpreter": sys.executable,
        "ansible_become_method": "su", "ddp_lab_user": "ddp", "ddp_job_stop_timeout_s": 90}}}}
    (tmp_path / "hosts.yml").write_text(json.dumps(inv))
    env = dict(os.environ, ANSIBLE_CONFIG=str(ROOT / "ansible.cfg"), ANSIBLE_ROLES_PATH=str(ROOT / "roles"),
               ANSIBLE_LOCAL_TEMP=str(tmp_path / "tmp"), ANSIBLE_HOME=str(tmp_path / "home"),
               PATH=f"{bindir}{os.pathsep}{os.environ.get('PATH', '')}")
    start = time.monotonic()
    out = subprocess.run([PLAYBOOK, "-i", str(tmp_path / "hosts.yml"), str(tmp_path / "play.yml")],
                         capture_output=True, text=True, env=env, timeout=300, cwd=ROOT)
    return out, json.loads(state_file.read_text()), time.monotonic() - start


@pytest.mark.skipif(PLAYBOOK is None, reason="ansible-playbook is not installed (make venv)")
def test_a_unit_stuck_deactivating_with_no_process_left_is_done_in_seconds(tmp_path):
    out, st, took = _run(tmp_path, state="deactivating", procs_s=2.0)
    text = out.stdout + out.stderr
    assert out.returncode == 0, text
    assert st["state"] == "failed", text
    # the reload came only once the agent's processes were gone, and the wait ended long before
    # the stop timeout (before: the play waited the whole STUCK_S)
    assert len(st["reloads"]) == 1 and st["reloads"][0] >= st["killed_at"] + 2.0, st
    assert took < STUCK_S / 2, f"the rejoin waited {took:.0f} s for the old unit\n{text}"
    assert st["shows"] >= 3, st  # before, after the processes went, and the wait: all by the module


@pytest.mark.skipif(PLAYBOOK is None, reason="ansible-playbook is not installed (make venv)")
def test_a_stopped_unit_is_not_reloaded(tmp_path):
    out, st, _took = _run(tmp_path, state="failed", procs_s=0.0)
    text = out.stdout + out.stderr
    assert out.returncode == 0, text
    assert st["reloads"] == [], text
    assert "changed=0" in text, text
