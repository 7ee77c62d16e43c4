"""ddp_job_fault_tolerance diloco through the roles: the launch is per_step's (one replica group per
laptop under the lighthouse), run.json carries the ft_* keys and diloco's own, the training program
accepts them; the engines under the lighthouse have one list on each side (Python, Ansible)."""

import json
from pathlib import Path

import pytest
import yaml
from ddplab.config import build_config
from ddplab.controller import lighthouse as lh
from ddplab.controller.supervisor import ServiceError
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


def test_the_lighthouse_waits_for_a_late_replica_as_long_as_its_engine_needs():
    """per_step forms a quorum every step (1 s for a straggler); diloco once per round (30 s): a laptop
    late for a sync is waited for instead of losing its round. One value, or one per engine; a bad
    one is one line naming the setting."""
    defaults = yaml.safe_load((REPO / "roles/rendezvous/defaults/main.yml").read_text())
    assert defaults["rendezvous_lighthouse_join_timeout_ms"] == lh.JOIN_TIMEOUT_MS
    assert lh.JOIN_TIMEOUT_MS == {"per_step": 1000, "diloco": 30000}
    as_ansible_passes_it = json.dumps(lh.JOIN_TIMEOUT_MS)  # the role's `| to_json`
    assert lh.join_timeout_ms(as_ansible_passes_it, "per_step") == 1000
    assert lh.join_timeout_ms(as_ansible_passes_it, "diloco") == 30000
    assert lh.join_timeout_ms(None, "diloco") == 30000
    assert lh.join_timeout_ms("4000", "diloco") == lh.join_timeout_ms(json.dumps("4000"), "per_step") == 4000
    assert lh.join_timeout_ms('{"diloco": 0}', "diloco") == 0
    for bad, engine in (('{"diloco": 60000}', "per_step"), ("soon", "diloco"), ("-1", "diloco"),
                        ("true", "diloco"), ('{"diloco": "x"}', "diloco")):
        with pytest.raises(ServiceError) as err:
            lh.join_timeout_ms(bad, engine)
        assert "\n" not in str(err.value) and "rendezvous_lighthouse_join_timeout_ms" in str(err.value)


@pytest.mark.parametrize("engine", ["torchelastic", "per_step", "diloco"])
def test_the_rendezvous_arguments_validate_under_every_engine(tmp_path: Path, engine: str):
    """The role's argument spec (defaults included) validates whatever the engine, with the default
    join timeout and with a user's value (an int, or a string from ``-e key=value``)."""
    spec = yaml.safe_load((REPO / "roles/rendezvous/meta/argument_specs.yml").read_text())
    options = spec["argument_specs"]["main"]["options"]
    tasks = [{"name": f"Validate {i}", "vars": extra,
              "ansible.builtin.validate_argument_spec": {"argument_spec": options}}
             for i, extra in enumerate(({}, {"rendezvous_lighthouse_join_timeout_ms": 4000},
                                        {"rendezvous_lighthouse_join_timeout_ms": "4000"}))]
    play = tmp_path / "validate.yml"
    play.write_text(yaml.safe_dump([{
        "name": "Validate the rendezvous role's arguments", "hosts": "localhost", "gather_facts": False,
        "vars_files": [str(REPO / "roles/ddp_lab/defaults/main.yml"),
                       str(REPO / "roles/rendezvous/defaults/main.yml")],
        "vars": {"rendezvous_address": "127.0.0.1", "role_path": str(REPO / "roles/rendezvous")},
        "tasks": tasks}]))
    rc, out = run_playbooks(ansible_env(), "localhost,", [str(play)], "-c", "local",
                            "-e", f"ddp_job_fault_tolerance={engine}", timeout=120)
    assert rc == 0 and "ok=3" in out, out[-3000:]
