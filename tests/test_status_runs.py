"""status.yml, attach.yml and collect.yml on a run that is not the laptops' current job, or not
running: an older run's rows come from its own records (not the unit of a later launch), a
stopped run whose unit systemd dropped is collected by attach.yml, collect says which run it takes
and refuses a running one unless a snapshot is asked for (issue 14, newcomer's findings)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from ddplab import runstate
from ddplab import status as st
from test_status_table import FAKE_JOURNALCTL, PLAYBOOK, RUN_ID, UNITS, _case, _play, filters, recs, table

OLD, NEW = RUN_ID, "20261201-101500-beef"


def _lines(r: list[dict]) -> str:
    return "".join(json.dumps(x) + "\n" for x in r)


def test_past_run_state_from_the_records_of_the_newest_launch():
    done = recs("a", 0, 10, end=True)
    assert st.past_run_state(done) == "succeeded"
    assert st.past_run_state(recs("a", 0, 10, failure="boom")) == "failed"
    assert st.past_run_state(recs("a", 0, 10)) == "interrupted"
    # a resumed run: the end of its first launch does not count for the second
    later = [{**r, "time": r["time"] + 1000} for r in recs("a", 0, 3)]
    assert st.past_run_state(done + later) == "interrupted"


def test_unit_holds_run_by_invocation_then_current_run(tmp_path):
    run = tmp_path / "runs" / OLD
    run.mkdir(parents=True)
    unit = {"LoadState": "loaded", "InvocationID": "inv-new"}
    assert st.unit_holds_run(run, {}) is None
    assert st.unit_holds_run(run, unit) is None  # nothing recorded anywhere
    (run / "invocations").write_text("inv-old\n")
    assert st.unit_holds_run(run, unit) is False
    (tmp_path / "current_run").write_text(f"{OLD}\n")  # launched, its invocation not recorded yet
    assert st.unit_holds_run(run, unit) is True
    (tmp_path / "current_run").write_text(f"{NEW}\n")
    assert st.unit_holds_run(run, unit) is False
    (run / "invocations").write_text("inv-old\ninv-new\n")
    assert st.unit_holds_run(run, unit) is True


def _two_runs(tmp_path: Path, old_end: bool = True) -> tuple[Path, dict]:
    """Two local laptops whose agent unit runs run NEW (invocation inv-new, current_run NEW) while
    the older run OLD (invocation inv-old) ended on both: its records hold an end (or not)."""
    inv, env = _case(tmp_path, {"laptop-x": "running", "laptop-y": "running"}, unreachable=False)
    for i, host in enumerate(("laptop-x", "laptop-y")):
        show = tmp_path / "units" / f"agent-{host}.show"
        show.write_text(show.read_text() + "InvocationID=inv-new\n")
        base = tmp_path / "base" / host
        old = recs(host, i, 300 if old_end else 120, end=old_end)
        old = [{**r, "time": r["time"] - 3600} for r in old]  # an hour before the new launch
        (base / "runs" / OLD / "metrics" / f"{host}-local0.jsonl").write_text(_lines(old))
        (base / "runs" / OLD / "invocations").write_text("inv-old\n")
        new = base / "runs" / NEW / "metrics"
        new.mkdir(parents=True)
        (new / f"{host}-local0.jsonl").write_text(_lines(
            [{**r, "run_id": NEW} for r in recs(host, i, 20)]))
        (base / "runs" / NEW / "invocations").write_text("inv-new\n")
        (base / "current_run").write_text(f"{NEW}\n")
    (tmp_path / "runs" / "current").unlink()
    (tmp_path / "runs" / NEW).mkdir()
    (tmp_path / "runs" / "current").symlink_to(NEW)
    return inv, env


def _rows(text: str) -> dict[str, list[str]]:
    return {line.split()[0]: line.split()[1:] for line in text.splitlines() if line.startswith(" laptop-")}


@pytest.mark.skipif(PLAYBOOK is None, reason="ansible-playbook is not installed (make venv)")
def test_status_of_an_older_run_reads_its_records_not_the_later_launchs_unit(tmp_path):
    """newcomer: `status.yml -e run_id=<an older run>` showed the unit states of a later run
    ("running") for a run that had ended an hour before."""
    inv, env = _two_runs(tmp_path)
    out = _play(inv, env, "status.yml", f"run_id={OLD}")
    text = out.stdout + out.stderr
    assert out.returncode == 0, text
    rows = _rows(text)
    assert rows["laptop-x"][:3] == ["ended", OLD, "300/300"], text
    assert rows["laptop-y"][:3] == ["ended", OLD, "300/300"], text
    assert f"run {OLD} is not the laptops' current job" in text and f"run {NEW}" in text, text
    # the store's line is the current job's, and says so (it said nothing: read as OLD's)
    assert (f"rendezvous store (the laptops' current job's, run {NEW}; not run {OLD}'s): stopped "
            "(port 29499)") in text, text
    # the current run still reads its unit
    out = _play(inv, env, "status.yml")
    text = out.stdout + out.stderr
    assert out.returncode == 0 and _rows(text)["laptop-x"][:3] == ["running", NEW, "20/300"], text
    assert "is not the laptops' current job" not in text, text
    assert "rendezvous store: stopped (port 29499)" in text, text


@pytest.mark.skipif(PLAYBOOK is None, reason="ansible-playbook is not installed (make venv)")
def test_status_of_an_older_run_cut_short_is_interrupted_and_not_a_failure(tmp_path):
    inv, env = _two_runs(tmp_path, old_end=False)
    out = _play(inv, env, "status.yml", f"run_id={OLD}")
    text = out.stdout + out.stderr
    assert out.returncode == 0, text
    assert _rows(text)["laptop-x"][:3] == ["interrupted", OLD, "120/300"], text


def test_a_running_job_without_a_step_says_starting_or_no_step_yet():
    """newcomer: right after a launch every cell read '-'."""
    unit = UNITS["running"]
    nothing = {"state": "running", "progress": st.node_progress([]), "unit": unit}
    assert table.row_of("laptop-a", nothing)["step"] == "starting"
    start = recs("laptop-a", 0, 0)[:1]
    started = {"state": "running", "progress": st.node_progress(start), "unit": unit}
    assert table.row_of("laptop-a", started)["step"] == "no step yet"
    ended = {"state": "succeeded", "progress": st.node_progress([]), "unit": UNITS["ended"]}
    assert table.row_of("laptop-a", ended)["step"] == "-"


def _one_running(tmp_path: Path) -> tuple[Path, dict]:
    return _case(tmp_path, {"laptop-run": "running", "laptop-end": "ended"}, unreachable=False,
                 journalctl=True)


@pytest.mark.skipif(PLAYBOOK is None, reason="ansible-playbook is not installed (make venv)")
@pytest.mark.parametrize("given", [(), ("collect_run_id=",)])
def test_collect_says_which_run_and_refuses_one_that_still_runs(tmp_path, given):
    """newcomer: collect.yml with an empty collect_run_id took runs/current, another user's live run,
    without saying so, and wrote its summary and report there."""
    inv, env = _one_running(tmp_path)
    runs = tmp_path / "runs"
    out = _play(inv, env, "playbooks/collect.yml", *given, f"collect_runs_dir={runs}")
    text = out.stdout + out.stderr
    assert out.returncode != 0, text
    assert f"collect: run {RUN_ID} (runs/current)" in text, text
    line = next(x for x in text.splitlines() if "still runs on" in x and x.startswith("[ERROR]"))
    assert f"run {RUN_ID} (runs/current) still runs on laptop-run: not collected" in line, text
    assert f"attach.yml -e run_id={RUN_ID}" in line and "-e collect_snapshot=true" in line, text
    assert not (runs / RUN_ID / "summary.json").exists() and not (runs / RUN_ID / "laptop-end").exists()


@pytest.mark.skipif(PLAYBOOK is None, reason="ansible-playbook is not installed (make venv)")
def test_collect_snapshot_of_a_running_run_is_labelled_running(tmp_path):
    inv, env = _one_running(tmp_path)
    runs = tmp_path / "runs"
    out = _play(inv, env, "playbooks/collect.yml", f"collect_run_id={RUN_ID}", "collect_snapshot=true",
                f"collect_runs_dir={runs}")
    text = out.stdout + out.stderr
    assert out.returncode == 0, text
    assert f"collect: run {RUN_ID} (-e collect_run_id)" in text, text
    summary = json.loads((runs / RUN_ID / "summary.json").read_text())
    assert (summary["outcome"], summary["running_on"]) == ("running", ["laptop-run"]), summary
    assert "RUNNING (a snapshot; it goes on on laptop-run)" in text, text
    assert "running (snapshot taken by collect)" in (runs / RUN_ID / "report.html").read_text()


@pytest.mark.skipif(PLAYBOOK is None, reason="ansible-playbook is not installed (make venv)")
def test_site_collect_after_a_launch_without_a_watch_leaves_the_run_running(tmp_path):
    """site.yml -e ddp_job_watch=false: the collect play that follows the launch says the run goes on
    and collects nothing (no failure)."""
    inv, env = _one_running(tmp_path)
    runs = tmp_path / "runs"
    out = _play(inv, env, "playbooks/collect.yml", "ddp_job_watch=false", f"collect_runs_dir={runs}")
    text = out.stdout + out.stderr
    assert out.returncode == 0, text
    assert "(launched with ddp_job_watch=false): not collected" in text, text
    assert not (runs / RUN_ID / "summary.json").exists(), text


def test_attach_plan_follows_only_a_run_an_agent_unit_speaks_of():
    stop = {"kind": "stop", "time": 1_800_000_000.0, "hosts": ["a", "b"]}
    running = {"state": "running", "unit_holds_run": True, "run_state": "running"}
    gone = {"state": "absent", "unit_holds_run": None, "run_state": "failed"}
    other = {"state": "running", "unit_holds_run": False, "run_state": "succeeded", "current_run": NEW}
    plan = filters.attach_plan({"a": running, "b": gone}, stop, OLD)
    assert plan["watch"] and not plan["other_job"] and plan["line"] == ""
    plan = filters.attach_plan({"a": gone, "b": gone}, stop, OLD)
    assert plan["states"] == {"a": "stopped", "b": "stopped"} and not plan["watch"]
    assert plan["line"].startswith(f"run {OLD} does not run any more (a: stopped, b: stopped; stopped by "
                                   "stop.yml at "), plan
    plan = filters.attach_plan({"a": other, "b": {"state": "unreachable"}}, {}, OLD)
    assert plan["states"] == {"a": "succeeded", "b": "unreachable"} and plan["other_job"]
    assert plan["line"] == (f"run {OLD} does not run any more (a: ended, b: unreachable): nothing to follow; "
                            f"it is collected now (the trainers' agents run run {NEW})")


@pytest.mark.skipif(PLAYBOOK is None, reason="ansible-playbook is not installed (make venv)")
def test_attach_collects_a_stopped_run_whose_unit_systemd_dropped(tmp_path):
    """newcomer: attach.yml refused a run stop.yml had stopped once systemd had dropped its agent
    unit ('no job of run R on any trainer'): it says the run was stopped and collects it."""
    inv, env = _case(tmp_path, {"laptop-x": "absent", "laptop-y": "absent"}, unreachable=False,
                     journalctl=True)
    for i, host in enumerate(("laptop-x", "laptop-y")):
        m = tmp_path / "base" / host / "runs" / RUN_ID / "metrics"
        m.mkdir(parents=True)
        (m / f"{host}-local0.jsonl").write_text(_lines(recs(host, i, 40, failure="Terminated: SIGTERM")))
    events = [{"time": 1.0, "kind": "launch", "run_id": RUN_ID, "hosts": ["laptop-x", "laptop-y"]},
              {"time": recs("x", 0, 40)[-1]["time"], "kind": "stop", "run_id": RUN_ID,
               "hosts": ["laptop-x", "laptop-y"]}]
    runs = tmp_path / "runs"
    (runs / RUN_ID / "events.jsonl").write_text(_lines(events))
    out = _play(inv, env, "attach.yml", "ddp_job_watch_interval_s=1", "ddp_job_watch_timeout_s=5",
                f"collect_runs_dir={runs}", f"report_runs_dir={runs}")
    text = out.stdout + out.stderr
    assert out.returncode == 0, text
    assert (f"run {RUN_ID} does not run any more (laptop-x: stopped, laptop-y: stopped; stopped by stop.yml "
            "at ") in text, text
    assert "Watch the training" not in text, text
    assert json.loads((runs / RUN_ID / "summary.json").read_text())["outcome"] == "stopped"


@pytest.mark.skipif(PLAYBOOK is None, reason="ansible-playbook is not installed (make venv)")
def test_attach_to_an_older_run_collects_it_and_leaves_the_running_job_and_its_store(tmp_path):
    inv, env = _two_runs(tmp_path)
    (tmp_path / "bin" / "journalctl").write_text(FAKE_JOURNALCTL)
    (tmp_path / "bin" / "journalctl").chmod(0o755)
    runs = tmp_path / "runs"
    out = _play(inv, env, "attach.yml", f"run_id={OLD}", "ddp_job_watch_interval_s=1",
                "ddp_job_watch_timeout_s=5", f"collect_runs_dir={runs}", f"report_runs_dir={runs}")
    text = out.stdout + out.stderr
    assert out.returncode == 0, text
    assert (f"run {OLD} does not run any more (laptop-x: ended, laptop-y: ended): nothing to follow; it is "
            f"collected now (the trainers' agents run run {NEW})") in text, text
    assert "Watch the training" not in text, text
    stop = text.split("TASK [Stop the store]", 1)[1].split("TASK [", 1)[0]
    assert "skipping: [controller]" in stop, text  # the running run's store stays
    assert json.loads((runs / OLD / "summary.json").read_text())["outcome"] == "finished"


@pytest.mark.skipif(PLAYBOOK is None, reason="ansible-playbook is not installed (make venv)")
def test_logs_of_a_healthy_worker_say_no_stderr_and_show_its_stdout(tmp_path):
    """newcomer: logs.yml showed a healthy worker's empty stderr as '(empty)', not where its lines
    are (torchrun --tee 3: stdout.log beside stderr.log, and the journal)."""
    inv, env = _one_running(tmp_path)
    worker = tmp_path / f"base/laptop-run/runs/{RUN_ID}/logs/{RUN_ID}_x1/attempt_0/0"
    worker.mkdir(parents=True)
    (worker / "stderr.log").write_text("")
    (worker / "stdout.log").write_text("[ddplab] one\n[ddplab] two\n[ddplab] three\n")
    out = _play(inv, env, "logs.yml", "node=laptop-run", "rank=0", "lines=2")
    text = out.stdout + out.stderr
    assert out.returncode == 0, text
    assert "(empty)" not in text, text
    assert "no stderr output (a healthy worker writes none)" in text, text
    assert "attempt_0/0/stdout.log (last 2 lines)" in text and "[ddplab] three" in text, text
    assert "[ddplab] one" not in text, text


def test_run_endpoints_from_run_json_and_the_agents_command_line(tmp_path):
    run = tmp_path / "runs" / OLD
    run.mkdir(parents=True)
    unit = {"InvocationID": "i",
            "ExecStart": "{ path=/v/python ; argv[]=/v/python -m ddplab.agent --nnodes 1:3 "
                         "--rdzv-backend c10d --rdzv-endpoint 10.89.0.1:29411 --rdzv-id r ; }"}
    assert st.run_endpoints(run, unit, True) == {"store": "10.89.0.1:29411", "lighthouse": None}
    assert st.run_endpoints(run, unit, False) == {"store": None, "lighthouse": None}  # a later run's unit
    (run / "run.json").write_text(json.dumps({"fault_tolerance": "per_step",
                                              "ft_lighthouse": "http://10.89.0.1:29511"}))
    assert st.run_endpoints(run, unit, True) == {"store": None, "lighthouse": "http://10.89.0.1:29511"}


def test_where_lines_say_where_the_state_was_read_and_what_the_run_recorded_elsewhere():
    running = {"state": "running", "unit_holds_run": True,
               "endpoints": {"store": None, "lighthouse": "http://10.89.0.1:29511"}}
    lighthouse = {"running": False, "port": 29510}
    lines = table.where_lines({"a": running}, {}, lighthouse, "/c/runs/.rdzv", "R")
    assert lines[0] == "store and lighthouse state read in /c/runs/.rdzv on this controller"
    assert lines[1] == ("run R's lighthouse http://10.89.0.1:29511 (recorded on a) is not the one read here "
                        "(port 29510); fix: -e rendezvous_lighthouse_port=29511 (and -e rendezvous_state_dir="
                        "<the checkout that launched it>/runs/.rdzv)")
    same = {**running, "endpoints": {"lighthouse": "http://10.89.0.1:29510"}}
    lines = table.where_lines({"a": same}, {}, lighthouse, "/c/runs/.rdzv", "R")
    assert lines[1].startswith("run R's lighthouse http://10.89.0.1:29510 (recorded on a) runs, but "
                               "/c/runs/.rdzv has no running one: launched from another checkout?"), lines
    assert table.where_lines({"a": same}, {}, {"running": True, "port": 29510}, "/c", "R")[1:] == []


@pytest.mark.skipif(PLAYBOOK is None, reason="ansible-playbook is not installed (make venv)")
def test_status_says_where_it_read_the_store_and_the_store_the_run_was_launched_with(tmp_path):
    """newcomer: `make status` read the store's state only in this checkout's state folder and did
    not say so, whatever store the job used."""
    inv, env = _one_running(tmp_path)
    show = tmp_path / "units" / "agent-laptop-run.show"
    show.write_text(show.read_text() + "ExecStart={ path=/v/python ; argv[]=/v/python -m ddplab.agent "
                    "--rdzv-endpoint 127.0.0.1:29411 --rdzv-id r ; }\n")
    out = _play(inv, env, "status.yml")
    text = out.stdout + out.stderr
    assert out.returncode == 0, text
    assert f"store and lighthouse state read in {tmp_path / 'rdzv'} on this controller" in text, text
    assert (f"run {RUN_ID}'s store 127.0.0.1:29411 (recorded on laptop-run) is not the one read here "
            "(port 29499); fix: -e rendezvous_port=29411") in text, text


@pytest.mark.skipif(PLAYBOOK is None, reason="ansible-playbook is not installed (make venv)")
def test_a_refusal_is_one_line_without_ansibles_origin_block(tmp_path):
    """newcomer: status.yml's refusals carried Ansible's 'Origin:' block (the task file and five
    lines of its YAML) under the message (callback ddp_lab.cluster.ddp_lab, ansible.cfg)."""
    inv, env = _one_running(tmp_path)
    out = _play(inv, env, "status.yml", "run_id=nonsense")
    text = out.stdout + out.stderr
    assert out.returncode != 0, text
    lines = text.splitlines()
    refusal = "[ERROR]: Task failed: Action failed: no trainer holds run nonsense"
    at = next(i for i, line in enumerate(lines) if line.startswith(refusal))
    assert lines[at + 1].startswith("fatal: [laptop-"), text
    assert "Origin:" not in text and "assertion" not in text, text


def test_collect_and_the_table_ask_run_state_of_whether_the_run_runs():
    """'Does run R run on this node' had three rules (run_state_of, collect's Jinja, the table's
    any(...)): collect's refusal (ddp_job_running_hosts) and the table's where-lines now ask
    run_state_of, the one home."""
    running = {"state": "running", "unit_holds_run": True, "run_state": "running"}
    other = {"state": "running", "unit_holds_run": False, "run_state": "succeeded", "current_run": NEW}
    gone = {"state": "absent", "unit_holds_run": None, "run_state": "failed"}
    hostvars = {"a": {"ddp_job_status": running}, "b": {"ddp_job_status": other},
                "c": {"ddp_job_status": gone},
                "d": {"ddp_job_status": {"skipped": True}}, "e": {}}
    hosts = ["a", "b", "c", "d", "e", "f"]
    assert filters.running_hosts(hosts, hostvars) == ["a"]
    assert filters.running_hosts(hosts, hostvars) == [
        h for h in hosts if runstate.node_state(hostvars.get(h, {}).get("ddp_job_status"), h) == "running"]
    assert filters.FilterModule().filters()["ddp_job_running_hosts"] is filters.running_hosts
    collect = (Path(__file__).parents[1] / "roles/collect/tasks/main.yml").read_text()
    assert "ddp_job_running_hosts(hostvars)" in collect and "selectattr('1.state'" not in collect
    # the table: a lighthouse another run's unit recorded is not "running while the folder has none"
    lighthouse = {"running": False, "port": 29510}
    ended = {**other, "endpoints": {"lighthouse": "http://10.89.0.1:29510"}}
    assert table.where_lines({"b": ended}, {}, lighthouse, "/c", "R")[1:] == []
    live = {**running, "endpoints": {"lighthouse": "http://10.89.0.1:29510"}}
    assert "runs, but /c has no running one" in table.where_lines({"a": live}, {}, lighthouse, "/c", "R")[1]
