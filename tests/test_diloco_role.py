"""ddp_job_fault_tolerance diloco through the roles: the launch is per_step's (one replica group per
laptop under the lighthouse), run.json carries the ft_* keys and diloco's own, the training program
accepts them; the engines under the lighthouse have one list on each side (Python, Ansible)."""

from pathlib import Path

import yaml
from ddplab.config import build_config
from ddplab.engines import LIGHTHOUSE_ENGINES
from labharness import REPO, ansible_env, render_agent_launch, run_playbooks


def test_the_lighthouse_engines_are_one_list_on_both_sides():
    defaults = yaml.safe_load((REPO / "roles/ddp_lab/defaults/main.yml").read_text())
    assert defaults["ddp_lab_lighthouse_engines"] == list(LIGHTHOUSE_ENGINES) == ["per_step", "diloco"]


def test_diloco_launches_like_per_step_and_writes_its_keys(tmp_path: Path):
    for name in "pd":
        (tmp_path / name).mkdir()
    per_step, per_step_opts, per_step_config = render_agent_launch(
        tmp_path / "p", "-e", "ddp_job_fault_tolerance=per_step")
    argv, opts, config = render_agent_launch(tmp_path / "d", "-e", "ddp_job_fault_tolerance=diloco",
                                             "-e", "ddp_job_sync_every=25")
    assert argv == per_step and opts == per_step_opts
    assert config.pop("fault_tolerance") == "diloco" and per_step_config.pop("fault_tolerance") == "per_step"
    assert {k: config.pop(k) for k in ("sync_every", "outer_lr", "outer_momentum")} == {
        "sync_every": 25, "outer_lr": 0.7, "outer_momentum": 0.9}
    assert config == per_step_config  # the same ft_* keys, paths and launch id
    merged = build_config({**config, "fault_tolerance": "diloco", "sync_every": 25, "eval_interval": 100,
                           "data_url": None})
    assert merged.fault_tolerance == "diloco" and merged.ft_lighthouse == "http://192.168.50.10:29510"


def test_the_lighthouse_waits_for_a_late_replica_as_long_as_its_engine_needs(tmp_path: Path):
    """per_step forms a quorum every step (1 s for a straggler); diloco once per round (30 s): a laptop
    late for a sync is waited for instead of losing its round; a setting of the user's wins."""
    play = tmp_path / "render.yml"
    tasks = [{"name": f"Print {engine}", "vars": {"ddp_job_fault_tolerance": engine, **extra},
              "ansible.builtin.debug": {"msg": f"{engine}={{{{ rendezvous_lighthouse_join_timeout_ms }}}}"}}
             for engine, extra in (("per_step", {}), ("diloco", {}),
                                   ("mine", {"rendezvous_fault_tolerance": "diloco",
                                             "rendezvous_lighthouse_join_timeout_ms": 4000}))]
    play.write_text(yaml.safe_dump([{
        "name": "Render the join timeout", "hosts": "localhost", "gather_facts": False,
        "vars_files": [str(REPO / "roles/ddp_lab/defaults/main.yml"),
                       str(REPO / "roles/rendezvous/defaults/main.yml")],
        "tasks": tasks}]))
    rc, out = run_playbooks(ansible_env(), "localhost,", [str(play)], "-c", "local", timeout=120)
    assert rc == 0, out[-3000:]
    assert '"msg": "per_step=1000"' in out and '"msg": "diloco=30000"' in out, out[-3000:]
    assert '"msg": "mine=4000"' in out, out[-3000:]
