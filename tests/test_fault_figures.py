"""One figure, one value: kill-node's measurement, summary.json and the report agree, and the
report's "no training" bands say what caused them (issue #14, the newcomer's findings).

Fixtures (copied from runs/ on the lab, read-only here): ``torchelastic_faults_7570`` (torchelastic,
log_interval 10: kill-agent laptop-a, its rejoin, poweroff laptop-b, its rejoin, stop.yml, a resume
to 1100 steps) and ``per_step_cut_off_9e9b`` (per_step: a 200 s partition of laptop-c, a resume).
"""

from __future__ import annotations

import html
import json
import shutil
from pathlib import Path

import pytest
from ddplab import faults
from ddplab.controller import rundir
from ddplab.controller import summary as sm
from ddplab.controller.report import data, load_run
from test_faults import AB, ABC, T0, Run

FIXTURES = Path(__file__).resolve().parent / "fixtures"
TE = FIXTURES / "torchelastic_faults_7570"
PS = FIXTURES / "per_step_cut_off_9e9b"


def copy_run(src: Path, dest: Path) -> Path:
    shutil.copytree(src, dest)
    return dest


def live_copy(run_dir: Path, cut: dict[str, float], events_until: float) -> Path:
    """``run_dir/.live`` as kill-node.yml's fetch leaves it: each host's records up to ``cut[host]``
    (a node that was down keeps the copy of an earlier fetch); events.jsonl up to ``events_until``."""
    ev = run_dir / "events.jsonl"
    kept = [x for x in ev.read_text().splitlines() if json.loads(x)["time"] <= events_until]
    ev.write_text("".join(x + "\n" for x in kept))
    for host_dir in rundir.host_dirs(run_dir):
        for f in (host_dir / "metrics").glob("*.jsonl"):
            keep = [line for line in f.read_text().splitlines()
                    if json.loads(line)["time"] <= cut[host_dir.name]]
            out = run_dir / ".live" / host_dir.name / "metrics" / f.name
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text("".join(x + "\n" for x in keep))
    return run_dir / ".live"


def test_poweroff_detection_is_one_value_in_kill_node_and_the_summary(tmp_path, capsys):
    """The newcomer's kill-node line said poweroff detected 1.9 s, summary.json 1.6 s: the summary
    counted the powered-off node's own SIGTERM failure record, which kill-node could not read."""
    run_dir = copy_run(TE, tmp_path / "run")
    events = rundir.load_events(run_dir)
    inj = [e for e in events if e["kind"] == "fault"]
    rejoin_a, poweroff = inj[1]["time"], inj[2]["time"]
    # kill-node of the poweroff fetches a and c 40 s after it; b is off: its copy is the rejoin's
    cut = {"laptop-a": poweroff + 40, "laptop-c": poweroff + 40, "laptop-b": rejoin_a + 30}
    live = live_copy(run_dir, cut, poweroff)
    assert sm.main(["faults", str(run_dir), "--metrics", str(live), "--last", "--json", "--no-write"]) == 0
    (kill_node,) = json.loads(capsys.readouterr().out)
    (run_dir / "events.jsonl").write_text((TE / "events.jsonl").read_text())  # the collected run's
    summary = sm.build_summary(run_dir)
    collected = summary["faults"][2]
    assert (kill_node["mode"], collected["mode"]) == ("poweroff", "poweroff")
    for key in ("detected_s", "recovered_s", "steps_lost", "restarts", "last_step_before",
                "world_size_before", "world_size_after", "world_size_path", "outcome"):
        assert kill_node[key] == collected[key], key
    assert collected["detected_by"] == "failure on laptop-a"
    assert collected["detected_s"] == pytest.approx(1.865, abs=1e-3)
    # the human summary prints the same value
    assert ("fault poweroff laptop-b: world size 3->2, detected 1.9 s, recovered 20.6 s"
            in sm.human_summary(summary))


def test_kill_node_output_names_the_records_it_read_and_the_node_that_was_down(tmp_path, capsys):
    run_dir = copy_run(TE, tmp_path / "run")
    inj = [e for e in rundir.load_events(run_dir) if e["kind"] == "fault"]
    live = live_copy(run_dir, {"laptop-a": inj[2]["time"] + 40, "laptop-c": inj[2]["time"] + 40,
                               "laptop-b": inj[1]["time"] + 30}, inj[2]["time"])
    assert sm.main(["faults", str(run_dir), "--metrics", str(live), "--last", "--no-write",
                    "--down", "laptop-b"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[1].startswith("poweroff  laptop-b")
    line = out[-1]
    assert line.startswith("measured from the records of laptop-a (to ") and "laptop-c (to " in line
    assert "down, not read now: laptop-b (an older copy to " in line
    assert "measured again from every node's records when the run is collected" in line


def test_a_resume_ends_a_faults_window(tmp_path):
    """A job that ended after a fault and was resumed later: the resume's new workers are no
    recovery from the fault (before: 'recovered' after 100 s, restarts counting the resume's)."""
    run = Run(tmp_path)
    run.start(ABC, T0 - 1)
    run.steps(ABC, 1, 10, T0)
    run.fault("kill-worker", "laptop-b", T0 + 9.5, rank=1)
    run.failure("laptop-a", T0 + 9.7, 0, 3, step=10, error="no restart left")
    with (run.dir / "events.jsonl").open("a") as fh:
        fh.write(json.dumps({"time": T0 + 100, "kind": "resume", "run_id": "r1"}) + "\n")
    run.start(ABC, T0 + 110, resumed_from_step=10)
    run.steps(ABC, 11, 20, T0 + 112)
    (m,) = run.measures()
    assert m.outcome == "not_recovered" and m.recovered_s is None and m.restarts == 0


def _logged_to_50_then_kill(tmp_path, event: str) -> Run:
    """log_interval 10: step records at 10..50, one ``event`` record (val or checkpoint) saying 55
    was completed, then laptop-c's agent killed at T0 + 56."""
    run = Run(tmp_path)
    run.start(ABC, T0 - 1)
    for s in (10, 20, 30, 40, 50):
        run.steps(ABC, s, s, T0 + s)
    run.rec("laptop-a", event, T0 + 55.2, 0, 3, step=55)
    run.fault("kill-agent", "laptop-c", T0 + 56, rank=2)
    return run


def test_step_at_is_the_newest_completed_step_any_record_names(tmp_path):
    """log_interval 10: the step records say 50, a checkpoint record says 55 was completed: step_at
    the injection (faults and the report, one function) is 55. The fault's last_step_before is
    step_at the restart, 56: the survivor's failure record after the injection names it."""
    run = _logged_to_50_then_kill(tmp_path, "checkpoint")
    run.failure("laptop-a", T0 + 56.2, 0, 3, step=56)
    run.start(("laptop-a", "laptop-b"), T0 + 60, resumed_from_step=56, restart_count=1)
    run.steps(("laptop-a", "laptop-b"), 60, 60, T0 + 64)
    folder = load_run(run.dir)
    m = faults.measure(faults.injections(folder.events)[0], folder.records)
    assert faults.step_at(folder.records, T0 + 56) == 55
    assert data.step_at(folder, T0 + 56) == 55
    # a later record with a smaller step (a restart went back) is the newer truth
    assert faults.step_at(folder.records, T0 + 70) == 60
    assert m.steps_lost == 0 and m.last_step_before == 56 == faults.step_at(folder.records, T0 + 60)


def test_a_recovered_faults_last_step_reads_val_and_checkpoint_records_too(tmp_path):
    """log_interval 10, no failure record (the survivors were restarted without one): the val record
    says 55 was completed, the group resumed from the checkpoint of 50. Before, a recovered fault's
    last_step_before read the step records alone: 50, and 0 steps lost."""
    run = _logged_to_50_then_kill(tmp_path, "val")
    run.start(("laptop-a", "laptop-b"), T0 + 60, resumed_from_step=50, restart_count=1)
    run.steps(("laptop-a", "laptop-b"), 60, 60, T0 + 70)
    (m,) = run.measures()
    assert m.outcome == "recovered"
    assert (m.last_step_before, m.resumed_from_step, m.steps_lost) == (55, 50, 5)


def bands_of(path: Path) -> list[data.Band]:
    return data.no_training_bands(load_run(path))


def test_bands_follow_the_faults_and_name_their_cause():
    """The newcomer's report: a 13 s band at a checkpoint under load and none for the 11.5 s
    kill-agent gap (bands were 5 x the median interval between step records)."""
    run = load_run(TE)
    inj = [e for e in run.events if e["kind"] == "fault"]
    bands = data.no_training_bands(run)
    by_label = {b.label: b for b in bands}
    kill = by_label["fault: kill-agent laptop-a"]
    assert kill.start <= inj[0]["time"] <= kill.end and kill.seconds == pytest.approx(11.5, abs=0.1)
    assert (kill.from_step, kill.to_step) == (270, 280)
    off = by_label["fault: poweroff laptop-b"]
    assert off.start <= inj[2]["time"] <= off.end and off.seconds == pytest.approx(26.3, abs=0.1)
    assert "fault: rejoin laptop-a" in by_label  # the group restarts to take the node back in
    ckpt = by_label["checkpoint save + eval"]
    assert ckpt.cause == "checkpoint save" and ckpt.seconds == pytest.approx(13.5, abs=0.1)
    stop = by_label["stopped, then resumed"]
    assert stop.cause == "stop" and stop.seconds > 400
    assert {b.cause for b in bands} <= set(data.BAND_CAUSES)
    # every fault that stopped the training has its band
    for e in inj:
        if e["mode"] in ("kill-agent", "poweroff"):
            assert any(b.cause == "fault" and b.start <= e["time"] <= b.end for b in bands), e


def test_per_step_partition_band_and_no_noise_bands():
    bands = bands_of(PS)
    assert [b.label for b in bands] == ["fault: partition laptop-c"]
    assert bands[0].seconds == pytest.approx(5.6, abs=0.1)


def test_bands_of_a_synthetic_run_with_eval_and_unknown(tmp_path):
    run = Run(tmp_path)
    run.start(ABC, T0 - 1)
    run.steps(ABC, 1, 50, T0)                       # 1 s a step
    run.rec("laptop-a", "val", T0 + 55, 0, 3, step=50, val_loss=2.0, train_loss=2.0)
    run.steps(ABC, 51, 100, T0 + 80)                # 30 s for one step: an evaluation
    run.steps(ABC, 101, 150, T0 + 160)              # 31 s without any record: unknown
    bands = bands_of(run.dir)
    assert [(b.from_step, b.to_step, b.cause) for b in bands] == [(50, 51, "eval"), (100, 101, "unknown")]
    with pytest.raises(ValueError):
        data.no_training_bands(load_run(run.dir), k=0)


def test_report_lists_the_bands_with_their_cause(tmp_path):
    from ddplab.controller import report

    run_dir = copy_run(TE, tmp_path / "run")
    path, _ = report.build_report(run_dir)
    page = path.read_text()
    assert "Time without training" in page
    # the rule as no_training_bands applies it (the page said 'later than one step time' for faults)
    rule = data.band_rule()
    assert rule in html.unescape(page) and "by more than 20 median step times and 2 s" in rule
    assert "by more than one median step time and 2 s" in rule
    for label in ("kill-agent laptop-a", "poweroff laptop-b", "checkpoint save + eval",
                  "stopped, then resumed"):
        assert label in page


def test_the_reports_at_step_is_the_summarys_last_step_before(tmp_path):
    """log_interval 10: the kill-agent hit the group at step 273 (its failure records say so); the
    recovery table said 270 (the newest step record) beside summary.json's 273."""
    from ddplab.controller.report import html

    run_dir = copy_run(TE, tmp_path / "run")
    sm.write_summary(run_dir, sm.build_summary(run_dir))
    run = load_run(run_dir)
    measured = [f["last_step_before"] for f in run.summary["faults"]]
    assert measured[0] == 273
    assert [data.fault_step(run, f) for f in data.faults(run)] == measured
    plots = dict.fromkeys(("loss", "step_time", "world_size", "cpu", "share"), "plots/x.png")
    page = html.render_page(run, [], plots, (False, False), 0.2, 10, 0.8)
    rows = page.split("<th>outcome</th></tr>", 1)[1].split("</table>", 1)[0].split("<tr>")[1:]
    assert [int(r.split('<td class="n">')[3].split("<")[0]) for r in rows] == measured


def test_a_nodes_restarts_are_named_for_what_they_count(tmp_path):
    """status.yml said restarts 0 for laptop-a (its newest agent, started by the rejoin) where the
    summary said 1 (the most any of its agents reached): both now, each named, from one function."""
    from ddplab import status

    summary = sm.build_summary(copy_run(TE, tmp_path / "run"))
    run = rundir.load_run(TE)
    for host, recs in run.per_host.items():
        fig = summary["per_host"][host]
        shown = status.node_progress(recs)["restart_count"]
        assert fig["agent_restarts"] == shown == faults.agent_restarts(recs)
    a = summary["per_host"]["laptop-a"]
    assert (a["restart_count"], a["agent_restarts"]) == (1, 0)
    line = ("laptop-a: step 1100, 8511 tok/s, "
            "restarts 1 in the run (0 of its newest agent, as status.yml shows)")
    assert line in sm.human_summary(summary)


# ----------------------------------------------------------------------------- issue 14, session 9
# Fixtures copied from runs/: ``torchelastic_interim_62f9`` (torchelastic, load 15, log_interval 10:
# kill-agent laptop-a, after which laptop-c formed a group of 1 and trained steps 101-106 alone
# before laptop-b joined; rejoin, poweroff laptop-b, rejoin, stop, resume) and
# ``per_step_restarts_2bec`` (per_step: partition laptop-b 30 s, stop, resume, kill-agent laptop-a,
# its rejoin, poweroff laptop-c, its rejoin).
TI = FIXTURES / "torchelastic_interim_62f9"
PR = FIXTURES / "per_step_restarts_2bec"


def _kill_agent_of_62f9(tmp_path: Path) -> tuple[Path, dict]:
    run_dir = copy_run(TI, tmp_path / "run")
    s = sm.build_summary(run_dir)
    sm.write_summary(run_dir, s)
    return run_dir, s["faults"][0]


def test_a_recovery_through_an_interim_group_is_measured_as_its_path(tmp_path):
    """62f9: summary.json said world size 3 -> 2, last_step_before 106 and the lone group's SIGTERM
    as the cause, while its timeline said 3 -> 1 (step 101) -> 2 (step 106)."""
    _, f = _kill_agent_of_62f9(tmp_path)
    assert (f["mode"], f["outcome"]) == ("kill-agent", "recovered")
    assert f["world_size_path"] == [3, 1, 2]
    assert (f["world_size_before"], f["world_size_after"]) == (3, 2)
    (interim,) = f["interim_groups"]
    assert (interim["world_size"], interim["hosts"], interim["resumed_from_step"], interim["last_step"],
            interim["steps_trained"]) == (1, ["laptop-c"], 101, 106, 5)
    assert 0 < interim["started_s"] < interim["stopped_s"] < f["recovered_s"]
    # the ORIGINAL group stopped at 101 (its failure records); the final group resumed from 106
    assert (f["last_step_before"], f["resumed_from_step"], f["steps_lost"]) == (101, 106, 0)
    assert "Terminated" not in f["cause"] and f["cause"].startswith("laptop-c (rank 2): RuntimeError")
    # the faults without an interim group keep their two-entry path
    s = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert [x["world_size_path"] for x in s["faults"][1:]] == [[2, 3], [3, 2], [2, 3]]


def test_kill_nodes_line_and_the_summary_show_the_interim_group(tmp_path, capsys):
    run_dir, _ = _kill_agent_of_62f9(tmp_path)
    run = rundir.load_run(run_dir)
    table = faults.format_table(faults.measure_all(run.events, run.records)[:1])
    assert "3->1->2" in table and "3->2 " not in table
    assert "kill-agent laptop-a: via a group of 1 (laptop-c) that trained steps 101->106" in table
    text = sm.human_summary(json.loads((run_dir / "summary.json").read_text()))
    assert "fault kill-agent laptop-a: world size 3->1->2" in text


def test_the_reports_table_and_plot_show_the_interim_group(tmp_path, monkeypatch):
    from ddplab.controller.report import html, plots

    run_dir, _ = _kill_agent_of_62f9(tmp_path)
    run = load_run(run_dir)
    page = html.render_page(run, [], dict.fromkeys(("loss", "step_time", "world_size", "cpu", "share"),
                                                   "plots/x.png"), (False, False), 0.2, 10, 0.8)
    row = page.split("<th>outcome</th></tr>", 1)[1].split("</tr>", 1)[0]
    assert "3 → 1 → 2" in row and '<td class="n">101</td>' in row
    assert "via a group of 1 (laptop-c) that trained steps 101 → 106" in html_text(row)
    (seg,) = data.interim_segments(run)
    assert (seg.world_size, seg.from_step, seg.to_step) == (1, 101, 106)
    drawn = []
    monkeypatch.setattr(plots, "save", lambda fig, out: drawn.append(fig))
    tx = plots.TimeAxis.for_span(*data.time_span(run))
    plots.plot_world_size(run, data.faults(run), data.restarts(run), tx, tmp_path / "ws.png")
    ax = drawn[0].axes[0]
    assert any(set(line.get_ydata()) == {1} for line in ax.get_lines())
    assert any("steps 101→106" in t.get_text() for t in ax.texts)


def html_text(fragment: str) -> str:
    import re

    return html.unescape(re.sub(r"<[^>]+>", "", fragment))


def test_restarts_are_one_figure_in_the_summary_and_the_report(tmp_path):
    """2bec (per_step): the report's key figure said 5 restarts (every replica start of the resume
    counted) where the per-fault restarts add up to 2 (the two rejoins) and each laptop's status
    said 0 (its newest agent's torchrun restart_count: a different fact, named so)."""
    from ddplab.controller.report import html

    run_dir = copy_run(PR, tmp_path / "run")
    s = sm.build_summary(run_dir)
    sm.write_summary(run_dir, s)
    assert s["restarts"] == 2 == sum(f["restarts"] for f in s["faults"])
    assert s["launches"] == ["launch", "resume"]
    assert all(fig["agent_restarts"] == 0 for fig in s["per_host"].values())
    run = load_run(run_dir)
    cards = dict(html.key_figures(run, data.restarts(run), data.faults(run), [], 0.0, 1.0))
    assert cards["restarts (replica processes started again; launches not counted)"] == "2"
    assert cards["launches"] == "2 (launch, resume)"
    # without summary.json the report counts the same
    (run_dir / "summary.json").unlink()
    run = load_run(run_dir)
    cards = dict(html.key_figures(run, data.restarts(run), data.faults(run), [], 0.0, 1.0))
    assert cards["restarts (replica processes started again; launches not counted)"] == "2"
    # torchelastic: group re-formations, the resume's start not counted (62f9: 6 before)
    te = sm.build_summary(copy_run(TI, tmp_path / "te"))
    assert (te["restarts"], te["launches"]) == (5, ["launch", "resume"])


def _band(bands, from_step, to_step):
    return next(b for b in bands if (b.from_step, b.to_step) == (from_step, to_step))


def test_a_band_is_a_faults_only_when_the_faults_window_covers_it():
    """2bec: a 7.4 s band (steps 150 -> 160) was labelled with a partition injected 0.1 s before
    its end, and the checkpoint + eval band 15 s after the group had recovered from it (steps
    200 -> 210, inside the partition's 30 s) was labelled with the partition too."""
    run = load_run(PR)
    (partition,) = [f for f in data.faults(run) if f.mode == "partition"]
    bands = data.no_training_bands(run)
    assert not any(b.from_step == 150 for b in bands)  # 4 s late: no band without the fault
    fault_bands = [b for b in bands if b.label == "fault: partition laptop-b"]
    assert [(b.from_step, b.to_step) for b in fault_bands] == [(160, 163)]
    assert fault_bands[0].start <= partition.time + partition.recovered_s <= fault_bands[0].end
    # steps 200 -> 210 (checkpoint + eval inside) came 2.2 s late: under the rule without a fault
    assert not any(b.from_step == 200 for b in bands)
    assert _band(bands, 100, 110).label == "checkpoint save + eval"


def test_a_launchs_start_up_is_its_own_cause_and_slow_steps_are_not_unknown():
    """2bec: a 13 s band 14 s after the resume's group started (steps 310 -> 320) was 'unknown';
    7570: a 10 s band (570 -> 580) whose step records say each step took 0.8-1.3 s was 'unknown',
    and the rejoin's band stays the rejoin's (not the kill-agent's, recovered 77 s earlier)."""
    bands = data.no_training_bands(load_run(PR))
    up = _band(bands, 310, 320)
    assert (up.cause, up.label) == ("start-up", "start-up after resume")
    te = data.no_training_bands(load_run(TE))
    slow = _band(te, 570, 580)
    assert slow.cause == "slow steps" and slow.label.startswith("slow steps: 1.0 s a step")
    assert _band(te, 500, 510).label == "fault: rejoin laptop-a"
    assert "unknown" not in {b.cause for b in bands + te}


def test_steps_lost_add_up_over_the_groups_of_the_path(tmp_path):
    """A synthetic interim group that trained 21-25 and was resumed from a checkpoint of 23 by the
    final group: 2 steps lost on the way (the original group's emergency checkpoint lost none)."""
    run = Run(tmp_path)
    run.start(ABC, T0 - 1)
    run.steps(ABC, 1, 20, T0)                                   # step 20 at T0+19
    run.fault("kill-agent", "laptop-a", T0 + 19.5, rank=0)
    run.failure("laptop-b", T0 + 19.8, 1, 3, step=20)
    run.failure("laptop-c", T0 + 19.9, 2, 3, step=20)
    run.start(("laptop-c",), T0 + 24, resumed_from_step=20, restart_count=1)
    run.steps(("laptop-c",), 21, 25, T0 + 25)
    run.failure("laptop-c", T0 + 30.5, 0, 1, step=25, saved=False, error="Terminated: stopped by SIGTERM")
    run.start(("laptop-b", "laptop-c"), T0 + 35, resumed_from_step=23, restart_count=1)
    run.steps(("laptop-b", "laptop-c"), 24, 30, T0 + 36)
    (m,) = run.measures()
    assert (m.outcome, m.world_size_path, m.last_step_before, m.resumed_from_step) == ("recovered", [3, 1, 2],
                                                                                      20, 23)
    assert [(g["hosts"], g["resumed_from_step"], g["last_step"], g["steps_trained"])
            for g in m.interim_groups] == [(["laptop-c"], 20, 25, 5)]
    assert m.steps_lost == 2 and m.cause == "laptop-c (rank 2): gloo: Connection reset by peer"
    assert m.recovered_s == pytest.approx(16.5)


def test_the_pages_world_sizes_are_the_tables_path():
    """Fault.ws_text is faults.path_text with the page's arrow (an old summary without
    world_size_path: before -> after; '—' when no size is known)."""
    assert data.Fault("kill-agent", "laptop-a", 0, 1.0, world_size_path=(3, 1, 2)).ws_text == "3 → 1 → 2"
    old = data.Fault("poweroff", "laptop-b", 1, 1.0, world_size_before=3, world_size_after=None)
    assert old.ws_text == "3 → -"
    assert data.Fault("freeze", "laptop-b", 1, 1.0).ws_text == "—"


def _kill_agent_at_step_20(tmp_path: Path, target: str, group: tuple[str, ...]) -> Run:
    """A run of three whose ``target`` agent is killed after step 20; ``group`` re-forms 4.5 s
    later, resumes from 20 and trains steps 21-300 (step 21 at T0+25, one a second)."""
    run = Run(tmp_path)
    run.start(ABC, T0 - 1)
    run.steps(ABC, 1, 20, T0)
    run.fault("kill-agent", target, T0 + 19.5, rank=ABC.index(target))
    for i, h in enumerate(ABC):
        if h != target:
            run.failure(h, T0 + 19.8 + 0.1 * i, i, 3, step=20)
    run.start(group, T0 + 24, resumed_from_step=20, restart_count=1)
    run.steps(group, 21, 300, T0 + 25)
    return run


def test_a_later_change_of_group_size_is_not_the_recovery(tmp_path):
    """Review: kill-agent 3 -> 2 recovered after 5.5 s; 5 min later laptop-b's agent died on its own
    and a group of 1 formed. The old rule took the last group that trained in the fault's window:
    recovered_s 316.5, path [3, 2, 1] and an 'interim group' of laptop-a, laptop-b."""
    run = _kill_agent_at_step_20(tmp_path, "laptop-c", AB)       # step 300 at T0+304
    run.failure("laptop-a", T0 + 305, 0, 2, step=300)
    run.start(("laptop-a",), T0 + 335, resumed_from_step=300, restart_count=2)
    run.steps(("laptop-a",), 301, 310, T0 + 336)
    (m,) = run.measures()
    assert (m.outcome, m.world_size_path, m.interim_groups) == ("recovered", [3, 2], [])
    assert m.recovered_s == pytest.approx(5.5)
    assert (m.last_step_before, m.resumed_from_step, m.steps_lost) == (20, 20, 0)


def test_a_larger_group_long_after_the_recovery_is_not_a_latecomer(tmp_path):
    """3 -> 1 recovered; the missing agent came back on its own 5 min later (no rejoin event): the
    group of 1 is the recovery, not an interim group of a 3 -> 1 -> 2 path."""
    run = _kill_agent_at_step_20(tmp_path, "laptop-a", ("laptop-c",))
    run.start(("laptop-b", "laptop-c"), T0 + 330, resumed_from_step=300, restart_count=2)
    run.steps(("laptop-b", "laptop-c"), 301, 310, T0 + 331)
    (m,) = run.measures()
    assert (m.world_size_path, m.interim_groups, m.resumed_from_step) == ([3, 1], [], 20)
    assert m.recovered_s == pytest.approx(5.5)


def test_a_fault_without_recovery_or_duration_holds_the_training_until_the_next_step(tmp_path):
    """A fault that restarted nothing (no recovered_s, no duration) explains the stretch to the
    first committed step after it, not a later evaluation (a guard of the window rule)."""
    run = Run(tmp_path)
    run.start(ABC, T0 - 1)
    run.steps(ABC, 1, 10, T0)
    run.fault("kill-worker", "laptop-c", T0 + 9.5, rank=2)
    run.steps(ABC, 11, 50, T0 + 30)                 # 20 s late after the fault: its band
    run.rec("laptop-a", "val", T0 + 70, 0, 3, step=50, val_loss=2.0, train_loss=2.0)
    run.steps(ABC, 51, 60, T0 + 100)                # 30 s for one step: the evaluation
    bands = bands_of(run.dir)
    assert [(b.from_step, b.to_step, b.cause) for b in bands] == [(10, 11, "fault"), (50, 51, "eval")]
