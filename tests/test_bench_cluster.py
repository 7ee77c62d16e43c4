"""ddplab.bench.cluster: links + all-reduce at N=2 (a subgroup) and N=3 in one 3-rank torchrun job."""

import json

import pytest
from ddplab.bench import cluster as bc
from test_bench_allreduce import torchrun


def test_parse_world_sizes():
    assert bc.parse_world_sizes("3,2,3") == [2, 3]
    for bad in ("1,2", "", "two"):
        with pytest.raises(ValueError, match="--world-sizes"):
            bc.parse_world_sizes(bad)


def test_bad_arguments_before_any_collective(monkeypatch, capsys):
    for var in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    assert bc.main(["--out-dir", "x", "--world-sizes", "1"]) == 2
    assert bc.main(["--out-dir", "x", "--min-bytes", "8e6", "--max-bytes", "1e6"]) == 2
    assert bc.main(["--out-dir", "x", "--max-bytes", "4e6"]) == 2  # outside torchrun
    assert "torchrun" in capsys.readouterr().err


def test_links_and_allreduce_at_two_and_three(tmp_path):
    out = tmp_path / "job"
    proc = torchrun("ddplab.bench.cluster", "--out-dir", str(out), "--world-sizes", "2,3",
                    "--max-bytes", "2e6", "--repeats", "2", "--links-bytes", "1e6",
                    "--links-repeats", "1", "--rtt-repeats", "3",
                    nproc=3, timeout=240)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    (links,) = [json.loads(line) for line in (out / "links.jsonl").read_text().splitlines()]
    assert links["kind"] == "links" and links["world_size"] == 3 and len(links["hosts"]) == 3
    bw = links["bandwidth_bytes_per_s"]
    assert all((bw[i][j] is None) == (i == j) for i in range(3) for j in range(3))
    assert all(v > 0 for row in bw for v in row if v is not None)
    recs = [json.loads(line) for line in (out / "allreduce.jsonl").read_text().splitlines()]
    assert [(r["world_size"], r["bytes"]) for r in recs] == [(2, 1_000_000), (2, 2_000_000),
                                                             (3, 1_000_000), (3, 2_000_000)]
    assert [len(r["hosts"]) for r in recs] == [2, 2, 3, 3]
    assert all(r["repeats"] == 2 and r["median_s"] > 0 for r in recs)
    assert "meas/model" in proc.stdout and "bandwidth, MB/s" in proc.stdout


def test_world_size_larger_than_the_job(tmp_path):
    proc = torchrun("ddplab.bench.cluster", "--out-dir", str(tmp_path), "--world-sizes", "2,3",
                    "--max-bytes", "1e6", "--no-links", nproc=2, timeout=180)
    assert proc.returncode != 0
    assert "needs at least 2 ranks and at least max(--world-sizes) = 3" in proc.stderr
    assert not (tmp_path / "allreduce.jsonl").exists()
