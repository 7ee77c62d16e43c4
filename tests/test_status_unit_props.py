"""The agent unit's properties the job state is read from have one home, ddplab.status.UNIT_PROPS:
ddplab.status asks systemctl for them, and the node_status action plugin's systemd fallback (when
ddplab.status cannot run on the node) imports the same tuple (review of 2026-12-01: the plugin
repeated the list)."""

import subprocess

from ansible_collections.ddp_lab.cluster.plugins.action import node_status as watch
from ddplab import status as st


def test_the_plugin_uses_ddplab_status_unit_props():
    assert watch.UNIT_PROPS is st.UNIT_PROPS  # no second list


def test_unit_state_asks_systemctl_for_the_unit_props(monkeypatch):
    seen = {}

    def run(argv, **kw):
        seen["argv"] = argv
        return subprocess.CompletedProcess(argv, 0, stdout="LoadState=loaded\nSubState=running\n", stderr="")

    monkeypatch.setattr(st.subprocess, "run", run)
    assert st.unit_state("ddp-lab-agent") == {"LoadState": "loaded", "SubState": "running"}
    assert seen["argv"] == ["systemctl", "show", "ddp-lab-agent", "-p", ",".join(st.UNIT_PROPS)]
