"""make doctor's launch row after stop.yml (newcomer, 2026-12-01): once stop.yml had cleared the
agent's unit, the row said "no agent launched on this node yet"; it says the last run was stopped
by stop.yml at T, from the facts status.yml reads (the run, its ``kind: stop`` event)."""

from __future__ import annotations

import json
import time

import pytest
from ansible_collections.ddp_lab.cluster.plugins.action import validate_check as vc
from test_status_table import PLAYBOOK, RUN_ID, _play, _stop_case

SHOW_GONE = "LoadState=not-found\nExecStart=\nEnvironment=\n"
SHOW_LOADED = ("LoadState=loaded\nExecStart={ path=/opt/ddp-lab/venv/bin/python ;"
               " argv[]=/opt/ddp-lab/venv/bin/python -m ddplab.agent --local-addr 10.89.0.11"
               " --rdzv-endpoint 10.89.0.1:29400 ; }\n"
               "Environment=GLOO_SOCKET_IFNAME=eth0\n")


def test_launch_row_of_a_node_stop_yml_stopped():
    stop = {"kind": "stop", "time": time.time() - 60, "run_id": RUN_ID, "hosts": ["laptop-a"]}
    when = time.strftime("%H:%M:%S", time.localtime(stop["time"]))
    gone = vc.launch("laptop-a", SHOW_GONE, RUN_ID, stop)
    assert gone["status"] == "skip", gone
    said = f"the last run {RUN_ID} was stopped by stop.yml at {when}"
    assert gone["detail"].startswith(f"{said} (its agent unit is gone)"), gone
    kept = vc.launch("laptop-a", SHOW_LOADED, RUN_ID, stop)  # the unit kept after the SIGTERM (failed)
    assert kept["status"] == "ok" and kept["detail"].endswith(f"; {said}"), kept
    other = vc.launch("laptop-b", SHOW_GONE, RUN_ID, stop)  # not named by the stop: as before
    assert other["detail"].startswith("no agent launched on this node yet"), other
    assert vc.launch("laptop-a", SHOW_GONE)["detail"].startswith("no agent launched on this node yet")


@pytest.mark.skipif(PLAYBOOK is None, reason="ansible-playbook is not installed (make venv)")
def test_doctor_says_the_run_was_stopped_once_stop_cleared_the_unit(tmp_path):
    inv, env = _stop_case(tmp_path, {"laptop-x": "absent"})  # the unit is gone after stop.yml
    stop = {"time": time.time() - 10, "kind": "stop", "run_id": RUN_ID, "hosts": ["laptop-x"]}
    with open(tmp_path / "runs" / RUN_ID / "events.jsonl", "a", encoding="utf-8") as fh:
        fh.write(json.dumps(stop) + "\n")
    out = _play(inv, env, "doctor.yml")
    text = out.stdout + out.stderr
    row = next((line for line in text.splitlines() if line.lstrip().startswith('"launch ')), "")
    assert f"the last run {RUN_ID} was stopped by stop.yml at" in row, text[-4000:]
    assert "no agent launched" not in text, text[-4000:]
