"""Straggler detection on synthetic metrics records (docs/CONTRACTS.md step schema)."""

import pytest
from ddplab.controller import straggler as sg

HOSTS = ("laptop-a", "laptop-b", "laptop-c")


def make_steps(steps, hosts=HOSTS, compute=None, mhz=None, temp=None, t0=1000.0):
    """Step records for ``hosts`` over ``steps``; ``compute(host, step)``, ``mhz(host, step)`` override."""
    recs = []
    for step in steps:
        for rank, host in enumerate(hosts):
            c = compute(host, step) if compute else 1.0
            recs.append({
                "event": "step", "time": t0 + step * 2.0 + rank * 0.01, "host": host, "rank": rank,
                "local_rank": 0, "world_size": len(hosts), "restart_count": 0, "step": step, "loss": 3.0,
                "lr": 1e-3, "global_batch_size": 24, "per_rank_batch_size": 8, "grad_accum_steps": 1,
                "samples_seen": 24 * step, "step_time_s": 2.0, "compute_s": c, "allreduce_s": 2.0 - c,
                "tokens_per_s": 1000.0, "cpu_mhz": mhz(host, step) if mhz else 2400.0,
                "temp_c": temp(host, step) if temp else None,
            })
    return recs


def test_no_findings_on_a_balanced_run():
    recs = make_steps(range(50), compute=lambda h, s: 1.0 + 0.05 * ((s + len(h)) % 3))
    assert sg.detect_stragglers(recs) == []


def test_slow_compute_window_is_found_with_steps_and_ratio():
    recs = make_steps(range(60), compute=lambda h, s: 1.5 if h == "laptop-c" and 20 <= s < 35 else 1.0)
    (f,) = sg.detect_stragglers(recs)
    assert (f.kind, f.host, f.rank) == ("slow_compute", "laptop-c", 2)
    assert (f.from_step, f.to_step, f.records) == (20, 34, 15)
    assert f.ratio == pytest.approx(1.5) and not f.active
    line = sg.format_finding(f)
    assert "laptop-c" in line and "rank 2" in line and "20-34" in line and "1.50x" in line


def test_short_blip_below_window_is_ignored():
    recs = make_steps(range(40), compute=lambda h, s: 3.0 if h == "laptop-b" and 10 <= s < 19 else 1.0)
    assert sg.detect_stragglers(recs, window=10) == []
    assert len(sg.detect_stragglers(recs, window=9)) == 1


def test_margin_is_configurable():
    recs = make_steps(range(30), compute=lambda h, s: 1.15 if h == "laptop-a" else 1.0)
    assert sg.detect_stragglers(recs, margin=0.2) == []
    (f,) = sg.detect_stragglers(recs, margin=0.1)
    assert f.host == "laptop-a" and f.from_step == 0 and f.to_step == 29 and f.active


def test_two_nodes_only_the_slow_one_is_named():
    recs = make_steps(range(20), hosts=HOSTS[:2], compute=lambda h, s: 2.0 if h == "laptop-b" else 1.0)
    assert [f.host for f in sg.detect_stragglers(recs)] == ["laptop-b"]


def test_clock_drop_against_own_nominal_clock_with_temperature():
    def mhz(h, s):
        if h == "laptop-a":
            return 2800.0 if s < 12 or s >= 30 else 1400.0  # laptop-a throttles to 50 %
        return 1800.0  # a slower but steady CPU is not a clock drop

    recs = make_steps(range(40), mhz=mhz, temp=lambda h, s: 95.0 if h == "laptop-a" and s >= 12 else 60.0)
    (f,) = sg.detect_stragglers(recs)
    assert (f.kind, f.host, f.from_step, f.to_step) == ("clock_drop", "laptop-a", 12, 29)
    assert f.ratio == pytest.approx(0.5) and f.reference == 2800.0 and f.temp_c_max == 95.0
    assert "laptop-a" in sg.format_finding(f) and "95 C" in sg.format_finding(f)


def test_clock_drop_for_most_of_the_run_is_still_found():
    """The nominal clock is a high quantile: a node throttled 70 % of the run is still flagged."""
    def mhz(h, s):
        if h == "laptop-c":
            return 3000.0 if s < 15 else 2100.0
        return 2000.0

    recs = make_steps(range(50), mhz=mhz)
    (f,) = sg.detect_stragglers(recs)
    assert f.host == "laptop-c" and f.from_step == 15 and f.active


def test_no_sensor_means_no_clock_findings():
    recs = make_steps(range(30), mhz=lambda h, s: None)
    assert sg.detect_stragglers(recs) == []


def test_live_only_reports_ongoing_streaks():
    old = make_steps(range(40), compute=lambda h, s: 2.0 if h == "laptop-a" and s < 15 else 1.0)
    assert len(sg.detect_stragglers(old)) == 1
    assert sg.live_stragglers(old) == []
    now = make_steps(range(40), compute=lambda h, s: 2.0 if h == "laptop-b" and s >= 25 else 1.0)
    (f,) = sg.live_stragglers(now)
    assert f.host == "laptop-b" and f.active and "still going" in sg.format_finding(f)


def test_redone_steps_after_restart_count_once_and_rank_change():
    first = make_steps(range(15), compute=lambda h, s: 2.0 if h == "laptop-c" else 1.0)
    # restart: steps 10..29 redone later, laptop-c now rank 0
    again = make_steps(range(10, 30), hosts=("laptop-c", "laptop-a", "laptop-b"),
                       compute=lambda h, s: 2.0 if h == "laptop-c" else 1.0, t0=5000.0)
    (f,) = sg.detect_stragglers(first + again)
    assert f.records == 30 and f.rank == 0 and (f.from_step, f.to_step) == (0, 29)


def test_tail_by_step():
    recs = make_steps(range(3), compute=lambda h, s: {"laptop-a": 1.0, "laptop-b": 1.2, "laptop-c": 3.0}[h])
    tail = sg.tail_by_step(recs)
    assert [t.step for t in tail] == [0, 1, 2]
    assert tail[0].slowest_host == "laptop-c" and tail[0].ratio == pytest.approx(2.5)
    assert tail[0].median_compute_s == pytest.approx(1.2)


def test_ignores_other_events_and_malformed_records():
    recs = make_steps(range(12), compute=lambda h, s: 2.0 if h == "laptop-a" else 1.0)
    recs += [{"event": "val", "step": 5, "host": "laptop-a"}, {"event": "step", "host": "laptop-a"},
             {"event": "step", "step": 3, "host": "laptop-b", "compute_s": None}]
    assert [f.host for f in sg.detect_stragglers(recs)] == ["laptop-a"]


@pytest.mark.parametrize("kwargs", [{"margin": 0}, {"window": 0}, {"window": 2.5}, {"clock_drop": 1.2},
                                    {"clock_quantile": 0}])
def test_bad_parameters(kwargs):
    with pytest.raises(ValueError):
        sg.detect_stragglers([], **kwargs)


def test_to_dict_is_json_ready():
    import json

    recs = make_steps(range(12), compute=lambda h, s: 2.0 if h == "laptop-a" else 1.0)
    d = sg.detect_stragglers(recs)[0].to_dict()
    assert json.loads(json.dumps(d))["host"] == "laptop-a"
