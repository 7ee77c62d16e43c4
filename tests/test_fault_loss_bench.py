"""benchmarks/fault_loss.py: the validation curve of a collected run, the side-by-side table and the
plot (the lab runs themselves are a benchmark, not a test)."""

import importlib.util
import sys

import pytest
from labharness import REPO
from test_report import make_run

sys.path.insert(0, str(REPO / "benchmarks"))
spec = importlib.util.spec_from_file_location("fault_loss_bench", REPO / "benchmarks/fault_loss.py")
fl = importlib.util.module_from_spec(spec)
spec.loader.exec_module(fl)


def test_val_curve_has_one_loss_per_evaluation_step(tmp_path):
    run = make_run(tmp_path)
    curve = fl.val_curve(run)
    assert list(curve) == [49, 99, 149, 199]
    assert all(1.4 < v < 6.0 for v in curve.values())


def _run(label, seed, curve, val, faults=()):
    return {
        "label": label,
        "run_id": f"r-{label}",
        "seed": seed,
        "faults": list(faults),
        "steps": 350,
        "final_val_loss": val,
        "final_train_loss": val - 0.05,
        "outcome": "completed",
        "wall_s": 300,
        "load_start": "3.0 2.0 1.0",
        "load_end": "4.0 3.0 2.0",
        "curve": curve,
    }


def test_table_puts_the_cost_of_faults_beside_a_seeds_worth():
    runs = [
        _run("clean", 1337, {"100": 2.5, "200": 2.1}, 1.990),
        _run("noise", 1338, {"100": 2.52, "200": 2.12}, 2.010),
        _run("faulted", 1337, {"100": 2.55}, 2.002, ["kill-agent@laptop-a", "freeze@laptop-b"]),
    ]
    text = fl.table(runs)
    assert "faulted - clean +0.012 nats, noise (other seed) - clean +0.020 nats" in text
    row100 = next(line for line in text.splitlines() if line.strip().startswith("100 "))
    assert row100.split() == ["100", "2.500", "2.520", "2.550", "+0.050", "+0.020"]
    row200 = next(line for line in text.splitlines() if line.strip().startswith("200 "))
    assert row200.split() == ["200", "2.100", "2.120", "-", "-", "+0.020"]
    assert "kill-agent@laptop-a, freeze@laptop-b" in text and "3.0 2.0 1.0 -> 4.0 3.0 2.0" in text


def test_plot_writes_a_png(tmp_path):
    out = tmp_path / "curves.png"
    fl.plot([_run("clean", 1, {"10": 3.0, "20": 2.5}, 2.5), _run("faulted", 1, {"10": 3.1}, 2.6)], out)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bad_plan_is_refused_before_any_play(monkeypatch, capsys):
    def no_play(*a, **k):
        raise AssertionError("a playbook ran")

    monkeypatch.setattr(fl, "play", no_play)
    with pytest.raises(SystemExit) as exc:
        fl.main(["--plan", "kill-agent@rank0,bogus@rank1"])
    assert exc.value.code == 2
    assert "expected <mode>@" in capsys.readouterr().err
