"""stop.yml stops an agent whose job state ddplab.status cannot read (the node runtime not installed
or broken on the node): systemd's view of the unit decides. molecule reset's stand-in agent (a
process under the agent's unit, no ddplab in the venv) was left running at bcdc88b: "training
processes still run after stopping ddp-lab-agent"."""

import json

import pytest
from test_status_table import PLAYBOOK, _events, _play, _stop_case


def without_ddplab(tmp_path, inv, host):
    """``host``'s venv python fails as it does where ddplab.status is not installed."""
    venv = tmp_path / "venv-without-ddplab"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin/python").write_text(
        "#!/bin/sh\necho \"/opt/ddp-lab/venv/bin/python: No module named ddplab.status\" >&2\nexit 1\n"
    )
    (venv / "bin/python").chmod(0o755)
    data = json.loads(inv.read_text())
    data["all"]["children"]["trainers"]["hosts"][host]["ddp_job_venv"] = str(venv)
    inv.write_text(json.dumps(data))


@pytest.mark.skipif(PLAYBOOK is None, reason="ansible-playbook is not installed (make venv)")
def test_stop_stops_a_running_agent_whose_state_ddplab_cannot_read(tmp_path):
    inv, env = _stop_case(tmp_path, {"laptop-run": "running"})
    without_ddplab(tmp_path, inv, "laptop-run")
    out = _play(inv, env, "playbooks/stop.yml")
    text = out.stdout + out.stderr
    assert out.returncode == 0, text
    assert (tmp_path / "units/agent-laptop-run.stopped_at").exists(), text  # systemctl stop ran
    # two changes: the stop recorded in the run's events (it names the node) and the agent stopped
    assert "laptop-run" in text and "changed=2" in text, text
    stops = [e for e in _events(tmp_path) if e["kind"] == "stop"]
    assert [e["hosts"] for e in stops] == [["laptop-run"]], stops


@pytest.mark.skipif(PLAYBOOK is None, reason="ansible-playbook is not installed (make venv)")
def test_stop_check_mode_leaves_a_running_job_alone_and_succeeds(tmp_path):
    """stop.yml --check (and reset.yml --check, which runs the same tasks) on a running job: the stop
    is only pretended, so the job's processes rightly still run; it must neither stop the agent nor
    fail telling the user to pkill the healthy job (newcomer, 2026-12-01: 'training processes still
    run after stopping ddp-lab-agent (pids 1701 1717); fix: pkill -u ddp')."""
    inv, env = _stop_case(tmp_path, {"laptop-run": "running"})
    (tmp_path / "bin/pgrep").write_text("#!/bin/sh\necho 1701\necho 1717\nexit 0\n")  # the job runs
    out = _play(inv, env, "playbooks/stop.yml", check=True)
    text = out.stdout + out.stderr
    assert out.returncode == 0, text
    assert "pkill" not in text, text
    assert not (tmp_path / "units/agent-laptop-run.stopped_at").exists(), text  # nothing stopped
