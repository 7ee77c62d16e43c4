"""benchmarks/recovery.py's plan parsing and side-by-side table (the lab runs are a benchmark, not a test)."""

import argparse

import pytest
import recovery as rb


def fault(mode, rec, restarts, duration_s=None):
    return {
        "mode": mode,
        "detected_s": 0.5,
        "recovered_s": rec,
        "steps_lost": 0,
        "stall_s": rec,
        "restarts": restarts,
        "duration_s": duration_s,
    }


def test_plan():
    assert rb.parse_plan("kill-agent@rank0,freeze@laptop-b:30") == [
        ("kill-agent", "rank0", None),
        ("freeze", "laptop-b", 30.0),
    ]
    for bad in ("bogus@rank0", "freeze@", "freeze@rank0:x"):
        with pytest.raises(ValueError, match="expected <mode>@"):
            rb.parse_plan(bad)


def test_table_is_side_by_side_median_with_load():
    runs = [
        {
            "engine": "torchelastic",
            "run_id": f"t{i}",
            "load_start": "5.0 4.0 3.0",
            "load_end": "6.0 5.0 4.0",
            "faults": [fault("kill-agent", rec, 2), fault("rejoin", 12.0, 3), fault("freeze", None, 0, 30.0)],
        }
        for i, rec in enumerate((9.0, 10.0, 30.0))
    ]
    runs.append(
        {
            "engine": "per_step",
            "run_id": "p0",
            "load_start": "5.0 4.0 3.0",
            "load_end": "5.5 4.0 3.0",
            "faults": [fault("kill-agent", 1.1, 0), fault("rejoin", 4.0, 1)],
        }
    )
    text = rb.table(runs, ["torchelastic", "per_step"])
    lines = text.splitlines()
    assert lines[0].split()[:4] == ["fault", "torchelastic:det", "torchelastic:rec", "torchelastic:lost"]
    kill = lines[1].split()
    assert kill[0] == "kill-agent" and kill[2] == "10.0" and kill[6] == "3"  # median of 3 runs, n=3
    assert kill[8] == "1.1" and kill[11] == "0" and kill[12] == "1"  # per_step: no process restarted, n=1
    assert lines[2].startswith("rejoin after kill-agent")
    freeze = lines[3].split()
    assert freeze[:3] == ["freeze", "30s", "0.5"] and freeze[3] == "-" and freeze[-1] == "0"
    assert "per_step      run p0: load average 5.0 4.0 3.0 -> 5.5 4.0 3.0" in lines


def test_inject_plan_awaits_full_size_after_each_fault_unless_told_not_after_the_last(monkeypatch, tmp_path):
    calls = []
    monkeypatch.setattr(rb, "play", lambda inv, book, extra, label: calls.append(label))
    monkeypatch.setattr(rb, "await_full_size", lambda *a: calls.append("await"))
    a = type("A", (), {"inventory": "inv", "nodes": 3, "runs_dir": tmp_path})()
    plan = rb.parse_plan("freeze@rank0:15,partition@laptop-b:15")
    rb.inject_plan(a, [], "r1", plan)
    assert calls == ["freeze", "await", "partition", "await"]
    calls.clear()
    rb.inject_plan(a, [], "r1", plan, await_last=False)
    assert calls == ["freeze", "await", "partition"]


def test_inject_plan_names_the_fault_that_did_not_fit(monkeypatch, tmp_path):
    def play(inv, book, extra, label):
        if label == "partition":
            raise rb.BenchError("partition failed (exit 2) after 1 s: no job of run r1 is running there")

    monkeypatch.setattr(rb, "play", play)
    monkeypatch.setattr(rb, "await_full_size", lambda *a: None)
    a = type("A", (), {"inventory": "inv", "nodes": 3, "runs_dir": tmp_path})()
    with pytest.raises(
        rb.PlanError, match=r"^fault 2/2 partition@laptop-b:15 of the plan did not complete in run r1"
    ):
        rb.inject_plan(a, [], "r1", rb.parse_plan("freeze@rank0:15,partition@laptop-b:15"))



def test_every_option_has_help_and_help_names_the_plan_syntax_and_presets(capsys, monkeypatch):
    """newcomer, 2026-12-01: ``--help`` said nothing of ``--plan`` or ``--preset`` (nor ``-i``)."""
    with pytest.raises(SystemExit):
        rb.main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "<mode>@<target>[:<seconds>]" in text and "kill-agent, poweroff" in text, text
    assert "{tiny,small,medium,gpt2}" in text, text
    seen = []  # the parser's options, caught before it parses

    def catch(parser, *args, **kwargs):
        seen.extend(parser._actions)
        raise SystemExit(0)

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", catch)
    with pytest.raises(SystemExit):
        rb.main([])
    assert seen and [a.dest for a in seen if not a.help] == [], text


def test_a_failed_play_is_told_by_its_failure_not_by_the_timing_recap():
    """The benchmarks' BenchError of a failed play carries Ansible's fatal line and its message; the
    task timing recap (printed last) is left out."""
    out = "\n".join(["PLAY [x]", "TASK [rendezvous : Validate]",
                     "fatal: [controller]: FAILED! => {\"msg\": \"validate_argument_spec failed\"}",
                     "PLAY RECAP", *[f"task {i} ---- 0.{i}s" for i in range(30)]])
    got = rb.failure_lines(out)
    assert got.startswith("fatal: [controller]: FAILED!") and "validate_argument_spec failed" in got
    assert "task 29" not in got
    assert rb.failure_lines("a\nb") == "a\nb"  # no failure line: the tail
