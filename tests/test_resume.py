"""A resume (``-e ddp_job_resume_run_id=R``) trains with the run's own settings, refuses given ones
that cannot change, and is judged before the store or lighthouse starts (issues #13/#14 newcomer
findings): roles/validate/tasks/resume.yml, filter validate_resume_plan, ddplab.config.resume_plan.

Three layers: the merge itself (ddplab.config, no Ansible), the filter, and real playbooks against
two local "trainers" (ansible_connection local, each its own ddp_lab_base_dir holding a staged run:
checkpoints and the run.json its launch wrote) and the controller as rendezvous host on this
machine's non-loopback address. The playbooks never reach a launch: validate.yml and a play that
renders the run.json a launch would write (roles/ddp_job/vars/main.yml), or site.yml refused.
"""

from __future__ import annotations

import json
import os
import re
import socket
import sys
from pathlib import Path

import psutil
import pytest
import yaml
from ansible_collections.ddp_lab.cluster.plugins.filter import validate as validate_filters
from ddplab import config
from labharness import (
    REPO,
    ansible_env,
    errors,
    free_port,
    local_controller,
    recap,
    run_playbooks,
)

RUN = "20261201-070000-abcd"
LIGHTHOUSE = "http://192.0.2.10:29510"
# What ddp_job wrote at the run's launch (a per_step run of 2000 steps, tiny preset, own overrides).
RECORDED = {
    "run_id": RUN,
    "out_dir": f"/var/lib/ddp-lab/runs/{RUN}",
    "data_path": "/var/lib/ddp-lab/data/x.txt",
    "data_url": None,
    "data_sha256": config.CANONICAL_DATA_SHA256,
    "preset": "tiny",
    "max_steps": 2000,
    "allow_fresh_start": False,
    "fault_tolerance": "per_step",
    "ft_lighthouse": LIGHTHOUSE,
    "ft_replica_id": "t-a",
    "eval_interval": 50,
    "batch_policy": "keep_global",
    "base_lr": 0.003,
}


def _filters():
    return validate_filters


# --------------------------------------------------------------------------- the merge


def test_resume_takes_the_runs_settings():
    plan = config.resume_plan(RUN, RECORDED, {}, reached_step=1100)
    assert not plan.conflicts and not plan.changes
    s = plan.settings
    assert (
        s["max_steps"],
        s["fault_tolerance"],
        s["preset"],
        s["eval_interval"],
        s["batch_policy"],
        s["base_lr"],
    ) == (2000, "per_step", "tiny", 50, "keep_global", 0.003)
    # the model's shape as resolved at the launch (not re-derived from a preset that may change)
    assert {k: s[k] for k in config.MODEL_SHAPE_FIELDS} == {
        "n_layer": 2,
        "n_head": 2,
        "n_embd": 32,
        "block_size": 32,
        "vocab_size": None,  # the dataset's characters (a run without the padded vocabulary)
    }
    assert set(s) == set(config.RESUME_FIELDS)
    assert "run_id" not in s and "threads" not in s and "ft_replica_id" not in s


def test_a_run_already_at_its_max_steps_is_refused_when_none_is_given():
    """newcomer, 2026-12-01: a resume of a per_step run at 500/500 without -e ddp_job_max_steps
    said 'newest checkpoint step 500 ... max_steps 500' and launched the agents anyway (one
    ended at once, one sat at step 58, one ran until stopped)."""
    names = {"max_steps": "ddp_job_max_steps"}
    plan = config.resume_plan(RUN, RECORDED, {}, 2000, names)
    assert plan.conflicts == [f"run {RUN} has reached its max_steps 2000 (newest checkpoint step 2000): "
                              "nothing to resume; fix: give ddp_job_max_steps above 2000 to train it further"]
    # a given max_steps at or below the step reached: the fix no longer offers the run's own
    plan = config.resume_plan(RUN, RECORDED, {"max_steps": 2000}, 2000, names)
    assert plan.conflicts == [f"ddp_job_max_steps: given 2000, run {RUN} has reached step 2000 (its newest "
                              "checkpoint); fix: a max_steps above 2000"]
    assert config.resume_plan(RUN, RECORDED, {}, 1999, names).conflicts == []
    assert config.resume_plan(RUN, RECORDED, {}, None, names).conflicts == []  # step unknown


def test_a_changeable_setting_given_is_used_and_named():
    plan = config.resume_plan(
        RUN, RECORDED, {"max_steps": "3000", "eval_interval": 50}, 1100, {"max_steps": "ddp_job_max_steps"}
    )
    assert plan.conflicts == [] and plan.changes == ["ddp_job_max_steps 2000 -> 3000"]
    assert "max_steps" not in plan.settings and "eval_interval" not in plan.settings


@pytest.mark.parametrize(
    ("given", "start"),
    [
        (
            {"fault_tolerance": "torchelastic"},
            f"ddp_job_fault_tolerance: run {RUN} was trained with 'per_step', given 'torchelastic';"
            " fix: leave",
        ),
        ({"n_layer": 4}, f"n_layer: run {RUN} was trained with 2, given 4; fix: leave n_layer out"),
        ({"preset": "small"}, f"preset: run {RUN} was trained with 'tiny', given 'small'"),
        ({"seed": 7}, f"seed: run {RUN} was trained with 1337, given 7"),
        (
            {"max_steps": 350},
            f"ddp_job_max_steps: given 350, run {RUN} has reached step 1100 (its newest checkpoint);"
            " fix: a max_steps above 1100, or leave it out to resume to the run's 2000",
        ),
        ({"warmup_steps": 5000}, "the resumed configuration is refused: config key 'warmup_steps' = 5000"),
    ],
)
def test_a_setting_that_cannot_change_is_refused(given, start):
    names = {"fault_tolerance": "ddp_job_fault_tolerance", "max_steps": "ddp_job_max_steps"}
    plan = config.resume_plan(RUN, RECORDED, given, 1100, names)
    assert len(plan.conflicts) == 1 and plan.conflicts[0].startswith(start), plan.conflicts
    assert "\n" not in plan.conflicts[0]


def test_an_unreadable_recorded_configuration_is_a_config_error():
    with pytest.raises(config.ConfigError, match=f"the recorded configuration of run {RUN} is not valid"):
        config.resume_plan(RUN, {**RECORDED, "n_lyer": 3}, {})


# --------------------------------------------------------------------------- the filter


def test_filter_reads_the_nodes_that_hold_checkpoints():
    f = _filters()
    nodes = {
        "t-a": {"checkpoints": ["ckpt-00001000.pt", "ckpt-00001100.pt"], "run_json": json.dumps(RECORDED)},
        "t-b": {"checkpoints": [], "run_json": ""},
        "t-c": {
            "checkpoints": ["ckpt-00001000.pt"],
            "run_json": json.dumps({**RECORDED, "ft_replica_id": "t-c"}),
        },
    }
    out = f.resume_plan(nodes, RUN, {"ddp_job_max_steps": "2500", "ddp_lab_user": "ddp"})
    assert out["problems"] == [] and out["holders"] == ["t-a", "t-c"] and out["step"] == 1100
    assert out["engine"] == "per_step" and out["changes"] == ["ddp_job_max_steps 2000 -> 2500"]
    out = f.resume_plan({"t-a": {"checkpoints": [], "run_json": ""}}, "nope", {}, "/b/runs/nope/checkpoints")
    assert out["problems"] == [
        "no trainer holds a checkpoint of run nope (looked in /b/runs/nope/checkpoints on"
        " t-a); fix: pick a run id from runs/ on the controller or leave"
        " ddp_job_resume_run_id empty to start a new run"
    ]
    other = {
        **nodes,
        "t-c": {"checkpoints": ["ckpt-00001000.pt"], "run_json": json.dumps({**RECORDED, "seed": 9})},
    }
    (line,) = f.resume_plan(other, RUN, {})["problems"]
    assert (
        line.startswith(f"run {RUN}: the trainers hold different settings for it")
        and "seed: t-a 1337, t-c 9" in line
    )


# --------------------------------------------------------------------------- playbooks, local trainers


def _local_address() -> str:
    """This machine's address on its default route (not loopback: validate refuses one)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect(("192.0.2.254", 9))  # no packet is sent (UDP connect only picks the route)
        return s.getsockname()[0]


@pytest.fixture
def cluster(tmp_path: Path):
    """Two local trainers holding run RUN (checkpoints of steps 1000 and 1100, its run.json) and the
    controller as rendezvous host; yields ``run(playbooks, *args) -> (rc, out)``. Any store or
    lighthouse a run started is stopped afterwards (by its pidfile: this test's own processes)."""
    if os.geteuid() != 0:
        pytest.skip("the roles read the run's files as ddp_lab_user (root here, su)")
    local = {
        "ansible_connection": "local",
        "ansible_python_interpreter": sys.executable,
        "ansible_become_method": "su",
        "ddp_lab_user": "root",
    }
    trainers = {}
    for i, host in enumerate(("t-a", "t-b")):
        base = tmp_path / host
        ckpts = base / "runs" / RUN / "checkpoints"
        ckpts.mkdir(parents=True)
        for step in (1000, 1100):
            (ckpts / f"ckpt-{step:08d}.pt").write_bytes(b"x")
        (base / "runs" / RUN / "run.json").write_text(json.dumps({**RECORDED, "ft_replica_id": host}))
        trainers[host] = {**local, "ansible_host": f"192.0.2.{21 + i}", "ddp_lab_base_dir": str(base)}
    state = tmp_path / "rdzv"
    port, lighthouse_port = free_port(), free_port()
    rdzv = {
        **local,
        "rendezvous_address": _local_address(),
        "rendezvous_port": port,
        "rendezvous_lighthouse_port": lighthouse_port,
        "rendezvous_state_dir": str(state),
    }
    inventory = tmp_path / "hosts.yml"
    inventory.write_text(
        yaml.safe_dump(
            {
                "all": {
                    "children": {
                        "trainers": {"hosts": trainers},
                        "rendezvous": {"hosts": {"controller": rdzv}},
                    }
                }
            }
        )
    )

    def run(playbooks: list[str], *args: str) -> tuple[int, str]:
        return run_playbooks(
            ansible_env(), str(inventory), playbooks, "-e", "validate_node_checks=false", *args, timeout=600
        )

    run.state = state
    yield run
    for pidfile in state.glob("*.json") if state.is_dir() else []:
        info = json.loads(pidfile.read_text())
        for key in ("server_pid", "supervisor_pid"):
            if info.get(key) and psutil.pid_exists(info[key]):
                psutil.Process(info[key]).kill()


def _render_play(tmp_path: Path) -> str:
    """A play that shows, per trainer, the run.json a launch would write (ddp_job's vars) and the
    engine every host (the rendezvous host too) would start."""
    play = tmp_path / "render.yml"
    play.write_text(
        yaml.safe_dump(
            [
                {
                    "name": "Render the launch's run.json",
                    "hosts": "trainers",
                    "gather_facts": False,
                    "roles": [{"role": "ddp_lab"}],
                    "tasks": [
                        {
                            "name": "Load ddp_job's defaults and vars",
                            "ansible.builtin.include_vars": {
                                "file": f"{REPO}/roles/ddp_job/{{{{ item }}}}/main.yml"
                            },
                            "loop": ["defaults", "vars"],
                        },
                        {"name": "Name the run", "ansible.builtin.set_fact": {"ddp_lab_run_id": RUN}},
                        {
                            "name": "Name the launch as ddp_job does (run.json's ft_launch_id)",
                            "ansible.builtin.include_tasks": f"{REPO}/roles/ddp_job/tasks/launch_token.yml",
                        },
                        {
                            "name": "Show it",
                            "ansible.builtin.debug": {
                                "msg": "RUNJSON {{ {'host': inventory_hostname, "
                                "'engine_rdzv': hostvars['controller'].ddp_job_fault_tolerance"
                                " | default('unset'), "
                                "'config': __ddp_job_config} | to_json }}"
                            },
                        },
                    ],
                }
            ]
        )
    )
    return str(play)


def _rendered(out: str) -> dict[str, dict]:
    found = [json.loads(m) for m in re.findall(r'"msg": "RUNJSON (\{.*\})"', out.replace('\\"', '"'))]
    return {r["host"]: r for r in found}


def test_resume_without_settings_trains_with_the_runs(cluster, tmp_path: Path):
    """Newcomer: a 2000-step per_step run resumed without max_steps and engine ran as a 350-step
    torchelastic one. Now the launch's run.json and the controller's engine are the run's."""
    rc, out = cluster(
        [str(REPO / "playbooks" / "validate.yml"), _render_play(tmp_path)],
        "-e",
        f"ddp_job_resume_run_id={RUN}",
    )
    assert rc == 0, out[-4000:]
    shown = _rendered(out)
    assert set(shown) == {"t-a", "t-b"}, out[-3000:]
    for host, r in shown.items():
        c = r["config"]
        assert (
            c["max_steps"],
            c["fault_tolerance"],
            c["preset"],
            c["n_layer"],
            c["eval_interval"],
            c["batch_policy"],
            c["base_lr"],
        ) == (2000, "per_step", "tiny", 2, 50, "keep_global", 0.003), c
        assert c["ft_replica_id"] == host and c["run_id"] == RUN
        assert r["engine_rdzv"] == "per_step"  # the rendezvous play starts the lighthouse, not the store
    assert (
        f"resume run {RUN} (newest checkpoint step 1100 on t-a, t-b) with the run's settings:"
        " engine per_step, max_steps 2000, preset tiny" in out
    )


def test_resume_with_a_larger_max_steps_uses_and_names_it(cluster, tmp_path: Path):
    rc, out = cluster(
        [str(REPO / "playbooks" / "validate.yml"), _render_play(tmp_path)],
        "-e",
        f"ddp_job_resume_run_id={RUN}",
        "-e",
        "ddp_job_max_steps=3000",
    )
    assert rc == 0, out[-4000:]
    assert {int(r["config"]["max_steps"]) for r in _rendered(out).values()} == {3000}  # -e gives a string
    assert "; given: ddp_job_max_steps 2000 -> 3000" in out


@pytest.mark.parametrize(
    ("args", "line"),
    [
        (
            ["-e", "ddp_job_fault_tolerance=torchelastic"],
            f"ddp_job_fault_tolerance: run {RUN} was trained with 'per_step', given 'torchelastic';"
            " fix: leave ddp_job_fault_tolerance out to resume with the run's value (or start a new run)",
        ),
        (
            ["-e", '{"ddp_job_train_overrides": {"n_embd": 64}}'],
            f"ddp_job_train_overrides.n_embd: run {RUN} was trained with 32, given 64",
        ),
        (["-e", "ddp_job_max_steps=350"], f"ddp_job_max_steps: given 350, run {RUN} has reached step 1100"),
    ],
)
def test_a_conflicting_resume_is_one_line_before_anything_starts(cluster, args, line):
    rc, out = cluster(
        [str(REPO / "site.yml"), "--tags", "train"], "-e", f"ddp_job_resume_run_id={RUN}", *args
    )
    assert rc == 2, out[-3000:]
    found = errors(out)
    assert len(found) == 1 and found[0].startswith(line), found
    assert not list(cluster.state.glob("*.json")) if cluster.state.is_dir() else True, (
        "a store or lighthouse started"
    )


def test_an_unknown_run_is_refused_before_the_store_starts(cluster):
    """Newcomer: -e ddp_job_resume_run_id=<unknown> was refused (rc 2, one line) only after the
    rendezvous store had started, and the store was left running."""
    rc, out = cluster([str(REPO / "site.yml"), "--tags", "train"], "-e", "ddp_job_resume_run_id=nope")
    assert rc == 2, out[-3000:]
    found = errors(out)
    assert len(found) == 1 and found[0].startswith("no trainer holds a checkpoint of run nope (looked in"), (
        found
    )
    assert "TASK [rendezvous" not in out
    pidfiles = list(cluster.state.glob("*.json")) if cluster.state.is_dir() else []
    assert not pidfiles, f"left running: {pidfiles}"


# --------------------------------------------------------------------------- settings given with -e


@pytest.mark.parametrize(
    ("setting", "start"),
    [
        (
            "ddp_job_fault_tolerance=bogus",
            "-e ddp_job_fault_tolerance='bogus': value of ddp_job_fault_tolerance must be"
            " one of: torchelastic, per_step, diloco, got: bogus; fix: give",
        ),
        (
            "ddp_job_ft_manager_port=abc",
            "-e ddp_job_ft_manager_port='abc': argument 'ddp_job_ft_manager_port' is of"
            " type str and we were unable to convert to int",
        ),
        (
            "validate_mode=bogus",
            "-e validate_mode='bogus': value of validate_mode must be one of: preflight, doctor, got: bogus;",
        ),
        # the other roles' settings too: once, before any host task (they were one line per trainer)
        (
            "ddp_job_start_method=bogus",
            "-e ddp_job_start_method='bogus': value of ddp_job_start_method must be one of:"
            " fork, spawn, got: bogus; fix:",
        ),
        (
            "firewall_manage_ufw=maybe",
            "-e firewall_manage_ufw='maybe': argument 'firewall_manage_ufw' is of type str",
        ),
        ("ddp_job_max_steps=abc", "-e ddp_job_max_steps='abc': argument 'ddp_job_max_steps' is of type str"),
        # a run id's form before any path is built from it (the resume looked in runs/../etc/checkpoints)
        ("ddp_job_resume_run_id=../etc", "-e ddp_job_resume_run_id='../etc': not a run id: a run id is 1-64"),
        ("ddp_job_resume_run_id=..", "-e ddp_job_resume_run_id='..': not a run id:"),
    ],
)
def test_a_bad_setting_given_is_one_line_not_the_spec(tmp_path: Path, setting, start):
    """Newcomer: -e ddp_job_fault_tolerance=bogus printed the right message, then ~3.9 KB of the
    ddp_lab role's argument spec (its own check at its start, before the validate role's)."""
    trainers = {"t-a": {"ansible_host": "192.0.2.11", "ansible_connection": "ssh"}}
    rdzv = local_controller(tmp_path)
    inventory = tmp_path / "hosts.yml"
    inventory.write_text(
        yaml.safe_dump(
            {"all": {"children": {"trainers": {"hosts": trainers}, "rendezvous": {"hosts": rdzv}}}}
        )
    )
    rc, out = run_playbooks(
        ansible_env(),
        str(inventory),
        [str(REPO / "site.yml")],
        "--tags",
        "train",
        "-e",
        "validate_node_checks=false",
        "-e",
        setting,
        timeout=300,
    )
    assert rc == 2, out[-3000:]
    found = errors(out)
    assert len(found) == 1 and found[0].startswith(start), found
    assert "argument_spec_data" not in out and "argument_spec" not in found[0], out[-3000:]
    assert set(recap(out)) == {"localhost"}, recap(out)  # before any task of a trainer or the controller


def test_a_play_without_validate_judges_the_resume_as_ddp_job_does(cluster, tmp_path: Path):
    """playbooks/train.yml alone (no validate play): ddp_job's preflight includes the same check,
    guarded by validate_resume_checked (its task, run here as the preflight runs it)."""
    preflight = yaml.safe_load((REPO / "roles/ddp_job/tasks/preflight.yml").read_text())
    (task,) = [
        t for t in preflight if t.get("ansible.builtin.include_role", {}).get("tasks_from") == "resume"
    ]
    play = tmp_path / "preflight.yml"
    play.write_text(
        yaml.safe_dump(
            [
                {
                    "name": "As ddp_job's preflight",
                    "hosts": "trainers",
                    "gather_facts": False,
                    "roles": [{"role": "ddp_lab"}],
                    "tasks": [task],
                }
            ]
        )
    )
    rc, out = cluster([str(play), _render_play(tmp_path)], "-e", f"ddp_job_resume_run_id={RUN}")
    assert rc == 0, out[-4000:]
    assert {int(r["config"]["max_steps"]) for r in _rendered(out).values()} == {2000}
    assert {r["engine_rdzv"] for r in _rendered(out).values()} == {"per_step"}
    rc, out = cluster([str(play)], "-e", "ddp_job_resume_run_id=nope")
    assert rc == 2 and errors(out)[0].startswith("no trainer holds a checkpoint of run nope"), out[-3000:]


def _preflight_alone(tmp_path: Path, *args: str) -> tuple[int, str]:
    """ddp_job's preflight as playbooks/train.yml's first play runs it (no validate play), on this
    machine as the one trainer."""
    local = {"ansible_connection": "local", "ansible_python_interpreter": sys.executable}
    inventory = tmp_path / "hosts.yml"
    inventory.write_text(yaml.safe_dump({"all": {"children": {
        "trainers": {"hosts": {"t-a": local}}, "rendezvous": {"hosts": local_controller(tmp_path)}}}}))
    play = tmp_path / "preflight.yml"
    play.write_text(yaml.safe_dump([{
        "name": "As playbooks/train.yml's launch", "hosts": "trainers", "gather_facts": False,
        "roles": [{"role": "ddp_lab"}],
        "tasks": [{"name": "Preflight",
                   "ansible.builtin.include_role": {"name": "ddp_job", "tasks_from": "preflight"}}],
    }]))
    return run_playbooks(ansible_env(), str(inventory), [str(play)], *args, timeout=300)


def test_ddp_jobs_own_argument_check_is_one_line(tmp_path: Path):
    """playbooks/train.yml alone (no validate play): ddp_job's preflight is judged by the role's own
    argument spec (entry point preflight) at its start; a bad -e value is one line naming the setting,
    the fix and where the role documents it, without the spec Ansible carries (KBs): the callback
    ddp_lab.cluster.ddp_lab shortens an argument check's failure."""
    rc, out = _preflight_alone(tmp_path, "-e", "ddp_job_max_steps=abc")
    assert rc == 2, out[-3000:]
    (line,) = errors(out)
    assert line.startswith("argument 'ddp_job_max_steps' is of type str and we were unable to convert"), line
    assert line.endswith("; fix: correct it in the inventory, group_vars or -e (roles/ddp_job/README.md)"), (
        line)
    assert "argument_spec_data" not in out and "Origin:" not in out, out[-3000:]


@pytest.mark.parametrize("setting", ["ddp_job_resume_run_id=../etc", "ddp_job_run_id=.."])
def test_ddp_jobs_preflight_checks_a_run_ids_form_by_ddp_labs_rule(tmp_path: Path, setting):
    """playbooks/train.yml alone (no validate play): ddp_job's preflight had its own pattern, which
    took '..'; it now asks ddp_lab's filter (one home of a run id's form), one line naming the variable."""
    rc, out = _preflight_alone(tmp_path, "-e", setting)
    name, value = setting.split("=", 1)
    assert rc == 2, out[-3000:]
    (line,) = errors(out)
    assert line.startswith(f"{name} {value!r} is not a run id: a run id is 1-64 of the characters"), line


@pytest.mark.parametrize("setting", ["ddp_job_resume_run_id=../etc", "ddp_job_run_id=.."])
def test_train_playbook_refuses_a_bad_run_id_before_the_store_starts(tmp_path: Path, setting):
    """The real playbooks/train.yml: its first play used to start the store (roles/rendezvous)
    before ddp_job's preflight refused the id, and the play that stops the store never ran (an
    orphaned store). The refusal now comes first: one line naming the variable, no store pidfile,
    nothing listening on the store's port."""
    local = {"ansible_connection": "local", "ansible_python_interpreter": sys.executable}
    controller = local_controller(tmp_path)
    controller["controller"]["rendezvous_address"] = "127.0.0.1"  # a store there would answer
    port = controller["controller"]["rendezvous_port"]
    inventory = tmp_path / "hosts.yml"
    inventory.write_text(yaml.safe_dump({"all": {"children": {
        "trainers": {"hosts": {"t-a": local}}, "rendezvous": {"hosts": controller}}}}))
    rc, out = run_playbooks(ansible_env(), str(inventory), [str(REPO / "playbooks/train.yml")],
                            "-e", setting, timeout=300)
    name, value = setting.split("=", 1)
    assert rc == 2, out[-3000:]
    (line,) = errors(out)
    assert line.startswith(f"{name} {value!r} is not a run id"), line
    assert "Start the rendezvous store" not in out, out[-3000:]
    assert not list((tmp_path / "rdzv").glob("store-*.json")), out[-3000:]
    with socket.socket() as s:
        s.settimeout(2)
        assert s.connect_ex(("127.0.0.1", port)) != 0, f"something listens on the store port {port}"
