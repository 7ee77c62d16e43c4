"""benchmarks/lr_sweep.py: the grid and its defaults' row, bad arguments, the verdict, and a tiny sweep
under torchrun whose table and results file hold what its runs' records say."""

from __future__ import annotations

import os
import subprocess
import sys

import lr_sweep as ls
import pytest
from conftest import dataset_path
from ddplab.config import build_config
from ddplab.records import events_of, read_metrics_dir
from labharness import REPO

DEFAULTS = build_config({"preset": "tiny"})


def test_the_default_grid_holds_the_defaults_once_and_marks_them():
    rows = ls.plan_rows(ls.GRID, "small", 1.0)
    assert [(r.base_lr, r.warmup, r.max_steps) for r in rows] == list(ls.GRID)
    small = build_config({"preset": "small"})
    assert [r.label for r in rows if r.default] == [
        f"{small.base_lr:g}:{small.warmup_steps}:{small.max_steps}"]


def test_a_grid_without_the_defaults_gets_them_and_the_steps_are_scaled():
    rows = ls.plan_rows(ls.parse_grid("3e-3:30:600, 1.5e-2:30:300"), "tiny", 0.1)
    assert [r.label for r in rows] == ["0.003:30:600", "0.015:30:300",
                                       f"{DEFAULTS.base_lr:g}:{DEFAULTS.warmup_steps}:{DEFAULTS.max_steps}"]
    assert [r.default for r in rows] == [False, False, True]
    assert [(r.run_warmup, r.run_max_steps) for r in rows[:2]] == [(3, 60), (3, 30)]


@pytest.mark.parametrize(("argv", "message"), [
    (["--grid", "1e-2:30"], "--grid entry '1e-2:30': expected BASE_LR:WARMUP:MAX_STEPS"),
    (["--grid=-1:30:350"], "--grid entry '-1:30:350': expected BASE_LR:WARMUP:MAX_STEPS"),
    (["--grid", "1e-2:400:350"], "--grid row 0.01:400:350: config key 'warmup_steps' = 400: must be smaller"),
    (["--grid", "1e-2:30:40", "--max-steps-scale", "0.05"],
     "--grid row 0.01:30:40 (x0.05: 2:2): config key 'warmup_steps' = 2: must be smaller"),
    (["--max-steps-scale", "0"], "--max-steps-scale 0.0: must be a number > 0"),
    (["--nproc", "0"], "--nproc 0: must be an integer >= 1"),
    (["--data-path", "/nonexistent/input.txt"], "--data-path /nonexistent/input.txt: no such file"),
])
def test_bad_arguments_get_one_line_before_anything_runs(argv, message, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(ls, "run_row", lambda *a: pytest.fail("a run was started"))
    assert ls.main([*argv, "--results-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"lr_sweep: {message}") and err.count("\n") == 1, err
    assert list(tmp_path.iterdir()) == []  # no results file, no run


def _outcome(val, first, error=None):
    return ls.Outcome(val, first, 10.0, 5.0, 0.5, 0.6, error)


def test_verdict_names_the_fewest_steps_ties_broken_by_the_shorter_schedule_then_the_loss():
    rows = ls.plan_rows(ls.parse_grid("8e-3:30:350,1e-2:30:350,1e-2:30:400,6e-3:30:300"), "small", 1.0)
    outs = [_outcome(1.995, 350), _outcome(1.975, 350), _outcome(1.949, 350),
            _outcome(1.9, 300, "torchrun exit 1")]  # a failed run never wins
    line = ls.verdict(rows, outs, 2.0)
    assert line == ("defaults base_lr 0.01, warmup 30, max_steps 350: val < 2.0 at step 350 (final 1.975); "
                    "fewest steps to val < 2.0: the defaults (step 350, final 1.975)")
    outs[1] = _outcome(2.02, None)
    line = ls.verdict(rows, outs, 2.0)
    assert "val NOT < 2.0 (final 2.020)" in line and line.endswith("row 0.008:30:350 (step 350, final 1.995)")
    outs[0] = _outcome(1.995, 400)
    assert ls.verdict(rows, outs, 2.0).endswith("row 0.01:30:400 (step 350, final 1.949)")
    outs = [_outcome(2.1, None), _outcome(None, None, "torchrun exit 1"), _outcome(2.2, None),
            _outcome(2.3, None)]
    assert ls.verdict(rows, outs, 2.0) == ("defaults base_lr 0.01, warmup 30, max_steps 350: val NOT < 2.0 "
                                           "(no evaluation, torchrun exit 1); no row reaches val < 2.0")


@pytest.mark.slow
def test_a_tiny_sweep_under_torchrun_tables_its_runs_records(tmp_path):
    """Two rows of the tiny preset at 2 workers, scaled to a few steps, an evaluation every 3 steps;
    the run folders are kept (``--work-dir``) to check the table against their records."""
    work, out = tmp_path / "runs", tmp_path / "results"
    grid = f"{DEFAULTS.base_lr:g}:{DEFAULTS.warmup_steps}:{DEFAULTS.max_steps},3e-3:30:600"
    cmd = [sys.executable, str(REPO / "benchmarks/lr_sweep.py"), "--preset", "tiny", "--nproc", "2",
           "--threads", "1", "--grid", grid, "--max-steps-scale", "0.03", "--eval-interval", "3",
           "--target", "3.9", "--data-path", str(dataset_path()), "--work-dir", str(work),
           "--results-dir", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=REPO)
    assert done.returncode == 0, done.stdout + done.stderr

    lines = done.stdout.splitlines()
    head = next(i for i, line in enumerate(lines) if line.split()[:2] == ["base_lr", "warmup"])
    table = lines[head:head + 3]
    default, other = (line.split() for line in table[1:])
    assert default[:5] == ["*", f"{DEFAULTS.base_lr:g}", str(DEFAULTS.warmup_steps), str(DEFAULTS.max_steps),
                           f"{round(DEFAULTS.warmup_steps * 0.03)}/{round(DEFAULTS.max_steps * 0.03)}"]
    assert other[:4] == ["0.003", "30", "600", "1/18"]
    assert default[-1] == other[-1] == "finished"

    expected = []
    for row, cells in ((default[1:], default), (other, other)):
        label = "_".join(row[:3])
        recs, _ = read_metrics_dir(work / label / os.uname().nodename / "metrics")
        vals = sorted((r["step"], r["val_loss"]) for r in events_of(recs, "val", rank=0))
        steps = int(row[3].split("/")[1])
        assert vals[-1][0] == steps and [s for s, _ in vals] == sorted({*range(3, steps + 1, 3), steps})
        first = next((s for s, v in vals if v < 3.9), None)
        assert row[4] == f"{vals[-1][1]:.3f}" and row[5] == ("-" if first is None else str(first)), cells
        assert float(row[6]) > 0 and float(row[7]) > 0  # wall s, cpu s
        expected.append((first, vals[-1][1], label))
    reached = [e for e in expected if e[0] is not None]
    verdict = lines[head + 3]
    assert verdict.startswith(f"defaults base_lr {DEFAULTS.base_lr:g}, warmup {DEFAULTS.warmup_steps}, "
                              f"max_steps {DEFAULTS.max_steps}: val ")
    if reached:
        first, loss, label = min(reached)  # the same number of steps (10, 18) never ties
        who = "the defaults" if label == "_".join(default[1:4]) else f"row {label.replace('_', ':')}"
        assert verdict.endswith(f"fewest steps to val < 3.9: {who} (step {first}, final {loss:.3f})")
    else:
        assert verdict.endswith("no row reaches val < 3.9")

    md = (out / "lr_sweep.md").read_text()
    assert "\n".join(table) in md and verdict in md
    assert "- command: `" in md and "--grid " + grid in md and "- load average (1, 5, 15 min): before " in md
    assert "preset tiny, 2 workers x 4 (global batch 8)" in md
