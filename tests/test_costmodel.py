"""Cost model: the seed's GPT-2 124M table on gigabit Ethernet, formulas, CLI and bad input."""

import json

import pytest
from ddplab.bench import costmodel as cm

GPT2_PARAMS = 124e6
GPT2_BYTES = 496e6


def test_gpt2_grad_bytes():
    assert cm.grad_bytes_from_params(GPT2_PARAMS) == pytest.approx(GPT2_BYTES)


def test_seed_table_gigabit():
    """Seed: 496 MB on gigabit -> ~4.5 s at N=2, ~6.0 s at N=3, limit 2x -> ~9 s."""
    preds = {p.world_size: p for p in cm.predict(GPT2_BYTES, [1, 2, 3], link_gbps=1.0)}
    assert preds[1].allreduce_s == 0.0
    assert preds[2].allreduce_s == pytest.approx(4.5, abs=0.05)
    assert preds[3].allreduce_s == pytest.approx(6.0, abs=0.05)
    bps = cm.link_bytes_per_s(1.0)
    assert bps == pytest.approx(110e6)
    assert cm.ring_allreduce_limit(GPT2_BYTES, bps) == pytest.approx(9.0, abs=0.05)
    # the limit is approached from below as N grows
    big = cm.predict(GPT2_BYTES, [64])[0].allreduce_s
    assert 8.8 < big < cm.ring_allreduce_limit(GPT2_BYTES, bps)


def test_raw_line_rate_is_faster_than_seed():
    """At the raw 125 MB/s (efficiency 1) the ring gives 3.97 s / 5.29 s: the seed's figures need goodput."""
    preds = cm.predict(GPT2_BYTES, [2, 3], link_gbps=1.0, link_efficiency=1.0)
    assert preds[0].allreduce_s == pytest.approx(496 / 125, rel=1e-9)
    assert preds[1].allreduce_s == pytest.approx(2 * (2 / 3) * 496 / 125, rel=1e-9)


def test_ring_factor_and_bytes_sent():
    assert cm.ring_factor(1) == 0
    assert cm.ring_factor(2) == 1
    assert cm.ring_factor(4) == pytest.approx(1.5)
    p = cm.predict(100.0, [4], link_gbps=1.0)[0]
    assert p.bytes_sent_per_rank == pytest.approx(150.0)


def test_latency_term():
    # 2(N-1) messages of alpha each
    t0 = cm.ring_allreduce_time(1e6, 3, 1e8)
    t1 = cm.ring_allreduce_time(1e6, 3, 1e8, latency_s=0.001)
    assert t1 - t0 == pytest.approx(0.004)


def test_bus_bandwidth_matches_nccl_tests_definition():
    algbw, busbw = cm.bus_bandwidth(496e6, 4.0, 3)
    assert algbw == pytest.approx(124e6)
    assert busbw == pytest.approx(124e6 * 4 / 3)
    # a ring run exactly at the model's rate has busbw == B, whatever N
    bps = 110e6
    for n in (2, 3, 8):
        t = cm.ring_allreduce_time(496e6, n, bps)
        assert cm.bus_bandwidth(496e6, t, n)[1] == pytest.approx(bps)


def test_step_time_overlap_and_speedup_keep_per_rank():
    preds = cm.predict(GPT2_BYTES, [1, 2, 3], compute_s=10.0)
    by_n = {p.world_size: p for p in preds}
    assert by_n[1].step_s == 10.0 and by_n[1].speedup == 1.0
    assert by_n[2].step_s == pytest.approx(10.0 + 4.509, abs=0.01)
    assert by_n[2].speedup == pytest.approx(20.0 / by_n[2].step_s)
    assert by_n[3].efficiency == pytest.approx(by_n[3].speedup / 3)
    ov = {p.world_size: p for p in cm.predict(GPT2_BYTES, [1, 2, 3], compute_s=10.0, overlap=True)}
    # compute dominates: perfect overlap hides the all-reduce completely
    assert ov[3].step_s == 10.0 and ov[3].speedup == pytest.approx(3.0)
    # all-reduce dominates: the step is the all-reduce
    ov_fast = cm.predict(GPT2_BYTES, [3], compute_s=1.0, overlap=True)[0]
    assert ov_fast.step_s == pytest.approx(ov_fast.allreduce_s)


def test_speedup_keep_global_splits_compute():
    p = cm.predict(GPT2_BYTES, [2], compute_s=10.0, batch_policy="keep_global")[0]
    assert p.step_s == pytest.approx(5.0 + p.allreduce_s)
    assert p.speedup == pytest.approx(10.0 / p.step_s)


def test_diminishing_returns():
    """Speedups grow but efficiency falls from 1 -> 2 -> 3 nodes when communication is not free."""
    preds = cm.predict(1e8, [1, 2, 3], compute_s=2.0)
    speedups = [p.speedup for p in preds]
    effs = [p.efficiency for p in preds]
    assert speedups == sorted(speedups)
    assert effs == sorted(effs, reverse=True)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"grad_bytes": -1, "world_sizes": [2]},
        {"grad_bytes": 1e6, "world_sizes": [0]},
        {"grad_bytes": 1e6, "world_sizes": []},
        {"grad_bytes": 1e6, "world_sizes": [2], "link_gbps": 0},
        {"grad_bytes": 1e6, "world_sizes": [2], "link_efficiency": 1.5},
        {"grad_bytes": 1e6, "world_sizes": [2], "compute_s": -1.0},
        {"grad_bytes": 1e6, "world_sizes": [2], "batch_policy": "nope"},
        {"grad_bytes": float("nan"), "world_sizes": [2]},
    ],
)
def test_bad_input_raises(kwargs):
    with pytest.raises(ValueError):
        cm.predict(**kwargs)


def test_cli_table(capsys):
    assert cm.main(["--params", "124e6", "--nodes", "3", "--link-gbps", "1", "--compute-s", "5"]) == 0
    out = capsys.readouterr().out
    assert "4.51s" in out and "6.01s" in out and "2D/B = 9.02s" in out
    assert len([ln for ln in out.splitlines() if ln.strip()[:1].isdigit()]) == 3


def test_cli_json_and_node_list(capsys):
    assert cm.main(["--bytes", "496e6", "--nodes", "2,3", "--overlap", "--compute-s", "1", "--json"]) == 0
    rows = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert [r["world_size"] for r in rows] == [2, 3]
    assert all(r["overlap"] for r in rows)
    assert rows[1]["step_s"] == pytest.approx(rows[1]["allreduce_s"])


def test_cli_bad_input(capsys):
    assert cm.main(["--bytes", "1e6", "--link-efficiency", "0"]) == 2
    assert "link efficiency" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cm.main(["--bytes", "1e6", "--nodes", "x"])
