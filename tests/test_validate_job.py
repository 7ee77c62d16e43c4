"""The checks ddp_job's preflight runs right before a launch: the role's own settings
(roles/ddp_job/tasks/settings.yml: nproc_per_node, max_restarts, the recovery engine by the role's
rules) and the validate role's job checks (roles/validate/tasks/job.yml: the venvs' pinned packages,
the store's reach), run here on the controller alone (the trainer is this machine, the store a
listening socket)."""

from __future__ import annotations

import json
import socket
import sys
from pathlib import Path

import pytest
import yaml
from labharness import ansible_env, errors, run_playbooks

GOOD = {"ddp_job_nproc_per_node": 1, "ddp_job_max_restarts": 3, "ddp_job_fault_tolerance": "torchelastic",
        "ddp_job_worker_argv": [], "ddp_job_nnodes_min": 1, "ddp_job_nnodes_max": 1,
        "ddp_job_rdzv_conf": {"join_timeout": 60}, "ddp_job_venv": "/opt/ddp-lab/venv",
        "ddp_job_grad_compression": "none"}


PINNED = {"torch": "2.13.0+cpu", "numpy": "2.4.6", "psutil": "7.2.2", "torchft": "0.2.0"}


def _run(tmp_path: Path, packages: dict | None = None, trainers: int = 1, **changes) -> tuple[int, str]:
    """Run tasks_from job for ``trainers`` trainers (this machine) whose venv reads Python 3.11.2 and
    python_env's pins (the first one's ``packages`` changed by ``packages``), with GOOD settings
    updated by ``changes``, against a store that listens."""
    packages = packages or {}
    nnodes = {"ddp_job_nnodes_max": trainers}
    with socket.socket() as store:
        store.bind(("127.0.0.1", 0))
        store.listen()
        port = store.getsockname()[1]
        local = {"ansible_connection": "local", "ansible_python_interpreter": sys.executable}
        inventory = tmp_path / "hosts.yml"
        inventory.write_text(yaml.safe_dump({"all": {"children": {
            "trainers": {"hosts": {f"t-{c}": {**local, "odd": packages if c == "a" else {}}
                                   for c in "abc"[:trainers]}},
            "rendezvous": {"hosts": {"controller": {**local, "rendezvous_address": "127.0.0.1",
                                                    "rendezvous_port": port}}}}}}))
        play = tmp_path / "job.yml"
        play.write_text(yaml.safe_dump([{
            "name": "The preflight's job checks", "hosts": "trainers", "gather_facts": False,
            "roles": [{"role": "ddp_lab"}],
            "tasks": [
                {"name": "Note what the venv holds",
                 "ansible.builtin.set_fact": {"versions": {
                     "python": "3.11.2", "packages": "{{ pinned | combine(odd) }}"}},
                 "vars": {"pinned": PINNED}},
                {"name": "Check the job's settings",
                 "ansible.builtin.include_role": {"name": "ddp_job", "tasks_from": "settings"}},
                {"name": "Check the job", "vars": {"validate_job_versions_var": "versions"},
                 "ansible.builtin.include_role": {"name": "validate", "tasks_from": "job"}}]}]))
        settings = json.dumps({**GOOD, **nnodes, **changes})
        return run_playbooks(ansible_env(), str(inventory), [str(play)], "-e", settings, timeout=300)


def test_good_job_settings_pass(tmp_path: Path):
    rc, out = _run(tmp_path)
    assert rc == 0, out[-3000:]


@pytest.mark.parametrize(("changes", "line"), [
    ({"ddp_job_nproc_per_node": 0}, "t-a: ddp_job_nproc_per_node = 0 must be >= 1; fix: correct it in the"
                                     " inventory, group_vars or -e"),
    ({"ddp_job_max_restarts": -1}, "t-a: ddp_job_max_restarts = -1 must be >= 0; fix:"),
    ({"ddp_job_fault_tolerance": "per_step", "ddp_job_nproc_per_node": 2, "ddp_job_nnodes_max": 1},
     "t-a: ddp_job_fault_tolerance=per_step (worker argv [], nproc_per_node 2); fix: torchelastic, or"
     " per_step or diloco with one ddplab.train worker per laptop"),
    ({"ddp_job_fault_tolerance": "per_step", "ddp_job_worker_argv": ["-m", "mine"]},
     "t-a: ddp_job_fault_tolerance=per_step (worker argv ['-m', 'mine'], nproc_per_node 1); fix:"),
])
def test_bad_job_settings_are_refused_by_validate(tmp_path: Path, changes: dict, line: str):
    rc, out = _run(tmp_path, **changes)
    assert rc != 0
    found = errors(out)
    assert any(e.startswith(line) for e in found), found or out[-3000:]


def test_an_unknown_engine_is_refused_by_the_argument_spec(tmp_path: Path):
    """ddp_job_fault_tolerance's choices live in roles/ddp_lab/meta/argument_specs.yml."""
    rc, out = _run(tmp_path, ddp_job_fault_tolerance="torchft")
    assert rc != 0 and "ddp_job_fault_tolerance must be one of: torchelastic, per_step" in out, out[-3000:]


@pytest.mark.parametrize(("packages", "trainers", "line"), [
    # issue 27 item 9: one laptop's numpy is not the pin (validate compared Python and torch only)
    ({"numpy": "2.3.0"}, 3, "t-a: numpy 2.3.0 here, 2.4.6 on t-b, t-c (/opt/ddp-lab/venv): mismatched"),
    ({"numpy": "2.3.0"}, 1, "t-a: numpy 2.3.0 (pinned 2.4.6) in /opt/ddp-lab/venv; fix: provision"),
    ({"torchft": None}, 1, "t-a: torchft not installed (pinned 0.2.0) in /opt/ddp-lab/venv"),
    ({"psutil": "7.0.0", "torchft": "0.1.0"}, 1,
     "t-a: psutil 7.0.0 (pinned 7.2.2), torchft 0.1.0 (pinned 0.2.0)"),
])
def test_every_pinned_package_is_compared_before_a_launch(tmp_path: Path, packages, trainers, line):
    rc, out = _run(tmp_path, packages=packages, trainers=trainers)
    assert rc != 0, out[-3000:]
    found = errors(out)
    assert any(e.startswith(line) for e in found), found or out[-3000:]
    assert all("fix:" in e for e in found), found
