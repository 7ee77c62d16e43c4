"""Scenario nodes5's cleanup (molecule/nodes5/cleanup.yml) stops the scenario's own rendezvous store
and never a store or lighthouse of the lab.

A failed nodes5 converge left its store on port 29415 running: molecule then prunes the ephemeral
folder, where the store's pidfile was, and the next run found the port held. A first cleanup
stopped by port with the project's shared state folder (runs/.rdzv) and so stopped the lab's
lighthouse. Here two real supervised stores run on this host: the "lab's" in a project checkout's
runs/.rdzv and the scenario's in its ephemeral folder; the cleanup runs as molecule runs it
(extra vars from molecule/nodes5/extra_vars.yml, MOLECULE_EPHEMERAL_DIRECTORY set).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
import rdzv_harness as h
from ddplab.controller import rdzv_store as rs
from ddplab.controller.supervisor import port_free

ROOT = Path(__file__).resolve().parent.parent
SCENARIO = ROOT / "molecule" / "nodes5"
BIN = Path(sys.executable).parent
PLAYBOOK = shutil.which("ansible-playbook", path=str(BIN)) or shutil.which("ansible-playbook")

pytestmark = pytest.mark.skipif(PLAYBOOK is None, reason="ansible-playbook is not installed (make venv)")


@pytest.fixture
def world(tmp_path: Path):
    """(project checkout, ephemeral folder, lab store's port, scenario store's port, run_cleanup).

    The checkout's train/ is the repository's (the role's stop runs ddplab from there); both
    stores are stopped at the end whatever the test did.
    """
    project = tmp_path / "checkout"
    project.mkdir()
    (project / "train").symlink_to(ROOT / "train")
    ephemeral = tmp_path / "molecule.nodes5"
    ephemeral.mkdir()
    lab_dir, own_dir = project / "runs" / ".rdzv", ephemeral / "rdzv"
    lab_port, own_port = h.free_port(), h.free_port()
    while own_port == lab_port:
        own_port = h.free_port()
    inv = {"rendezvous": {"hosts": {"controller": {
        "ansible_connection": "local", "ansible_python_interpreter": sys.executable}}}}
    (tmp_path / "hosts.yml").write_text(json.dumps(inv))
    env = dict(os.environ, ANSIBLE_CONFIG=str(ROOT / "ansible.cfg"), ANSIBLE_ROLES_PATH=str(ROOT / "roles"),
               ANSIBLE_LOCAL_TEMP=str(tmp_path / "tmp"), ANSIBLE_HOME=str(tmp_path / "home"),
               MOLECULE_EPHEMERAL_DIRECTORY=str(ephemeral), MOLECULE_PROJECT_DIRECTORY=str(ROOT))

    def run_cleanup(*extra: str, scenario_vars: bool = True) -> subprocess.CompletedProcess[str]:
        argv = [PLAYBOOK, "-i", str(tmp_path / "hosts.yml"), str(SCENARIO / "cleanup.yml"),
                "-e", f"rendezvous_project_dir={project}", "-e", f"rendezvous_python={sys.executable}"]
        if scenario_vars:
            argv += ["-e", f"@{SCENARIO / 'extra_vars.yml'}"]
        for e in extra:
            argv += ["-e", e]
        return subprocess.run(argv, capture_output=True, text=True, env=env, timeout=300, cwd=ROOT)

    try:
        yield lab_dir, own_dir, lab_port, own_port, run_cleanup
    finally:
        rs.stop(lab_port, lab_dir)
        rs.stop(own_port, own_dir)


def _answers(port: int, state_dir: Path) -> bool:
    st = rs.status(port, state_dir)
    return st["running"] and st["answering"]


def test_cleanup_stops_the_scenarios_store_and_not_the_labs(world):
    lab_dir, own_dir, lab_port, own_port, run_cleanup = world
    lab = rs.start("127.0.0.1", lab_port, lab_dir, wait_s=60)
    own = rs.start("127.0.0.1", own_port, own_dir, wait_s=60)
    # the lab's store on the port the scenario's lighthouse would have: matched by name and port
    # only inside the scenario's own folder
    out = run_cleanup(f"rendezvous_port={own_port}", f"rendezvous_lighthouse_port={lab_port}")
    text = out.stdout + out.stderr
    assert out.returncode == 0, text
    assert not (own_dir / f"store-{own_port}.json").exists(), text
    assert not psutil.pid_exists(own["supervisor_pid"]) or (
        psutil.Process(own["supervisor_pid"]).status() == psutil.STATUS_ZOMBIE)
    assert port_free(own_port), f"port {own_port} still held after the cleanup"
    assert _answers(lab_port, lab_dir), text
    assert rs.status(lab_port, lab_dir)["supervisor_pid"] == lab["supervisor_pid"]
    # a second cleanup (molecule runs it again before the last destroy): nothing left to stop
    again = run_cleanup(f"rendezvous_port={own_port}", f"rendezvous_lighthouse_port={lab_port}")
    assert again.returncode == 0, again.stdout + again.stderr
    assert "changed=0" in again.stdout
    assert _answers(lab_port, lab_dir)


def test_cleanup_without_the_scenarios_state_folder_refuses_and_stops_nothing(world):
    """Run without extra_vars.yml (as the reverted cleanup ran for scenarios whose settings live in
    converge's vars files): rendezvous_state_dir is then the checkout's runs/.rdzv, where the lab's
    store lives on the port named. The play must stop before any stop, with a one-line cause."""
    lab_dir, _own_dir, lab_port, _own_port, run_cleanup = world
    lab = rs.start("127.0.0.1", lab_port, lab_dir, wait_s=60)
    out = run_cleanup(f"rendezvous_port={lab_port}", scenario_vars=False)
    text = out.stdout + out.stderr
    assert out.returncode != 0, text
    assert "is not inside" in text and "nothing was stopped" in text
    assert "changed: [controller]" not in text
    assert _answers(lab_port, lab_dir), text
    assert rs.status(lab_port, lab_dir)["supervisor_pid"] == lab["supervisor_pid"]
