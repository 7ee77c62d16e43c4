"""ddplab.controller.report --metrics: the page kill-node.yml writes from the live metrics it fetched."""

import json
import shutil

from ddplab.controller import report
from test_report import make_run


def test_report_from_live_metrics(tmp_path, capsys):
    run = make_run(tmp_path)
    live = run / ".live"
    for host_dir in [p for p in run.iterdir() if (p / "metrics").is_dir()]:
        shutil.move(str(host_dir), live / host_dir.name)  # as the fault role leaves them mid-run
    assert report.main([str(run)]) == report.EXIT_NO_METRICS
    capsys.readouterr()
    assert report.main([str(run), "--metrics", str(live)]) == 0
    page = (run / "report.html").read_text()
    assert "copies taken while the run went on" in page
    assert "plots/loss.png" in page and (run / "plots" / "loss.png").stat().st_size > 5000
    assert json.loads((run / "summary.json").read_text())["run_id"] == "run-synth"


def test_report_live_metrics_folder_missing(tmp_path, capsys):
    run = make_run(tmp_path)
    before = sorted(p.name for p in run.iterdir())
    assert report.main([str(run), "--metrics", str(run / ".live")]) == report.EXIT_BAD_INPUT
    assert "no such folder" in capsys.readouterr().err
    assert sorted(p.name for p in run.iterdir()) == before
