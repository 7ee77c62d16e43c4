"""Learning-rate schedule sweep: which (base_lr, warmup_steps, max_steps) brings the validation loss
below a target (2.0) in the fewest steps, and do the current defaults.

Every row of the grid (``--grid BASE_LR:WARMUP:MAX_STEPS,...``; default :data:`GRID`, the schedules
the defaults were chosen from) is one run of ``torchrun --standalone --nproc-per-node=N -m
ddplab.train --preset P`` on this machine, one after the other, with that schedule and otherwise the
training program's defaults (batch policy keep_per_rank, so the LR is ``base_lr x global batch /
reference_batch_size``). The current defaults (ddplab.config: the preset's ``base_lr``,
``warmup_steps``, ``max_steps``) are always one of the rows: added at the end when the grid lacks
them, marked ``*`` in the table.

Each run evaluates every ``--eval-interval`` steps and at its end; it writes no periodic checkpoint
(only the final one) and no sample text. From its run folder (ddplab.controller.rundir.load_run;
final evaluation by ddplab.controller.summary.final_evaluation):

* val loss: the final evaluation's validation loss (nats, mean over the fixed windows of the split);
* first < T: the first evaluated step whose validation loss is below ``--target`` T ("-": none);
* wall s: the torchrun process from launch to exit (start-up, evaluations and the final checkpoint
  included: it depends on the machine's load, printed beside it as the 1-minute load average at the
  row's start and end);
* cpu s: user + system CPU seconds of torchrun and its workers (less dependent on the load).

The verdict line says whether the defaults reach T and which row reaches it in the fewest steps
(ties: the shorter schedule, then the lower final loss). ``--max-steps-scale S`` multiplies every
row's warmup and max_steps (a quick look, or the test's tiny grid: the rows keep their grid values
in the table, the steps run are shown). Writes the table to ``benchmarks/results/lr_sweep.md``
(:mod:`ddplab.bench.results`). Exit 0 when every run finished, 1 when one failed (its row says so,
the sweep goes on), 2 on bad arguments (before anything runs).

Usage: .venv/bin/python benchmarks/lr_sweep.py [--grid 1e-2:30:350,8e-3:30:350] [--nproc 3]
    [--preset small] [--target 2.0] [--eval-interval 50] [--data-path input.txt]
"""

from __future__ import annotations

import argparse
import math
import os
import resource
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path[:0] = [str(HERE), str(REPO / "train")]

from benchcli import HelpFormatter, add_results_dir, first_sentence  # noqa: E402  (benchmarks/benchcli.py)
from ddplab.bench import results  # noqa: E402
from ddplab.config import PRESETS, ConfigError, build_config  # noqa: E402
from ddplab.controller.rundir import load_run  # noqa: E402
from ddplab.controller.summary import final_evaluation  # noqa: E402
from ddplab.records import num  # noqa: E402

#: The default grid: (base_lr, warmup_steps, max_steps) of each row.
GRID: tuple[tuple[float, int, int], ...] = (
    (3e-3, 30, 600), (6e-3, 30, 400), (8e-3, 30, 350), (1e-2, 30, 350), (1e-2, 30, 400),
    (1e-2, 40, 300), (1.2e-2, 40, 320), (1.5e-2, 30, 300),
)
DEFAULT_DATA = os.environ.get("DDP_LAB_DATA") or str(REPO.parent / "shared/data/tinyshakespeare/input.txt")
#: Lines of a failed run's output shown with its error.
LOG_TAIL = 15


class SweepError(ValueError):
    """Bad arguments: the message says what to fix."""


@dataclass(frozen=True)
class Row:
    """One schedule of the grid (``base_lr``, ``warmup``, ``max_steps`` as given) and the steps run
    (``run_warmup``, ``run_max_steps``: scaled by ``--max-steps-scale``)."""

    base_lr: float
    warmup: int
    max_steps: int
    run_warmup: int
    run_max_steps: int
    default: bool = False

    @property
    def label(self) -> str:
        """``1e-2:30:350`` style (the ``--grid`` form)."""
        return f"{self.base_lr:g}:{self.warmup}:{self.max_steps}"


@dataclass(frozen=True)
class Outcome:
    """What one row's run gave: ``val_loss`` final (None: no evaluation), ``first_below`` the first
    evaluated step below the target, ``wall_s`` and ``cpu_s`` (s), the 1-minute load at start and
    end, ``error`` why the run failed (None: it finished)."""

    val_loss: float | None
    first_below: int | None
    wall_s: float
    cpu_s: float
    load_start: float
    load_end: float
    error: str | None = None


def parse_grid(text: str) -> list[tuple[float, int, int]]:
    """``"1e-2:30:350,8e-3:30:350"`` -> ``[(0.01, 30, 350), (0.008, 30, 350)]``.

    Raises:
        SweepError: an entry is not BASE_LR:WARMUP:MAX_STEPS (a number > 0, two integers).
    """
    out = []
    for entry in (e.strip() for e in text.split(",")):
        parts = entry.split(":")
        try:
            if len(parts) != 3:
                raise ValueError
            lr, warmup, steps = float(parts[0]), int(parts[1]), int(parts[2])
            if not math.isfinite(lr) or lr <= 0 or warmup < 0 or steps <= 0:
                raise ValueError
        except ValueError:
            raise SweepError(f"--grid entry {entry!r}: expected BASE_LR:WARMUP:MAX_STEPS (a learning rate "
                             "> 0, warmup steps >= 0, max steps > 0), e.g. 1e-2:30:350") from None
        out.append((lr, warmup, steps))
    return out


def scaled(steps: int, scale: float, low: int) -> int:
    """``steps x scale`` rounded, at least ``low``."""
    return max(low, round(steps * scale))


def plan_rows(grid: Sequence[tuple[float, int, int]], preset: str, scale: float) -> list[Row]:
    """The rows to run: the grid in its order, then the preset's defaults (ddplab.config) when the
    grid lacks them; the defaults' row is marked. Every row's scaled schedule is checked by
    ddplab.config.build_config.

    Raises:
        SweepError: ``scale`` is not > 0, or a row is refused by the training program's config.
    """
    if not math.isfinite(scale) or scale <= 0:
        raise SweepError(f"--max-steps-scale {scale!r}: must be a number > 0 (1 runs the grid as given)")
    cfg = build_config({"preset": preset})
    defaults = (cfg.base_lr, cfg.warmup_steps, cfg.max_steps)

    def is_default(entry: tuple[float, int, int]) -> bool:
        return math.isclose(entry[0], defaults[0], rel_tol=1e-9) and tuple(entry[1:]) == defaults[1:]

    entries = list(grid) + ([] if any(is_default(e) for e in grid) else [defaults])
    rows = []
    for lr, warmup, steps in entries:
        row = Row(lr, warmup, steps, scaled(warmup, scale, 0), scaled(steps, scale, 2),
                  is_default((lr, warmup, steps)))
        try:
            build_config({"preset": preset}, {"base_lr": lr, "warmup_steps": row.run_warmup,
                                              "max_steps": row.run_max_steps})
        except ConfigError as exc:
            run = "" if scale == 1 else f" (x{scale:g}: {row.run_warmup}:{row.run_max_steps})"
            raise SweepError(f"--grid row {row.label}{run}: {exc}") from None
        rows.append(row)
    return rows


def train_cmd(args: argparse.Namespace, row: Row, out_dir: Path) -> list[str]:
    """The row's ``torchrun --standalone --nproc-per-node=N -m ddplab.train ...`` command."""
    torchrun = Path(sys.executable).with_name("torchrun")
    cmd = [str(torchrun) if torchrun.exists() else "torchrun", "--standalone",
           f"--nproc-per-node={args.nproc}", "--max-restarts=0", "-m", "ddplab.train",
           "--preset", args.preset, "--run-id", f"lr-sweep-{row.label.replace(':', '-')}",
           "--out-dir", str(out_dir), "--base-lr", repr(row.base_lr),
           "--warmup-steps", str(row.run_warmup), "--max-steps", str(row.run_max_steps),
           "--eval-interval", str(args.eval_interval), "--ckpt-interval", str(row.run_max_steps),
           "--sample-chars", "0"]
    if args.data_path:
        cmd += ["--data-path", str(args.data_path)]
    if args.threads:
        cmd += ["--threads", str(args.threads)]
    return cmd


def train_env() -> dict[str, str]:
    """This process's environment with the package on PYTHONPATH, no torchrun variables of an outer
    launch, and one rendezvous store per round (docs/rendezvous.md)."""
    env = {k: v for k, v in os.environ.items() if k not in (
        "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
        "TORCHELASTIC_RESTART_COUNT")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO / "train"), env.get("PYTHONPATH")) if p)
    env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    return env


def read_outcome(run_dir: Path, target: float) -> tuple[float | None, int | None]:
    """``(final val loss, first evaluated step below target)`` of a run folder ``run_dir``
    (``<run_dir>/<host>/metrics/*.jsonl``: rank 0's ``val`` records)."""
    run = load_run(run_dir)
    _, val_loss, _ = final_evaluation(run.records, run.results.values())
    below = sorted(step for r in run.by_event("val", rank=0)
                   if (loss := num(r.get("val_loss"))) is not None and loss < target
                   and isinstance(step := r.get("step"), int))
    return val_loss, below[0] if below else None


def children_cpu_s() -> float:
    """User + system CPU seconds of this process's ended children and their waited-for descendants
    (torchrun and its workers): :func:`resource.getrusage`."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run_row(args: argparse.Namespace, row: Row, work: Path) -> Outcome:
    """Run one row under torchrun in ``work/<label>/<host>`` and read its figures."""
    run_dir = work / row.label.replace(":", "_")
    out_dir = run_dir / os.uname().nodename
    out_dir.mkdir(parents=True)
    log = run_dir / "torchrun.log"
    load_start = results.loadavg()[0]
    t0, cpu0 = time.monotonic(), children_cpu_s()
    with open(log, "w", encoding="utf-8") as fh:
        code = subprocess.run(train_cmd(args, row, out_dir), env=train_env(), cwd=REPO, stdout=fh,
                              stderr=subprocess.STDOUT, check=False).returncode
    wall, cpu = time.monotonic() - t0, children_cpu_s() - cpu0
    val_loss, first = read_outcome(run_dir, args.target)
    error = None
    if code != 0:
        tail = log.read_text(errors="replace").splitlines()[-LOG_TAIL:]
        error = f"torchrun exit {code}"
        print(f"row {row.label}: {error}; the end of {log}:\n" + "\n".join(f"  {line}" for line in tail),
              file=sys.stderr, flush=True)
    return Outcome(val_loss, first, wall, cpu, load_start, results.loadavg()[0], error)


def table(rows: Sequence[Row], outcomes: Sequence[Outcome], target: float) -> str:
    """The sweep as a fixed-width table, one line per row (``*``: the defaults)."""
    head = ["", "base_lr", "warmup", "max_steps", "steps run", "val loss", f"first < {target}",
            "wall s", "cpu s", "load 1m", "status"]
    lines = [head]
    for row, out in zip(rows, outcomes, strict=True):
        lines.append([
            "*" if row.default else "", f"{row.base_lr:g}", str(row.warmup), str(row.max_steps),
            f"{row.run_warmup}/{row.run_max_steps}",
            "-" if out.val_loss is None else f"{out.val_loss:.3f}",
            "-" if out.first_below is None else str(out.first_below), f"{out.wall_s:.0f}", f"{out.cpu_s:.0f}",
            f"{out.load_start:.2f} -> {out.load_end:.2f}", out.error or "finished",
        ])
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    return "\n".join("  ".join(c.ljust(w) if i in (0, len(head) - 1) else c.rjust(w)
                               for i, (c, w) in enumerate(zip(line, widths, strict=True))).rstrip()
                     for line in lines)


def verdict(rows: Sequence[Row], outcomes: Sequence[Outcome], target: float) -> str:
    """One line: do the defaults reach the target, and which row reaches it in the fewest steps
    (of the finished runs; ties: the shorter schedule, then the lower final loss)."""
    pairs = list(zip(rows, outcomes, strict=True))
    row, out = next((r, o) for r, o in pairs if r.default)
    said = f"defaults base_lr {row.base_lr:g}, warmup {row.warmup}, max_steps {row.max_steps}: "
    final = "no evaluation" if out.val_loss is None else f"final {out.val_loss:.3f}"
    if out.first_below is not None:
        said += f"val < {target} at step {out.first_below} ({final})"
    else:
        said += f"val NOT < {target} ({final}{', ' + out.error if out.error else ''})"
    reached = [(o.first_below, r.run_max_steps, o.val_loss, r) for r, o in pairs
               if o.first_below is not None and o.error is None]
    if not reached:
        return f"{said}; no row reaches val < {target}"
    step, _, loss, best = min(reached, key=lambda x: x[:3])
    which = "the defaults" if best.default else f"row {best.label}"
    return f"{said}; fewest steps to val < {target}: {which} (step {step}, final {loss:.3f})"


def make_parser() -> argparse.ArgumentParser:
    """The command line (every option with its default under ``--help``)."""
    parser = argparse.ArgumentParser(description=first_sentence(__doc__), formatter_class=HelpFormatter)
    add = parser.add_argument
    add("--grid", default=",".join(f"{lr:g}:{w}:{s}" for lr, w, s in GRID),
        help="rows BASE_LR:WARMUP:MAX_STEPS, comma-separated (the defaults are added when missing)")
    add("--preset", default="small", choices=sorted(PRESETS), help="model/batch preset")
    add("--nproc", type=int, default=3, help="torchrun workers (world size) of every run")
    add("--target", type=float, default=2.0, help="validation loss (nats) to get below")
    add("--eval-interval", type=int, default=50, help="steps between evaluations")
    add("--max-steps-scale", type=float, default=1.0,
        help="multiply every row's warmup and max_steps by this (1: as in the grid)")
    add("--threads", type=int, default=None,
        help="intra-op threads per worker (unset: the training program's rule, ddplab.cpushare)")
    add("--data-path", type=Path, default=Path(DEFAULT_DATA) if Path(DEFAULT_DATA).is_file() else None,
        help="tiny-shakespeare input.txt (unset: the training program's own path and download)")
    add("--work-dir", type=Path, default=None,
        help="keep every run's folder here (unset: a temporary folder, removed at the end)")
    add_results_dir(parser)
    return parser


def check_args(args: argparse.Namespace) -> list[Row]:
    """The rows to run (:func:`plan_rows`) once the arguments are checked.

    Raises:
        SweepError: a count below 1, a missing dataset, a work folder in use, a bad grid row.
    """
    for key in ("nproc", "eval_interval", "threads"):
        value = getattr(args, key)
        if value is not None and value < 1:
            raise SweepError(f"--{key.replace('_', '-')} {value}: must be an integer >= 1")
    if args.data_path is not None and not args.data_path.is_file():
        raise SweepError(f"--data-path {args.data_path}: no such file (give tiny-shakespeare's input.txt)")
    if args.work_dir is not None and args.work_dir.exists() and any(args.work_dir.iterdir()):
        raise SweepError(f"--work-dir {args.work_dir}: not empty (give a new or empty folder)")
    return plan_rows(parse_grid(args.grid), args.preset, args.max_steps_scale)


def main(argv: list[str] | None = None) -> int:
    args = make_parser().parse_args(argv)
    try:
        rows = check_args(args)
    except SweepError as exc:
        print(f"lr_sweep: {exc}", file=sys.stderr)
        return 2
    batch = build_config({"preset": args.preset}).per_rank_batch_size
    setting = (f"preset {args.preset}, {args.nproc} workers x {batch} (global batch {args.nproc * batch}), "
               f"torchrun --standalone on this machine, evaluation every {args.eval_interval} steps and at "
               f"the end, target val < {args.target}, steps scaled x{args.max_steps_scale:g}")
    print(setting, flush=True)
    load_before = results.loadavg()
    outcomes = []
    with tempfile.TemporaryDirectory(prefix="lr-sweep-") as tmp:
        work = args.work_dir or Path(tmp)
        for row in rows:
            outcomes.append(out := run_row(args, row, work))
            print(f"row {row.label}: val {out.val_loss}, first < {args.target} at {out.first_below}, "
                  f"{out.wall_s:.0f} s, {out.error or 'finished'}", flush=True)
    load_after = results.loadavg()
    text, line = table(rows, outcomes, args.target), verdict(rows, outcomes, args.target)
    loads = f"{results.load_text(load_before)} -> {results.load_text(load_after)}"
    print(f"\nload average {loads}\n{text}\n{line}")
    notes = ["`*`: the current defaults (ddplab.config)",
             "steps run: warmup/max_steps after --max-steps-scale",
             "wall s, cpu s: the torchrun process and its workers, start-up included"]
    path = results.write("lr_sweep", f"{setting}\n\n{results.code_block(text)}\n\n{line}",
                         title="Learning-rate schedule sweep: validation loss below the target in the "
                         "fewest steps", load_before=load_before, load_after=load_after,
                         out_dir=args.results_dir, notes=notes)
    print(f"results: {path}")
    return 1 if any(o.error for o in outcomes) else 0


if __name__ == "__main__":
    sys.exit(main())
