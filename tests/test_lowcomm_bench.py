"""benchmarks/lowcomm.py on recorded inputs: each mode's playbook variables, a run's figures from
its collected folder (NIC and model bytes per step after the first, step time, tokens/s, the
communication share, the final val loss), the table with the noise band, the results file."""

import json
from pathlib import Path

import lowcomm
import pytest


def test_each_mode_is_its_engine_and_compression():
    def values(mode, preset="small"):
        extra = lowcomm.mode_vars(mode, 500, 7, preset)
        plain = dict(e.split("=", 1) for e in extra if not e.startswith("{"))
        return plain, json.loads(extra[-1])["ddp_job_train_overrides"]

    plain, over = values("bf16")
    assert plain["ddp_job_fault_tolerance"] == "torchelastic" and plain["ddp_job_grad_compression"] == "bf16"
    assert over == {
        "log_interval": 1,
        "eval_interval": 500,
        "ckpt_interval": 5000,
        "seed": 7,
        "sample_chars": 0,
    }
    assert values("fp32")[0]["ddp_job_grad_compression"] == "none"
    assert values("powersgd")[0]["ddp_job_powersgd_start_step"] == "10"
    assert values("powersgd", "gpt2")[0]["ddp_job_powersgd_start_step"] == "2"
    plain, _ = values("diloco-50")
    assert plain["ddp_job_fault_tolerance"] == "diloco" and plain["ddp_job_sync_every"] == "50"
    assert plain["collect_checkpoints"] == "0" and plain["ddp_job_max_steps"] == "500"


def make_run(root: Path, name: str, per_step: list[tuple[int, float, float]], val: float) -> Path:
    """A collected run of two laptops: per step (NIC sent, step s, allreduce s), a val at the end."""
    run = root / name
    for host in ("laptop-a", "laptop-b"):
        recs = [{"event": "start", "time": 1000.0, "host": host, "rank": 0, "local_rank": 0, "world_size": 2}]
        t = 1000.0
        for i, (sent, step_s, comm_s) in enumerate(per_step, start=1):
            t += step_s
            recs.append(
                {
                    "event": "step",
                    "time": t,
                    "host": host,
                    "rank": 0,
                    "local_rank": 0,
                    "world_size": 2,
                    "step": i,
                    "step_time_s": step_s,
                    "allreduce_s": comm_s,
                    "global_batch_size": 10,
                    "nic_sent_bytes": sent,
                    "nic_recv_bytes": sent,
                    "wire_model_bytes": 1000,
                    "nic_steps": 1,
                    "max_rss_mb": 300.0,
                }
            )
        recs.append(
            {
                "event": "val",
                "time": t,
                "host": host,
                "rank": 0,
                "local_rank": 0,
                "world_size": 2,
                "step": len(per_step),
                "val_loss": val,
                "train_loss": val,
            }
        )
        (run / host / "metrics").mkdir(parents=True)
        (run / host / "metrics" / f"{host}-local0.jsonl").write_text(
            "".join(json.dumps(r) + "\n" for r in recs)
        )
        (run / host / "run.json").write_text(json.dumps({"block_size": 8}))
    return run


def test_a_runs_figures_from_its_folder(tmp_path):
    run = make_run(
        tmp_path, "r1", [(9999, 5.0, 4.0), (1100, 1.0, 0.2), (1060, 1.0, 0.2), (1040, 2.0, 0.2)], 2.5
    )
    f = lowcomm.figures(run, start=1)
    assert f["nic_sent"] == pytest.approx((1100 + 1060 + 1040) / 3)  # step 1 (start-up) left out
    assert f["model"] == 1000 and f["step_s"] == 1.0 and f["val"] == 2.5 and f["nodes"] == 2
    assert f["comm_share"] == pytest.approx(0.6 / 4.0)
    assert f["tokens_per_s"] == pytest.approx(3 * 10 * 8 / 4.0)  # steps 2-4 over the time from step 1 to 4
    assert lowcomm.figures(run, start=3)["nic_sent"] == 1040


def row(mode, seed, sent, val, preset="small"):
    return {
        "link_mbit": "1000",
        "mode": mode,
        "preset": preset,
        "seed": seed,
        "steps": 3 if preset == "gpt2" else 500,
        "nic_sent": sent,
        "model": sent,
        "step_s": 0.2,
        "tokens_per_s": 1000.0,
        "comm_share": 0.1,
        "val": val,
        "load_start": "3.1 2.0 1.0",
        "load_end": "4.2 2.0 1.0",
    }


def test_the_table_sets_every_mode_beside_fp32_and_the_noise_band():

    rows = [
        row("fp32", 1, 4e6, 2.00),
        row("bf16", 1, 2e6, 2.01),
        row("diloco-50", 1, 5e4, 2.20),
        row("fp32", 2, 4e6, 1.98),
        row("fp32", 3, 4e6, 2.02),
        row("fp32", 1, 5e8, None, "gpt2"),
    ]
    text = lowcomm.table(rows)
    lines = text.splitlines()
    bf16 = next(line for line in lines if " bf16 " in line)
    assert "2.0x" in bf16 and " in " in bf16 and "3.1->4.2" in bf16
    diloco = next(line for line in lines if "diloco-50" in line)
    assert "80.0x" in diloco and "+0.180" in diloco  # the gap above the band
    assert lines[-1] == "noise band at 1000 Mbit/s (fp32, 3 seeds): val 1.9800 .. 2.0200"
    assert "500 MB" in next(line for line in lines if "gpt2" in line)


def test_the_note_of_each_stage_says_how_the_links_were_left(monkeypatch):
    calls = []

    def run(argv, **_):
        calls.append(argv[argv.index("--link-mbit") + 1])
        return type("Done", (), {"returncode": 0, "stdout": "", "stderr": ""})()

    monkeypatch.setattr(lowcomm.subprocess, "run", run)
    a = lowcomm.argparse.Namespace(no_shape=False, cpus="0.6")
    assert lowcomm.shape(a, "100") == "lab limits: every laptop's egress tbf 100 Mbit/s, CPU quota 0.6"
    assert lowcomm.shape(a, "off") == "lab limits: every laptop's egress not shaped, CPU quota 0.6"
    assert calls == ["100", "off"]


def test_an_earlier_runs_json_writes_the_results_page_with_table_and_write(tmp_path, capsys):
    """--table JSON --write: the page of an earlier (e.g. interrupted) invocation's finished runs,
    its notes and raw-figures line, the steps read from the rows."""
    raw = tmp_path / "bench-lowcomm-x.json"
    rows = [row("fp32", 1, 4e6, 2.00), row("fp32", 2, 4e6, 1.98), row("fp32", 1, 5e8, None, "gpt2")]
    raw.write_text(json.dumps({"runs": rows, "notes": ["1000 Mbit/s: lab limits: every laptop's egress"]}))
    assert lowcomm.main(["--table", str(raw)]) == 0 and not (tmp_path / "lowcomm.md").exists()
    assert lowcomm.main(["--table", str(raw), "--write", "--results-dir", str(tmp_path)]) == 0
    page = (tmp_path / "lowcomm.md").read_text()
    assert "(3 laptops; small preset 500 steps, gpt2 3 steps)" in page and "noise band at 1000 Mbit/s" in page
    assert "per run: the table's load column" in page and f"raw figures: {raw}" in page
    assert "1000 Mbit/s: lab limits" in page
    assert "did not record their command, date, commit and machine" in page  # raw figures of before


def test_table_write_shows_the_command_date_and_commit_the_raw_figures_recorded(tmp_path):
    """A page written again from raw figures showed the rewrite's command (--table ... --write),
    date and commit."""
    raw = tmp_path / "bench-lowcomm-x.json"
    made = {"date": "2026-12-07 14:56:07 UTC", "commit": "0123abc", "machine": "the measuring machine"}
    raw.write_text(json.dumps({"runs": [row("fp32", 1, 4e6, 2.00)], "notes": [],
                               "command": "benchmarks/lowcomm.py --links 1000,100", "made": made}))
    assert lowcomm.main(["--table", str(raw), "--write", "--results-dir", str(tmp_path)]) == 0
    page = (tmp_path / "lowcomm.md").read_text()
    assert ("- command: `benchmarks/lowcomm.py --links 1000,100`\n- date: 2026-12-07 14:56:07 UTC\n"
            "- git commit: 0123abc\n- machine: the measuring machine\n") in page
    assert "did not record" not in page


@pytest.mark.parametrize("content", [None, "", '{"runs": [', "[]", "{}", '{"runs": 5}',
                                     '{"runs": [], "made": 5}', '{"runs": [], "made": {"date": "d"}}'])
def test_a_table_that_is_not_this_benchmarks_raw_figures_is_one_line(tmp_path, capsys, content):
    """A missing, empty, cut or foreign --table file, or one whose "made" is not a provenance, was a
    traceback."""
    raw = tmp_path / "raw.json"
    if content is not None:
        raw.write_text(content)
    assert lowcomm.main(["--table", str(raw), "--write", "--results-dir", str(tmp_path / "res")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: --table {raw}: ") and "fix: " in err[0], err
    assert not (tmp_path / "res").exists()


def test_a_lab_that_cannot_be_shaped_is_one_line_each_and_no_traceback(monkeypatch, tmp_path, capsys):
    """The lab's containers cannot run (lab.py up fails): the benchmark says so in one line, the
    attempt to unshape after it in one more, runs nothing and exits 2."""
    def run(argv, **_):
        return type("Failed", (), {"returncode": 1, "stdout": "",
                                   "stderr": "lab: error: laptop-a: systemd did not finish booting\n"})()

    monkeypatch.setattr(lowcomm.subprocess, "run", run)
    monkeypatch.setattr(lowcomm, "one_run", lambda *_: pytest.fail("a run was launched"))
    assert lowcomm.main(["--links", "1000", "--out", str(tmp_path / "raw.json")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and all(line.startswith("error: ") for line in err), err
    assert err[0].endswith("failed: lab: error: laptop-a: systemd did not finish booting"), err
    assert err[1].startswith("error: after the benchmark")
