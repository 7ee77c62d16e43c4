"""Action plugin rendezvous_status (roles/rendezvous): the store's and the lighthouse's state read
in the background and collected later (status.yml), their answers and their failures."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from ansible.errors import AnsibleActionFail
from ansible_collections.ddp_lab.cluster.plugins.action import rendezvous_status as rs

ROOT = Path(__file__).resolve().parent.parent


def fake_python(tmp_path: Path, body: str) -> str:
    """An executable standing in for the interpreter: ``-m ddplab.controller.<module> status ...``
    runs ``body`` (sh) with $3 the module."""
    path = tmp_path / "python"
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(0o755)
    return str(path)


SERVICES = {"rendezvous_status": {"module": "rdzv_store", "port": 29411},
            "rendezvous_lighthouse_status": {"module": "lighthouse", "port": 29510}}


STORE_AND_LIGHTHOUSE = """sleep 1
case "$2" in
  *rdzv_store) echo '{"running": true, "answering": false, "port": 29411}'; exit 1;;
  *) echo '{"running": false, "port": 29510}'; exit 3;;
esac
"""


def test_reads_start_in_the_background_and_every_answer_counts(tmp_path):
    """Exit 0 (answering), 1 (running, not answering) and 3 (not running) are answers; start returns
    before the reads end (each takes 1 s) and collect removes the folder."""
    started = rs.start(fake_python(tmp_path, STORE_AND_LIGHTHOUSE), "", str(tmp_path), SERVICES)
    assert not any(os.path.exists(f) for f in started["reads"].values())  # still reading
    facts = rs.collect(started, timeout_s=30)
    assert facts == {"rendezvous_status": {"running": True, "answering": False, "port": 29411},
                     "rendezvous_lighthouse_status": {"running": False, "port": 29510}}
    assert not os.path.exists(started["dir"])


def test_the_reads_get_the_module_port_state_dir_and_pythonpath(tmp_path):
    py = fake_python(tmp_path, 'printf \'{"argv": "%s", "pp": "%s"}\\n\' "$*" "$PYTHONPATH"\n')
    facts = rs.collect(rs.start(py, "/x/train", "/state", SERVICES), timeout_s=30)
    assert facts["rendezvous_status"] == {"argv": "-m ddplab.controller.rdzv_store status --port 29411 "
                                                  "--state-dir /state", "pp": "/x/train"}
    assert facts["rendezvous_lighthouse_status"]["argv"].startswith(
        "-m ddplab.controller.lighthouse status --port 29510")


@pytest.mark.parametrize("body, message", [
    ("echo 'Traceback ...' >&2; echo 'ModuleNotFoundError: No module named torch' >&2; exit 2\n",
     "reading the rendezvous_status's state failed (exit 2): ModuleNotFoundError: No module named torch"),
    ("echo not json\n", "reading the rendezvous_status's state printed no JSON: not json"),
    ("echo '[1]'\n", "printed list, not an object"),
    ("exit 0\n", "failed (exit 0): no output"),
])
def test_a_read_that_is_no_answer_fails_in_one_line(tmp_path, body, message):
    py = fake_python(tmp_path, body)
    started = rs.start(py, "", str(tmp_path), {"rendezvous_status": SERVICES["rendezvous_status"]})
    with pytest.raises(AnsibleActionFail) as exc:
        rs.collect(started, timeout_s=30)
    assert message in str(exc.value) and "\n" not in str(exc.value)
    assert not os.path.exists(started["dir"])


def test_a_read_that_hangs_fails_after_the_timeout(tmp_path):
    py = fake_python(tmp_path, "sleep 5\n")
    started = rs.start(py, "", str(tmp_path), {"rendezvous_status": SERVICES["rendezvous_status"]})
    with pytest.raises(AnsibleActionFail, match="reading the rendezvous_status's state took more than 1 s"):
        rs.collect(started, timeout_s=1.0)

