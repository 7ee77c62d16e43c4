"""ddplab.controller.bench_report on a synthetic bench folder laid out as bench.yml leaves it."""

import json
import re
from html.parser import HTMLParser
from pathlib import Path

import pytest
from ddplab.bench import costmodel
from ddplab.controller import bench_report

HOSTS = ["laptop-a", "laptop-b", "laptop-c"]
MB = 1e6
GOOD = 117e6  # bytes/s, the measured goodput of a healthy gigabit link
T0 = 1_780_000_000.0


def _links(slow: float | None = None) -> dict:
    bw = [[None if i == j else GOOD for j in range(3)] for i in range(3)]
    if slow:
        bw[2][0] = slow  # laptop-c -> laptop-a, e.g. a 100 Mb/s cable
    rtt = [[None if i == j else 0.2 for j in range(3)] for i in range(3)]
    return {"kind": "links", "time": T0, "backend": "gloo", "world_size": 3, "hosts": HOSTS,
            "bytes": 64_000_000, "repeats": 3, "rtt_repeats": 20, "bandwidth_bytes_per_s": bw,
            "rtt_ms": rtt, "slow_links": []}


def _allreduce(n: int, nbytes: int, seconds: float) -> dict:
    return {"kind": "allreduce", "time": T0, "bytes": nbytes, "world_size": n, "hosts": HOSTS[:n],
            "repeats": 3, "median_s": seconds, "min_s": seconds * 0.95, "max_s": seconds * 1.1,
            "link_gbps": 1.0, "link_efficiency": 0.88, "link_source": "nominal",
            "model_s": costmodel.ring_allreduce_time(nbytes, n, 110e6)}


def _train_run(rounds: Path, n: int, compute: float, allreduce: float, steps: int = 20,
               params: float = 800_000) -> None:
    run = rounds / f"bench-x-train-n{n}"
    for rank, h in enumerate(HOSTS[:n]):
        recs = [{"event": "start", "time": T0, "host": h, "rank": rank, "local_rank": 0, "world_size": n,
                 "restart_count": 0, "params": params, "per_rank_batch_size": 12, "global_batch_size": 12 * n,
                 "batch_policy": "keep_per_rank", "max_steps": steps}]
        for s in range(1, steps + 1):
            slow = 3.0 if s == 1 else 1.0  # the first step pays start-up costs: left out
            st = compute * slow + allreduce
            recs.append({"event": "step", "time": T0 + s, "host": h, "rank": rank, "local_rank": 0,
                         "world_size": n, "restart_count": 0, "step": s, "loss": 3.0, "step_time_s": st,
                         "compute_s": compute * slow, "allreduce_s": allreduce,
                         "tokens_per_s": 12 * n * 64 / st})
        d = run / h / "metrics"
        d.mkdir(parents=True)
        (d / f"{h}-local0.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))


def make_bench(root: Path, shared_cpu: bool = True, slow_link: float | None = None) -> Path:
    bench = root / "bench-x"
    (bench / "raw").mkdir(parents=True)
    (bench / "rounds").mkdir()
    nodes = {h: {"boot_id": "same" if shared_cpu else f"boot-{h}", "cpus_online": "0-1",
                 "loadavg": [0.3, 0.2, 0.1],
                 "threads": 1, "ifname": "eth0"} for h in HOSTS}
    (bench / "bench.json").write_text(json.dumps({
        "bench_id": "x", "started": "2026-11-29T18:00:00Z", "hosts": HOSTS, "shape_rate_mbit": 1000,
        "link_gbps": 1.0, "link_efficiency": 0.88, "settings": {"allreduce_max_mb": 64}, "nodes": nodes}))
    (bench / "raw" / "bench-x-links-n3.jsonl").write_text(json.dumps(_links(slow_link)) + "\n")
    lines = [_allreduce(n, int(d * MB), (2 * (n - 1) / n) * d * MB / GOOD * 1.2 + 0.002)
             for n in (2, 3) for d in (1, 2, 4, 8, 16, 32, 64)]
    (bench / "raw" / "bench-x-allreduce-n3.jsonl").write_text(
        "".join(json.dumps(r) + "\n" for r in lines if r["world_size"] == 3))
    (bench / "raw" / "bench-x-allreduce-n2.jsonl").write_text(
        "".join(json.dumps(r) + "\n" for r in lines if r["world_size"] == 2) + '{"kind": "allr')
    _train_run(bench / "rounds", 1, 0.20, 0.0)
    _train_run(bench / "rounds", 2, 0.21, 0.03)
    _train_run(bench / "rounds", 3, 0.30, 0.05)
    (bench / "rounds" / "current").symlink_to("bench-x-train-n1")
    return bench


class _Page(HTMLParser):
    def __init__(self):
        super().__init__()
        self.imgs, self.external = [], []

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "img":
            self.imgs.append(a.get("src"))
        if tag == "script" or any(re.match(r"^(https?:)?//", a.get(k) or "") for k in ("src", "href")):
            self.external.append(tag)


def test_bench_report_tables_json_and_page(tmp_path, capsys):
    bench = make_bench(tmp_path)
    assert bench_report.main([str(bench)]) == 0
    out = capsys.readouterr().out
    # the three tables
    assert "== links" in out and "== all-reduce" in out and "== scaling" in out
    assert "largest at N=3: 64 MB" in out and "largest at N=2: 64 MB" in out
    assert out.strip().endswith(f"report: {bench / 'report.html'}")
    # all-reduce: the model runs at the slowest measured link between the round's hosts, alpha = RTT/2
    ar = json.loads((bench / "allreduce.json").read_text())
    assert [(r["world_size"], r["bytes"]) for r in ar][:2] == [(2, 1_000_000), (2, 2_000_000)]
    assert len(ar) == 14  # the torn last line of a file is skipped
    big3 = ar[-1]
    assert big3["world_size"] == 3 and big3["link_bytes_per_s"] == GOOD
    assert big3["latency_s"] == pytest.approx(0.1e-3)
    expected_model = 2 * 2 * 0.1e-3 + (4 / 3) * 64 * MB / GOOD
    assert big3["model_s"] == pytest.approx(expected_model)
    assert big3["measured_over_model"] == pytest.approx(big3["median_s"] / expected_model)
    assert big3["busbw_bytes_per_s"] == pytest.approx(64 * MB / big3["median_s"] * 4 / 3)
    # scaling: steady state leaves out the first step; speedup and model
    sc = {r["world_size"]: r for r in json.loads((bench / "scaling.json").read_text())}
    assert sorted(sc) == [1, 2, 3]
    assert sc[1]["step_s"] == pytest.approx(0.20) and sc[1]["speedup"] == pytest.approx(1.0)
    assert sc[2]["speedup"] == pytest.approx(2 * 0.20 / 0.24)
    assert sc[3]["efficiency"] == pytest.approx(3 * 0.20 / 0.35 / 3)
    t_ar3 = costmodel.ring_allreduce_time(3.2e6, 3, GOOD, 0.1e-3)
    assert sc[3]["model_allreduce_s"] == pytest.approx(t_ar3)
    assert sc[3]["model_speedup"] == pytest.approx(3 * 0.20 / (0.20 + t_ar3))
    assert sc[3]["model_here_speedup"] == pytest.approx(3 * 0.20 / (0.30 + t_ar3))
    assert sc[2]["seed_speedup"] == 1.9 and sc[3]["seed_speedup"] == 2.7
    # shared CPU: the nodes have one kernel; compute at N=3 is 1.5x the 1-node figure
    assert "run on one machine" in out and "with 2 CPU core(s)" in out and "N=3 is 1.50x" in out
    assert (bench / "tables.txt").read_text().startswith("bench x:")
    page = (bench / "report.html").read_text()
    p = _Page()
    p.feed(page)
    assert p.external == []
    assert sorted(p.imgs) == ["plots/allreduce.png", "plots/scaling.png"]
    for src in p.imgs:
        assert (bench / src).stat().st_size > 5000
    assert "measured/model" in page and "run on one machine" in page


def test_slow_link_sets_the_model_and_is_named(tmp_path, capsys):
    bench = make_bench(tmp_path, shared_cpu=False, slow_link=11e6)
    rec = json.loads((bench / "raw" / "bench-x-links-n3.jsonl").read_text())
    from ddplab.bench.links import slow_links
    rec["slow_links"] = slow_links(rec["bandwidth_bytes_per_s"], rec["hosts"], 0.5)
    (bench / "raw" / "bench-x-links-n3.jsonl").write_text(json.dumps(rec) + "\n")
    assert bench_report.main([str(bench)]) == 0
    out = capsys.readouterr().out
    assert "SLOW LINK laptop-c -> laptop-a" in out
    ar = json.loads((bench / "allreduce.json").read_text())
    # N=2 (laptop-a, laptop-b) does not use the slow link; N=3 does, and it sets B
    assert {r["link_bytes_per_s"] for r in ar if r["world_size"] == 2} == {GOOD}
    assert {r["link_bytes_per_s"] for r in ar if r["world_size"] == 3} == {11e6}
    assert "run on one machine" not in out
    assert "slow" in (bench / "report.html").read_text()


def test_nominal_link_without_links_record(tmp_path, capsys):
    bench = make_bench(tmp_path)
    (bench / "raw" / "bench-x-links-n3.jsonl").unlink()
    assert bench_report.main([str(bench)]) == 0
    assert "(no links record)" in capsys.readouterr().out
    ar = json.loads((bench / "allreduce.json").read_text())
    assert ar[0]["link_bytes_per_s"] == pytest.approx(110e6)
    assert ar[0]["link_source"] == "nominal 1 Gb/s x 0.88"
    assert not (bench / "links.json").exists()


def test_run_whose_world_size_changed_is_left_out(tmp_path, capsys):
    bench = make_bench(tmp_path)
    f = bench / "rounds" / "bench-x-train-n3" / "laptop-c" / "metrics" / "laptop-c-local0.jsonl"
    recs = [json.loads(line) for line in f.read_text().splitlines()]
    recs[-1]["world_size"] = 2
    f.write_text("".join(json.dumps(r) + "\n" for r in recs))
    assert bench_report.main([str(bench)]) == 0
    out = capsys.readouterr().out
    assert "scaling run left out" in out and "world size changed" in out
    assert [r["world_size"] for r in json.loads((bench / "scaling.json").read_text())] == [1, 2]


def test_without_one_node_run_no_speedup(tmp_path, capsys):
    bench = make_bench(tmp_path)
    import shutil
    shutil.rmtree(bench / "rounds" / "bench-x-train-n1")
    assert bench_report.main([str(bench)]) == 0
    sc = json.loads((bench / "scaling.json").read_text())
    assert [r["speedup"] for r in sc] == [None, None]
    assert [r["model_speedup"] for r in sc] == [None, None]


def test_empty_folder_writes_a_page_that_says_so(tmp_path, capsys):
    bench = tmp_path / "bench-empty"
    bench.mkdir()
    assert bench_report.main([str(bench)]) == bench_report.EXIT_EMPTY
    captured = capsys.readouterr()
    assert "no links, all-reduce or scaling result" in captured.err
    assert "holds no result" in (bench / "report.html").read_text()


@pytest.mark.parametrize("case", ["missing", "bad-json", "not-object"])
def test_bad_input_writes_nothing(tmp_path, capsys, case):
    bench = tmp_path / "bench-bad"
    if case != "missing":
        bench.mkdir()
        (bench / "bench.json").write_text("{oops" if case == "bad-json" else "[1, 2]")
    assert bench_report.main([str(bench)]) == bench_report.EXIT_BAD_INPUT
    assert "bench_report:" in capsys.readouterr().err
    assert not (bench / "report.html").exists()


def test_count_cpus():
    assert bench_report.count_cpus({"cpus_online": "0-1"}) == 2
    assert bench_report.count_cpus({"cpus_online": "0-3,6,8-9"}) == 7
    assert bench_report.count_cpus({"cpus": 4, "cpus_online": "0"}) == 4
    assert bench_report.count_cpus({"cpus_online": "x"}) is None
    assert bench_report.count_cpus({}) is None


def test_one_low_link_that_is_not_slow_does_not_set_the_model(tmp_path, capsys):
    bench = make_bench(tmp_path, slow_link=0.7 * GOOD)  # low by chance, above half the median: not flagged
    assert bench_report.main([str(bench)]) == 0
    assert "SLOW LINK" not in capsys.readouterr().out
    ar = json.loads((bench / "allreduce.json").read_text())
    assert {r["link_bytes_per_s"] for r in ar} == {GOOD}
    assert {r["link_source"] for r in ar} == {"the median measured link"}


def test_superlinear_speedup_is_called_out(tmp_path, capsys):
    bench = make_bench(tmp_path)
    import shutil
    shutil.rmtree(bench / "rounds" / "bench-x-train-n1")
    _train_run(bench / "rounds", 1, 0.40, 0.0)  # the 1-node run met a busier machine
    assert bench_report.main([str(bench)]) == 0
    out = capsys.readouterr().out
    assert "Efficiency above 100 % at N=2" in out and "not comparable" in out
