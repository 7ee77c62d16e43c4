"""Run report on a synthetic run folder: 3 hosts, world size 3 -> 2 -> 3, a kill and a rejoin."""

import json
import random
import re
from html.parser import HTMLParser
from pathlib import Path

import pytest
from ddplab.controller import report
from ddplab.controller.report import data, plots

HOSTS = ("laptop-a", "laptop-b", "laptop-c")
T0 = 1_780_000_000.0


def _common(host, rank, ws, restart):
    return {"host": host, "rank": rank, "local_rank": 0, "world_size": ws, "restart_count": restart}


def make_run(root: Path, run_id: str = "run-synth", summary: bool = True) -> Path:
    """Write runs/<run_id>/ as collect.yml would: per-host metrics, events.jsonl, summary.json.

    Steps 0-79 at N=3, laptop-c killed after step 79 (emergency checkpoint: nothing lost), steps
    80-139 at N=2, laptop-c rejoins, steps 140-199 at N=3. laptop-b is 40 % slower over steps
    30-59; laptop-a's clock drops to 55 % from step 160 while it heats up; laptop-c has no sensor.
    """
    rng = random.Random(0)
    run = root / run_id
    recs = {h: [] for h in HOSTS}
    phases = [(range(0, 80), HOSTS, 0, 0), (range(80, 140), HOSTS[:2], 1, 80),
              (range(140, 200), HOSTS, 2, 140)]
    t = T0
    timeline = []
    for i, (steps, hosts, restart, resumed) in enumerate(phases):
        if i:
            t += 18.0  # detection + re-rendezvous
        ws = len(hosts)
        timeline.append({"time": t, "step": resumed, "world_size": ws})
        for rank, h in enumerate(hosts):
            recs[h].append({"event": "start", "time": t + 0.1 * rank, **_common(h, rank, ws, restart),
                            "resumed_from_step": resumed, "samples_seen": resumed * 8 * ws,
                            "batch_policy": "keep_per_rank", "per_rank_batch_size": 8,
                            "global_batch_size": 8 * ws, "grad_accum_steps": 1, "lr_scale": ws / 3,
                            "threads": 2, "params": 10.65e6})
        t += 3.0
        for step in steps:
            compute = {}
            for h in hosts:
                c = 1.0 + rng.uniform(-0.04, 0.04)
                if h == "laptop-b" and 30 <= step < 60:
                    c *= 1.4
                if h == "laptop-a" and step >= 160:
                    c *= 1.1
                compute[h] = c
            comm = 0.25 * 2 * (ws - 1) / ws
            step_time = max(compute.values()) + comm
            t += step_time
            loss = 4.2 * (0.985 ** step) + 1.4 + rng.uniform(-0.03, 0.03)
            for rank, h in enumerate(hosts):
                mhz = None if h == "laptop-c" else 2600.0 + rng.uniform(-40, 40)
                if h == "laptop-a" and step >= 160:
                    mhz = 1430.0 + rng.uniform(-30, 30)
                hot = h == "laptop-a" and step >= 150
                temp = None if h == "laptop-c" else (92.0 if hot else 62.0)
                recs[h].append({
                    "event": "step", "time": t + 0.01 * rank, **_common(h, rank, ws, restart), "step": step,
                    "loss": loss, "lr": 3e-4, "global_batch_size": 8 * ws, "per_rank_batch_size": 8,
                    "grad_accum_steps": 1, "samples_seen": 8 * ws * (step + 1), "step_time_s": step_time,
                    "compute_s": compute[h], "allreduce_s": step_time - compute[h],
                    "tokens_per_s": 8 * ws * 128 / step_time, "cpu_mhz": mhz, "temp_c": temp})
            if step % 50 == 49:
                for rank, h in enumerate(hosts):
                    recs[h].append({"event": "val", "time": t + 0.5, **_common(h, rank, ws, restart),
                                    "step": step, "val_loss": loss + 0.08, "train_loss": loss})
                t += 1.0
        if i == 0:
            kill_time = t + 0.5
            recs["laptop-a"].append({"event": "failure", "time": t + 2, **_common("laptop-a", 0, 3, 0),
                                     "step": 79, "error": "gloo: connection reset by peer", "saved": True})
    for rank, h in enumerate(HOSTS):
        recs[h].append({"event": "end", "time": t + 1, **_common(h, rank, 3, 2), "step": 199,
                        "final_train_loss": 1.62, "final_val_loss": 1.71, "wall_s": t + 1 - T0})
    for h, rs in recs.items():
        d = run / h / "metrics"
        d.mkdir(parents=True)
        (d / f"{h}-local0.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rs) + '{"event": "st')
    rejoin_time = timeline[2]["time"] - 12.0
    events = [
        {"time": T0 - 5, "kind": "play", "mode": None, "node": None, "rank": None, "play": "train.yml"},
        {"time": kill_time, "kind": "fault", "mode": "kill", "node": "laptop-c", "rank": 2,
         "signal": "SIGKILL"},
        {"time": rejoin_time, "kind": "fault", "mode": "rejoin", "node": "laptop-c", "rank": None},
    ]
    (run / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    if summary:
        (run / "summary.json").write_text(json.dumps({
            "run_id": run_id, "hosts": list(HOSTS), "steps_completed": 200, "final_train_loss": 1.62,
            "final_val_loss": 1.71, "wall_s": t + 1 - T0, "world_size_timeline": timeline, "restarts": 2,
            "faults": [
                {"mode": "kill", "node": "laptop-c", "rank": 2, "injected_at": kill_time, "detected_s": 6.2,
                 "recovered_s": 17.9, "steps_lost": 0, "world_size_before": 3, "world_size_after": 2,
                 "outcome": "recovered", "notes": ["emergency checkpoint at step 79"]},
                {"mode": "rejoin", "node": "laptop-c", "rank": None, "injected_at": rejoin_time,
                 "detected_s": 3.1, "recovered_s": 12.0, "steps_lost": 0, "world_size_before": 2,
                 "world_size_after": 3},
            ],
            "batch_policy": "keep_per_rank", "stragglers": [], "report": "report.html"}))
    return run


class _Collect(HTMLParser):
    def __init__(self):
        super().__init__()
        self.imgs, self.tables, self.external = [], 0, []

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "img":
            self.imgs.append(a.get("src"))
        if tag == "table":
            self.tables += 1
        for key in ("src", "href"):
            if a.get(key) and re.match(r"^(https?:)?//", a[key]):
                self.external.append(a[key])
        if tag == "script":
            self.external.append("script")


def parse(page: str) -> _Collect:
    p = _Collect()
    p.feed(page)
    return p


RESTARTS = "restarts (group re-formed; launches not counted)"  # the key figure's label


def test_report_of_a_run_with_faults(tmp_path, capsys):
    run = make_run(tmp_path)
    assert report.main([str(run)]) == 0
    out = run / "report.html"
    assert capsys.readouterr().out.strip() == str(out)
    page = out.read_text()
    p = parse(page)
    assert p.external == []  # offline: no CDN, no script
    names = ("loss", "step_time", "world_size", "cpu", "share")
    assert sorted(p.imgs) == sorted(f"plots/{n}.png" for n in names)
    for src in p.imgs:
        png = run / src
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    assert p.tables >= 4  # recoveries, stragglers, per world size, events
    text = re.sub(r"<[^>]+>", " ", page)
    text = re.sub(r"\s+", " ", text)
    # recoveries table from summary.json
    assert "kill laptop-c 2" in text and "6.2 s 17.9 s 0 3 → 2 recovered; emergency checkpoint" in text
    assert "rejoin laptop-c" in text and "2 → 3" in text
    # straggler findings name the node
    assert "straggler laptop-b (rank 1)" in text and "steps 30-59" in text
    assert "clock drop laptop-a (rank 0)" in text
    # key figures
    assert "steps completed 200" in text and "val loss: evaluation, step 199 1.710" in text
    assert "world sizes 3 → 2 → 3" in text and f"{RESTARTS} 2" in text
    # per world size rows and the events table
    # steps at N=2: 81-139 (resumed from step 80; this synthetic run numbers its steps from 0)
    assert re.search(r"\b2 59 [\d.]+ s \d+% \d+%", text) and "SIGKILL" in text
    assert "finished, 2 fault(s) survived" in text


def test_report_without_summary_derives_figures(tmp_path):
    run = make_run(tmp_path, summary=False)
    path, has = report.build_report(run)
    assert has
    text = re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", path.read_text()))
    assert "summary.json is missing" in text and "last step 199" in text
    # faults then come from events.jsonl (those with a mode), the play event is not a fault
    assert "kill laptop-c" in text and "faults injected 2" in text
    assert f"{RESTARTS} 2" in text


def test_a_report_build_measures_the_faults_once(tmp_path, monkeypatch, capsys):
    """Without faults in summary.json the report measured them on every faults() call (4 per build:
    the recovery table, the bands of the page and of the plot, the plot's marks) and printed a
    malformed fault event's warning 4 times (this run's "kill" is no fault mode)."""
    run = make_run(tmp_path, summary=False)
    calls = []
    real = data.measure_faults
    monkeypatch.setattr(data, "measure_faults", lambda r: calls.append(r) or real(r))
    report.build_report(run)
    assert len(calls) == 1
    assert capsys.readouterr().err.count("fault event with unknown mode 'kill'") == 1


def test_derived_series(tmp_path):
    run = report.load_run(make_run(tmp_path))
    rs = data.restarts(run)
    assert [(r.step, r.world_size, r.initial) for r in rs] == [(0, 3, True), (80, 2, False), (140, 3, False)]
    assert [w.world_size for w in data.per_world_size(run)] == [2, 3]
    loss = data.loss_per_step(run)
    assert [s for s, _ in loss] == list(range(200))
    f = data.faults(run)[0]
    assert data.step_at(run, f.time) == 79
    bands = data.no_training_bands(run)
    assert [(b.from_step, b.to_step) for b in bands] == [(79, 80), (139, 140)]
    assert all(b.seconds > 18 and b.cause == "fault" for b in bands), bands


def test_all_null_sensors_say_no_sensor(tmp_path):
    run = make_run(tmp_path)
    for f in run.glob("*/metrics/*.jsonl"):
        lines = [json.loads(x) for x in f.read_text().splitlines() if x.endswith("}")]
        for r in lines:
            if r["event"] == "step":
                r["cpu_mhz"] = r["temp_c"] = None
        f.write_text("".join(json.dumps(r) + "\n" for r in lines))
    path, _ = report.build_report(run)
    assert "No sensor" in path.read_text()


def test_run_without_metrics_writes_a_page_and_exits_3(tmp_path, capsys):
    run = tmp_path / "run-empty"
    (run / "laptop-a" / "metrics").mkdir(parents=True)
    (run / "laptop-a" / "metrics" / "laptop-a-local0.jsonl").write_text(
        json.dumps({"event": "start", "time": T0, **_common("laptop-a", 0, 1, 0)}) + "\n")
    assert report.main([str(run)]) == 3
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "no step metrics" in err
    page = (run / "report.html").read_text()
    assert "This run has no step metrics" in page and "<img" not in page
    assert not (run / "plots").exists()


def test_missing_folder_is_bad_input(tmp_path, capsys):
    assert report.main([str(tmp_path / "nope")]) == 2
    assert "no such run folder" in capsys.readouterr().err
    assert not (tmp_path / "nope").exists()


def test_corrupt_summary_is_bad_input(tmp_path, capsys):
    run = make_run(tmp_path)
    (run / "summary.json").write_text("{not json")
    assert report.main([str(run)]) == 2
    assert "summary.json: not valid JSON" in capsys.readouterr().err
    assert not (run / "report.html").exists()


def test_bad_straggler_parameters(tmp_path):
    run = make_run(tmp_path)
    with pytest.raises(ValueError):
        report.build_report(run, margin=0)


def test_label_levels_put_overlapping_labels_on_other_rows():
    # labels 10 wide: 0 and 5 overlap, 12 is clear of 0 (ends at 10), 13 overlaps 12 and 5 (ends 15)
    assert plots.label_levels([0, 5, 12, 13, 40], [10] * 5, levels=3) == [0, 1, 0, 2, 0]
    # order given is kept in the result
    assert plots.label_levels([12, 0, 5], [10] * 3) == [0, 0, 1]
    # more overlapping labels than rows: the row whose label ends first is reused
    assert plots.label_levels([0, 1, 2], [10, 10, 10], levels=2) == [0, 1, 0]


def test_short_cause_drops_source_paths_boilerplate_and_emoji():
    raw = ("h6-c (rank 2): RuntimeError: "
           "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] "
           "Connection closed by peer [10.89.1.2]:28063. This is typically caused by a remote worker "
           "crashing. Check the logs of the remote worker before reporting an error. GLHF! \U0001F642")
    want = "h6-c (rank 2): RuntimeError: Connection closed by peer [10.89.1.2]:28063"
    assert data.short_cause(raw) == want
    long = "x" * 300
    out = data.short_cause(long, limit=50)
    assert len(out) == 50 and out.endswith("…")


def test_break_gaps_splits_the_line_where_a_rank_was_away():
    pts = [(s, 1.0) for s in range(0, 10)] + [(s, 2.0) for s in range(100, 105)]
    xs, ys = plots._break_gaps(pts)
    nan_at = [i for i, x in enumerate(xs) if x != x]
    assert len(nan_at) == 1 and xs[nan_at[0] - 1] == 9 and xs[nan_at[0] + 1] == 100
    assert len(xs) == len(ys) == len(pts) + 1
    # evenly spaced records (log_interval 5) are never split
    assert plots._break_gaps([(s, 0.5) for s in range(0, 100, 5)])[0] == [float(s) for s in range(0, 100, 5)]
