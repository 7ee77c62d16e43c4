"""ddplab.controller.summary: summary.json of a synthetic collected run, the update hook, live progress."""

import json
from pathlib import Path

import pytest
from ddplab.controller import summary as sm

T0 = 1_800_000_000.0


def rec(event, t, host, rank, ws, restart=0, **kw):
    return {
        "event": event,
        "time": T0 + t,
        "host": host,
        "rank": rank,
        "local_rank": 0,
        "world_size": ws,
        "restart_count": restart,
        **kw,
    }


def write_host(run: Path, host: str, records, files=("journal.txt",), ckpt_step=None, result=None):
    d = run / host
    (d / "metrics").mkdir(parents=True)
    with open(d / "metrics" / f"{host}-local0.jsonl", "w") as fh:
        for r in records:
            fh.write(json.dumps(r) + "\n")
        fh.write('{"event": "step", "time": ')  # a torn last line (killed writer)
    for f in files:
        (d / f).write_text("x\n")
    if ckpt_step is not None:
        (d / "checkpoints").mkdir()
        (d / "checkpoints" / f"ckpt-{ckpt_step:08d}.pt").write_bytes(b"\0")
    if result is not None:
        (d / "result.json").write_text(json.dumps(result))


def shrink_run(tmp_path: Path) -> Path:
    """3 nodes; laptop-c dies after step 20; a and b re-form at world size 2 and finish at 40."""
    run = tmp_path / "20261129-1200-ab12"
    gen1 = {"laptop-a": 0, "laptop-b": 1, "laptop-c": 2}
    gen2 = {"laptop-a": 1, "laptop-b": 0}
    for host, r1 in gen1.items():
        recs = [
            rec(
                "start",
                0,
                host,
                r1,
                3,
                resumed_from_step=0,
                max_steps=40,
                batch_policy="keep_per_rank",
                run_id="20261129-1200-ab12",
            )
        ]
        for i, step in enumerate((10, 20)):
            recs.append(
                rec(
                    "step",
                    10 + 10 * i,
                    host,
                    r1,
                    3,
                    step=step,
                    loss=4.0 - step / 20,
                    tokens_per_s=3000.0 + r1,
                    compute_s=0.1,
                    step_time_s=0.2,
                )
            )
        recs.append(rec("val", 21, host, r1, 3, step=20, val_loss=3.2, train_loss=3.1))
        if host in gen2:
            r2 = gen2[host]
            recs.append(
                rec("failure", 25, host, r1, 3, step=20, error="Connection reset by peer", saved=True)
            )
            recs.append(
                rec(
                    "start",
                    40,
                    host,
                    r2,
                    2,
                    restart=1,
                    resumed_from_step=20,
                    max_steps=40,
                    batch_policy="keep_per_rank",
                    run_id="20261129-1200-ab12",
                )
            )
            for i, step in enumerate((30, 40)):
                recs.append(
                    rec(
                        "step",
                        50 + 10 * i,
                        host,
                        r2,
                        2,
                        restart=1,
                        step=step,
                        loss=2.6 - step / 100,
                        tokens_per_s=2000.0,
                    )
                )
            recs.append(
                rec(
                    "end",
                    70,
                    host,
                    r2,
                    2,
                    restart=1,
                    step=40,
                    final_train_loss=2.1,
                    final_val_loss=2.25,
                    wall_s=70.0,
                )
            )
        write_host(
            run,
            host,
            recs,
            files=("journal.txt", "sample.txt") if host == "laptop-b" else ("journal.txt",),
            ckpt_step=40 if host in gen2 else 20,
        )
    return run


def test_build_summary_shrink(tmp_path):
    run = shrink_run(tmp_path)
    s = sm.build_summary(run)
    assert s["run_id"] == "20261129-1200-ab12"
    assert s["hosts"] == ["laptop-a", "laptop-b", "laptop-c"]
    assert s["steps_completed"] == 40 and s["max_steps"] == 40
    assert s["final_train_loss"] == 2.1 and s["final_val_loss"] == 2.25
    assert s["first_train_loss"] == pytest.approx(3.5)
    assert s["wall_s"] == 70.0
    assert s["world_size_timeline"] == [
        {"time": T0 + 0, "step": 0, "world_size": 3},
        {"time": T0 + 40, "step": 20, "world_size": 2},
    ]
    assert s["restarts"] == 1
    assert s["faults"] == []
    assert s["batch_policy"] == "keep_per_rank"
    assert s["per_host"]["laptop-c"]["last_step"] == 20
    assert s["per_host"]["laptop-a"]["failures"][0]["error"].startswith("Connection reset")
    assert s["per_host"]["laptop-a"]["checkpoint"] == "laptop-a/checkpoints/ckpt-00000040.pt"
    assert s["sample"] == "laptop-b/sample.txt"
    text = sm.human_summary(s, run)
    assert "40/40 steps on 3 node(s)" in text and "finished" in text
    assert "3 (step 0) -> 2 (step 20)" in text and "group restarts: 1" in text


def test_write_keeps_other_fields_and_update_hook(tmp_path):
    run = shrink_run(tmp_path)
    sm.update_summary(run, report_note="kept", faults=[{"mode": "kill-agent", "node": "laptop-c"}])
    path = sm.write_summary(run, sm.build_summary(run))
    data = json.loads(path.read_text())
    assert data["report_note"] == "kept"
    # no fault injections in events.jsonl: the list already recorded is kept
    assert data["faults"] == [{"mode": "kill-agent", "node": "laptop-c"}]
    assert not list(run.glob(".summary.json.*"))  # no temp file left behind


def test_faults_measured_from_events(tmp_path):
    run = shrink_run(tmp_path)
    (run / "events.jsonl").write_text(
        json.dumps({"time": T0 + 22, "kind": "fault", "mode": "kill-agent", "node": "laptop-c", "rank": 2})
        + "\n"
    )
    s = sm.build_summary(run)
    assert len(s["faults"]) == 1
    f = s["faults"][0]
    assert f["mode"] == "kill-agent" and f["node"] == "laptop-c"
    assert f["world_size_before"] == 3 and f["world_size_after"] == 2
    assert f["recovered_s"] == pytest.approx(50 - 22)


def test_without_end_record_falls_back(tmp_path):
    run = tmp_path / "r1"
    recs = [
        rec("start", 0, "n1", 0, 1, resumed_from_step=0, max_steps=100),
        rec("step", 5, "n1", 0, 1, step=10, loss=3.0),
        rec("val", 6, "n1", 0, 1, step=10, val_loss=3.3, train_loss=3.1),
    ]
    write_host(run, "n1", recs)
    s = sm.build_summary(run)
    assert (s["final_train_loss"], s["final_val_loss"]) == (3.1, 3.3)
    assert s["wall_s"] == pytest.approx(6.0)
    assert "NOT finished" in sm.human_summary(s)


def test_bad_input(tmp_path, capsys):
    with pytest.raises(sm.SummaryError):
        sm.build_summary(tmp_path / "missing")
    assert sm.main(["build", str(tmp_path / "missing")]) == 2
    assert not (tmp_path / "missing").exists()


def test_cli_build(tmp_path, capsys):
    run = shrink_run(tmp_path)
    assert sm.main(["build", str(run), "--hosts", "laptop-a,laptop-b,laptop-c"]) == 0
    out = capsys.readouterr().out
    assert "run 20261129-1200-ab12: 40/40 steps" in out
    assert json.loads((run / "summary.json").read_text())["steps_completed"] == 40
