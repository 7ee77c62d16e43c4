"""Median step time of a collected run: scenario fault sizes its fault run with it.

``python molecule/fault/step_time.py RUN_DIR`` (``train/`` on ``PYTHONPATH``) prints the median
``step_time_s`` of the ``step`` records of every host of ``RUN_DIR`` (a folder of
``runs/<run_id>/`` as collected, docs/CONTRACTS.md), in seconds. converge.yml runs it on the short
run that site.yml made a moment before on the same nodes and with the same model, so that the fault
run lasts about as much training time on a fast machine as on a slow or busy one (its steps keep
running while the plays between two faults run). Exit status 1 with a message on stderr when the
run has no step record.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

from ddplab.controller.rundir import load_run


def median_step_time(run_dir: Path) -> float:
    """Median ``step_time_s`` (s) over the step records of every host of ``run_dir``.

    Raises:
        ValueError: the run has no step record with a step time.
    """
    records = load_run(run_dir).records
    times = [float(r["step_time_s"]) for r in records if r.get("event") == "step" and r.get("step_time_s")]
    if not times:
        raise ValueError(f"{run_dir}: no step record with step_time_s in <host>/metrics/*.jsonl")
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path, help="a collected run folder, runs/<run_id>")
    args = parser.parse_args(argv)
    try:
        print(f"{median_step_time(args.run_dir.resolve()):.6f}")
    except (OSError, ValueError) as exc:
        print(f"step_time: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
