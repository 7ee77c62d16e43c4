"""benchmarks/fault_loss.py: the validation curve of a collected run, the side-by-side table and the
plot (the lab runs themselves are a benchmark, not a test)."""

import json
import subprocess
from pathlib import Path

import fault_loss as fl
import pytest
from test_report import make_run


def test_val_curve_has_one_loss_per_evaluation_step(tmp_path):
    run = make_run(tmp_path)
    curve = fl.val_curve(run)
    assert list(curve) == [49, 99, 149, 199]
    assert all(1.4 < v < 6.0 for v in curve.values())


def _run(label, seed, curve, val, faults=(), samples=None):
    return {
        "label": label,
        "run_id": f"r-{label}",
        "seed": seed,
        "faults": list(faults),
        "steps": 350,
        "final_val_loss": val,
        "final_train_loss": val - 0.05,
        "outcome": "completed",
        "samples": samples if samples is not None else {"laptop-a": 12600, "laptop-b": 12600},
        "wall_s": 300,
        "load_start": "3.0 2.0 1.0",
        "load_end": "4.0 3.0 2.0",
        "curve": curve,
    }


def _row(text, first):
    return next(line for line in text.splitlines() if line.split()[:1] == [first]).split()


def test_table_puts_the_cost_of_faults_beside_the_noise_band_of_several_seeds():
    runs = [
        _run("clean", 1337, {"100": 2.5, "200": 2.1}, 1.990),
        _run(
            "faulted",
            1337,
            {"100": 2.55},
            2.002,
            ["kill-agent@laptop-a", "freeze@laptop-b"],
            {"laptop-a": 9000},
        ),
        _run("noise1", 1338, {"100": 2.52, "200": 2.12}, 2.010),
        _run("noise2", 1339, {"100": 2.49, "200": 2.08}, 1.980),
        _run("noise3", 1340, {"100": 2.51, "200": 2.13}, 2.030),
    ]
    text = fl.table(runs)
    # step, clean, faulted, noise1..3, faulted-clean, band (min..max of noise - clean), where,
    # clean@samples, faulted-clean@samples (no samples by step here)
    assert _row(text, "100") == [
        "100",
        "2.500",
        "2.550",
        "2.520",
        "2.490",
        "2.510",
        "+0.050",
        "-0.010..+0.020",
        "above",
        "-",
        "-",
    ]
    assert _row(text, "200") == [
        "200",
        "2.100",
        "-",
        "2.120",
        "2.080",
        "2.130",
        "-",
        "-0.020..+0.030",
        "-",
        "-",
        "-",
    ]
    assert _row(text, "final") == [
        "final",
        "1.990",
        "2.002",
        "2.010",
        "1.980",
        "2.030",
        "+0.012",
        "-0.010..+0.040",
        "in",
        "-",
        "-",
    ]
    assert (
        "verdict: faulted - clean +0.012 nats at the final evaluation is INSIDE the noise band "
        "[-0.010, +0.040] of 3 other seed(s); inside at 0 of 1 evaluation steps" in text
    )
    faulted = _row(text, "faulted")
    assert faulted[6:8] == ["9,000", "71"]  # samples trained, % of clean's 12,600
    assert "kill-agent@laptop-a, freeze@laptop-b" in text and "3.0 2.0 1.0 -> 4.0 3.0 2.0" in text


def test_verdict_says_outside_and_which_side():
    clean, noise = _run("clean", 1, {}, 2.0), _run("noise1", 2, {}, 2.02)
    assert "OUTSIDE (worse than) the noise band [+0.000, +0.020]" in fl.verdict(
        [clean, _run("faulted", 1, {}, 2.05), noise]
    )
    assert "OUTSIDE (better than)" in fl.verdict([clean, _run("faulted", 1, {}, 1.99), noise])
    # closer to clean than the other seed: inside (the band holds clean's own 0)
    assert "+0.010 nats at the final evaluation is INSIDE the noise band [+0.000, +0.020]" in fl.verdict(
        [clean, _run("faulted", 1, {}, 2.01), noise]
    )
    assert fl.verdict([clean, noise]).startswith("verdict: - (needs a clean, a faulted")


def test_table_of_the_runs_done_so_far_without_a_band():
    text = fl.table([_run("clean", 1337, {"100": 2.5}, 1.990)])
    assert _row(text, "clean")[:4] == ["clean", "r-clean", "1337", "350"] and "verdict" not in text


def test_samples_trained_is_samples_seen_of_the_last_committed_step_per_host(tmp_path):
    """samples_seen of the last committed step: an uncommitted (retried) step does not count."""
    run = tmp_path / "r"
    steps = {
        "laptop-a": [(10, 360, True), (20, 720, True), (21, 720, False), (21, 744, True)],
        "laptop-b": [(10, 360, True), (20, 720, True)],
    }
    for host, recs in steps.items():
        (run / host / "metrics").mkdir(parents=True)
        lines = [
            json.dumps(
                {"event": "step", "time": 1.0 + i, "host": host, "step": s, "samples_seen": n, "committed": c}
            )
            for i, (s, n, c) in enumerate(recs)
        ]
        (run / host / "metrics" / f"{host}-local0.jsonl").write_text("\n".join(lines) + "\n")
    assert fl.samples_trained(run) == {"laptop-a": 744, "laptop-b": 720}
    assert fl._samples(fl.samples_trained(run)) == "720..744"


def test_val_at_samples_interpolates_the_clean_curve_at_the_faulted_runs_samples():
    curve, samples = {"100": 2.5, "200": 2.1, "300": 2.0}, {100: 3600, 200: 7200, 300: 10800}
    assert fl.val_at_samples(curve, samples, 5400) == pytest.approx(2.3)
    assert fl.val_at_samples(curve, samples, 10800) == pytest.approx(2.0)
    assert fl.val_at_samples(curve, samples, 3000) is None  # before the first evaluation
    assert fl.val_at_samples(curve, samples, None) is None


def test_table_compares_at_equal_samples_when_the_faulted_run_trained_on_fewer():
    """Under keep_per_rank a step at 2 participants trains on 24 samples instead of 36: the
    faulted run is behind at equal steps; the @samples columns say whether it is at equal samples."""
    clean = _run("clean", 1, {"100": 2.5, "200": 2.1, "300": 2.0}, 2.0, samples={"laptop-a": 10800})
    clean["samples_curve"] = {"100": 3600, "200": 7200, "300": 10800}
    faulted = _run("faulted", 1, {"100": 2.5, "200": 2.3, "300": 2.2}, 2.2, samples={"laptop-a": 7200})
    faulted["samples_curve"] = {"100": 3600, "200": 6000, "300": 7200}
    text = fl.table([clean, faulted, _run("noise1", 2, {"300": 2.01}, 2.01)])
    row200 = _row(text, "200")
    assert row200[-2:] == ["2.233", "+0.067"]  # clean at 6,000 samples: 2.5 - 0.4 * 2400 / 3600
    assert _row(text, "final")[-2:] == ["2.100", "+0.100"]
    assert "at equal samples: faulted - clean +0.100 nats at the final evaluation" in text
    assert _row(text, "faulted")[6:8] == ["7,200", "67"]


def test_samples_curve_is_samples_seen_by_committed_step(tmp_path):
    run = tmp_path / "r"
    (run / "laptop-a" / "metrics").mkdir(parents=True)
    recs = [(100, 3600, True), (150, 5000, False), (150, 5012, True), (200, 6200, True)]
    lines = [
        json.dumps(
            {
                "event": "step",
                "time": 1.0 + i,
                "host": "laptop-a",
                "step": s,
                "samples_seen": n,
                "committed": c,
            }
        )
        for i, (s, n, c) in enumerate(recs)
    ]
    (run / "laptop-a" / "metrics" / "laptop-a-local0.jsonl").write_text("\n".join(lines) + "\n")
    assert fl.samples_curve(run) == {100: 3600, 150: 5012, 200: 6200}
    assert fl.samples_curve(run, [100, 200]) == {100: 3600, 200: 6200}


def test_table_option_prints_an_earlier_json_again_without_a_play(monkeypatch, tmp_path, capsys):
    def no_play(*a, **k):
        raise AssertionError("a playbook ran")

    monkeypatch.setattr(fl.recovery.subprocess, "run", no_play)
    runs = tmp_path / "runs"
    (make_run(runs, "run-1") / "events.jsonl").write_text("")
    old = {"runs": [{**_run("clean", 1337, {"49": 3.0}, 1.99), "run_id": "run-1", "samples": {}}]}
    (tmp_path / "old.json").write_text(json.dumps(old))
    assert fl.main(["--runs-dir", str(runs), "--table", str(tmp_path / "old.json")]) == 0
    assert _row(capsys.readouterr().out, "clean")[6] == "4,800"  # samples read again from run-1


def test_last_fault_step_is_the_runs_progress_when_the_last_fault_was_over(tmp_path):
    run = tmp_path / "r"
    (run / "laptop-b" / "metrics").mkdir(parents=True)
    recs = [(100, 10.0, True), (200, 20.0, True), (210, 26.0, False), (210, 27.0, True), (300, 40.0, True)]
    lines = [
        json.dumps(
            {"event": "step", "time": t, "host": "laptop-b", "step": st, "samples_seen": 1, "committed": c}
        )
        for st, t, c in recs
    ]
    (run / "laptop-b" / "metrics" / "laptop-b-local0.jsonl").write_text("\n".join(lines) + "\n")
    events = [
        {"time": 5.0, "kind": "fault", "mode": "kill-agent", "node": "laptop-a"},
        {"time": 12.0, "kind": "fault", "mode": "partition", "node": "laptop-a", "duration_s": 15.0},
    ]
    (run / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    assert fl.last_fault_step(run) == 210  # partition over at 27.0 s: step 210 committed by then
    (run / "events.jsonl").write_text("")
    assert fl.last_fault_step(run) is None


class FakeLab:
    """subprocess.run of the benchmark's playbooks, on synthetic run folders (tests/test_report's
    make_run): a launch makes the run folder and runs/current, kill-node.yml records a fault event,
    the await play fails once ``await_fails_after`` faults are in (the run has ended), a fault
    play fails from fault number ``fault_fails_at`` on (no job running any more)."""

    def __init__(self, runs, await_fails_after=None, fault_fails_at=None):
        self.runs, self.n, self.faults = runs, 0, 0
        self.await_fails_after, self.fault_fails_at = await_fails_after, fault_fails_at
        self.books = []

    def __call__(self, args, **kw):
        book = Path(args[3]).name
        extra = dict(v.split("=", 1) for v in args[4:][1::2] if "=" in v and not v.startswith("{"))
        self.books.append((book, extra.get("fault")))
        rc, out = 0, "ok"
        if book == "train.yml":
            self.n += 1
            run = make_run(self.runs, f"run-{self.n}")
            (run / "events.jsonl").write_text(json.dumps({"time": 1.0e9, "kind": "launch"}) + "\n")
            (self.runs / "current").unlink(missing_ok=True)
            (self.runs / "current").symlink_to(f"run-{self.n}")
        elif book == "kill-node.yml" and extra.get("fault") != "rejoin":
            self.faults += 1
            if self.fault_fails_at is not None and self.faults >= self.fault_fails_at:
                rc, out = 2, "laptop-a: no job of run run-2 is running there"
            else:
                event = {
                    "time": 1.0e9 + self.faults,
                    "kind": "fault",
                    "mode": extra["fault"],
                    "node": "laptop-a",
                }
                with open(self.runs / f"run-{self.n}" / "events.jsonl", "a") as fh:
                    fh.write(json.dumps(event) + "\n")
        elif book == "ddplab-bench-await.yml" and self.faults >= (self.await_fails_after or 10**6):
            rc, out = 2, "the run ended"
        return subprocess.CompletedProcess(args, rc, out, "")


def _main(monkeypatch, tmp_path, lab, *argv):
    runs = tmp_path / "runs"
    runs.mkdir(exist_ok=True)
    lab.runs = runs
    monkeypatch.setattr(fl.recovery.subprocess, "run", lab)
    monkeypatch.setattr(fl, "plot", lambda runs, path: None)
    return fl.main(["--runs-dir", str(runs), "--out", str(tmp_path / "b.json"), *argv])


def test_faulted_run_ending_during_the_wait_after_the_last_fault_still_gives_the_table(
    monkeypatch, tmp_path, capsys
):
    """The last session's failure: the run ended during the await after the last fault -> exit 2,
    no table. attach.yml follows the run to its end anyway: no await after the last fault."""
    lab = FakeLab(None, await_fails_after=2)
    code = _main(
        monkeypatch, tmp_path, lab, "--plan", "kill-agent@rank0,freeze@rank0:15", "--noise-seeds", "2"
    )
    out = capsys.readouterr().out
    assert code == 0
    assert [b for b, _ in lab.books].count("attach.yml") == 4  # clean, faulted, noise1, noise2
    assert "verdict: faulted - clean +0.000 nats at the final evaluation is INSIDE" in out
    assert _row(out, "faulted")[:3] == ["faulted", "run-2", "1337"] and _row(out, "noise2")[2] == "1339"


def test_a_plan_that_does_not_fit_names_the_fault_and_prints_the_runs_done(monkeypatch, tmp_path, capsys):
    lab = FakeLab(None, fault_fails_at=2)
    code = _main(monkeypatch, tmp_path, lab, "--plan", "kill-agent@rank0,poweroff@rank0,freeze@rank0:15")
    got = capsys.readouterr()
    assert code == 2
    err = got.err.splitlines()[0]
    assert err.startswith("error: fault 2/3 poweroff@rank0 of the plan did not complete in run run-2")
    assert "raise ddp_job_max_steps" in err
    assert _row(got.out, "clean")[1] == "run-1"  # the table of the runs done so far
    assert lab.books[-1] == ("attach.yml", None)  # the faulted run was still followed and collected
    assert [b for b, _ in lab.books].count("train.yml") == 2  # no noise run after a failed plan


def test_help_first_line_is_a_whole_sentence(capsys):
    with pytest.raises(SystemExit):
        fl.main(["--help"])
    out = capsys.readouterr().out
    assert "Does a run that loses and regains nodes learn as well as one that does not?" in " ".join(
        out.split()
    )
    assert "The loss of a run" not in out


def test_plot_writes_a_png(tmp_path):
    out = tmp_path / "curves.png"
    fl.plot([_run("clean", 1, {"10": 3.0, "20": 2.5}, 2.5), _run("faulted", 1, {"10": 3.1}, 2.6)], out)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bad_plan_is_refused_before_any_play(monkeypatch, capsys):
    def no_play(*a, **k):
        raise AssertionError("a playbook ran")

    monkeypatch.setattr(fl, "play", no_play)
    monkeypatch.setattr(fl.recovery, "play", no_play)
    with pytest.raises(SystemExit) as exc:
        fl.main(["--plan", "kill-agent@rank0,bogus@rank1"])
    assert exc.value.code == 2
    assert "expected <mode>@" in capsys.readouterr().err


def _collected(runs, run_id, seed=1337, engine="per_step", faults=(), outcome="finished", **config):
    """A run folder as collect.yml leaves it (tests/test_report's make_run: metrics of laptop-a/b/c)
    with each host's result.json holding the resolved training configuration the training
    program records, a summary of ``outcome``/``engine`` and ``faults`` (mode@node) in events.jsonl."""
    from ddplab.config import build_config

    run = make_run(runs, run_id)
    values = {"max_steps": 350, **config, "seed": seed, "fault_tolerance": engine}
    if engine == "per_step":
        values["ft_lighthouse"] = "http://10.89.0.1:29510"
    resolved = build_config(values).to_dict()
    for host in ("laptop-a", "laptop-b", "laptop-c"):
        (run / host / "result.json").write_text(json.dumps({"run_id": run_id, "config": resolved}))
        (run / host / "run.json").write_text(json.dumps(values))
    summary = json.loads((run / "summary.json").read_text())
    (run / "summary.json").write_text(json.dumps({**summary, "outcome": outcome, "engine": engine}))
    events = [{"time": 1.0e9, "kind": "launch", "run_id": run_id}]
    events += [
        {"time": 1.0e9 + i, "kind": "fault", "mode": f.split("@")[0], "node": f.split("@")[1]}
        for i, f in enumerate(faults, 1)
    ]
    (run / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    return run


def test_reused_runs_are_taken_from_the_runs_folder_and_only_the_missing_ones_trained(
    monkeypatch, tmp_path, capsys
):
    runs = tmp_path / "runs"
    _collected(runs, "old-clean")
    _collected(runs, "old-noise", seed=1338)
    # the earlier JSON that trained old-clean: its wall time and load are shown again
    earlier = {"runs": [{**_run("clean", 1337, {}, 1.9), "run_id": "old-clean", "wall_s": 982}]}
    (runs / "bench-fault-loss-s6.json").write_text(json.dumps(earlier))
    lab = FakeLab(None)
    code = _main(
        monkeypatch, tmp_path, lab, "--plan", "kill-agent@rank0", "--noise-seeds", "2",
        "-e", "ddp_job_max_steps=350", "--reuse", "clean=old-clean", "--reuse", "seed=1338=old-noise",
    )  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0
    assert [b for b, _ in lab.books].count("train.yml") == 2  # faulted and noise2 only
    assert _row(out, "clean")[:3] == ["clean", "old-clean", "1337"] and _row(out, "clean")[8] == "982"
    assert _row(out, "noise1")[:3] == ["noise1", "old-noise", "1338"]
    assert _row(out, "faulted")[1] == "run-1" and _row(out, "noise2")[:3] == ["noise2", "run-2", "1339"]
    assert "reused (trained before, wall s and load as recorded then): clean (old-clean), noise1" in out
    saved = {r["label"]: r for r in json.loads((tmp_path / "b.json").read_text())["runs"]}
    assert saved["clean"]["reused"] and saved["noise1"]["reused"] and "reused" not in saved["faulted"]
    assert saved["clean"]["load_start"] == "3.0 2.0 1.0" and saved["noise1"]["load_start"] == "-"


@pytest.mark.parametrize(
    ("made", "argv", "message"),
    [
        ({"max_steps": 2400}, [], "max_steps is 2400 in the run, this invocation trains 350"),
        ({"seed": 1340}, [], "seed is 1340 in the run, this invocation trains 1337"),
        ({"preset": "tiny"}, [], "preset is 'tiny' in the run, this invocation trains 'small'"),
        (
            {"engine": "torchelastic"},
            [],
            "engine is 'torchelastic' in the run, this invocation trains 'per_step'",
        ),
        ({}, ["-e", "ddp_job_preset=tiny"], "preset is 'small' in the run, this invocation trains 'tiny'"),
        (
            {"eval_interval": 100},
            ["-e", '{"ddp_job_train_overrides": {"eval_interval": 50}}'],
            "eval_interval is 100 in the run, this invocation trains 50",
        ),
        (
            {},
            ["-e", "ddp_job_ft_min_replicas=2"],
            "ft_min_replicas is 1 in the run, this invocation trains 2",
        ),
        ({}, ["--nodes", "5"], "nodes is 3 in the run, this invocation trains 5"),
        ({"outcome": "stopped"}, [], "outcome is 'stopped' in the run, a reused run must be 'finished'"),
        (
            {"faults": ["kill-agent@laptop-a"]},
            [],
            "faults are kill-agent@laptop-a in the run, a clean run has none",
        ),
    ],
)
def test_a_reused_run_that_does_not_match_is_one_line_and_nothing_is_launched(
    monkeypatch, tmp_path, capsys, made, argv, message
):
    _collected(tmp_path / "runs", "old", **made)
    lab = FakeLab(None)
    code = _main(monkeypatch, tmp_path, lab, "-e", "ddp_job_max_steps=350", "--reuse", "clean=old", *argv)
    err = capsys.readouterr().err
    assert code == 2 and lab.books == []
    assert err.strip().splitlines() == [f"error: --reuse clean run old: {message}"]


def test_a_reused_noise_or_faulted_run_is_checked_for_its_role(monkeypatch, tmp_path, capsys):
    _collected(tmp_path / "runs", "f", faults=["freeze@laptop-a"])
    _collected(tmp_path / "runs", "c")
    lab = FakeLab(None)
    assert _main(monkeypatch, tmp_path, lab, "--reuse", "seed=1338=f") == 2
    assert (
        "--reuse noise1 run f: seed is 1337 in the run, this invocation trains 1338"
        in capsys.readouterr().err
    )
    assert _main(monkeypatch, tmp_path, lab, "--reuse", "faulted=c") == 2
    assert "--reuse faulted run c: faults are none in the run" in capsys.readouterr().err
    assert _main(monkeypatch, tmp_path, lab, "--reuse", "clean=missing") == 2
    assert "--reuse clean run missing: " in capsys.readouterr().err
    assert lab.books == []


@pytest.mark.parametrize(
    ("items", "message"),
    [
        (["noise=x"], "--reuse noise=x: expected clean=RUN_ID, faulted=RUN_ID or seed=N=RUN_ID"),
        (["seed=1345=x"], "seed 1345 is not a noise seed of this invocation (1338..1340"),
        (["clean=a", "clean=b"], "--reuse clean=b: clean is already reused as run a"),
    ],
)
def test_a_malformed_reuse_is_refused_before_any_play(monkeypatch, tmp_path, capsys, items, message):
    lab = FakeLab(None)
    argv = [x for item in items for x in ("--reuse", item)]
    assert _main(monkeypatch, tmp_path, lab, *argv) == 2
    assert message in capsys.readouterr().err and lab.books == []


def test_the_launch_keeps_the_train_overrides_given_with_e(monkeypatch, tmp_path):
    """The seed of each run was passed as its own ddp_job_train_overrides, which replaced the one
    given with -e (e.g. eval_interval) at every launch."""
    lab = FakeLab(None)
    seen = []

    def record(args, **kw):
        seen.append(args)
        return lab(args, **kw)

    runs = tmp_path / "runs"
    runs.mkdir()
    lab.runs = runs
    monkeypatch.setattr(fl.recovery.subprocess, "run", record)
    monkeypatch.setattr(fl, "plot", lambda runs, path: None)
    argv = ["--runs-dir", str(runs), "--out", str(tmp_path / "b.json"), "--plan", "kill-agent@rank0"]
    assert (
        fl.main([*argv, "--noise-seeds", "1", "-e", '{"ddp_job_train_overrides": {"eval_interval": 50}}'])
        == 0
    )
    launches = [a for a in seen if Path(a[3]).name == "train.yml"]
    last = [json.loads(v) for v in launches[-1][4:][1::2] if v.startswith("{")][-1]
    assert last == {"ddp_job_train_overrides": {"eval_interval": 50, "seed": 1338}}


def test_reduced_stretches_are_the_steps_and_seconds_at_fewer_participants(tmp_path):
    """The figures the faulted run's lag is explained by (last session counted them by hand):
    steps 3-4 and 7-8 at 2 of 3 participants, the run ending at 2."""
    run = tmp_path / "r"
    (run / "laptop-b" / "metrics").mkdir(parents=True)
    sizes = [3, 3, 2, 2, 3, 3, 2, 2]
    lines = [
        json.dumps({"event": "step", "time": 100.0 + 10 * i, "host": "laptop-b", "rank": 0, "step": i + 1,
                    "world_size": ws, "committed": True})
        for i, ws in enumerate(sizes)
    ]  # fmt: skip
    lines.insert(3, json.dumps({"event": "step", "time": 125.0, "host": "laptop-b", "rank": 0, "step": 4,
                                "world_size": 1, "committed": False}))  # fmt: skip
    (run / "laptop-b" / "metrics" / "laptop-b-local0.jsonl").write_text("\n".join(lines) + "\n")
    got = fl.reduced_stretches(run, 3)
    assert got == [
        {"world_size": 2, "first_step": 3, "last_step": 4, "seconds": 20.0},
        {"world_size": 2, "first_step": 7, "last_step": 8, "seconds": 10.0},
    ]
    assert fl.reduced_line("faulted", got) == (
        "faulted: at fewer participants 2 over steps 3-4 (20 s), 2 over steps 7-8 (10 s); "
        "4 steps, 30 s in all"
    )
    assert fl.reduced_stretches(run, 2) == []


def test_verdict_says_how_often_a_fault_free_seed_leaves_a_band_of_the_same_size():
    # evaluations at steps 1-4; val - clean: noise1 +0.01 each, noise2 +0.02 each; noise3 +0.05 at
    # step 1, else 0; faulted +0.03 at steps 1-2, 0 at 3-4
    clean = _run("clean", 1, {"1": 2.0, "2": 2.0, "3": 2.0, "4": 2.0}, 2.0)
    noise = [
        _run("noise1", 2, {"1": 2.01, "2": 2.01, "3": 2.01, "4": 2.01}, 2.01),
        _run("noise2", 3, {"1": 2.02, "2": 2.02, "3": 2.02, "4": 2.02}, 2.02),
        _run("noise3", 4, {"1": 2.05, "2": 2.0, "3": 2.0, "4": 2.0}, 2.0),
    ]
    faulted = _run("faulted", 1, {"1": 2.03, "2": 2.03, "3": 2.0, "4": 2.0}, 2.0)
    runs = [clean, faulted, *noise]
    # noise1 inside [0, +0.05] at 1, [0, +0.02] else: 0; noise2 outside [0, +0.01] at 2-4: 3;
    # noise3 outside [0, +0.02] at 1: 1. faulted: without noise1 out at 2, without noise2 out at 2,
    # without noise3 ([0, +0.02]) out at 1-2
    assert [fl.outside_counts(runs, n["label"], [o["label"] for o in noise if o is not n])
            for n in noise] == [(0, 4), (3, 4), (1, 4)]
    want = ("by chance: each fault-free seed is outside the band of clean and the other 2 at 0, 3, 1 of 4 "
            "evaluation steps; the faulted run, against each band of the same size, at 1, 1, 2")
    assert want in fl.verdict(runs)
    assert fl.chance_line(runs[:3]) is None  # one noise run: no band of the same size to compare
