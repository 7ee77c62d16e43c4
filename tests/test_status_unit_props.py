"""The agent unit's properties the job state is read from have one home, ddplab.status.UNIT_PROPS:
ddplab.status asks systemctl for them, and the ddp_job_watch action plugin's systemd fallback (when
ddplab.status cannot run on the node) reads the same tuple from train/ddplab/status.py without
importing ddplab (review of 2026-12-01: the plugin repeated the list)."""

import subprocess
from pathlib import Path

import pytest
from ansible.errors import AnsibleError
from ddplab import status as st
from test_status_table import _load

ROOT = Path(__file__).resolve().parent.parent


def _watch():
    return _load("ddp_job_watch_props", "roles/ddp_job/action_plugins/ddp_job_watch.py")


def test_the_plugin_reads_ddplab_status_unit_props():
    watch = _watch()
    assert watch.STATUS_PY == ROOT / "train/ddplab/status.py"
    assert watch.unit_props() == st.UNIT_PROPS
    assert not hasattr(watch, "UNIT_PROPS")  # no second list


def test_unit_props_of_a_file_without_them_is_a_clear_error(tmp_path):
    watch = _watch()
    (tmp_path / "status.py").write_text("X = 1\n")
    with pytest.raises(AnsibleError, match="assigns no UNIT_PROPS"):
        watch.unit_props(tmp_path / "status.py")
    with pytest.raises(AnsibleError, match="cannot read UNIT_PROPS"):
        watch.unit_props(tmp_path / "missing.py")


def test_unit_state_asks_systemctl_for_the_unit_props(monkeypatch):
    seen = {}

    def run(argv, **kw):
        seen["argv"] = argv
        return subprocess.CompletedProcess(argv, 0, stdout="LoadState=loaded\nSubState=running\n", stderr="")

    monkeypatch.setattr(st.subprocess, "run", run)
    assert st.unit_state("ddp-lab-agent") == {"LoadState": "loaded", "SubState": "running"}
    assert seen["argv"] == ["systemctl", "show", "ddp-lab-agent", "-p", ",".join(st.UNIT_PROPS)]
