"""The stdout callback ``ddp_lab.cluster.ddp_lab`` (plugins/callback/ddp_lab.py): a refusal (a false
assert, a fail task's own message, a project action plugin's deliberate failure), looped or not, is one
``[ERROR]`` line without ansible-core's ``Origin:`` block; every other failure of the same actions (a
broken conditional or template, an exception inside a project action plugin) keeps its Origin
(file:line) (review, session 8: the callback treated any failed assert/fail/plugin as a refusal and
did not handle looped failures at all)."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from labharness import BINDIR, REPO, ansible_env, errors, local_controller, run_playbooks

PLAYBOOK = shutil.which("ansible-playbook", path=str(BINDIR)) or shutil.which("ansible-playbook")
BANNER = re.compile(r"^TASK \[(.+?)\] \*+$", re.M)

# name -> the task (YAML flow mapping, on one line so its Origin line is known); every task ignores
# its error so that one run shows them all.
REFUSALS = {
    "assert false": "ansible.builtin.assert: {that: [1 > 2], fail_msg: one is not more than two}",
    "fail": "ansible.builtin.fail: {msg: 'give it; fix: -e x=1'}",
    "fail looped": "ansible.builtin.fail: {msg: '{{ item }}'}, loop: [first problem, second problem]",
    "assert looped": "ansible.builtin.assert: {that: [item > 2], fail_msg: '{{ item }} is small'}, loop: [1]",
    # AnsibleActionFail: the plugin's own message in the result
    "plugin refusal": "ddp_lab.cluster.validate_check: {checks: [{check: no_such_check}]}",
    "plugin refusal looped": ("ddp_lab.cluster.validate_check: {checks: [{check: '{{ item }}'}]}, "
                              "loop: [no_such_check]"),
    # a role's own argument check (what a role with meta/argument_specs.yml runs at its start): its
    # errors in one line, without the whole spec it carries
    "argument spec": ("ansible.builtin.validate_argument_spec: {argument_spec: {n: {type: int},"
                      " b: {type: bool}}, provided_arguments: {n: abc, b: maybe}}"),
    # ddp_lab's wait on a background job that outlives its timeout (the job: SETUP's sleep)
    "plugin timeout": ("ddp_lab.cluster.ddp_lab_await: {jid: '{{ bg.ansible_job_id }}', what: a sleep, "
                       "interval_s: 0.2, timeout_s: 0.5}"),
}
# tasks the cases need first (not asserted on)
SETUP = ("    - {name: setup sleep, ansible.builtin.command: sleep 5, async: 30, poll: 0, register: bg, "
         "changed_when: false}\n")
BROKEN = {
    "assert broken conditional": "ansible.builtin.assert: {that: [no_such_var.attr > 1], fail_msg: x}",
    "fail broken template": "ansible.builtin.fail: {msg: '{{ no_such_var.attr }}'}",
    "fail broken when": "ansible.builtin.fail: {msg: m}, when: no_such_var.attr > 1",
    "assert looped broken": "ansible.builtin.assert: {that: [item.nope > 2], fail_msg: x}, loop: [1]",
    # an exception inside the plugin (a check entry that is not a mapping): a bug, not a refusal
    "plugin crash": "ddp_lab.cluster.validate_check: {checks: [not_a_mapping]}",
    "plugin crash looped": "ddp_lab.cluster.validate_check: {checks: ['{{ item }}']}, loop: [not_a_mapping]",
}
HEAD = "- hosts: localhost\n  gather_facts: false\n  tasks:\n"


@pytest.fixture(scope="module")
def shown(tmp_path_factory) -> tuple[Path, dict[str, int], dict[str, str]]:
    """One ansible-playbook run (the project's ansible.cfg, its collection ddp_lab.cluster) of
    every case: the playbook, each task's line in it and each task's output (banner to banner)."""
    if PLAYBOOK is None:
        pytest.skip("ansible-playbook is not installed (make venv)")
    play = tmp_path_factory.mktemp("callback") / "cases.yml"
    lines, at = [HEAD, SETUP], {}
    for name, task in {**REFUSALS, **BROKEN}.items():
        at[name] = len("".join(lines).splitlines()) + 1
        lines.append(f"    - {{name: {name}, ignore_errors: true, {task}}}\n")
    play.write_text("".join(lines))
    env = ansible_env()
    out = subprocess.run([PLAYBOOK, "-i", "localhost,", "-c", "local", "-e",
                          f"ansible_python_interpreter={sys.executable}", str(play)], env=env, cwd=REPO,
                         capture_output=True, text=True, timeout=300, check=False)
    text = out.stdout + out.stderr
    assert out.returncode == 0, text  # every failure ignored
    parts = BANNER.split(text)
    tasks = dict(zip(parts[1::2], parts[2::2], strict=True))
    assert set(tasks) >= set(REFUSALS) | set(BROKEN), text
    return play, at, tasks


@pytest.mark.parametrize("name", list(REFUSALS))
def test_a_refusal_is_one_error_line_without_the_origin_block(shown, name):
    _, _, tasks = shown
    text = tasks[name]
    errors = [i for i, line in enumerate(text.splitlines()) if line.startswith("[ERROR]: ")]
    assert errors, text
    lines = text.splitlines()
    for i in errors:
        assert lines[i].startswith("[ERROR]: Task failed: Action failed: "), text
        assert "Task failed" not in lines[i][len("[ERROR]: Task failed: Action failed: "):], text
        assert lines[i + 1].startswith(("fatal: [localhost]: FAILED!", "failed: [localhost] (item=")), text
    assert "Origin:" not in text and "assertion" not in text and "evaluated_to" not in text, text
    assert "argument_spec_data" not in text, text
    if "looped" in name:
        assert len(errors) == len(re.findall(r"^failed: \[localhost\] \(item=", text, re.M)), text


@pytest.mark.parametrize("name", list(BROKEN))
def test_a_broken_task_keeps_its_origin_file_and_line(shown, name):
    play, at, tasks = shown
    text = tasks[name]
    assert f"Origin: {play}:{at[name]}:" in text, text
    assert "Action failed" not in text, text


def test_a_looped_refusal_of_the_project_is_one_line(tmp_path: Path):
    """doctor.yml's early check (roles/validate/tasks/given.yml: a fail task looping over the
    problems) printed the Origin block under each problem's line."""
    if PLAYBOOK is None:
        pytest.skip("ansible-playbook is not installed (make venv)")
    trainers = {"t-a": {"ansible_host": "192.0.2.11", "ansible_connection": "ssh"}}
    inventory = tmp_path / "hosts.yml"
    inventory.write_text(yaml.safe_dump({"all": {"children": {
        "trainers": {"hosts": trainers}, "rendezvous": {"hosts": local_controller(tmp_path)}}}}))
    rc, out = run_playbooks(ansible_env(), str(inventory), [str(REPO / "doctor.yml")],
                            "-e", "ddp_job_fault_tolerance=bogus", timeout=300)
    assert rc != 0, out[-3000:]
    (line,) = errors(out)
    assert line.startswith("-e ddp_job_fault_tolerance='bogus': value of"), line
    assert "Origin:" not in out, out[-3000:]

