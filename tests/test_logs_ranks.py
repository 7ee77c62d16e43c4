"""logs.yml shows something useful for every rank (newcomer, session 8: ``-e node=laptop-b -e
rank=1``, the README's example, said the worker's lines were in its stdout, then ``no stdout
output``: only global rank 0 prints the ``[ddplab]`` lines). The messages are built by the role's
filters (ddp_job_logs_worker_messages, ddp_job_stdout_log, ddp_job_logs_journal_message,
ddp_job_logs_rank_problem), not in Jinja."""

from __future__ import annotations

import os
import time

import pytest
from test_status_table import NOW, PLAYBOOK, _case, _play, filters

LOG = "/var/lib/ddp-lab/runs/r/logs/r_aa/attempt_1/{}/stderr.log"
WORKERS = [{"host": "laptop-b", "local_rank": 0, "rank": 1, "world_size": 3, "restart_count": 1,
            "step": 120, "event": "step", "time": 0.0}]


def tail(path: str, lines: list[str], rc: int = 0) -> dict:
    return {"item": path, "stdout_lines": lines, "rc": rc}


def test_stdout_log_is_beside_the_stderr_log():
    assert filters.stdout_log_of(LOG.format(2)) == "/var/lib/ddp-lab/runs/r/logs/r_aa/attempt_1/2/stdout.log"
    with pytest.raises(ValueError, match="not a torchrun worker's stderr.log"):
        filters.stdout_log_of("/tmp/stderr.log.old")


def test_a_rank_other_than_0_is_pointed_to_rank_0_and_shown_its_newest_record():
    workers = [{**WORKERS[0], "time": time.time() - 7}]
    err = tail(LOG.format(0), [])
    [msg] = filters.logs_worker_messages([err], [tail(err, [])], 20, workers, "laptop-b  step 120/300 ...")
    text = "\n".join(msg)
    assert msg[0] == f"{LOG.format(0)} (last 20 lines):"
    assert msg[1] == "no stderr output (a healthy worker writes none)"
    assert "its own lines are in its stdout" not in text
    assert msg[2] == LOG.format(0).replace("stderr.log", "stdout.log") + " (last 20 lines):"
    assert msg[3].startswith("no stdout output: rank 1 prints no progress lines; rank 0 prints them")
    command = ("ansible-playbook logs.yml -e node=<the laptop of rank 0 in `ansible-playbook status.yml`>"
               " -e rank=0")
    assert command in msg[3]
    assert msg[4] == "rank 1's newest record: step at step 120, world size 3, restart 1, 7 s ago"
    assert msg[5] == "the node's progress: laptop-b  step 120/300 ..."


def test_rank_0_shows_its_stdout_and_a_stderr_tail():
    workers = [{**WORKERS[0], "rank": 0}]
    err = tail(LOG.format(0), ["a warning"])
    [msg] = filters.logs_worker_messages([err], [tail(err, ["[ddplab] step 5/10 loss 2.1"])], 5, workers)
    assert msg[1] == "a warning" and msg[3] == "[ddplab] step 5/10 loss 2.1" and len(msg) == 4
    [msg] = filters.logs_worker_messages([err], [tail(err, [])], 5, workers)  # just launched
    assert msg[3] == "no stdout output yet (rank 0 prints its first line after the rendezvous)"
    [msg] = filters.logs_worker_messages([err], [tail(err, [], rc=1)], 5, workers)  # no stdout.log
    assert msg[3] == "no stdout.log"


def test_without_a_worker_log_one_message_says_so():
    assert filters.logs_worker_messages([], [], 5, [], "", "/base/runs/r", "r", "1") == [
        ["no worker stderr of run r under /base/runs/r/logs for rank 1"]]
    assert filters.logs_worker_messages([], [], 5, [], "", "/base/runs/r", "") == [
        ["no worker stderr of run (none) under /base/runs/r/logs"]]


def test_the_journal_message_and_the_rank_refusal():
    assert filters.logs_journal_message(["l1", "l2"], "ddp-lab-agent", 2) == [
        "journalctl -u ddp-lab-agent (last 2 lines):", "l1", "l2"]
    assert filters.logs_rank_problem(WORKERS, "1", "laptop-b", "r") == ""
    assert filters.logs_rank_problem(WORKERS, "", "laptop-b", "r") == ""
    assert filters.logs_rank_problem(WORKERS, "0", "laptop-b", "r") == (
        "rank=0 is not held by a worker on laptop-b in run r (its workers hold ranks 1); fix: pick the node "
        "from `ansible-playbook status.yml`, or leave rank out")


@pytest.mark.skipif(PLAYBOOK is None, reason="ansible-playbook is not installed (make venv)")
def test_logs_playbook_of_rank_1_says_where_the_progress_lines_are(tmp_path):
    """logs.yml -e node=laptop-two -e rank=1: a healthy worker of rank 1 (empty stderr.log and
    stdout.log, as torchrun --tee 3 leaves them)."""
    inv, env = _case(tmp_path, {"laptop-one": "running", "laptop-two": "running"}, unreachable=False,
                     journalctl=True)
    logs = tmp_path / "base/laptop-two/runs/20261130-190000-abcd/logs/20261130-190000-abcd_x1/attempt_0/0"
    logs.mkdir(parents=True)
    for name in ("stderr.log", "stdout.log"):
        (logs / name).write_text("")
        os.utime(logs / name, (NOW - 50, NOW - 50))
    out = _play(inv, env, "logs.yml", "node=laptop-two", "rank=1", "lines=5")
    text = out.stdout + out.stderr
    assert out.returncode == 0, text
    assert "agent-laptop-two journal line 5" in text, text
    assert "no stderr output (a healthy worker writes none)" in text, text
    assert "its own lines are in its stdout" not in text, text
    assert "no stdout output: rank 1 prints no progress lines; rank 0 prints them" in text, text
    assert "-e rank=0" in text and "rank 1's newest record: val at step 40, world size 3" in text, text
    assert "the node's progress: laptop-two" in text, text
