"""The report of a per_step run (issue 13): each laptop is rank 0 of its own replica group of 1, so
its records must not read as torchelastic group restarts. A synthetic run of three replicas
(laptop-a/b/c), 300 steps at 3 participants; laptop-c's worker started again at 0:41 from its own
checkpoint of step 100 and joined the live peers at step 231; every node wrote the same sample."""

import json
import re
from pathlib import Path

from ddplab.controller import report, summary

T0 = 1_790_000_000.0
HOSTS = ("laptop-a", "laptop-b", "laptop-c")
SAMPLE = "ROMEO:\nO sweet\n"


def rec(event, t, host, **kw):
    return {"event": event, "time": T0 + t, "host": host, "rank": 0, "local_rank": 0, "world_size": 1,
            "restart_count": 0, **kw}


def make_run(root: Path, rejoin: bool, end: bool = True) -> Path:
    run = root / "run-ps"
    for i, host in enumerate(HOSTS):
        rs = [rec("start", i * 0.1, host, engine="per_step", resumed_from_step=None, max_steps=300,
                  params=8e5, batch_policy="keep_per_rank")]
        for s in range(10, 301, 10):
            t = s * 0.2
            if rejoin and host == "laptop-c" and 200 < s < 240:
                continue  # down from 0:41 to its first commit at step 231
            if rejoin and host == "laptop-c" and s == 240:
                rs.append(rec("start", 41.0, host, engine="per_step", resumed_from_step=100, max_steps=300))
                rs.append(rec("step", 46.2, host, step=231, loss=2.2, participants=3, committed=True,
                              engine="per_step", world_size=3, step_time_s=0.2, compute_s=0.15,
                              allreduce_s=0.05, tokens_per_s=9000.0))
            rs.append(rec("step", t, host, step=s, loss=3.0 - s / 300, participants=3, committed=True,
                          engine="per_step", world_size=3, step_time_s=0.2, compute_s=0.15,
                          allreduce_s=0.05, tokens_per_s=9000.0))
            if s % 100 == 0:
                rs.append(rec("val", t + 0.1, host, step=s, val_loss=2.5 - s / 1000, train_loss=2.4))
        if end:
            rs.append(rec("end", 61.0, host, step=300, final_train_loss=1.9, final_val_loss=1.98, wall_s=61))
            (run / host).mkdir(parents=True, exist_ok=True)
            (run / host / "sample.txt").write_text(SAMPLE)
        d = run / host / "metrics"
        d.mkdir(parents=True, exist_ok=True)
        (d / f"{host}-local0.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rs))
    launch = {"time": T0 - 1, "kind": "launch", "run_id": "run-ps"}
    (run / "events.jsonl").write_text(json.dumps(launch) + "\n")
    return run


def text_of(page: str) -> str:
    return re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", page))


def figure(text: str, name: str) -> str:
    return re.search(rf"\b{name} (\S+)", text).group(1)


def test_live_and_final_page_count_the_same_restarts(tmp_path):
    for rejoin, want in ((False, "0"), (True, "1")):
        run = make_run(tmp_path / str(rejoin), rejoin, end=False)
        live = text_of(report.build_report(run, refresh_s=5)[0].read_text())  # no summary.json yet
        summary.write_summary(run, summary.build_summary(run))
        final = text_of(report.build_report(run)[0].read_text())
        name = r"restarts \(replica processes started again; launches not counted\)"
        assert figure(live, name) == figure(final, name) == want, (rejoin, live)


def test_replica_starts_name_the_host_and_the_step_it_joined_at(tmp_path):
    run = make_run(tmp_path, rejoin=True)
    text = text_of(report.build_report(run)[0].read_text())
    starts = re.search(r"Replica starts \(m:ss since the first record\): ([^.]*)\.", text).group(1)
    assert "N=1" not in starts and "from step 100" not in starts, starts
    assert starts.count("launch, first commit step 10 at 3 participants") == 3, starts
    assert "laptop-c restarted, first commit step 231 at 3 participants" in starts, starts
    assert "Group starts" not in text


def test_the_same_sample_of_every_node_is_shown_once(tmp_path):
    run = make_run(tmp_path, rejoin=False)
    page = report.build_report(run)[0].read_text()
    assert page.count("ROMEO:") == 1
    assert "laptop-a/sample.txt, laptop-b/sample.txt, laptop-c/sample.txt" in page
