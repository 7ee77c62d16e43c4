"""stop.yml's stop event and its words (newcomer, 2026-12-01): a node whose ddplab.status fails
while its agent's unit runs is stopped and must be named in the run's `kind: stop` event (status.yml
and the watch then call it stopped, not failed); `stop.yml --check` says what it would stop instead
of "stopped run ..."."""

import pytest
from test_status_table import PLAYBOOK, RUN_ID, _events, _play, _stop_case
from test_stop_without_runtime import without_ddplab


@pytest.mark.skipif(PLAYBOOK is None, reason="ansible-playbook is not installed (make venv)")
def test_stop_event_names_a_running_agent_whose_state_ddplab_cannot_read(tmp_path):
    inv, env = _stop_case(tmp_path, {"laptop-run": "running", "laptop-bad": "running", "laptop-end": "ended"})
    without_ddplab(tmp_path, inv, "laptop-bad")
    out = _play(inv, env, "playbooks/stop.yml")
    text = out.stdout + out.stderr
    assert out.returncode == 0, text
    stops = [e for e in _events(tmp_path) if e["kind"] == "stop"]
    assert len(stops) == 1 and sorted(stops[0]["hosts"]) == ["laptop-bad", "laptop-run"], stops
    assert (tmp_path / "units/agent-laptop-bad.stopped_at").exists(), text
    assert f"stopped run {RUN_ID} on laptop-run, laptop-bad" in text, text  # inventory order


@pytest.mark.skipif(PLAYBOOK is None, reason="ansible-playbook is not installed (make venv)")
def test_stop_check_says_what_it_would_stop(tmp_path):
    inv, env = _stop_case(tmp_path, {"laptop-run": "running", "laptop-end": "ended"})
    (tmp_path / "bin/pgrep").write_text("#!/bin/sh\necho 1701\nexit 0\n")  # the job runs
    out = _play(inv, env, "playbooks/stop.yml", check=True)
    text = out.stdout + out.stderr
    assert out.returncode == 0, text
    assert f"would stop run {RUN_ID} on laptop-run; nothing was stopped or recorded (--check)" in text, text
    assert "stopped run" not in text, text
    assert not [e for e in _events(tmp_path) if e["kind"] == "stop"]
    assert not (tmp_path / "units/agent-laptop-run.stopped_at").exists(), text
