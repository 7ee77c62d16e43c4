"""The report of a run with speed-balanced batches (batch_balance speed): what balancing gained
(ddplab.controller.straggler.balance_gain), the shares over time under the step-time tail, and a
throttle fault re-balanced, on a synthetic run folder: laptop-a and laptop-b at 0.6 samples per
unit of compute, laptop-c at 0.3; laptop-a throttled to a quarter from step 100 to 200."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
from ddplab.controller import report, straggler

HOSTS = ("laptop-a", "laptop-b", "laptop-c")
T0 = 1_790_000_000.0
# the plans the run went through: from step -> shares by host (36 samples a step)
PLANS = {1: ("start", (12, 12, 12)), 4: ("calibrated", (15, 14, 7)), 112: ("speed", (6, 20, 10)),
         212: ("speed", (15, 14, 7))}


def speed(host: str, step: int) -> float:
    """Samples per second of compute."""
    if host == "laptop-a" and 100 <= step < 200:
        return 0.6 * 12 * 0.25
    return {"laptop-a": 0.6, "laptop-b": 0.6, "laptop-c": 0.3}[host] * 12


def make_balanced_run(root: Path, balanced: bool = True) -> Path:
    run = root / "run-balanced"
    recs: dict[str, list[dict]] = {h: [] for h in HOSTS}
    t = T0
    for rank, h in enumerate(HOSTS):
        recs[h].append({"event": "start", "time": t, "host": h, "rank": rank, "local_rank": 0,
                        "world_size": 3, "restart_count": 0, "resumed_from_step": None,
                        "samples_seen": 0, "batch_policy": "keep_global", "per_rank_batch_size": 12,
                        "global_batch_size": 36, "grad_accum_steps": 1, "lr_scale": 1.0,
                        "batch_balance": "speed" if balanced else "off", "params": 8e5})
    plan, reason = PLANS[1][1], None
    fault_at = None
    for step in range(1, 301):
        if balanced and step in PLANS:
            reason, plan = PLANS[step]
        shares = plan if balanced else (12, 12, 12)
        compute = {h: shares[r] / speed(h, step) for r, h in enumerate(HOSTS)}
        step_time = max(compute.values()) + 0.05
        t += step_time
        if step == 100:
            fault_at = t
        for rank, h in enumerate(HOSTS):
            r = {"event": "step", "time": t, "host": h, "rank": rank, "local_rank": 0, "world_size": 3,
                 "restart_count": 0, "step": step, "loss": 2.0, "global_batch_size": 36,
                 "per_rank_batch_size": shares[rank], "samples_seen": 36 * step, "step_time_s": step_time,
                 "compute_s": compute[h], "allreduce_s": step_time - compute[h],
                 "tokens_per_s": 36 * 64 / step_time, "cpu_mhz": None, "temp_c": None,
                 "batch_share": shares[rank]}
            if balanced:
                r.update(batch_shares=list(shares), batch_speeds=[speed(x, step) for x in HOSTS])
                if step in PLANS:
                    r["batch_plan"] = reason
            recs[h].append(r)
    for h, rs in recs.items():
        folder = run / h / "metrics"
        folder.mkdir(parents=True)
        (folder / f"{h}-local0.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rs))
    throttle = {"time": fault_at, "kind": "fault", "mode": "throttle", "node": "laptop-a", "rank": 0,
                "duration_s": None}
    end_time = next(r["time"] for r in recs["laptop-a"] if r.get("step") == 200)
    throttle["duration_s"] = end_time - fault_at
    (run / "events.jsonl").write_text(json.dumps(throttle) + "\n")
    (run / "summary.json").write_text(json.dumps({
        "run_id": "run-balanced", "hosts": list(HOSTS), "steps_completed": 300,
        "faults": [{"mode": "throttle", "node": "laptop-a", "rank": 0, "injected_at": fault_at,
                    "duration_s": throttle["duration_s"], "last_step_before": 100, "outcome": "rode out"}]}))
    return run


def png_height(path: Path) -> int:
    return struct.unpack(">I", path.read_bytes()[20:24])[0]


def test_balance_gain_compares_the_slowest_compute_with_equal_shares(tmp_path):
    run = make_balanced_run(tmp_path)
    records = report.load_run(run).records
    gain = straggler.balance_gain(records)
    assert gain is not None and gain.steps == 300
    # calm steps: 15/7.2 = 2.083 s (14/7.2 and 7/3.6 below); with equal shares laptop-c 12/3.6 = 3.33 s
    assert gain.compute_s == pytest.approx(15 / 7.2)
    assert gain.equal_compute_s == pytest.approx(12 / 3.6)
    assert gain.gain == pytest.approx(1 - (15 / 7.2) / (12 / 3.6))
    assert [(p.step, p.reason) for p in gain.plans] == [(s, r) for s, (r, _) in PLANS.items()]
    assert gain.plans[2].shares == {("laptop-a", 0): 6, ("laptop-b", 0): 20, ("laptop-c", 0): 10}
    shares = {w.host: (w.share, round(w.speed, 3)) for w in gain.workers}
    assert shares == {"laptop-a": (15, 7.2), "laptop-b": (14, 7.2), "laptop-c": (7, 3.6)}
    line = straggler.format_balance(gain)
    assert line.startswith("batches balanced by speed over 300 steps: the slowest rank's compute 2.083 s")
    assert "3.333 s with equal shares" in line and "38% less waiting" in line


def test_no_balance_without_shares_of_the_group():
    assert straggler.balance_gain([]) is None
    assert straggler.balance_gain([{"event": "step", "host": "a", "step": 1, "batch_share": 12,
                                    "compute_s": 1.0}]) is None


def test_report_shows_the_shares_the_gain_and_the_throttle_rebalanced(tmp_path):
    run = make_balanced_run(tmp_path)
    out, has = report.build_report(run)
    page = out.read_text()
    assert has and "<h3>Balanced batches</h3>" in page
    assert "38% less waiting for the slowest" in page
    assert "speed (38% less waiting)" in page  # the key figure
    # the throttle hit at step 100, the new plan from step 112: 12 steps; its end at 200 -> 212
    rows = [r for r in page.split("<tr>") if r.startswith(("<td>throttle laptop-a<", "<td>end of throttle"))]
    assert len(rows) == 2, rows
    cells = [[c.split(">", 1)[1].split("<")[0] for c in r.split("<td")[1:]] for r in rows]
    assert [c[:5] for c in cells] == [["throttle laptop-a", "100", "112", "12", "speed"],
                                      ["end of throttle laptop-a", "200", "212", "12", "speed"]], cells
    assert "laptop-a 6, laptop-b 20, laptop-c 10" in page
    # the step-time plot has the third panel: batch share per rank
    assert png_height(run / "plots" / "step_time.png") == 820


def test_report_of_equal_batches_says_off_and_keeps_the_share_panel(tmp_path):
    run = make_balanced_run(tmp_path, balanced=False)
    out, _ = report.build_report(run)
    page = out.read_text()
    assert "Balanced batches" not in page and ">off<" in page
    assert png_height(run / "plots" / "step_time.png") == 820
