"""ddplab.summary: summary.json of a synthetic collected run, the update hook, live progress."""

import json
import time
from pathlib import Path

import pytest
from ddplab import summary as sm

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


@pytest.mark.parametrize(
    ("unit", "records", "state"),
    [
        (
            {"LoadState": "loaded", "ActiveState": "active", "SubState": "running", "Result": "success"},
            [],
            "running",
        ),
        (
            {
                "LoadState": "loaded",
                "ActiveState": "active",
                "SubState": "exited",
                "Result": "success",
                "ExecMainStatus": "0",
            },
            [],
            "succeeded",
        ),
        (
            {
                "LoadState": "loaded",
                "ActiveState": "failed",
                "SubState": "failed",
                "Result": "exit-code",
                "ExecMainStatus": "1",
            },
            [],
            "failed",
        ),
        ({"LoadState": "not-found", "ActiveState": "inactive"}, [], "absent"),
        ({}, [{"event": "end"}], "succeeded"),
        ({}, [], "running"),
    ],
)
def test_job_state(unit, records, state):
    assert sm.job_state(unit, records) == state


def test_progress_line(tmp_path):
    now = time.time()
    out = tmp_path / "run"
    (out / "metrics").mkdir(parents=True)
    recs = [
        {
            "event": "start",
            "time": now - 20,
            "rank": 1,
            "world_size": 3,
            "restart_count": 0,
            "max_steps": 1500,
        },
        {
            "event": "step",
            "time": now - 10,
            "rank": 1,
            "world_size": 3,
            "restart_count": 0,
            "step": 110,
            "loss": 2.5,
            "tokens_per_s": 12345.0,
        },
        {
            "event": "val",
            "time": now - 5,
            "rank": 1,
            "world_size": 3,
            "restart_count": 0,
            "step": 120,
            "val_loss": 2.41,
            "train_loss": 2.3,
        },
        {
            "event": "step",
            "time": now - 1,
            "rank": 1,
            "world_size": 3,
            "restart_count": 0,
            "step": 120,
            "loss": 2.314,
            "tokens_per_s": 12345.0,
        },
    ]
    # a long file: progress reads only its tail, the first (cut) line is skipped
    filler = "".join(json.dumps({**recs[1], "time": now - 100, "step": i % 100}) + "\n" for i in range(5000))
    (out / "metrics" / "laptop-a-local0.jsonl").write_text(
        filler + "".join(json.dumps(r) + "\n" for r in recs)
    )
    p = sm.progress(out, unit=None, host="laptop-a")
    assert p["state"] == "running"
    line = p["line"]
    assert line.startswith("laptop-a")
    for part in ("step   120/1500", "loss 2.314", "val 2.410", "ws 3", "rank 1", "12.3k tok/s", "restarts 0"):
        assert part in line, (part, line)
    empty = sm.progress(tmp_path / "nothing", unit=None, host="laptop-b")
    assert "no metrics yet" in empty["line"]


def test_progress_shows_failure():
    p = sm.node_progress(
        [
            {
                "event": "step",
                "time": 1.0,
                "rank": 0,
                "world_size": 3,
                "restart_count": 0,
                "step": 5,
                "loss": 3.0,
            },
            {
                "event": "failure",
                "time": 2.0,
                "rank": 0,
                "world_size": 3,
                "restart_count": 0,
                "step": 5,
                "error": "RuntimeError: Connection closed by peer",
            },
        ]
    )
    assert p["failure"].startswith("RuntimeError")
    assert "last failure: RuntimeError" in sm.format_progress("laptop-c", p, "running")


def test_progress_ignores_records_of_earlier_launches(tmp_path, monkeypatch):
    now = time.time()
    out = tmp_path / "run"
    (out / "metrics").mkdir(parents=True)
    old = {
        "event": "failure",
        "time": now - 300,
        "rank": 0,
        "world_size": 3,
        "restart_count": 0,
        "step": 584,
        "error": "Terminated: stopped by SIGTERM",
    }
    (out / "metrics" / "n-local0.jsonl").write_text(json.dumps(old) + "\n")
    started_mono_us = int((time.monotonic() - 5) * 1e6)  # the unit started 5 s ago
    unit = {
        "LoadState": "loaded",
        "ActiveState": "active",
        "SubState": "running",
        "Result": "success",
        "ExecMainStartTimestampMonotonic": str(started_mono_us),
    }
    monkeypatch.setattr(sm, "unit_state", lambda name: unit)
    assert sm.unit_started_at(unit) == pytest.approx(now - 5, abs=1)
    p = sm.progress(out, unit="ddp-lab-agent", host="n")
    assert "no metrics yet" in p["line"] and p["state"] == "running"
