"""Static HTML report of one run: ``python -m ddplab.controller.report runs/<run_id>``.

Reads the run record on the controller (docs/CONTRACTS.md): ``summary.json`` (optional: figures
are derived from the metrics when it is missing), ``events.jsonl`` (optional) and
``<host>/metrics/*.jsonl``. Writes ``report.html`` (no scripts, no CDN, inline CSS; opens
offline) and ``plots/*.png`` (matplotlib, Agg), referenced by relative paths:

* ``loss.png``       train loss per step, val loss, restart and fault markers
* ``step_time.png``  compute time per rank, the step time, the straggler tail
                     (slowest rank's compute / median, per step) with the findings shaded, and
                     each rank's batch share per step (re-plans of balanced batches, faults)
* ``world_size.png`` world size over time, fault injections, the gaps without training
* ``cpu.png``        CPU clock and temperature per node ("no sensor" when all null)
* ``share.png``      compute vs all-reduce share of the step, per step

Layout: :mod:`ddplab.controller.rundir` reads the folder, :mod:`.data` derives the figures,
:mod:`.plots` draws them, :mod:`.html` lays out the page; this module only ties them together.

Tables: key figures, recoveries (mode, node, detection, recovery, steps lost), straggler findings
(:mod:`ddplab.controller.straggler`) and, with balanced batches, what balancing gained, each
node's share and speed, the plans and each fault's re-balancing; figures per world size, events.

Live page (``--live SECONDS``, written by the ``node_status`` action plugin every watch interval
from the metrics it fetched into ``runs/<run_id>/.watch``): a banner "live, step S of M, updated
HH:MM:SS" and a ``<meta http-equiv="refresh">``, figures from the metrics only (a resumed run's
old summary.json is not read, except its ``faults``). ``--ended`` (the watch saw the job end): the
same figures, no reload, a banner that says the job ended and names the collect command. The final
page (collect.yml) has neither, and its path is recorded as ``report`` in summary.json.

Exit status: 0 report written; 2 bad input (no such run folder), nothing written; 3 the run has
no step metrics: a page saying so (with what was found) is written, so a printed link still works.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from ddplab.controller import straggler, summary
from ddplab.controller.report import html, plots
from ddplab.controller.rundir import SUMMARY_FILE, RunFolder, RunFolderError
from ddplab.controller.rundir import load_run as read_run_folder

EXIT_OK, EXIT_BAD_INPUT, EXIT_NO_METRICS = 0, 2, 3


class ReportError(RunFolderError):
    """Bad input: the run folder cannot be read (missing, or summary.json is not a JSON object)."""


def load_run(path: str | Path, metrics_dir: str | Path | None = None) -> RunFolder:
    """The run folder as :func:`ddplab.controller.rundir.load_run` reads it, for a report: raises ReportError
    when it is missing or its summary.json is unreadable; notes a missing summary.json."""
    try:
        run = read_run_folder(path, metrics_dir)
    except RunFolderError as exc:
        raise ReportError(str(exc)) from None
    if run.summary_error:
        raise ReportError(f"{run.summary_error}; re-run collect.yml")
    if not (run.path / SUMMARY_FILE).exists():
        run.notes.insert(0, "summary.json is missing: key figures derived from the metrics")
    return run


def build_report(run_dir: str | Path, margin: float = straggler.DEFAULT_MARGIN,
                 window: int = straggler.DEFAULT_WINDOW,
                 clock_drop: float = straggler.DEFAULT_CLOCK_DROP,
                 metrics_dir: str | Path | None = None, refresh_s: int | None = None,
                 ended: bool = False) -> tuple[Path, bool]:
    """Write ``report.html`` and ``plots/*.png`` into ``run_dir`` (metrics: see :func:`load_run`).

    ``refresh_s``: write the live page (see the module docstring), reloading every ``refresh_s``
    seconds; ``ended``: the page the watch leaves when it saw the job end (live figures, no reload,
    a banner naming the collect command). The final page (no ``metrics_dir``, no ``refresh_s``) of a
    run with a summary.json
    is recorded there as ``report`` (:func:`ddplab.controller.summary.update_summary`).

    Returns (path of report.html, whether the run had step metrics). Raises ReportError on a
    missing or unreadable run folder, ValueError on bad straggler parameters.
    """
    if refresh_s is not None and refresh_s < 1:
        raise ValueError(f"--live {refresh_s}: the reload interval must be at least 1 s")
    run = load_run(run_dir, metrics_dir)
    if refresh_s is not None or ended:  # the watch's page: figures from the metrics, not an old summary
        run.summary = {k: v for k, v in run.summary.items() if k in ("run_id", "faults")}
        run.notes = [n for n in run.notes if not n.startswith("summary.json is missing")]
    findings = straggler.detect_stragglers(run.records, margin, window, clock_drop)
    drawn, cpu_has = plots.draw_all(run, findings, margin, run.path / "plots")
    if refresh_s is not None:  # a reloading browser must not show the plots of its cache
        drawn = {k: f"{v}?t={int(time.time())}" for k, v in drawn.items()}
    page = html.render_page(run, findings, drawn, cpu_has, margin, window, clock_drop, refresh_s, ended)
    out = run.path / "report.html"
    tmp = out.with_suffix(".html.tmp")
    tmp.write_text(page, encoding="utf-8")
    tmp.replace(out)
    if metrics_dir is None and refresh_s is None and (run.path / SUMMARY_FILE).is_file():
        summary.update_summary(run.path, report=out.name)
    return out, bool(run.by_event("step"))


def main(argv: Sequence[str] | None = None) -> int:
    """CLI. Exit 0 written, 2 bad input (nothing written), 3 no step metrics (a page says so)."""
    ap = argparse.ArgumentParser(prog="python -m ddplab.controller.report",
                                 description="Write report.html and plots/*.png for a collected run.")
    ap.add_argument("run_dir", help="the run folder, e.g. runs/<run_id> (runs/current works)")
    ap.add_argument("--margin", type=float, default=straggler.DEFAULT_MARGIN,
                    help="straggler: compute above the others' median by this fraction (default 0.2)")
    ap.add_argument("--window", type=int, default=straggler.DEFAULT_WINDOW,
                    help="straggler: for at least this many step records (default 10)")
    ap.add_argument("--clock-drop", type=float, default=straggler.DEFAULT_CLOCK_DROP,
                    help="straggler: CPU clock below this fraction of its nominal clock (default 0.8)")
    ap.add_argument("--metrics", metavar="DIR",
                    help="read <DIR>/<host>/metrics/*.jsonl instead of the run folder's "
                         "(e.g. runs/<id>/.live)")
    ap.add_argument("--live", type=int, metavar="SECONDS", default=None,
                    help="the job still runs: a live page that reloads every SECONDS (banner, "
                         "meta refresh); the final page has neither")
    ap.add_argument("--ended", action="store_true",
                    help="the watch saw the job end: a page that no longer reloads and names the collect "
                         "command (with --metrics)")
    args = ap.parse_args(argv)
    if args.ended and args.live is not None:
        print("report: --ended and --live exclude each other", file=sys.stderr)
        return EXIT_BAD_INPUT
    if args.metrics and not Path(args.metrics).is_dir():
        print(f"report: --metrics {args.metrics}: no such folder", file=sys.stderr)
        return EXIT_BAD_INPUT
    try:
        out, has_metrics = build_report(args.run_dir, args.margin, args.window, args.clock_drop, args.metrics,
                                        args.live, args.ended)
    except (ReportError, ValueError) as exc:
        print(f"report: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    if not has_metrics:
        print(f"report: {args.run_dir}: no step metrics in */metrics/*.jsonl; wrote a page saying so: {out}",
              file=sys.stderr)
        return EXIT_NO_METRICS
    print(out)
    return EXIT_OK
