"""Does a run that loses and regains nodes learn as well as one that does not? The loss of a run with
faults beside fault-free runs of the same schedule (issue 13's target: the loss curve of a run with
4 faults within noise of a fault-free run of the same seed; docs/faults.md).

Three runs of one engine (``ddp_job_fault_tolerance``), one after the other on the same cluster,
each launched with ``playbooks/train.yml`` (the training settings of ``make demo`` unless ``-e``
changes them) and followed to its end with ``attach.yml`` (progress, collect, report):

  clean    seed S     no fault
  noise    seed S+1   no fault: how far a different seed alone moves the loss
  faulted  seed S     the ``--plan`` faults (default: kill-agent, poweroff, freeze 20 s, partition
                      20 s of the node holding rank 0; each node that was taken out rejoins), injected
                      as soon as the group trains at full size, each after the last recovered

Prints per run the final evaluation (summary.json's final_val_loss / final_train_loss), the faults
injected, the wall time and the load average; then the validation loss at every evaluation step of
the three runs side by side and the two differences that answer the question:
``faulted - clean`` (the cost of the faults) beside ``noise - clean`` (a seed's worth). Plots the
validation curves with matplotlib. Figures, not assertions: exit 0 whenever every play ran.

Usage (controller, lab up and provisioned, e.g. after ``make demo``):
  .venv/bin/python benchmarks/fault_loss.py [-i inventory/lab] [--engine per_step] [--seed 1337]
      [--plan kill-agent@rank0,poweroff@rank0,freeze@rank0:20,partition@rank0:20]
      [--out runs/bench-fault-loss-<time>.json] [--plot runs/bench-fault-loss-<time>.png] [-e k=v ...]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent / "train")]

import recovery  # noqa: E402  (benchmarks/recovery.py: play, await, plan, load average)
from ddplab import faults  # noqa: E402
from ddplab.controller.rundir import load_run  # noqa: E402
from ddplab.records import events_of, num  # noqa: E402
from recovery import REPO, BenchError, current_run, inject_plan, loadavg, parse_plan, play  # noqa: E402

DEFAULT_PLAN = "kill-agent@rank0,poweroff@rank0,freeze@rank0:20,partition@rank0:20"


def val_curve(run_dir: Path) -> dict[int, float]:
    """Validation loss (nats) by step of a collected run: the ``val`` records of every host (under
    per_step every replica group evaluates the same committed model; the first record of a step
    is taken)."""
    curve: dict[int, float] = {}
    for rec in events_of(load_run(run_dir).records, "val"):
        step, loss = rec.get("step"), num(rec.get("val_loss"))
        if isinstance(step, int) and loss is not None:
            curve.setdefault(step, loss)
    return dict(sorted(curve.items()))


def one_run(a: argparse.Namespace, label: str, seed: int, plan: recovery.Plan) -> dict:
    """Launch a run of ``a.engine`` with ``seed``, inject ``plan`` (may be empty), follow it to its
    end and collect it. Returns {label, run_id, seed, faults, final_val_loss, final_train_loss,
    steps, wall_s, load_start, load_end, curve}. BenchError when a play fails."""
    extra = [*a.extra, f"ddp_job_fault_tolerance={a.engine}"]
    load_start = loadavg()
    t0 = time.monotonic()
    overrides = json.dumps({"ddp_job_train_overrides": {"seed": seed}})
    play(a.inventory, a.launch, [*extra, "ddp_job_watch=false", overrides], f"{label}: launch (seed {seed})")
    run_id = current_run(a.runs_dir)
    if plan:
        recovery._await(a.inventory, run_id, a.nodes, extra, 600)
        inject_plan(a, extra, run_id, plan)
    play(
        a.inventory,
        "attach.yml",
        [*extra, f"run_id={run_id}", f"collect_run_id={run_id}"],
        f"{label}: to the end",
    )
    run = load_run(a.runs_dir / run_id)
    out = {
        "label": label,
        "run_id": run_id,
        "seed": seed,
        "faults": [f"{m.mode}@{m.node}" for m in faults.measure_all(run.events, run.records)],
        "final_val_loss": run.summary.get("final_val_loss"),
        "final_train_loss": run.summary.get("final_train_loss"),
        "steps": run.summary.get("steps_completed"),
        "outcome": run.summary.get("outcome"),
        "wall_s": round(time.monotonic() - t0),
        "load_start": load_start,
        "load_end": loadavg(),
        "curve": val_curve(a.runs_dir / run_id),
    }
    print(
        f"{label}: run {run_id} seed {seed}, {out['steps']} steps, val {out['final_val_loss']}, "
        f"{out['wall_s']} s, load {load_start} -> {out['load_end']}",
        flush=True,
    )
    return out


def _f(v: float | None) -> str:
    return "-" if v is None else f"{v:.3f}"


def _diff(x: float | None, y: float | None) -> str:
    return "-" if x is None or y is None else f"{x - y:+.3f}"


def table(runs: list[dict]) -> str:
    """The runs (final evaluation, faults, time, load) and the validation curves side by side
    (text), with ``faulted - clean`` beside ``noise - clean`` at every evaluation step."""
    lines = [
        f"{'run':<8} {'run id':<22} {'seed':>5} {'steps':>6} {'val':>6} {'train':>6} {'wall s':>7}"
        "  load   faults"
    ]
    for r in runs:
        lines.append(
            f"{r['label']:<8} {r['run_id']:<22} {r['seed']:>5} {r['steps'] or '-':>6} "
            f"{_f(num(r['final_val_loss'])):>6} {_f(num(r['final_train_loss'])):>6} {r['wall_s']:>7}  "
            f"{r['load_start']} -> {r['load_end']}   {', '.join(r['faults']) or '-'}"
        )
    by = {r["label"]: r for r in runs}
    if {"clean", "noise", "faulted"} <= by.keys():
        lines += [
            "",
            f"{'step':>6} {'clean':>7} {'noise':>7} {'faulted':>8} {'faulted-clean':>14} {'noise-clean':>12}",
        ]
        curves = {k: {int(s): v for s, v in by[k]["curve"].items()} for k in ("clean", "noise", "faulted")}
        for step in sorted(set().union(*(c.keys() for c in curves.values()))):
            c, n, f = (curves[k].get(step) for k in ("clean", "noise", "faulted"))
            lines.append(f"{step:>6} {_f(c):>7} {_f(n):>7} {_f(f):>8} {_diff(f, c):>14} {_diff(n, c):>12}")
        fc = _diff(num(by["faulted"]["final_val_loss"]), num(by["clean"]["final_val_loss"]))
        nc = _diff(num(by["noise"]["final_val_loss"]), num(by["clean"]["final_val_loss"]))
        lines += ["", f"final val loss: faulted - clean {fc} nats, noise (other seed) - clean {nc} nats"]
    return "\n".join(lines)


def plot(runs: list[dict], path: Path) -> None:
    """The validation curves of the runs in one PNG (matplotlib, Agg)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for r in runs:
        steps = [int(s) for s in r["curve"]]
        ax.plot(steps, list(r["curve"].values()), marker="o", label=f"{r['label']} (seed {r['seed']})")
    ax.set_xlabel("step")
    ax.set_ylabel("validation loss (nats/char)")
    ax.set_title("validation loss with and without faults")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("-i", "--inventory", default="inventory/lab")
    p.add_argument("--engine", default="per_step", choices=recovery.ENGINES)
    p.add_argument("--seed", type=int, default=1337, help="seed of clean and faulted; noise uses seed + 1")
    p.add_argument(
        "--plan", default=DEFAULT_PLAN, help="faults of the faulted run (recovery.py's --plan form)"
    )
    p.add_argument("--launch", default="playbooks/train.yml", help="playbook that launches a run")
    p.add_argument("--nodes", type=int, default=3, help="trainers of the inventory")
    p.add_argument("--runs-dir", type=Path, default=REPO / "runs", help="the controller's runs folder")
    p.add_argument("--out", type=Path, default=None, help="raw figures (JSON)")
    p.add_argument("--plot", type=Path, default=None, help="validation curves (PNG)")
    p.add_argument("-e", "--extra", action="append", default=[], help="extra var for every playbook")
    a = p.parse_args(argv)
    try:
        plan = parse_plan(a.plan)
    except ValueError as exc:
        p.error(str(exc))
    stamp = time.strftime("%Y%m%d-%H%M%S")
    out = a.out or a.runs_dir / f"bench-fault-loss-{stamp}.json"
    png = a.plot or out.with_suffix(".png")
    runs: list[dict] = []
    try:
        for label, seed, faults_of in (
            ("clean", a.seed, []),
            ("noise", a.seed + 1, []),
            ("faulted", a.seed, plan),
        ):
            runs.append(one_run(a, label, seed, faults_of))
            out.write_text(json.dumps({"engine": a.engine, "plan": a.plan, "runs": runs}, indent=1) + "\n")
    except BenchError as exc:
        print(f"error: {exc}", file=sys.stderr)
        if runs:
            print(table(runs))
        return 2
    print(f"\nloss with and without faults, engine {a.engine} (val loss in nats/char)")
    print(table(runs))
    plot(runs, png)
    print(f"\nraw figures: {out}\nplot: {png}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
