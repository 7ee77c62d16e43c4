"""benchmarks/scaling.py: the figures of a run from its records, the run settings per
configuration, and the two tables on recorded inputs (the lab runs themselves are the benchmark)."""

from __future__ import annotations

import argparse
import json

import pytest
import scaling as sb


def records(hosts: dict[str, float], steps: int, batch: int = 12, evals: dict[int, float] | None = None,
            allreduce: float = 0.01, pause_at: tuple[int, ...] = ()) -> list[dict]:
    """Step records of a run whose every step takes the slowest host's compute + ``allreduce`` s
    (``hosts``: host -> compute s, rank = position), an evaluation after the steps of ``evals``
    (step -> val loss) taking 5 s, a checkpoint pause after the steps of ``pause_at``."""
    evals = evals or {}
    step_s = max(hosts.values()) + allreduce
    n = len(hosts)
    out, t = [], 1000.0
    for rank, host in enumerate(hosts):
        out.append({"event": "start", "time": t, "host": host, "rank": rank, "params": 800_000, "threads": 1,
                    "global_batch_size": n * batch})
    for step in range(1, steps + 1):
        t += step_s
        for rank, (host, compute) in enumerate(hosts.items()):
            out.append({"event": "step", "time": t, "host": host, "rank": rank, "step": step,
                        "samples_seen": step * n * batch, "step_time_s": step_s, "compute_s": compute,
                        "allreduce_s": step_s - compute})
        if step in evals:
            t += 5.0
            out += [{"event": "val", "time": t, "host": h, "rank": r, "step": step, "val_loss": evals[step]}
                    for r, h in enumerate(hosts)]
        if step in pause_at:
            t += 2.0
            out += [{"event": "checkpoint", "time": t, "host": h, "rank": r, "step": step}
                    for r, h in enumerate(hosts)]
    return out


def test_training_time_leaves_evaluations_and_checkpoints_out():
    recs = records({"a": 0.09}, 6, evals={3: 2.5}, pause_at=(5,))
    times = sb.training_times(recs)
    assert [s for s, _, _ in times] == [1, 2, 3, 4, 5, 6]
    assert all(t == pytest.approx(0.1) for _, t, _ in times)  # the 5 s eval and 2 s checkpoint are out
    assert times[-1][2] == 72


def test_training_time_needs_a_record_every_step():
    recs = [r for r in records({"a": 0.09}, 6) if r.get("step") != 4]
    with pytest.raises(ValueError, match="not one per step"):
        sb.training_times(recs)
    with pytest.raises(ValueError, match="rank 0 wrote no step records"):
        sb.training_times([])


def test_tokens_per_s_after_the_skipped_fraction():
    times = [(1, 1.0, 12), (2, 1.0, 24), (3, 0.5, 36), (4, 0.5, 48)]
    assert sb.tokens_per_s(times, 64, 0.0) == pytest.approx(48 * 64 / 3.0)
    assert sb.tokens_per_s(times, 64, 0.5) == pytest.approx(24 * 64 / 1.0)  # steps 3, 4


def test_time_to_loss_interpolates_between_evaluations():
    times = [(s, 0.1, 12 * s) for s in range(1, 11)]
    evals = [(2, 3.0), (4, 2.5), (6, 2.0), (8, 1.9)]
    t, samples = sb.time_to_loss(times, evals, 2.25)  # halfway from step 4 to 6: step 5
    assert t == pytest.approx(0.5) and samples == pytest.approx(60)
    t, samples = sb.time_to_loss(times, evals, 2.0)
    assert t == pytest.approx(0.6) and samples == 72
    assert sb.time_to_loss(times, evals, 3.5) == (pytest.approx(0.2), 24)  # the first evaluation already
    assert sb.time_to_loss(times, evals, 1.0) is None


def test_run_figures_of_unequal_nodes_wait_for_the_slowest():
    recs = records({"laptop-a": 0.1, "laptop-b": 0.1, "laptop-c": 0.2}, 10, evals={5: 2.4, 10: 2.0})
    f = sb.run_figures(recs, 64, 2.2, 0.0)
    assert f["tokens_per_s"] == pytest.approx(36 * 64 / 0.21)
    assert f["hosts"]["laptop-c"]["compute_s"] == pytest.approx(0.2)
    assert f["hosts"]["laptop-a"]["allreduce_s"] == pytest.approx(0.11)  # waits for laptop-c
    assert f["allreduce_share"] == pytest.approx(0.11 / 0.21) and f["tail"] == pytest.approx(1.0)
    assert f["samples_to_target"] == pytest.approx(36 * 7.5) and f["final_val_loss"] == 2.0
    assert (f["params"], f["threads"], f["global_batch_size"], f["steps"]) == (800_000, 1, 36, 10)


def _args(**kw) -> argparse.Namespace:
    base = {"per_rank_batch": 12, "samples": 12600, "reference_batch": 36, "warmup_samples": 1080,
            "eval_samples": 600, "seed": 1337, "preset": "small", "extra": ["ddp_job_x=1"], "train": []}
    return argparse.Namespace(**{**base, **kw})


@pytest.mark.parametrize(
    ("config", "steps", "warmup", "evals"),
    [(sb.CONFIGS[0], 1050, 90, 50), (sb.CONFIGS[1], 525, 45, 25), (sb.CONFIGS[2], 350, 30, 17)],
)
def test_every_run_trains_the_same_samples_warmup_and_eval_spacing(config, steps, warmup, evals):
    extra, variables = sb.train_vars(_args(), config)
    variables = json.loads(variables)
    assert extra == "ddp_job_x=1"
    assert variables["ddp_job_max_steps"] == steps
    assert (variables["ddp_job_nnodes_min"], variables["ddp_job_nnodes_max"]) == (config.nodes, config.nodes)
    assert variables["ddp_job_live_report"] is False and variables["ddp_job_watch"] is False
    o = variables["ddp_job_train_overrides"]
    assert (o["warmup_steps"], o["eval_interval"], o["ckpt_interval"]) == (warmup, evals, steps)
    assert (o["log_interval"], o["batch_policy"], o["per_rank_batch_size"]) == (1, "keep_per_rank", 12)
    assert o["reference_batch_size"] == 36


def test_the_unequal_rows_train_one_global_batch_in_passes_of_up_to_twice_the_share():
    """The equal, balanced and reference rows of 3 laptops: global batch 36 (keep_global), a
    micro-batch of up to 24 samples, so a fast laptop's share of 14-15 is one pass."""
    for config in (c for c in sb.CONFIGS if c.group == "unequal"):
        o = json.loads(sb.train_vars(_args(), config)[1])["ddp_job_train_overrides"]
        batch = (o["batch_policy"], o["global_batch_size"], o["per_rank_batch_size"])
        assert batch == ("keep_global", 36, 24)
    equal = json.loads(sb.train_vars(_args(), sb.CONFIGS[2])[1])["ddp_job_train_overrides"]
    assert "global_batch_size" not in equal


def test_train_settings_of_every_run_come_last():
    o = json.loads(sb.train_vars(_args(train=[sb.train_setting("bucket_cap_mb=1"),
                                              sb.train_setting("per_rank_batch_size=6")]),
                                 sb.CONFIGS[3])[1])["ddp_job_train_overrides"]
    assert (o["bucket_cap_mb"], o["per_rank_batch_size"]) == (1, 6)
    assert sb.train_setting("grad_compression=fp16") == ("grad_compression", "fp16")
    with pytest.raises(argparse.ArgumentTypeError, match="give KEY=VALUE"):
        sb.train_setting("bucket_cap_mb")


def test_the_balanced_entry_is_one_more_configuration_with_its_variables():
    balanced = next(c for c in sb.CONFIGS if c.batches == "speed")
    assert (balanced.label, balanced.cpus) == ("0.6/0.6/0.3 balanced", (0.6, 0.6, 0.3))
    assert json.loads(sb.train_vars(_args(extra=[]), balanced)[0])["ddp_job_batch_balance"] == "speed"


def test_configs_are_picked_by_label_and_an_unknown_one_is_named():
    assert [c.label for c in sb.pick("3 nodes, 1 node")] == ["1 node", "3 nodes"]  # CONFIGS order
    assert sb.pick(None) == list(sb.CONFIGS)
    with pytest.raises(ValueError, match=r"no configuration '4 nodes'; the configurations: 1 node, 2 nodes"):
        sb.pick("4 nodes")


def _run(config: sb.Config, hosts: dict[str, float], ttl_evals: dict[int, float], steps: int, link=930.0):
    recs = records(hosts, steps, evals=ttl_evals, allreduce=0.0 if len(hosts) == 1 else 0.02)
    figures = sb.run_figures(recs, 64, 2.1, 0.0)
    quota_nodes = {f"laptop-{x}": {"quota": q, "busy_cpu": q, "threads": 1, "link_mbit": 1000}
                   for x, q in zip("abc", config.cpus, strict=False)}
    return {"config": sb.asdict(config), "run_id": f"r-{config.label}", "figures": figures,
            "limits": {"nodes": quota_nodes, "link": {"rate_mbit": 1000, "payload_mbit_s": link}},
            "load_start": "0.5 0.4 0.3", "load_end": "0.6 0.5 0.4"}


def test_the_tables_on_recorded_inputs():
    """1 node 0.1 s a step; 2 and 3 nodes 0.1 s compute + 0.02 s all-reduce (2x and 3x the samples
    a step); the target reached at 1/1, 1/2 and 1/3 of the steps. Unequal: 0.2 s on the 0.3 node
    against 0.12 s for 0.5 everywhere, 0.02 s all-reduce."""
    c1, c2, c3, unequal, balanced, ref = sb.CONFIGS
    runs = [
        _run(c1, {"laptop-a": 0.1}, {300: 2.0}, 300),
        _run(c2, {"laptop-a": 0.1, "laptop-b": 0.1}, {150: 2.0}, 150),
        _run(c3, {"laptop-a": 0.1, "laptop-b": 0.1, "laptop-c": 0.1}, {100: 2.0}, 100),
        _run(unequal, {"laptop-a": 0.1, "laptop-b": 0.1, "laptop-c": 0.2}, {}, 100),
        _run(balanced, {"laptop-a": 0.125, "laptop-b": 0.125, "laptop-c": 0.125}, {}, 100),
        _run(ref, {"laptop-a": 0.12, "laptop-b": 0.12, "laptop-c": 0.12}, {}, 100),
    ]
    results = {"settings": {"preset": "small", "per_rank_batch": 12, "samples": 3600, "link_mbit": 1000,
                            "target": 2.1, "skip": 0.0}, "runs": runs}
    text = sb.tables(results)
    lines: dict[str, str] = {}  # a table row by its first two words (the first of rows alike)
    for line in text.splitlines():
        if line.strip():
            lines.setdefault(" ".join(line.split()[:2]), line)
    two, three = lines["2 0.6/0.6"].split(), lines["3 0.6/0.6/0.6"].split()
    assert two[2:6] == ["12,800", "1.67x", "1.9x", ">="] and two[6] == "1.95x"
    assert three[2:6] == ["19,200", "2.50x", "2.7x", ">="] and three[6] == "2.85x"
    # the cost model: 1-node compute 0.1 s, D = 4 x 800,000 bytes at 930 Mbit/s: 2(N-1)/N D / B
    ar3 = 2 * 2 / 3 * 3.2e6 / (930e6 / 8)
    assert three[7] == f"{3 * 0.1 / (0.1 + ar3):.2f}x" and three[8] == f"{3 * 0.1 / max(0.1, ar3):.2f}x"
    assert three[10] == "2.50x"  # time to 2.1: 30 s -> 12 s
    assert lines["3 0.6/0.6/0.6"].endswith("0.5 0.4 0.3 -> 0.6 0.5 0.4")
    u = lines["0.6/0.6/0.3 0.6/0.6/0.3"].split()
    assert u[2:5] == ["equal", "10,473", "0.64"]  # 36 x 64 / 0.22 beside 36 x 64 / 0.14
    # model: the reference's CPU-seconds 0.12 x 0.5 of compute at 0.3 CPU, + its 0.02 s all-reduce
    assert u[5] == f"{(0.06 / 0.5 + 0.02) / (0.06 / 0.3 + 0.02):.2f}"
    assert u[6:8] == ["100/100/200", "120/120/20"]
    b = lines["0.6/0.6/0.3 balanced"].split()
    assert b[3:7] == ["speed", "15,890", "0.97", ">="] and b[7] == "0.95"  # 36 x 64 / 0.145 s beside / 0.14 s
    assert "ref" in lines["0.5/0.5/0.5 0.5/0.5/0.5"]
    assert "laptop-c 0.3/0.30" in text and "link 930 of 1000 Mbit/s" in text
    assert "BELOW QUOTA" not in text
    runs[3]["limits"]["nodes"]["laptop-b"]["busy_cpu"] = 0.41  # 0.6 asked: the machine was too busy
    text = sb.tables(results)
    assert "run r-0.6/0.6/0.3: laptop-a 0.6/0.60  laptop-b 0.6/0.41  laptop-c 0.3/0.30" in text
    assert "; BELOW QUOTA: laptop-b" in text
    assert text.splitlines()[-1].startswith("BELOW QUOTA: a node got less")


def test_results_are_written_as_json_and_the_results_file(tmp_path):
    results = {"settings": {}, "runs": [], "command": "benchmarks/scaling.py --samples 1200",
               "load_start": "1.00 2.00 3.00", "load_end": "1.00 1.00 1.00"}
    out = tmp_path / "r" / "bench-scaling.json"
    paths = sb.write_results(results, "TABLE", out, tmp_path / "results")
    assert paths == [out, tmp_path / "results" / "scaling.md"]
    assert json.loads(out.read_text()) == results
    md = paths[1].read_text()
    assert "```text\nTABLE\n```" in md and "`benchmarks/scaling.py --samples 1200`" in md
    assert "before 1.00 2.00 3.00; after 1.00 1.00 1.00" in md and f"raw figures: {out}" in md


def fake_lab(monkeypatch, tmp_path, names, read_limits=None, apply_limits=None):
    """lab/lab.py's view of a lab of ``names`` (quota 0.6, links 1000 Mbit/s unless ``read_limits``
    says otherwise; ``apply_limits``: what applying limits does, by default nothing), and an
    inventory ``tmp_path/inventory`` that the benchmark's checkout (``sb.REPO``) holds."""
    import lab

    limits = lab.NodeLimits(0.6, 0.6, 1, "eth0", 1000.0)
    monkeypatch.setattr(lab, "lab_containers", lambda: list(names))
    monkeypatch.setattr(lab, "read_limits", read_limits or (lambda names: dict.fromkeys(names, limits)))
    monkeypatch.setattr(lab, "apply_limits", apply_limits or (lambda *args, **kw: None))
    monkeypatch.setattr(lab, "container_address", lambda name: "10.0.0.1")
    (tmp_path / "inventory").mkdir()
    (tmp_path / "inventory" / "hosts.yml").write_text("all: {}\n")
    monkeypatch.setattr(sb, "REPO", tmp_path)


def test_a_lab_whose_nodes_cannot_be_read_is_one_line_and_nothing_is_applied(monkeypatch, capsys, tmp_path):
    import lab

    applied = []

    why = "laptop-a: cannot read its CPU share (exit 255): cannot exec in a stopped container"

    def unreadable(names):
        raise lab.LabError(why)

    fake_lab(monkeypatch, tmp_path, ["laptop-a", "laptop-b", "laptop-c"], read_limits=unreadable,
             apply_limits=lambda *args, **kw: applied.append(args))
    assert sb.main(["-i", "inventory", "--runs-dir", str(tmp_path / "runs")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    fix = "fix: `make lab-down lab-up`, then `make demo` once to provision the laptops"
    assert err == [f"scaling: {why}; {fix}"]
    assert applied == [] and not (tmp_path / "runs").exists()


def test_limits_that_cannot_be_put_back_are_one_line_after_the_runs_error(monkeypatch, capsys, tmp_path):
    """The lab's containers stop mid-benchmark: the run's error and the failed restore are one line
    each (no traceback), and the exit status says a play failed."""
    import lab

    def stopped(*args, **kw):
        raise lab.LabError("laptop-a: cannot exec in a stopped container")

    def one_run(*args):
        raise sb.BenchError("1 node: training failed")

    fake_lab(monkeypatch, tmp_path, ["laptop-a", "laptop-b", "laptop-c"], apply_limits=stopped)
    monkeypatch.setattr(sb, "one_run", one_run)
    assert sb.main(["-i", "inventory", "--runs-dir", str(tmp_path / "runs"), "--configs", "1 node",
                    "--results-name", "scaling-one-node", "--results-dir", str(tmp_path / "results")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["scaling: 1 node: training failed",
                   "scaling: putting the lab's limits back: laptop-a: cannot exec in a stopped container"]


def test_a_named_invocation_writes_its_own_page_titled_by_its_groups(tmp_path):
    run = {"config": {"label": "1 node", "group": "scaling"}}
    results = {"settings": {}, "runs": [run], "command": "benchmarks/scaling.py --per-rank-batch 96",
               "load_start": "1.00 2.00 3.00", "load_end": "1.00 1.00 1.00"}
    (tmp_path / "results").mkdir()
    full = tmp_path / "results" / "scaling.md"
    full.write_text("the full invocation's page\n")
    name = "scaling-large-batch"
    paths = sb.write_results(results, "TABLE", tmp_path / "r.json", tmp_path / "results", name)
    assert paths[1] == tmp_path / "results" / "scaling-large-batch.md"
    assert paths[1].read_text().startswith("# Scaling on the lab: 1 -> 2 -> 3 laptops\n")
    assert full.read_text() == "the full invocation's page\n"


@pytest.mark.parametrize("name", ["", "../scaling", "a/b", ".hidden", "page md", "quota-0.4", "Scaling"])
def test_a_results_name_that_is_not_a_plain_file_name_is_refused_in_one_line(name, capsys):
    with pytest.raises(SystemExit) as exc:
        sb.main(["--results-name", name])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert "error: argument --results-name: " in err[-1] and "no folder or .md" in err[-1]


def test_quota_sets_every_node_of_the_scaling_rows_and_leaves_the_unequal_rows(capsys):
    got = sb.with_quota(sb.pick(None), 0.4)
    assert [c.cpus for c in got[:3]] == [(0.4,), (0.4, 0.4), (0.4, 0.4, 0.4)]
    assert got[3:] == list(sb.CONFIGS[3:])
    for bad in ("0", "1.5", "-0.2"):
        with pytest.raises(SystemExit) as exc:
            sb.main(["--quota", bad])
        assert exc.value.code == 2
        assert "0 < --quota <= 1" in capsys.readouterr().err.strip().splitlines()[-1]


def test_table_write_makes_the_page_of_an_earlier_invocation_and_keeps_its_raw_file(tmp_path, capsys):
    settings = {"samples": 12600, "target": 2.1, "link_mbit": 1000, "preset": "small", "per_rank_batch": 96,
                "skip": 0.2}
    results = {"settings": settings, "runs": [],
               "command": "benchmarks/scaling.py --quota 0.4", "load_start": "1.00 2.00 3.00",
               "load_end": "0.50 0.50 0.50"}
    raw = tmp_path / "bench-scaling.json"
    raw.write_text(json.dumps(results))
    before = raw.read_bytes()
    argv = ["--table", str(raw), "--runs-dir", str(tmp_path), "--results-dir", str(tmp_path / "res")]
    assert sb.main([*argv, "--write", "--results-name", "scaling-low-quota"]) == 0
    md = (tmp_path / "res" / "scaling-low-quota.md").read_text()
    assert "`benchmarks/scaling.py --quota 0.4`" in md and "before 1.00 2.00 3.00; after 0.50 0.50 0.50" in md
    assert raw.read_bytes() == before
    assert capsys.readouterr().out.strip().endswith(f"wrote {tmp_path / 'res' / 'scaling-low-quota.md'}")
    assert sb.main(argv) == 0  # without --write: printed only
    assert sorted(p.name for p in (tmp_path / "res").iterdir()) == ["scaling-low-quota.md"]


def test_a_partial_invocation_must_name_its_page_before_anything_runs(monkeypatch, capsys):
    import lab

    monkeypatch.setattr(lab, "lab_containers", lambda: pytest.fail("the lab was looked at"))
    with pytest.raises(SystemExit) as exc:
        sb.main(["--configs", "1 node,3 nodes", "--samples", "1200"])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "--configs runs part of the benchmark: name its page with --results-name scaling-<words>" in err
    with pytest.raises(SystemExit):
        sb.main(["--write"])  # --write without --table would start the full benchmark
    assert "give its raw figures with --table" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["lowcomm", "lr_sweep", "scaling-" + "x" * 100])
def test_a_results_name_of_another_benchmark_or_too_long_is_refused(name, capsys):
    with pytest.raises(SystemExit):
        sb.main(["--table", "x.json", "--write", "--results-name", name])
    assert "scaling or scaling-<words>" in capsys.readouterr().err


def test_table_write_shows_when_where_and_at_which_commit_the_figures_were_measured(tmp_path, capsys):
    """A page written again from raw figures showed the rewrite's date and commit."""
    settings = {"samples": 12600, "target": 2.1, "link_mbit": 1000, "preset": "small", "per_rank_batch": 96,
                "skip": 0.2}
    made = {"date": "2026-12-07 18:03:56 UTC", "commit": "0123abc", "machine": "the measuring machine"}
    raw = tmp_path / "raw.json"
    raw.write_text(json.dumps({"settings": settings, "runs": [], "command": "c", "made": made,
                               "load_start": "1 1 1", "load_end": "1 1 1"}))
    argv = ["--table", str(raw), "--write", "--runs-dir", str(tmp_path),
            "--results-dir", str(tmp_path / "res")]
    assert sb.main(argv) == 0
    md = (tmp_path / "res" / "scaling.md").read_text()
    assert "- date: 2026-12-07 18:03:56 UTC\n- git commit: 0123abc\n- machine: the measuring machine\n" in md
    assert "did not record" not in md
    raw.write_text(json.dumps({"settings": settings, "runs": [], "command": "c", "load_start": "1 1 1",
                               "load_end": "1 1 1"}))  # raw figures from before they recorded it
    assert sb.main(argv) == 0
    md = (tmp_path / "res" / "scaling.md").read_text()
    assert "0123abc" not in md and "those of this page's writing" in md


def test_a_run_records_its_provenance_beside_the_raw_figures(monkeypatch, tmp_path):
    fake_lab(monkeypatch, tmp_path, ["laptop-a"])
    monkeypatch.setattr(sb, "one_run", lambda a, lab, config, names: {"config": {"label": config.label,
                                                                                 "group": config.group}})
    monkeypatch.setattr(sb, "tables", lambda results: "TABLE")
    monkeypatch.setattr(sb.bench_results, "provenance", lambda: {"date": "D", "commit": "C", "machine": "M"})
    raw = tmp_path / "raw.json"
    assert sb.main(["-i", "inventory", "--runs-dir", str(tmp_path / "runs"), "--configs", "1 node",
                    "--results-name", "scaling-one-node", "--results-dir", str(tmp_path / "res"),
                    "--out", str(raw)]) == 0
    assert json.loads(raw.read_text())["made"] == {"date": "D", "commit": "C", "machine": "M"}
    page = (tmp_path / "res" / "scaling-one-node.md").read_text()
    assert "- date: D\n- git commit: C\n- machine: M\n" in page


def test_table_write_keeps_the_page_name_its_raw_figures_recorded(tmp_path, capsys):
    settings = {"samples": 12600, "target": 2.1, "link_mbit": 1000, "preset": "small", "per_rank_batch": 96,
                "skip": 0.2, "configs": "1 node,3 nodes", "results_name": "scaling-large-batch"}
    raw = tmp_path / "raw.json"
    raw.write_text(json.dumps({"settings": settings, "runs": [], "command": "c", "load_start": "1 1 1",
                               "load_end": "1 1 1"}))
    argv = ["--table", str(raw), "--write", "--runs-dir", str(tmp_path),
            "--results-dir", str(tmp_path / "res")]
    assert sb.main(argv) == 0
    assert sorted(p.name for p in (tmp_path / "res").iterdir()) == ["scaling-large-batch.md"]
    del settings["results_name"]  # a partial invocation's raw figures from before the name was recorded
    raw.write_text(json.dumps({"settings": settings, "runs": [], "command": "c", "load_start": "1 1 1",
                               "load_end": "1 1 1"}))
    assert sb.main(argv) == 2
    assert "--results-name scaling-<words>" in capsys.readouterr().err.strip().splitlines()[-1]
    assert sorted(p.name for p in (tmp_path / "res").iterdir()) == ["scaling-large-batch.md"]


@pytest.mark.parametrize("content", [None, "", '{"runs": [', "[]", "{}", '{"runs": []}', b"\xff\xfe"])
def test_a_table_that_is_not_this_benchmarks_raw_figures_is_one_line(tmp_path, capsys, content):
    raw = tmp_path / "raw.json"
    if isinstance(content, bytes):
        raw.write_bytes(content)
    elif content is not None:
        raw.write_text(content)
    assert sb.main(["--table", str(raw), "--write", "--results-dir", str(tmp_path / "res")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"scaling: --table {raw}: ") and "fix: " in err[0]
    assert not (tmp_path / "res").exists()


@pytest.mark.parametrize("made", [5, "yesterday", ["a"], {}, {"date": "d", "commit": "c"},
                                  {"date": 1, "commit": "c", "machine": "m"},
                                  {"date": "d", "commit": "c", "machine": None},
                                  {"date": "D\n# injected heading", "commit": "c", "machine": "m"},
                                  {"date": "", "commit": "c", "machine": "m"}])
def test_raw_figures_whose_provenance_is_not_one_are_one_line(tmp_path, capsys, made):
    settings = {"samples": 12600, "target": 2.1, "link_mbit": 1000, "preset": "small", "per_rank_batch": 96,
                "skip": 0.2}
    raw = tmp_path / "raw.json"
    raw.write_text(json.dumps({"settings": settings, "runs": [], "command": "c", "made": made,
                               "load_start": "1 1 1", "load_end": "1 1 1"}))
    assert sb.main(["--table", str(raw), "--write", "--runs-dir", str(tmp_path),
                    "--results-dir", str(tmp_path / "res")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f'scaling: --table {raw}: "made" is '), err
    assert "fix: " in err[0], err
    assert not (tmp_path / "res").exists()


def test_a_results_dir_that_is_a_file_is_refused_before_anything(tmp_path, capsys):
    (tmp_path / "file").write_text("x")
    with pytest.raises(SystemExit) as exc:
        sb.main(["--table", str(tmp_path / "raw.json"), "--write", "--results-dir", str(tmp_path / "file")])
    assert exc.value.code == 2 and "is a file: give a folder" in capsys.readouterr().err
