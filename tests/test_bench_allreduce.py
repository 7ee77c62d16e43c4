"""All-reduce and link benchmarks: pure helpers, then real 2-rank torchrun runs over loopback (seconds)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from ddplab.bench import allreduce as ba
from ddplab.bench import costmodel
from ddplab.bench import links as bl

TRAIN_DIR = Path(__file__).resolve().parents[1] / "train"


def torchrun(module: str, *args: str, nproc: int = 2, timeout: int = 120) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(TRAIN_DIR), OMP_NUM_THREADS="1")
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "-m", module, *args]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)


def test_sizes_between():
    assert ba.sizes_between(1e6, 496e6) == [int(1e6 * 2**k) for k in range(9)] + [496_000_000]
    assert ba.sizes_between(1e6, 1e6) == [1_000_000]
    assert all(s % 4 == 0 for s in ba.sizes_between(6, 1000))
    with pytest.raises(ValueError):
        ba.sizes_between(8e6, 1e6)


def test_result_record_busbw_and_model():
    rec = ba.result_record(496_000_000, 3, ["a", "b", "c"], [6.0, 5.0, 7.0], 1.0, 0.88)
    assert rec["median_s"] == 6.0 and rec["min_s"] == 5.0 and rec["repeats"] == 3
    assert rec["algbw_bytes_per_s"] == pytest.approx(496e6 / 6.0)
    assert rec["busbw_bytes_per_s"] == pytest.approx(rec["algbw_bytes_per_s"] * 2 * 2 / 3)
    assert rec["model_s"] == pytest.approx(6.01, abs=0.01)
    assert rec["measured_over_model"] == pytest.approx(6.0 / rec["model_s"])
    assert "496MB" in ba.format_table([rec])


def test_slow_links_flags_the_slow_direction():
    g = 117e6
    bw = [[None, g, g], [g, None, 11e6], [g, g, None]]
    (s,) = bl.slow_links(bw, ["a", "b", "c"], 0.5)
    assert (s["src"], s["dst"], s["src_rank"], s["dst_rank"]) == ("b", "c", 1, 2)
    rec = {"hosts": ["a", "b", "c"], "bytes": 64e6, "bandwidth_bytes_per_s": bw,
           "rtt_ms": [[None, 0.2, 0.3], [0.2, None, 5.0], [0.3, 5.0, None]], "slow_links": [s]}
    text = bl.format_matrices(rec)
    assert "SLOW LINK b -> c" in text and "5.000" in text


def test_refuses_to_run_outside_torchrun(monkeypatch, capsys):
    for var in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    assert ba.main(["--max-bytes", "4e6"]) == 2
    assert "torchrun" in capsys.readouterr().err
    assert ba.main(["--min-bytes", "8e6", "--max-bytes", "1e6"]) == 2
    assert bl.main(["--bytes", "1"]) == 2


def test_link_rate_from_links(tmp_path):
    f = tmp_path / "links.jsonl"
    f.write_text(json.dumps({"kind": "links", "bandwidth_bytes_per_s": [[None, 5e8], [2e8, None]]}) + "\n")
    assert ba.link_rate_from_links(f) == 2e8
    f.write_text('{"kind": "allreduce"}\n')
    with pytest.raises(ValueError, match="no links record"):
        ba.link_rate_from_links(f)
    with pytest.raises(ValueError, match="--link-from"):
        ba.link_rate_from_links(tmp_path / "missing.jsonl")


def test_allreduce_two_ranks(tmp_path):
    out = tmp_path / "bench" / "allreduce.jsonl"
    links = tmp_path / "links.jsonl"  # as if bench_links had measured 125 MB/s and 100 MB/s
    links.write_text(json.dumps({"kind": "links", "bandwidth_bytes_per_s": [[None, 125e6], [100e6, None]]}))
    proc = torchrun("ddplab.bench.allreduce", "--min-bytes", "1e6", "--max-bytes", "4e6", "--repeats", "2",
                    "--link-from", str(links), "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-2000:]
    recs = [json.loads(x) for x in out.read_text().splitlines()]
    assert [r["bytes"] for r in recs] == [1_000_000, 2_000_000, 4_000_000]
    for r in recs:
        assert r["kind"] == "allreduce" and r["world_size"] == 2 and len(r["hosts"]) == 2
        assert r["repeats"] == 2 and 0 < r["min_s"] <= r["median_s"] <= r["max_s"]
        assert r["algbw_bytes_per_s"] == pytest.approx(r["bytes"] / r["median_s"])
        assert r["busbw_bytes_per_s"] == pytest.approx(r["algbw_bytes_per_s"] * 2 * (2 - 1) / 2)
        assert r["link_efficiency"] == 1.0 and r["link_gbps"] == pytest.approx(0.8)
        assert "slowest link" in r["link_source"]
        model = costmodel.ring_allreduce_time(r["bytes"], 2, 100e6)  # the slowest link, 100 MB/s
        assert model == pytest.approx(r["bytes"] / 100e6) and r["model_s"] == pytest.approx(model)
        assert r["measured_over_model"] == pytest.approx(r["median_s"] / model)
    assert "meas/model" in proc.stdout and "4MB" in proc.stdout


def test_links_two_ranks(tmp_path):
    out = tmp_path / "links.jsonl"
    proc = torchrun("ddplab.bench.links", "--bytes", "4e6", "--repeats", "2", "--rtt-repeats", "5",
                    "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-2000:]
    (rec,) = [json.loads(x) for x in out.read_text().splitlines()]
    assert rec["kind"] == "links" and rec["world_size"] == 2 and rec["bytes"] == 4_000_000
    bw, rtt = rec["bandwidth_bytes_per_s"], rec["rtt_ms"]
    assert bw[0][0] is None and bw[1][1] is None and bw[0][1] > 0 and bw[1][0] > 0
    assert rtt[0][1] == rtt[1][0] > 0
    assert "RTT, ms" in proc.stdout and "from \\ to" in proc.stdout
