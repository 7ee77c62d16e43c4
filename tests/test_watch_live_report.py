"""The watch's live report: ``ddplab.status --chunks-from`` (the metrics lines since the last poll),
the controller's copies the ``node_status`` action plugin (mode watch) keeps of them, and the background build
of the live page, one at a time across the trainers' watches (a file lock)."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from ansible_collections.ddp_lab.cluster.plugins.action import node_status as watch
from ddplab import status as st
from ddplab.records import read_new_lines

ROOT = Path(__file__).resolve().parent.parent
T0 = 1_790_000_000.0




def line(event, t, **kw):
    return json.dumps({"event": event, "time": T0 + t, "rank": 0, "world_size": 1, **kw}) + "\n"


def test_read_new_lines_returns_complete_lines_and_restarts_on_a_shorter_file(tmp_path):
    f = tmp_path / "a.jsonl"
    f.write_text(line("start", 0, max_steps=20) + line("step", 1, step=1, loss=3.0) + '{"event": "st')
    text, start, end = read_new_lines(f, 0, 1 << 20)
    assert start == 0 and text.count("\n") == 2 and not text.endswith("st")  # the torn line waits
    with open(f, "a") as fh:
        fh.write('ep", "time": 1}\n')
    text2, start2, end2 = read_new_lines(f, end, 1 << 20)
    assert start2 == end and text2 == '{"event": "step", "time": 1}\n' and end2 == f.stat().st_size
    f.write_text(line("start", 0))  # replaced by a shorter file: from the start again
    assert read_new_lines(f, end2, 1 << 20)[1] == 0


def test_status_chunks_from_offsets(tmp_path, capsys):
    m = tmp_path / "metrics"
    m.mkdir()
    (m / "n-local0.jsonl").write_text(line("start", 0, max_steps=20) + line("step", 1, step=1, loss=3.0))
    argv = ["--out-dir", str(tmp_path), "--unit", "", "--host", "n", "--json"]
    assert st.main([*argv, "--chunks-from", "{}"]) == 0
    doc = json.loads(capsys.readouterr().out)
    c = doc["chunks"]["n-local0.jsonl"]
    assert c["from"] == 0 and c["to"] == (m / "n-local0.jsonl").stat().st_size and c["text"].count("\n") == 2
    offsets = json.dumps({"n-local0.jsonl": c["to"]})
    st.main(["--out-dir", str(tmp_path), "--unit", "", "--json", "--chunks-from", offsets])
    assert json.loads(capsys.readouterr().out)["chunks"]["n-local0.jsonl"]["text"] == ""
    st.main(["--out-dir", str(tmp_path), "--unit", "", "--json"])
    assert "chunks" not in json.loads(capsys.readouterr().out)  # only when asked


def test_status_refuses_bad_offsets(tmp_path, capsys):
    for bad in ("[1]", '{"a.jsonl": -1}', "not json"):
        try:
            st.main(["--out-dir", str(tmp_path), "--json", "--chunks-from", bad])
        except SystemExit as exc:
            assert exc.code == 2
        else:
            raise AssertionError(bad)
        assert "--chunks-from" in capsys.readouterr().err


def _live(tmp_path, host="n0", interval=5.0):
    run = tmp_path / "runs" / "run-1"
    run.mkdir(parents=True, exist_ok=True)
    return watch.LiveReport(str(run), host, sys.executable, str(ROOT / "train"), interval), run


def test_copies_follow_the_node_file(tmp_path):
    live, run = _live(tmp_path)
    copy = run / ".watch" / "n0" / "metrics" / "n0-local0.jsonl"
    first = line("start", 0, max_steps=20) + line("step", 1, step=1, loss=3.0)
    live.store({"n0-local0.jsonl": {"from": 0, "to": len(first), "text": first}})
    more = line("step", 2, step=2, loss=2.9)
    live.store({"n0-local0.jsonl": {"from": len(first), "to": len(first) + len(more), "text": more}})
    assert copy.read_text() == first + more and live.offsets == {"n0-local0.jsonl": len(first + more)}
    # the node's file was replaced (a new launch): the copy is rewritten, not appended to
    live.store({"n0-local0.jsonl": {"from": 0, "to": len(more), "text": more}})
    assert copy.read_text() == more
    # a name that is not a plain metrics file name writes nothing
    live.store({"../../evil.jsonl": {"from": 0, "to": 1, "text": "x\n"},
                "x.txt": {"from": 0, "to": 1, "text": "x"}})
    assert not (run / "evil.jsonl").exists() and not (copy.parent / "x.txt").exists()


def test_live_build_writes_a_reloading_page_once_per_interval(tmp_path):
    live, run = _live(tmp_path)
    text = line("start", 0, max_steps=20, host="n0") + "".join(
        line("step", s, step=s, loss=3.0 - s / 10, host="n0", compute_s=0.1, allreduce_s=0.0, step_time_s=0.1)
        for s in range(1, 8))
    live.store({"n0-local0.jsonl": {"from": 0, "to": len(text), "text": text}})
    assert live.maybe_build() is True
    other, _ = _live(tmp_path, host="n1")  # another trainer's watch, same run folder
    assert other.maybe_build() is False  # the lock is held: one build at a time
    live.close()
    assert live.child is None and live.error is None, (run / ".watch" / "report.log").read_text()
    page = (run / "report.html").read_text()
    assert '<meta http-equiv="refresh" content="5">' in page and "live, step 7 of 20, updated" in page
    assert other.maybe_build() is False  # the page is fresh: not again within the interval
    old = time.time() - 60
    os.utime(run / "report.html", (old, old))
    assert other.maybe_build() is True  # due, and the lock is free again
    other.close()


def test_a_failing_build_is_reported_not_raised(tmp_path):
    live, run = _live(tmp_path)
    live.python = str(tmp_path / "no-such-python")
    try:  # the plugin's _live_report turns the OSError into a warning
        live.maybe_build()
        raise AssertionError("no OSError")
    except OSError:
        assert not live.lock.is_locked  # a build that did not start holds no lock
    failing = tmp_path / "failing-python"  # an interpreter whose report build exits 1
    failing.write_text("#!/bin/sh\necho 'no module named ddplab' >&2\nexit 1\n")
    failing.chmod(0o755)
    live.python = str(failing)
    assert live.maybe_build() is True
    live.close()
    assert live.error and "exit 1" in live.error and "report.log" in live.error


def test_a_node_without_chunks_from_is_watched_without_the_live_page(tmp_path, monkeypatch):
    """attach.yml to a job launched by an older checkout: its ddplab.status refuses --chunks-from;
    the watch goes on without the live page instead of counting the node unreachable."""
    from ansible.errors import AnsibleError

    lines, warnings, calls = [], [], []
    monkeypatch.setattr(watch.display, "display", lambda msg, **kw: lines.append(msg))
    monkeypatch.setattr(watch.display, "warning", lambda msg, **kw: warnings.append(msg))
    monkeypatch.setattr(watch.time, "sleep", lambda s: None)
    plugin = watch.ActionModule.__new__(watch.ActionModule)

    def poll(args, live=None):
        calls.append(live is not None)
        if live is not None:
            raise AnsibleError("progress command failed: status: error: unrecognized arguments: "
                               "--chunks-from {}")
        return {"state": "succeeded", "line": "n0  step 5/5  [succeeded]", "progress": {}}

    plugin._poll = poll
    args = {"out_dir": "/x", "python": "p", "unit": "u", "label": "n0", "interval_s": 1.0,
            "timeout_s": 60.0, "max_errors": 2, "mode": "watch", "report_dir": str(tmp_path / "run"),
            "report_python": sys.executable, "report_pythonpath": ""}
    monkeypatch.setattr(watch.ActionBase, "run", lambda self, tmp=None, task_vars=None: {})
    monkeypatch.setattr(plugin, "validate_argument_spec", lambda argument_spec: (None, args), raising=False)
    res = plugin.run(task_vars={"inventory_hostname": "n0"})
    assert res["state"] == "succeeded" and calls == [True, False]
    assert warnings and "no live report" in warnings[0] and lines == ["n0  step 5/5  [succeeded]"]
