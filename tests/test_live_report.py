"""The live report (issue 14 item 5) and the run's outcome: the page the watch rewrites while the job
runs (meta refresh, banner) and the final one (neither); which train loss each key figure gives;
the generated sample; steps (not records) per world size; a run ended by stop.yml is "stopped";
summary.json names the report that exists."""

import json
import re
from pathlib import Path

from ddplab.controller import report, summary
from ddplab.controller.report import data
from ddplab.controller.rundir import load_run
from ddplab.runstate import run_outcome

T0 = 1_790_000_000.0
LOG_EVERY = 10


def rec(event, t, rank=0, ws=2, **kw):
    return {"event": event, "time": T0 + t, "host": f"n{rank}", "rank": rank, "local_rank": 0,
            "world_size": ws, "restart_count": 0, **kw}


def make_run(root: Path, last_step=350, max_steps=350, end=True, sample="ROMEO:\nO <b>sweet</b> & sour\n",
             failure=False) -> Path:
    """Two nodes (n0, n1), steps logged every LOG_EVERY steps; the last minibatch's loss (1.851) differs
    from the trainer's evaluation estimate (1.877), as in the run the issue quotes."""
    run = root / "run-live"
    for rank in (0, 1):
        rs = [rec("start", 0, rank, resumed_from_step=0, max_steps=max_steps, params=8e5,
                  batch_policy="keep_per_rank")]
        for s in range(LOG_EVERY, last_step + 1, LOG_EVERY):
            loss = 1.851 if s == last_step else 3.0 - s / 400
            rs.append(rec("step", s, rank, step=s, loss=loss, compute_s=0.2, allreduce_s=0.05,
                          step_time_s=0.25, tokens_per_s=9000.0))
            if s % 100 == 0 or (end and s == last_step):
                estimate = 1.877 if s == last_step else 2.1
                rs.append(rec("val", s + 0.5, rank, step=s, val_loss=2.0, train_loss=estimate))
        if failure:
            rs.append(rec("failure", last_step + 1, rank, step=last_step, error="stopped by SIGTERM",
                          cause="signal"))
        if end:
            rs.append(rec("end", last_step + 2, rank, step=last_step, final_train_loss=1.877,
                          final_val_loss=1.98, wall_s=400.0))
        d = run / f"n{rank}" / "metrics"
        d.mkdir(parents=True)
        (d / f"n{rank}-local0.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rs))
    if sample is not None:
        (run / "n0" / "sample.txt").write_text(sample)
    launch = {"time": T0 - 1, "kind": "launch", "run_id": "run-live"}
    (run / "events.jsonl").write_text(json.dumps(launch) + "\n")
    return run


def text_of(page: str) -> str:
    return re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", page))


def test_live_page_reloads_and_says_so_the_final_page_does_not(tmp_path):
    run = make_run(tmp_path, last_step=120, max_steps=350, end=False)
    assert report.main([str(run), "--live", "10"]) == 0
    live = (run / "report.html").read_text()
    assert '<meta http-equiv="refresh" content="10">' in live
    assert re.search(r"live, step 120 of 350, updated \d\d:\d\d:\d\d", text_of(live))
    assert "running" in text_of(live) and "incomplete" not in text_of(live)
    # the plots are reloaded with the page, not taken from the browser's cache
    assert re.search(r'src="plots/loss\.png\?t=\d+"', live)
    assert report.main([str(run)]) == 0
    final = (run / "report.html").read_text()
    assert "http-equiv" not in final and "live, step" not in final and 'class="live"' not in final
    assert 'src="plots/loss.png"' in final


def test_the_page_the_watch_leaves_at_the_end_no_longer_reloads_and_names_collect(tmp_path):
    """Issue 27 item 18: site.yml --tags train watched a run to 600/600 and left report.html saying
    "live, step 600 of 600 ... reloads every 10 s while the job runs", reloading forever. The watch's
    last build (--ended) says the job ended and how to collect it, and does not reload."""
    run = make_run(tmp_path, last_step=350, max_steps=350, end=True)
    (run / ".watch").mkdir()
    for host in ("n0", "n1"):
        (run / host).rename(run / ".watch" / host)
    assert report.main([str(run), "--metrics", str(run / ".watch"), "--ended"]) == 0
    page = (run / "report.html").read_text()
    text = text_of(page)
    assert "http-equiv" not in page and "reloads every" not in text, text
    assert re.search(r"the job ended: step 350 of 350, last record \d\d:\d\d:\d\d; not collected yet: "
                     r"ansible-playbook playbooks/collect.yml -e collect_run_id=run-live writes the final "
                     r"report", text), text
    assert re.findall(r'class="badge ([a-z]+)">([^<]*)', page) == [("ok", "finished")]
    assert report.main([str(run), "--metrics", str(run / ".watch"), "--ended", "--live", "5"]) == 2


def test_live_interval_below_one_second_is_bad_input(tmp_path, capsys):
    run = make_run(tmp_path)
    assert report.main([str(run), "--live", "0"]) == report.EXIT_BAD_INPUT
    assert "at least 1 s" in capsys.readouterr().err
    assert not (run / "report.html").exists()


def test_key_figures_say_which_train_loss(tmp_path):
    run = make_run(tmp_path)
    summary.write_summary(run, summary.build_summary(run))
    page, _ = report.build_report(run)
    text = text_of(page.read_text())
    # the last minibatch (the progress lines, the plot's line) and the evaluation estimate, each named
    assert "train loss: last minibatch, step 350 1.851" in text
    assert "train loss: evaluation estimate, step 350 1.877" in text
    tl = data.train_loss(load_run(run))
    assert (tl.minibatch, tl.minibatch_step, tl.estimate, tl.estimate_step) == (1.851, 350, 1.877, 350)
    assert data.loss_per_step(load_run(run))[-1] == (350, 1.851)  # what the loss plot ends on
    s = json.loads((run / "summary.json").read_text())
    assert (s["final_step_loss"], s["final_train_loss"]) == (1.851, 1.877)
    assert "last minibatch" in summary.human_summary(s) and "evaluation estimate" in summary.human_summary(s)


def test_sample_text_is_in_the_report_escaped(tmp_path):
    run = make_run(tmp_path)
    page = report.build_report(run)[0].read_text()
    assert "Generated sample" in page and "n0/sample.txt" in page
    assert "ROMEO:\nO &lt;b&gt;sweet&lt;/b&gt; &amp; sour" in page
    run2 = make_run(tmp_path / "b", sample=None, end=False)
    assert "No sample.txt" in report.build_report(run2, refresh_s=5)[0].read_text()


def test_steps_column_counts_steps_not_records(tmp_path):
    run = make_run(tmp_path)
    rows = data.per_world_size(load_run(run))
    assert [(r.world_size, r.steps) for r in rows] == [(2, 350)]  # 35 step records, 350 steps


def test_steps_per_world_size_across_a_restart(tmp_path):
    run = tmp_path / "r"
    rs = [rec("start", 0, ws=3, resumed_from_step=0), rec("step", 1, ws=3, step=10),
          rec("step", 2, ws=3, step=20), rec("failure", 3, ws=3, step=24),
          rec("start", 10, ws=2, resumed_from_step=20), rec("step", 11, ws=2, step=30),
          rec("end", 12, ws=2, step=35)]
    (run / "n0" / "metrics").mkdir(parents=True)
    (run / "n0" / "metrics" / "a.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rs))
    # 24 steps at N=3; 15 at N=2 (steps 21-24 redone after resuming from the step-20 checkpoint)
    assert data.steps_per_world_size(load_run(run)) == {3: 24, 2: 15}


def test_a_run_ended_by_stop_yml_is_stopped_not_failed(tmp_path):
    run = make_run(tmp_path, last_step=200, max_steps=350, end=False, failure=True, sample=None)
    loaded = load_run(run)
    assert run_outcome(loaded.records, loaded.events) == "failed"  # no mark: a failure
    with open(run / "events.jsonl", "a") as fh:
        fh.write(json.dumps({"time": T0 + 200.5, "kind": "stop", "run_id": "run-live"}) + "\n")
    assert summary.main(["build", str(run)]) == 0
    s = json.loads((run / "summary.json").read_text())
    assert s["outcome"] == "stopped"
    assert "stopped by stop.yml" in summary.human_summary(s)
    page = report.build_report(run)[0].read_text()
    assert re.findall(r'class="badge ([a-z]+)">([^<]*)', page) == [("warn", "stopped by stop.yml")]


def test_a_stop_before_a_resume_does_not_label_the_resumed_run(tmp_path):
    run = make_run(tmp_path, last_step=200, end=False, failure=True, sample=None)
    with open(run / "events.jsonl", "a") as fh:
        fh.write(json.dumps({"time": T0 - 100, "kind": "stop"}) + "\n")  # an earlier launch's stop
    loaded = load_run(run)
    assert run_outcome(loaded.records, loaded.events) == "failed"


def test_summary_names_the_report_written_after_it(tmp_path):
    """collect: summary build, then the final report: summary.json's report is the page's path."""
    run = make_run(tmp_path)
    assert summary.main(["build", str(run)]) == 0
    assert json.loads((run / "summary.json").read_text())["report"] is None  # not written yet
    out, _ = report.build_report(run)
    s = json.loads((run / "summary.json").read_text())
    assert s["report"] == "report.html" and (run / s["report"]) == out and out.is_file()
    assert s["outcome"] == "finished" and s["steps_completed"] == 350  # the rest is kept


def test_final_report_replaces_the_live_copy(tmp_path):
    """kill-node.yml left a page from its live copies (.live, fewer steps): the rebuild from the
    collected folder has the collected figures and no live note."""
    run = make_run(tmp_path)
    live = run / ".live"
    (live / "n0" / "metrics").mkdir(parents=True)
    lines = (run / "n0" / "metrics" / "n0-local0.jsonl").read_text().splitlines()
    short = [json.loads(x) for x in lines[:20]]
    (live / "n0" / "metrics" / "n0-local0.jsonl").write_text("".join(json.dumps(r) + "\n" for r in short))
    assert report.main([str(run), "--metrics", str(live)]) == 0
    assert "copies taken while the run went on" in (run / "report.html").read_text()
    summary.main(["build", str(run)])
    assert report.main([str(run)]) == 0
    text = text_of((run / "report.html").read_text())
    assert "copies taken while the run went on" not in text and "steps completed 350 of 350" in text


def test_report_and_summary_give_the_same_evaluation(tmp_path):
    """Without an end record both take the newest evaluation by time (one rule:
    summary.final_evaluation), also when the newest is not the highest step."""
    run = tmp_path / "r"
    recs = {"n0": [rec("start", 0, 0, ws=1, max_steps=500), rec("step", 1, 0, ws=1, step=300, loss=2.0),
                   rec("val", 30, 0, ws=1, step=300, val_loss=2.2, train_loss=2.1)],
            "n1": [rec("start", 0, 1, ws=1, max_steps=500), rec("step", 1, 1, ws=1, step=400, loss=1.9),
                   rec("val", 20, 1, ws=1, step=400, val_loss=2.15, train_loss=2.05)]}
    for host, rs in recs.items():
        (run / host / "metrics").mkdir(parents=True)
        (run / host / "metrics" / "m.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rs))
    assert summary.main(["build", str(run)]) == 0
    s = json.loads((run / "summary.json").read_text())
    text = text_of(report.build_report(run)[0].read_text())
    assert (s["final_train_loss"], s["final_val_loss"]) == (2.1, 2.2)
    assert "train loss: evaluation estimate, step 300 2.100" in text
    assert "val loss: evaluation, step 300 2.200" in text
