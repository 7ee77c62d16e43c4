"""The decisions of collect (where the run comes from, whether anybody holds it) and attach.yml
(whose statuses, whether there is a job to attach to) are filters with tests, not Jinja in the
task files (review, session 8: ``__collect_source`` and attach.yml's dict/zip/extract and reject
expressions)."""

from __future__ import annotations

import re
import time

import pytest
from ansible_collections.ddp_lab.cluster.plugins.filter import collect, ddp_job
from test_status_table import ROOT

# a Jinja expression that is more than a variable passed through filters: inline if/else (also split
# over lines), dict()/zip()/map('extract') building, list building (literal lists joined with +,
# product, map('join'), map('regex_replace') over a list), reject/select tests
LOGIC = re.compile(r"\bif\b.*\belse\b|dict\(|\bzip\b|'extract'|reject\(|selectattr\("
                   r"|\]\s*\+|\+\s*\[|\bproduct\b|map\(\s*'(?:join|regex_replace)'", flags=re.S)


def _expressions(path: str) -> list[str]:
    return re.findall(r"\{\{(.*?)\}\}", (ROOT / path).read_text(), flags=re.S)


def test_collect_source():
    assert collect.collect_source("r1", "r0") == "-e collect_run_id"
    assert collect.collect_source("", "r0") == "the run this play launched or followed"
    assert collect.collect_source("", "") == "runs/current"
    assert collect.collect_source(None, None) == "runs/current"


def test_collect_missing_run_names_where_it_looked():
    dirs = {"laptop-a": {"stat": {"exists": False}}, "laptop-b": {"unreachable": True, "msg": "no route"}}
    line = collect.collect_missing_run(dirs, {"stat": {"exists": False}}, "r9", "/var/lib/ddp-lab", "/x/runs")
    assert line == ("no trainer and not the controller holds run r9 (no /var/lib/ddp-lab/runs/r9 on "
                    "laptop-a; not reached: laptop-b; no /x/runs/r9 here); fix: name a run of /x/runs or of "
                    "the trainers' /var/lib/ddp-lab/runs with -e collect_run_id=<run id>, or bring the "
                    "laptops not reached back")
    assert "not reached" not in collect.collect_missing_run({"laptop-a": {"stat": {}}}, {}, "r9", "/b", "/r")
    held = {**dirs, "laptop-a": {"stat": {"exists": True, "isdir": True}}}
    assert collect.collect_missing_run(held, {}, "r9", "/b", "/r") == ""
    home = {"stat": {"isdir": True}}  # collected before
    assert collect.collect_missing_run(dirs, home, "r9", "/b", "/r") == ""


def test_collect_registered_reads_each_hosts_result_in_order():
    hostvars = {"b": {"__x": {"stat": 1}}, "a": {"__x": {"stat": 2}}, "c": {}}
    found = collect.collect_registered(["a", "b", "c"], hostvars, "__x")
    assert found == {"a": {"stat": 2}, "b": {"stat": 1}, "c": {}}


def test_statuses_and_the_attach_refusal():
    running = {"state": "running", "unit_holds_run": True, "run_state": "running"}
    hostvars = {"a": {"ddp_job_status": running}, "b": {}}
    assert ddp_job.statuses_of(["a", "b"], hostvars) == {"a": running, "b": None}
    assert ddp_job.attach_plan(ddp_job.statuses_of(["a", "b"], hostvars), {}, "r1")["problem"] == ""
    none = ddp_job.attach_plan({"a": None, "b": {"state": "unreachable"}}, {}, "r1")
    assert none["problem"] == ("no job of run r1 on any trainer; fix: start one with site.yml, or name "
                               "the run with -e run_id=<run id> (see runs/)")
    assert "(none: no runs/current" in ddp_job.attach_plan({"a": None}, {}, "")["problem"]


def test_the_logic_check_catches_split_if_else_and_list_building():
    """Review, session 9: an if/else over two lines and node.yml's list building passed the check."""
    caught = [" a\n if b\n else c ", " [x ~ '/logs'] + (f | map('regex_replace', '^', d) | list) ",
              " n | product(['', '.sha256']) | map('join') | list ", " x + ['a'] "]
    assert [bool(LOGIC.search(e)) for e in caught] == [True] * len(caught)
    passed = [" d | collect_pack_paths(files, newest) ", " __collect_ckpts.files | collect_newest(n) "]
    assert [bool(LOGIC.search(e)) for e in passed] == [False] * len(passed)


def test_collect_pack_paths():
    assert collect.collect_pack_paths("/b/runs/r1/", ["run.json", "invocations"],
                                      ["/b/runs/r1/checkpoints/ckpt-00000300.pt"]) == [
        "/b/runs/r1/logs", "/b/runs/r1/metrics", "/b/runs/r1/run.json", "/b/runs/r1/invocations",
        "/b/runs/r1/checkpoints/ckpt-00000300.pt", "/b/runs/r1/checkpoints/ckpt-00000300.pt.sha256"]
    assert collect.collect_pack_paths("/r", [], []) == ["/r/logs", "/r/metrics"]


def test_no_jinja_logic_left_in_the_collect_and_attach_tasks():
    tasks = [f"roles/collect/tasks/{t}.yml" for t in ("main", "take", "node")]
    tasks += [f"roles/ddp_job/tasks/{t}.yml" for t in ("attach", "logs", "table")]
    for path in tasks:
        logic = [e.strip() for e in _expressions(path) if LOGIC.search(e)]
        assert logic == [], (path, logic)


def test_collect_journal_argv_takes_the_runs_invocations():
    import base64

    content = base64.b64encode(b"aa11\nbb22\n\n").decode()
    assert collect.collect_journal_argv(content, "ddp-lab-agent") == [
        "journalctl", "--no-pager", "-o", "short-iso", "_SYSTEMD_INVOCATION_ID=aa11",
        "_SYSTEMD_INVOCATION_ID=bb22", "+", "INVOCATION_ID=aa11", "INVOCATION_ID=bb22"]
    for nothing in ("", None, base64.b64encode(b"\n").decode()):  # no invocations file, or an empty one
        assert collect.collect_journal_argv(nothing, "u") == ["journalctl", "--no-pager", "-o", "short-iso",
                                                              "-u", "u"]


def test_collect_newest_checkpoints_snapshot_hosts_and_summary_lines():
    files = [{"path": "/r/checkpoints/ckpt-00000200.pt"}, {"path": "/r/checkpoints/ckpt-00000100.pt"},
             {"path": "/r/checkpoints/ckpt-00000300.pt"}]
    assert collect.collect_newest(files, 1) == ["/r/checkpoints/ckpt-00000300.pt"]
    assert collect.collect_newest(files, "2") == ["/r/checkpoints/ckpt-00000200.pt",
                                                  "/r/checkpoints/ckpt-00000300.pt"]
    assert collect.collect_newest(files, 0) == [] and collect.collect_newest([], 3) == []
    with pytest.raises(ValueError, match=r"^collect_checkpoints must be a whole number .*got 'two'"):
        collect.collect_newest(files, "two")
    assert collect.collect_snapshot_hosts(["a", "b"], True) == "a,b"
    assert collect.collect_snapshot_hosts(["a", "b"], "false") == ""
    assert collect.collect_summary_lines(["run r1 - finished"], "/runs/r1", True) == [
        "run r1 - finished", "report: /runs/r1/report.html"]
    assert collect.collect_summary_lines(["run r1 - finished"], "/runs/r1", False) == ["run r1 - finished"]


def test_collect_run_over_only_when_every_trainer_was_read_and_none_belongs_to_another_run():
    ended = {"state": "succeeded", "unit_holds_run": True, "current_run": "r1", "progress": {"age_s": 30.0}}
    over = collect.collect_run_over({"a": ended, "b": ended}, "r1", now=1000.0)
    assert over == {"over": True, "why": "it ended on every trainer", "last_record": 970.0}
    off = collect.collect_run_over({"a": ended, "b": {"state": "unreachable"}}, "r1", now=1000.0)
    assert off["over"] is False and off["why"] == "not read on b (it may still run there)"
    running = {**ended, "state": "running"}
    assert collect.collect_run_over({"a": ended, "b": running}, "r1")["why"] == "it still runs on b"
    later = {**ended, "current_run": "r2"}
    why = collect.collect_run_over({"a": ended, "b": later}, "r1")["why"]
    assert why == "a later launch holds b (run r2)"


def test_collect_services_of_run_by_their_start():
    store = {"running": True, "port": 29400, "started_at": 900.0}
    assert collect.collect_services_of_run({"running": False}, {}, 950.0) == {"stop": False, "line": ""}
    assert collect.collect_services_of_run(store, {}, 950.0)["stop"] is True
    lighthouse = {"running": True, "port": 29510, "started_at": 990.0}
    late = collect.collect_services_of_run(store, lighthouse, 950.0)
    assert late == {"stop": False, "line": "rendezvous store on port 29400 and torchft lighthouse on port "
                                           "29510 left running: the torchft lighthouse started after the "
                                           "run's last record (a later launch's)"}


def test_collect_services_of_run_without_records_stops_nothing():
    """Review, session 9: with no record of the run on any trainer nothing tells its store from a
    later launch's that started it but has not shipped current_run yet: it stays."""
    store = {"running": True, "port": 29400, "started_at": time.time()}
    for fresh in (store, {**store, "started_at": 0.0}):
        kept = collect.collect_services_of_run(fresh, {}, None)
        assert kept["stop"] is False, kept
        assert kept["line"].startswith("rendezvous store on port 29400 left running: the run has no record "
                                       "on any trainer"), kept
