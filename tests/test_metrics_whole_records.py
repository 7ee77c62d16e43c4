"""Metrics records stay whole across a failed write (issue 27 item 3).

A write that runs out of room (here: the file size limit RLIMIT_FSIZE, the same short write and
error a full disk gives) must not leave half a record for the next session's ``start`` record to
be appended onto; a file that already ends in a torn line (a crash mid-write) must not swallow it.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

from conftest import REPO, subprocess_env
from ddplab.metrics import MetricsWriter
from ddplab.records import read_jsonl

FILL_UNTIL_FULL = textwrap.dedent("""
    import os, resource, signal, sys
    from ddplab.metrics import MetricsWriter
    from ddplab.outputs import OutputError
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG instead of a kill, as ENOSPC would be
    folder = sys.argv[1]
    w = MetricsWriter(folder, "h", 0, 0, 1, 0)
    w.write("start", max_steps=100)
    size = os.path.getsize(w.path)
    resource.setrlimit(resource.RLIMIT_FSIZE, (size + 1000, resource.RLIM_INFINITY))
    for step in range(1000):
        try:
            w.write("step", step=step, loss=1.5, note="x" * 97)
        except OutputError as exc:
            print("failed at", step, exc)
            break
    else:
        sys.exit("never ran out of room")
""")


def test_a_failed_write_leaves_no_half_record_for_the_next_start(tmp_path):
    folder = tmp_path / "metrics"
    full = subprocess.run([sys.executable, "-c", FILL_UNTIL_FULL, str(folder)], env=subprocess_env(),
                          capture_output=True, text=True, timeout=120, cwd=REPO)
    assert full.returncode == 0 and "failed at" in full.stdout, full.stdout + full.stderr
    path = folder / "h-local0.jsonl"
    assert path.read_bytes().endswith(b"\n")  # cut back to the last whole record

    again = MetricsWriter(folder, "h", 0, 0, 1, 1)
    again.write("start", max_steps=200)
    again.close()
    records, skipped = read_jsonl(path)
    assert skipped == 0
    assert [r["max_steps"] for r in records if r["event"] == "start"] == [100, 200]


def test_a_torn_last_line_does_not_swallow_the_next_record(tmp_path):
    path = tmp_path / "h-local0.jsonl"
    path.write_text(json.dumps({"event": "start", "max_steps": 100}) + '\n{"event":"step","st')
    w = MetricsWriter(tmp_path, "h", 0, 0, 1, 1)
    w.write("start", max_steps=200)
    w.close()
    records, skipped = read_jsonl(path)
    assert skipped == 1  # the torn line alone
    assert [r["max_steps"] for r in records if r["event"] == "start"] == [100, 200]
