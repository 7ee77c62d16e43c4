"""ddplab.status: the node-side state of the job (the line and JSON the node_status action polls)."""

import json
import time

import pytest
from ddplab import records as records_mod
from ddplab import status as st

T0 = 1_800_000_000.0


def rec(event, t, host, rank, ws, restart=0, **kw):
    return {"event": event, "time": T0 + t, "host": host, "rank": rank, "local_rank": 0, "world_size": ws,
            "restart_count": restart, **kw}


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
    assert st.job_state(unit, records) == state


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
    p = st.progress(out, unit=None, host="laptop-a")
    assert p["state"] == "running"
    line = p["line"]
    assert line.startswith("laptop-a")
    for part in ("step   120/1500", "loss 2.314", "val 2.410", "ws 3", "rank 1", "12.3k tok/s", "restarts 0"):
        assert part in line, (part, line)
    empty = st.progress(tmp_path / "nothing", unit=None, host="laptop-b")
    assert "no metrics yet" in empty["line"]


def test_progress_shows_failure():
    p = st.node_progress(
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
    assert "last failure: RuntimeError" in st.format_progress("laptop-c", p, "running")


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
    monkeypatch.setattr(st, "unit_state", lambda name: unit)
    assert st.unit_started_at(unit) == pytest.approx(now - 5, abs=1)
    p = st.progress(out, unit="ddp-lab-agent", host="n")
    assert "no metrics yet" in p["line"] and p["state"] == "running"


def test_cli_prints_the_json_the_watch_reads(tmp_path, capsys):
    out = tmp_path / "run"
    (out / "metrics").mkdir(parents=True)
    recs = [rec("start", 0, "h", 0, 2, max_steps=50, run_id="run-x"),
            rec("step", 1, "h", 0, 2, step=3, loss=2.0),
            rec("end", 2, "h", 0, 2, step=50)]
    (out / "metrics" / "h-local0.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    assert st.main(["--out-dir", str(out), "--unit", "", "--host", "h", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["state"] == "succeeded" and doc["host"] == "h"
    p = doc["progress"]
    assert (p["run_id"], p["step"], p["max_steps"], p["world_size"], p["rank"]) == ("run-x", 50, 50, 2, 0)
    assert st.main(["--out-dir", str(tmp_path / "none"), "--unit", ""]) == 0
    assert "no metrics yet" in capsys.readouterr().out


def _long_file(path, n_steps, start_at=0, **start):
    """A metrics file of a log_interval 1 run: ``n_steps`` step records, the start record after
    ``start_at`` of them (written by ddplab.metrics.MetricsWriter, as on a node)."""
    from ddplab.metrics import MetricsWriter

    w = MetricsWriter(path.parent, host="h", rank=0, local_rank=0, world_size=3, restart_count=0)
    for s in range(1, n_steps + 1):
        if s - 1 == start_at:
            w.write("start", run_id="run-long", max_steps=50_000, engine="per_step", **start)
        w.write("step", step=s, loss=2.0, tokens_per_s=1000.0, step_time_s=0.5, lr=1e-3, grad_norm=1.0)
    w.close()
    return w.path


@pytest.mark.parametrize("start_at", [0, 1200])
def test_long_run_keeps_the_facts_of_its_start(tmp_path, start_at):
    """status on a log_interval 1 run longer than TAIL_BYTES (newcomer, 2026-12-01: 'running -
    22427/?' and a store line instead of the lighthouse): run id, max_steps and engine come from
    the file's newest start record wherever it is (also a resumed launch's, mid-file)."""
    out = tmp_path / "run"
    path = _long_file(out / "metrics" / "h-local0.jsonl", 6000, start_at=start_at)
    assert path.stat().st_size > 3 * st.TAIL_BYTES
    doc = st.progress(out, unit=None, host="h")
    p = doc["progress"]
    assert (p["run_id"], p["max_steps"], p["engine"], p["step"]) == ("run-long", 50_000, "per_step", 6000)
    assert "step  6000/50000" in doc["line"]


def test_a_long_file_whose_tail_holds_its_start_is_not_searched(tmp_path, monkeypatch):
    """The search before the tail (~27 ms on a 50 MB file at every status read) only for a file
    whose tail lacks a start record: here the start is the 5,900th of 6,000 steps."""
    out = tmp_path / "run"
    first = _long_file(out / "metrics" / "h-local0.jsonl", 6000, start_at=5900, resumed_from_step=5900)
    first.rename(first.with_name("g-local0.jsonl"))  # the writer names its file h-local0.jsonl
    searched = []
    real = records_mod.newest_start_record
    monkeypatch.setattr(records_mod, "newest_start_record", lambda *a: searched.append(a) or real(*a))
    records, _ = st.read_node_metrics(out / "metrics")
    assert searched == []
    assert [r["resumed_from_step"] for r in records if r["event"] == "start"] == [5900]
    _long_file(out / "metrics" / "h-local0.jsonl", 6000, start_at=0)  # its start is before the tail
    records, _ = st.read_node_metrics(out / "metrics")
    assert len(searched) == 1 and searched[0][0].name == "h-local0.jsonl"
    assert len([r for r in records if r["event"] == "start"]) == 2


def test_newest_start_record_skips_lines_that_only_mention_a_start(tmp_path):
    f = tmp_path / "m.jsonl"
    lines = [{"event": "start", "time": 1, "run_id": "a"}, {"event": "start", "time": 2, "run_id": "b"},
             {"event": "failure", "time": 3, "error": 'text with "event":"start" inside'},
             {"event": "step", "time": 4, "note": {"event": "start"}}]
    f.write_text("".join(json.dumps(x, separators=(",", ":")) + "\n" for x in lines))
    assert st.newest_start_record(f, f.stat().st_size)["run_id"] == "b"
    assert st.newest_start_record(f, 5)["run_id"] == "a"  # only lines that begin before byte 5
    (tmp_path / "empty.jsonl").write_text("")
    assert st.newest_start_record(tmp_path / "empty.jsonl", 100) is None


def test_one_per_file_reader_serves_the_node_and_the_controller(tmp_path):
    """Review: ddplab.status read each metrics file itself beside records.read_metrics_dir; both now
    read through records.read_metrics_file (the tail and its start for the node, the whole file and
    the host for the controller)."""
    out = tmp_path / "run"
    path = _long_file(out / "metrics" / "h-local0.jsonl", 6000, start_at=0)
    whole, _ = records_mod.read_metrics_file(path)
    tail, _ = records_mod.read_metrics_file(path, st.TAIL_BYTES)
    kept, _ = records_mod.read_metrics_file(path, st.TAIL_BYTES, keep_start=True)
    assert len(whole) == 6001 and not records_mod.events_of(tail, "start")
    assert kept[:-1] == tail and kept[-1] == records_mod.events_of(whole, "start")[0]
    assert st.read_node_metrics(out / "metrics") == records_mod.read_metrics_dir(
        out / "metrics", tail_bytes=st.TAIL_BYTES, keep_start=True)
    assert records_mod.read_metrics_dir(out / "metrics", host="x")[0] == records_mod.by_time(whole)
