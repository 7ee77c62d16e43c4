"""collect.yml with a laptop powered off (issue 27 item 16): it exited 0, said "finished" and
listed that laptop as "step 0", nothing said the summary was partial, and the run's store stayed
without a word. Now summary.json (``partial``, ``unread``) and the printed summary say which
laptop was not read, a marked warning names the fix, the store's line says why it stays, and a
later collect with the laptop back completes the summary. The report says it too (its badge, the
line with the fix, "(not read)" on the node card), and the laptop not read is no longer listed as
"step 0": its step is unknown, or that of an earlier collect's copy, marked as such.

Local "laptops" (tests/test_status_table.py's harness): laptop-off is a TEST-NET address over ssh
(unreachable) first, then a local laptop holding its records (it came back)."""

from __future__ import annotations

import html
import json
import re
import time
from pathlib import Path

import pytest
from test_collect_services import RUN_ID, _collect
from test_collect_services import store as store  # noqa: F401  (the stand-in store fixture)
from test_status_table import PLAYBOOK, _case, recs

pytestmark = pytest.mark.skipif(PLAYBOOK is None, reason="ansible-playbook is not installed (make venv)")


def _report(tmp_path: Path) -> str:
    """report.html's text, tags and markup entities undone, whitespace folded."""
    page = (tmp_path / "runs" / RUN_ID / "report.html").read_text()
    return " ".join(html.unescape(re.sub(r"<[^>]+>", " ", page)).split())


def test_collect_with_a_laptop_off_is_partial_and_a_later_collect_completes_it(tmp_path, store):
    inv, env = _case(tmp_path, {"laptop-x": "ended", "laptop-y": "ended"}, unreachable=True)
    proc, pidfile, started = store
    started(time.time() - 3600)
    text = " ".join(_collect(tmp_path, inv, env, "collect_report=true").split())
    summary = json.loads((tmp_path / "runs" / RUN_ID / "summary.json").read_text())
    assert summary["partial"] is True and summary["unread"] == ["laptop-off"], summary
    assert "- PARTIAL" in text and "PARTIAL: laptop-off not read by this collect (unreachable)" in text, text
    assert f"WARNING: the summary of run {RUN_ID} is partial: laptop-off could not be read" in text, text
    assert "fix: bring laptop-off back and run playbooks/collect.yml again" in text
    # the laptop not read is not listed as "step 0" (it trained; its step is unknown here)
    assert summary["per_host"]["laptop-off"]["read"] is False
    assert summary["per_host"]["laptop-off"]["last_step"] is None
    assert "laptop-off: step 0" not in text, text
    unknown = "laptop-off: NOT READ by this collect; no record of it here: the step it reached is unknown"
    assert unknown in text, text
    # the report says it too: the badge, the line with the fix, the node card
    page = _report(tmp_path)
    assert "finished; PARTIAL: laptop-off not read (collect again when it is back)" in page, page[:2000]
    partial = ("PARTIAL: laptop-off not read by this collect (unreachable): its figures are an earlier"
               " collect's, or none; fix: bring laptop-off back and run playbooks/collect.yml again")
    assert partial in page, page[:2000]
    assert "3: laptop-off (not read), laptop-x, laptop-y" in page, page[:3000]
    # the store stays, with a line (it was silent before)
    assert ("rendezvous store on port 29499 left running: the run is not over on every trainer (not read on"
            " laptop-off") in text, text
    assert proc.poll() is None and pidfile.exists()

    # laptop-off is back (a local laptop holding its records): the next collect completes the summary
    data = json.loads(inv.read_text())
    base = tmp_path / "base" / "laptop-off"
    metrics = base / "runs" / RUN_ID / "metrics"
    metrics.mkdir(parents=True)
    (metrics / "laptop-off-local0.jsonl").write_text(
        "".join(json.dumps(r) + "\n" for r in recs("laptop-off", 2, 300, end=True)))
    (tmp_path / "units" / "agent-laptop-off.show").write_text(
        (tmp_path / "units" / "agent-laptop-x.show").read_text())
    data["all"]["children"]["trainers"]["hosts"]["laptop-off"] = {
        **data["all"]["children"]["trainers"]["hosts"]["laptop-x"], "ddp_lab_base_dir": str(base),
        "ddp_lab_unit": "agent-laptop-off"}
    inv.write_text(json.dumps(data))
    text = " ".join(_collect(tmp_path, inv, env, "collect_report=true").split())
    summary = json.loads((tmp_path / "runs" / RUN_ID / "summary.json").read_text())
    assert summary["partial"] is False and summary["unread"] == [], summary
    assert "- PARTIAL" not in text and "WARNING: the summary" not in text, text
    assert Path(tmp_path / "runs" / RUN_ID / "laptop-off").is_dir()
    assert "laptop-off: step 300," in text, text
    page = _report(tmp_path)
    assert "PARTIAL" not in page and "not read" not in page

    # off again: the summary shows the copy the last collect brought, marked as such
    data["all"]["children"]["trainers"]["hosts"]["laptop-off"] = {
        "ansible_host": "192.0.2.1", "ansible_connection": "ssh",
        "ansible_ssh_common_args": "-o ConnectTimeout=2 -o ControlMaster=no"}
    inv.write_text(json.dumps(data))
    text = " ".join(_collect(tmp_path, inv, env).split())
    copy = r"laptop-off: NOT READ by this collect; an earlier collect's copy to \d\d:\d\d:\d\d: step 300,"
    assert re.search(copy, text), text
