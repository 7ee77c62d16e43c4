"""Does a run that loses and regains nodes learn as well as one that does not? The loss of a run
with faults beside fault-free runs (issue 13's target: the loss curve of a run with 4 faults within
noise of a fault-free run of the same seed; docs/faults.md).

Runs of one engine (``ddp_job_fault_tolerance``), one after the other on the same cluster, each
launched with ``playbooks/train.yml`` (the training settings of ``make demo`` unless ``-e`` changes
them) and followed to its end with ``attach.yml`` (progress, collect, report):

  clean      seed S       no fault
  faulted    seed S       the ``--plan`` faults (default: kill-agent, poweroff, freeze 20 s, partition
                          20 s of the node holding rank 0; each node that was taken out rejoins),
                          injected as soon as the group trains at full size, each after the last
                          recovered (no wait after the last one: attach.yml follows the run anyway)
  noise1..K  seed S+1..S+K  no fault (``--noise-seeds K``, default 3): how far another seed alone
                          moves the loss

Prints per run the final evaluation (summary.json's final_val_loss / final_train_loss), the samples
it trained on (``samples_seen`` of its last committed step: the sum over committed steps of
participants x per-replica batch), the faults injected, the wall time and the load average; then
the validation loss at every evaluation step side by side with ``faulted - clean`` (the cost of the
faults) beside the noise band (min..max of ``noise_k - clean`` and of clean's own 0: every
fault-free run minus clean), and one verdict line: is the
faulted run inside the band, at the final evaluation and at how many evaluation steps. Beside it,
``faulted - clean@samples``: the clean run's val interpolated at the samples the faulted run had
trained on (under keep_per_rank a step at fewer participants trains on fewer samples). Plots the
validation curves with matplotlib. Figures, not assertions: exit 0 whenever every play ran; exit 2
(with the table of the runs done so far) when a play failed, e.g. a plan that does not fit the run.
The table and the plot go to ``benchmarks/results/fault_loss.md`` and ``fault_loss.png`` too
(:mod:`ddplab.bench.results`).

``--reuse ROLE=RUN_ID`` (ROLE ``clean``, ``faulted`` or ``seed=N`` for the noise run of seed N,
e.g. ``--reuse seed=1338=20261201-051613-1dda``) takes a run already collected in the runs folder
instead of training it. Before any play, each reused run is checked against what this invocation
would train (:func:`check_reuse`: engine, number of nodes, outcome finished, faults or none, and
the training configuration its result.json recorded: seed, preset, max_steps and every other field
that shapes training, plus every key given with ``-e``); a mismatch is a one-line error naming the
field and both values (exit 2, nothing launched).

Usage (controller, lab up and provisioned, e.g. after ``make demo``):
  .venv/bin/python benchmarks/fault_loss.py [-i inventory/lab] [--engine per_step] [--seed 1337]
      [--noise-seeds 3] [--plan kill-agent@rank0,poweroff@rank0,freeze@rank0:20,partition@rank0:20]
      [--reuse clean=RUN_ID] [--reuse seed=1338=RUN_ID ...]
      [--out runs/bench-fault-loss-<time>.json] [--plot runs/bench-fault-loss-<time>.png] [-e k=v ...]
  .venv/bin/python benchmarks/fault_loss.py --table runs/bench-fault-loss-<time>.json   # print again
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent / "train")]

import recovery  # noqa: E402  (benchmarks/recovery.py: play, await, plan, load average)
from benchcli import HelpFormatter, add_results_dir, first_sentence  # noqa: E402  (benchmarks/benchcli.py)
from ddplab import faults  # noqa: E402
from ddplab.bench import results  # noqa: E402
from ddplab.config import build_config  # noqa: E402
from ddplab.controller.rundir import RunFolderError, load_run, world_size_timeline  # noqa: E402
from ddplab.records import events_of, num  # noqa: E402
from recovery import (  # noqa: E402
    REPO,
    BenchError,
    PlanError,
    await_full_size,
    current_run,
    inject_plan,
    loadavg,
    parse_plan,
    play,
)

DEFAULT_PLAN = "kill-agent@rank0,poweroff@rank0,freeze@rank0:20,partition@rank0:20"

#: ddp_job variables that become run.json keys (roles/ddp_job/vars/main.yml,
#: ``__ddp_job_config_optional``); ``ddp_job_ft_<x>`` becomes ``ft_<x>`` and the keys of
#: ``ddp_job_train_overrides`` are run.json keys themselves.
CONFIG_VARS = {
    "ddp_job_preset": "preset",
    "ddp_job_max_steps": "max_steps",
    "ddp_job_threads": "threads",
    "ddp_job_lr_ramp_steps": "lr_ramp_steps",
}
#: ddplab.config.TrainConfig fields that shape what a run learns and how it is evaluated (model,
#: batch, schedule, optimizer, data, seed, evaluation, engine). A reused run must match the
#: invocation in each of them; the others (paths, ports, threads, checkpoint keeping) only when
#: given with ``-e``.
TRAINING_FIELDS = (
    "preset", "n_layer", "n_head", "n_embd", "block_size", "dropout",
    "per_rank_batch_size", "global_batch_size", "batch_policy",
    "base_lr", "reference_batch_size", "warmup_steps", "lr_ramp_steps", "min_lr_ratio", "max_steps",
    "weight_decay", "beta1", "beta2", "grad_clip",
    "eval_interval", "eval_iters", "data_sha256", "seed", "fault_tolerance", "ft_min_replicas",
)  # fmt: skip
REUSE_FORMS = "clean=RUN_ID, faulted=RUN_ID or seed=N=RUN_ID"


class ReuseError(ValueError):
    """A ``--reuse`` that is malformed or names a run this invocation would not have trained; the
    message is one line naming the run, the field and both values."""


def extra_vars(extra: list[str]) -> dict[str, Any]:
    """The variables of ``-e`` arguments as ansible-playbook merges them (later ones win): a JSON
    object, ``@file`` (YAML/JSON, relative to the repository: the plays run there) or
    space-separated ``key=value`` pairs (string values). Raises ValueError on an argument that is
    none of these."""
    out: dict[str, Any] = {}
    for e in extra:
        text = e.strip()
        if text.startswith(("{", "@")):
            try:
                if text.startswith("@"):
                    import yaml

                    data = yaml.safe_load((REPO / text[1:]).read_text())
                else:
                    data = json.loads(text)
            except (OSError, ValueError) as exc:
                raise ValueError(f"-e {e}: not readable as variables ({exc})") from None
            if not isinstance(data, dict):
                raise ValueError(f"-e {e}: expected a mapping of variables")
            out.update(data)
            continue
        for pair in shlex.split(text):
            key, sep, value = pair.partition("=")
            if not sep:
                raise ValueError(f"-e {e}: expected key=value, a JSON object or @file")
            out[key] = value
    return out


def train_overrides(extra: list[str]) -> dict[str, Any]:
    """``ddp_job_train_overrides`` given with ``-e`` ({} when not given): the launch adds the seed
    to it, keeping the keys given. Raises ValueError when it is not a mapping."""
    value = extra_vars(extra).get("ddp_job_train_overrides") or {}
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            value = None
    if not isinstance(value, dict):
        raise ValueError(f"-e ddp_job_train_overrides={value!r}: expected a JSON object")
    return value


def invocation_config(engine: str, seed: int, extra: list[str]) -> tuple[dict[str, Any], set[str]]:
    """The training configuration a run launched by this invocation with ``seed`` gets, resolved
    like the training program does (:func:`ddplab.config.build_config`: defaults < preset <
    run.json keys from ``-e`` < engine and seed), and the keys given explicitly. Raises
    ValueError (ConfigError) on a bad ``-e`` value."""
    from dataclasses import fields

    from ddplab.config import TrainConfig

    known = {f.name for f in fields(TrainConfig)}
    ev = extra_vars(extra)
    values: dict[str, Any] = {key: ev[var] for var, key in CONFIG_VARS.items() if ev.get(var) is not None}
    values.update(
        {
            f"ft_{var[11:]}": v
            for var, v in ev.items()
            if var.startswith("ddp_job_ft_") and f"ft_{var[11:]}" in known
        }
    )
    values.update(train_overrides(extra))
    values.update(fault_tolerance=engine, seed=seed)
    given = set(values)
    if engine == "per_step":  # the playbook sets the lighthouse (the rendezvous host) when not given
        values.setdefault("ft_lighthouse", "http://rendezvous-host:29510")
    return build_config(values).to_dict(), given


def parse_reuse(items: list[str], seed: int, noise_seeds: int) -> dict[str, str]:
    """``--reuse`` items -> {label: run_id} with the labels of the schedule (``clean``,
    ``faulted``, ``noise<k>`` for seed S+k). Raises ReuseError on a bad form, a seed that is not
    one of S+1..S+K, or a role given twice."""
    out: dict[str, str] = {}
    for item in items:
        parts = item.split("=")
        if len(parts) == 2 and parts[0] in ("clean", "faulted") and parts[1]:
            label, run_id = parts
        elif len(parts) == 3 and parts[0] == "seed" and parts[1].lstrip("-").isdigit() and parts[2]:
            k = int(parts[1]) - seed
            if not 1 <= k <= noise_seeds:
                raise ReuseError(
                    f"--reuse {item}: seed {parts[1]} is not a noise seed of this invocation "
                    f"({seed + 1}..{seed + noise_seeds}: --seed {seed}, --noise-seeds {noise_seeds})"
                )
            label, run_id = f"noise{k}", parts[2]
        else:
            raise ReuseError(f"--reuse {item}: expected {REUSE_FORMS}")
        if label in out:
            raise ReuseError(f"--reuse {item}: {label} is already reused as run {out[label]}")
        out[label] = run_id
    return out


def check_reuse(a: argparse.Namespace, label: str, seed: int, run_id: str) -> None:
    """Does the collected run ``run_id`` (in ``a.runs_dir``) match what this invocation would
    train as ``label`` with ``seed``? Engine, number of nodes, outcome ``finished``, faults (the
    faulted run has some, a clean or noise run none) and every field of :data:`TRAINING_FIELDS`
    and of ``-e`` in the configuration its result.json recorded (run.json resolved the same way
    when there is none). Read through :func:`ddplab.controller.rundir.load_run`. Raises
    ReuseError naming the field and both values."""
    where = f"--reuse {label} run {run_id}"
    try:
        run = load_run(a.runs_dir / run_id)
        want, given = invocation_config(a.engine, seed, a.extra)
    except (RunFolderError, ValueError) as exc:
        raise ReuseError(f"{where}: {exc}") from None

    def mismatch(field: str, got: Any, expected: Any) -> ReuseError:
        return ReuseError(f"{where}: {field} is {got!r} in the run, this invocation trains {expected!r}")

    recorded = next(
        (r["config"] for _, r in sorted(run.results.items()) if isinstance(r.get("config"), dict)), None
    )
    if recorded is None and run.configs:
        try:
            recorded = build_config(next(iter(sorted(run.configs.items())))[1]).to_dict()
        except ValueError as exc:
            raise ReuseError(f"{where}: its run.json does not resolve ({exc})") from None
    if recorded is None:
        raise ReuseError(
            f"{where}: no result.json or run.json in {a.runs_dir / run_id} (collected by collect.yml?)"
        )
    engine = run.summary.get("engine") or recorded.get("fault_tolerance", "torchelastic")
    if engine != a.engine:
        raise mismatch("engine", engine, a.engine)
    hosts = run.summary.get("hosts") or run.hosts
    if len(hosts) != a.nodes:
        raise mismatch("nodes", len(hosts), a.nodes)
    if run.summary.get("outcome") != "finished":
        raise ReuseError(
            f"{where}: outcome is {run.summary.get('outcome')!r} in the run, a reused run must be 'finished'"
        )
    for field in [*TRAINING_FIELDS, *sorted(given - set(TRAINING_FIELDS))]:
        if recorded.get(field) != want.get(field):
            raise mismatch(field, recorded.get(field), want.get(field))
    injected = [f"{i.mode}@{i.node}" for i in faults.injections(run.events)]
    if label == "faulted" and not injected:
        raise ReuseError(f"{where}: faults are none in the run, the faulted run has the plan's ({a.plan})")
    if label != "faulted" and injected:
        raise ReuseError(f"{where}: faults are {', '.join(injected)} in the run, a {label} run has none")


def earlier_figures(runs_dir: Path, run_id: str) -> dict[str, Any]:
    """wall_s, load_start and load_end of ``run_id`` as an earlier fault_loss JSON in ``runs_dir``
    (``bench-fault-loss-*.json``) recorded them when it trained the run; {} when none did."""
    for path in sorted(runs_dir.glob("bench-fault-loss-*.json"), reverse=True):
        try:
            runs = json.loads(path.read_text()).get("runs") or []
        except (OSError, ValueError, AttributeError):
            continue
        for r in runs:
            if isinstance(r, dict) and r.get("run_id") == run_id and not r.get("reused"):
                return {k: r[k] for k in ("wall_s", "load_start", "load_end") if k in r}
    return {}


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


def samples_trained(run_dir: Path) -> dict[str, int]:
    """Samples each host's model trained on, by host: ``samples_seen`` of its last committed
    ``step`` record (the training program adds participants x per-replica batch at every committed
    step, so this is that sum over the committed steps; under torchelastic every step counts).
    Hosts without a step record are left out."""
    out: dict[str, int] = {}
    for host, records in load_run(run_dir).per_host.items():
        seen = [
            r["samples_seen"]
            for r in events_of(records, "step")
            if r.get("committed", True) is not False and isinstance(r.get("samples_seen"), int)
        ]
        if seen:
            out[host] = max(seen)
    return out


def samples_curve(run_dir: Path, steps: list[int] | None = None) -> dict[int, int]:
    """Samples trained by step: the largest ``samples_seen`` among the committed ``step`` records of
    each step (of ``steps`` when given, e.g. the evaluation steps)."""
    want = None if steps is None else set(steps)
    out: dict[int, int] = {}
    for r in events_of(load_run(run_dir).records, "step"):
        step, seen = r.get("step"), r.get("samples_seen")
        if r.get("committed", True) is False or not isinstance(step, int) or not isinstance(seen, int):
            continue
        if want is None or step in want:
            out[step] = max(seen, out.get(step, 0))
    return dict(sorted(out.items()))


def last_fault_step(run_dir: Path) -> int | None:
    """How far the run had got when its last fault was over (the end of the last injection: its
    time plus its duration, e.g. a healed partition, or a rejoin's launch): the highest step
    committed by then. None without a fault or a step before its end."""
    run = load_run(run_dir)
    inj = faults.injections(run.events)
    if not inj:
        return None
    end = max(i.time + (i.duration_s or 0.0) for i in inj)
    done = [
        r["step"]
        for r in events_of(run.records, "step")
        if isinstance(r.get("step"), int)
        and r.get("committed", True) is not False
        and r.get("time", 0) <= end
    ]
    return max(done, default=None)


def reduced_stretches(run_dir: Path, nodes: int) -> list[dict]:
    """The stretches a run trained at fewer than ``nodes`` participants (world size), from
    :func:`ddplab.controller.rundir.world_size_timeline` (committed steps only): [{world_size,
    first_step, last_step, seconds}], ``seconds`` from the first step at that size to the first step
    at the next one (to the run's last committed step when it ended that way)."""
    records = load_run(run_dir).records
    timeline = world_size_timeline(records)
    last = max(
        (
            (r["time"], r["step"])
            for r in events_of(records, "step")
            if r.get("committed", True) is not False and isinstance(r.get("step"), int) and num(r.get("time"))
        ),
        default=None,
    )
    out = []
    for i, e in enumerate(timeline):
        if e["world_size"] >= nodes:
            continue
        nxt = timeline[i + 1] if i + 1 < len(timeline) else None
        end_time, end_step = (nxt["time"], nxt["step"] - 1) if nxt else (last or (e["time"], e["step"]))
        out.append(
            {
                "world_size": e["world_size"],
                "first_step": e["step"],
                "last_step": end_step,
                "seconds": round(end_time - e["time"], 1),
            }
        )
    return out


def reduced_line(label: str, stretches: list[dict]) -> str:
    """One line: where ``label`` trained at fewer participants, e.g. ``faulted: at fewer
    participants 2 over steps 34-521 (107.3 s), ...; 1,025 steps, 274 s in all``."""
    parts = [
        f"{s['world_size']} over steps {s['first_step']}-{s['last_step']} ({s['seconds']:.0f} s)"
        for s in stretches
    ]
    steps = sum(s["last_step"] - s["first_step"] + 1 for s in stretches)
    secs = sum(s["seconds"] for s in stretches)
    return f"{label}: at fewer participants {', '.join(parts)}; {steps:,} steps, {secs:.0f} s in all"


def val_at_samples(curve: dict, samples: dict, n: float | None) -> float | None:
    """Validation loss of a run interpolated (linearly) at ``n`` samples trained, from its
    evaluation steps (``curve``: step -> val) and ``samples`` (step -> samples trained); None when
    ``n`` is outside the evaluated range or a figure is missing."""
    pts = sorted((samples[s], v) for s, v in ((int(k), v) for k, v in curve.items()) if s in samples)
    if n is None or not pts or not pts[0][0] <= n <= pts[-1][0]:
        return None
    for (x0, y0), (x1, y1) in zip(pts, pts[1:], strict=False):
        if x0 <= n <= x1:
            return y0 if x1 == x0 else y0 + (y1 - y0) * (n - x0) / (x1 - x0)
    return pts[-1][1]


def one_run(a: argparse.Namespace, label: str, seed: int, plan: recovery.Plan) -> dict:
    """Launch a run of ``a.engine`` with ``seed``, inject ``plan`` (may be empty; no wait after its
    last fault), follow it to its end and collect it. Returns {label, run_id, seed, faults,
    final_val_loss, final_train_loss, steps, outcome, samples, wall_s, load_start, load_end,
    curve}. BenchError when a play fails; PlanError (after the run was followed to its end and
    collected) when the plan did not fit the run."""
    extra = [*a.extra, f"ddp_job_fault_tolerance={a.engine}"]
    load_start = loadavg()
    t0 = time.monotonic()
    overrides = json.dumps({"ddp_job_train_overrides": {**train_overrides(a.extra), "seed": seed}})
    play(a.inventory, a.launch, [*extra, "ddp_job_watch=false", overrides], f"{label}: launch (seed {seed})")
    run_id = current_run(a.runs_dir)
    to_end = [*extra, f"run_id={run_id}", f"collect_run_id={run_id}"]
    if plan:
        try:
            await_full_size(a.inventory, run_id, a.nodes, extra, 600)
            inject_plan(a, extra, run_id, plan, await_last=False)
        except PlanError:
            play(a.inventory, "attach.yml", to_end, f"{label}: to the end after the plan failed")
            raise
    play(a.inventory, "attach.yml", to_end, f"{label}: to the end")
    took = {"wall_s": round(time.monotonic() - t0), "load_start": load_start, "load_end": loadavg()}
    return run_entry(a.runs_dir, label, seed, run_id, took, bool(plan))


def run_entry(runs_dir: Path, label: str, seed: int, run_id: str, took: dict, faulted: bool) -> dict:
    """The figures of the collected run ``run_id`` (see :func:`one_run`), with ``took``'s
    wall_s, load_start and load_end ("-" when missing); prints its one-line summary."""
    run = load_run(runs_dir / run_id)
    out = {
        "label": label,
        "run_id": run_id,
        "seed": seed,
        "faults": [f"{m.mode}@{m.node}" for m in faults.measure_all(run.events, run.records)],
        "final_val_loss": run.summary.get("final_val_loss"),
        "final_train_loss": run.summary.get("final_train_loss"),
        "steps": run.summary.get("steps_completed"),
        "outcome": run.summary.get("outcome"),
        "samples": samples_trained(runs_dir / run_id),
        "wall_s": took.get("wall_s", "-"),
        "load_start": took.get("load_start", "-"),
        "load_end": took.get("load_end", "-"),
        "curve": val_curve(runs_dir / run_id),
    }
    out["samples_curve"] = samples_curve(runs_dir / run_id, list(out["curve"]))
    out["last_fault_step"] = last_fault_step(runs_dir / run_id) if faulted else None
    out["reduced"] = reduced_stretches(runs_dir / run_id, len(run.hosts)) if faulted else []
    print(
        f"{label}: run {run_id} seed {seed}, {out['steps']} steps, val {out['final_val_loss']}, "
        f"samples {_samples(out['samples'])}, {out['wall_s']} s, "
        f"load {out['load_start']} -> {out['load_end']}",
        flush=True,
    )
    return out


def reused_run(a: argparse.Namespace, label: str, seed: int, run_id: str) -> dict:
    """The entry of a run reused from the runs folder (checked by :func:`check_reuse` before):
    its figures read again, its wall time and load averages as the JSON that trained it recorded
    them (:func:`earlier_figures`), ``reused`` true."""
    entry = run_entry(
        a.runs_dir, label, seed, run_id, earlier_figures(a.runs_dir, run_id), label == "faulted"
    )
    return {**entry, "reused": True}


def remeasure(run: dict, runs_dir: Path) -> dict:
    """A run entry of an earlier JSON with its samples (per host, and by evaluation step) read again
    from its folder in ``runs_dir`` when the folder is there (entries written before those fields
    existed)."""
    folder = runs_dir / run["run_id"]
    if not folder.is_dir():
        return run
    steps = [int(s) for s in run["curve"]]
    return {
        **run,
        "samples": samples_trained(folder),
        "samples_curve": samples_curve(folder, steps),
        "last_fault_step": last_fault_step(folder),
        "reduced": reduced_stretches(folder, len(load_run(folder).hosts)) if run.get("faults") else [],
    }


def _f(v: float | None) -> str:
    return "-" if v is None else f"{v:.3f}"


def _d(v: float | None) -> str:
    return "-" if v is None else f"{v:+.3f}"


def _samples(by_host: dict[str, int] | None) -> str:
    vals = sorted(set((by_host or {}).values()))
    if not vals:
        return "-"
    return f"{vals[0]:,}" if len(vals) == 1 else f"{vals[0]:,}..{vals[-1]:,}"


def band_check(cost: float | None, noise: list[float]) -> str:
    """``in`` when ``cost`` (faulted - clean) lies within min..max of ``noise`` (noise_k - clean),
    ``above`` (worse than every other seed) or ``below`` (better) when outside, ``-`` when a figure
    is missing."""
    if cost is None or not noise:
        return "-"
    if cost > max(noise):
        return "above"
    return "below" if cost < min(noise) else "in"


def _noise_labels(runs: list[dict]) -> list[str]:
    return [r["label"] for r in runs if r["label"].startswith("noise")]


def comparison(runs: list[dict]) -> tuple[list[dict], dict] | None:
    """Faulted vs the noise band, per evaluation step and final. Returns (rows, final), each a dict
    {step (rows only), clean, faulted, noise: {label: val}, cost, band: [min, max] | None (of the
    fault-free runs minus clean: 0 and every ``noise_k - clean``), where,
    clean_same, cost_same}; ``clean_same`` is the clean run's val at the samples the faulted run
    had trained on at that point (:func:`val_at_samples`), ``cost_same`` faulted minus it. None
    without a clean, a faulted and at least one noise run."""
    by = {r["label"]: r for r in runs}
    noise = _noise_labels(runs)
    if not ({"clean", "faulted"} <= by.keys() and noise):
        return None
    curves = {k: {int(s): v for s, v in r["curve"].items()} for k, r in by.items()}

    clean_samples = {int(k): v for k, v in (by["clean"].get("samples_curve") or {}).items()}
    faulted_samples = {int(k): v for k, v in (by["faulted"].get("samples_curve") or {}).items()}

    def entry(get, f_samples: int | None) -> dict:
        c, f = get("clean"), get("faulted")
        same = val_at_samples(curves["clean"], clean_samples, f_samples)
        ns = {k: get(k) for k in noise}
        diffs = [v - c for v in ns.values() if v is not None and c is not None]
        cost = None if f is None or c is None else f - c
        return {
            "clean": c,
            "faulted": f,
            "noise": ns,
            "cost": cost,
            # the clean run is one fault-free draw too: its own difference (0) is in the band
            "band": [min(0.0, *diffs), max(0.0, *diffs)] if diffs else None,
            "where": band_check(cost, [0.0, *diffs] if diffs else []),
            "clean_same": same,
            "cost_same": None if f is None or same is None else f - same,
        }

    steps = sorted(set().union(*(curves[k].keys() for k in ("clean", "faulted", *noise))))
    rows = [{"step": s, **entry(lambda k, s=s: curves[k].get(s), faulted_samples.get(s))} for s in steps]
    final_samples = max((by["faulted"].get("samples") or {}).values(), default=None)
    final = entry(lambda k: num(by[k]["final_val_loss"]), final_samples)
    return rows, final


def outside_counts(runs: list[dict], label: str, others: list[str]) -> tuple[int, int]:
    """(evaluation steps where ``label - clean`` lies outside the band of 0 and ``other - clean``
    for every label in ``others``, evaluation steps judged): steps where a figure is missing are
    not judged."""
    curves = {r["label"]: {int(s): v for s, v in r["curve"].items()} for r in runs}
    clean, run = curves["clean"], curves[label]
    outside = judged = 0
    for step in sorted(clean.keys() & run.keys()):
        diffs = [curves[o][step] - clean[step] for o in others if step in curves[o]]
        if len(diffs) < len(others):
            continue
        judged += 1
        outside += band_check(run[step] - clean[step], [0.0, *diffs]) != "in"
    return outside, judged


def chance_line(runs: list[dict]) -> str | None:
    """How often a fault-free seed leaves the band by chance, beside the faulted run against bands
    of the same size (clean and K-1 seeds): with K noise runs, each seed against the band of clean
    and the other K-1, and the faulted run against each band of clean and K-1 of them. None with
    fewer than two noise runs. For i.i.d. runs a new draw falls outside the range of K others with
    probability 2/(K+1) (order statistics), so a band of K runs is left at about that share of the
    evaluations by a run that only differs by its seed."""
    noise = _noise_labels(runs)
    if len(noise) < 2:
        return None
    seeds = [outside_counts(runs, n, [o for o in noise if o != n]) for n in noise]
    faulted = [outside_counts(runs, "faulted", [o for o in noise if o != n]) for n in noise]
    judged = max(j for _, j in seeds + faulted)
    return (f"by chance: each fault-free seed is outside the band of clean and the other "
            f"{len(noise) - 1} at {', '.join(str(o) for o, _ in seeds)} of {judged} evaluation steps; "
            f"the faulted run, against each band of the same size, at "
            f"{', '.join(str(o) for o, _ in faulted)}")


def verdict(runs: list[dict]) -> str:
    """One line: is ``faulted - clean`` inside the noise band at the final evaluation, and at how
    many of the evaluation steps where every figure exists."""
    cmp = comparison(runs)
    if cmp is None:
        return "verdict: - (needs a clean, a faulted and at least one noise run)"
    rows, final = cmp
    judged = [r for r in rows if r["where"] != "-"]
    inside = sum(r["where"] == "in" for r in judged)
    k = len(_noise_labels(runs))
    if final["where"] == "-":
        head = "verdict: final val missing"
    else:
        band = final["band"]
        word = {"in": "INSIDE", "above": "OUTSIDE (worse than)", "below": "OUTSIDE (better than)"}
        head = (
            f"verdict: faulted - clean {_d(final['cost'])} nats at the final evaluation is "
            f"{word[final['where']]} the noise band [{_d(band[0])}, {_d(band[1])}] of {k} other seed(s)"
        )
    line = f"{head}; inside at {inside} of {len(judged)} evaluation steps"
    chance = chance_line(runs)
    if chance:
        line += "\n" + chance
    if final["cost_same"] is not None:
        line += (
            f"\nat equal samples: faulted - clean {_d(final['cost_same'])} nats at the final evaluation "
            "(the clean run's val interpolated at the samples the faulted run trained on)"
        )
    return line


def table(runs: list[dict]) -> str:
    """The runs (final evaluation, samples trained, faults, time, load), then the validation curves
    side by side (text) with ``faulted - clean`` and the noise band at every evaluation step, the
    final values and the verdict line."""
    clean_samples = max(
        (next((r for r in runs if r["label"] == "clean"), {}).get("samples") or {}).values(), default=0
    )
    lines = [
        f"{'run':<8} {'run id':<22} {'seed':>5} {'steps':>6} {'val':>6} {'train':>6} {'samples':>15} "
        f"{'% clean':>7} {'wall s':>7}  load   faults"
    ]
    for r in runs:
        got = max((r.get("samples") or {}).values(), default=0)
        share = f"{100 * got / clean_samples:.0f}" if clean_samples and got else "-"
        lines.append(
            f"{r['label']:<8} {r['run_id']:<22} {r['seed']:>5} {r['steps'] or '-':>6} "
            f"{_f(num(r['final_val_loss'])):>6} {_f(num(r['final_train_loss'])):>6} "
            f"{_samples(r.get('samples')):>15} {share:>7} {r['wall_s']:>7}  "
            f"{r['load_start']} -> {r['load_end']}   {', '.join(r['faults']) or '-'}"
        )
    reused = [f"{r['label']} ({r['run_id']})" for r in runs if r.get("reused")]
    if reused:
        lines.append(f"reused (trained before, wall s and load as recorded then): {', '.join(reused)}")
    lines += [reduced_line(r["label"], r["reduced"]) for r in runs if r.get("reduced")]
    for r in runs:
        if r.get("last_fault_step") and r.get("steps"):
            lines.append(
                f"{r['label']}: the last fault was over at step {r['last_fault_step']} of {r['steps']} "
                f"({100 * r['last_fault_step'] / r['steps']:.0f} % of the run)"
            )
    cmp = comparison(runs)
    if cmp is None:
        return "\n".join(lines)
    rows, final = cmp
    noise = _noise_labels(runs)
    head = ["step", "clean", "faulted", *noise, "faulted-clean", "noise-clean band", "faulted"]
    head += ["clean@samples", "faulted-clean@samples"]
    cells = [head]
    for r in [*rows, {**final, "step": "final"}]:
        band = "-" if r["band"] is None else f"{_d(r['band'][0])}..{_d(r['band'][1])}"
        cells.append(
            [
                str(r["step"]),
                _f(r["clean"]),
                _f(r["faulted"]),
                *(_f(r["noise"][k]) for k in noise),
                _d(r["cost"]),
                band,
                r["where"],
                _f(r["clean_same"]),
                _d(r["cost_same"]),
            ]
        )
    widths = [max(len(c[i]) for c in cells) for i in range(len(head))]
    lines.append("")
    lines += ["  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)) for row in cells]
    lines += ["", verdict(runs)]
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
    p = argparse.ArgumentParser(description=first_sentence(__doc__), formatter_class=HelpFormatter)
    p.add_argument("-i", "--inventory", default="inventory/lab", help="the inventory every playbook runs on")
    p.add_argument("--engine", default="per_step", choices=recovery.ENGINES,
                   help="recovery engine of every run (ddp_job_fault_tolerance)")
    p.add_argument("--seed", type=int, default=1337, help="seed S of clean and faulted")
    p.add_argument(
        "--noise-seeds", type=int, default=3, help="fault-free runs of seeds S+1..S+K for the noise band"
    )
    p.add_argument(
        "--plan", default=DEFAULT_PLAN, help="faults of the faulted run (recovery.py's --plan form)"
    )
    p.add_argument("--launch", default="playbooks/train.yml", help="playbook that launches a run")
    p.add_argument("--nodes", type=int, default=3, help="trainers of the inventory")
    p.add_argument("--runs-dir", type=Path, default=REPO / "runs", help="the controller's runs folder")
    p.add_argument("--out", type=Path, default=None,
                   help="raw figures (JSON); unset: <runs-dir>/bench-fault-loss-<time>.json")
    p.add_argument("--plot", type=Path, default=None,
                   help="validation curves (PNG); unset: the JSON's path with .png")
    p.add_argument("-e", "--extra", action="append", default=[],
                   help="extra var for every playbook (repeatable)")
    p.add_argument(
        "--reuse",
        action="append",
        default=[],
        metavar="ROLE=RUN_ID",
        help=f"take a collected run from --runs-dir instead of training it ({REUSE_FORMS}; repeatable); "
        "checked against this invocation before anything is launched",
    )
    p.add_argument(
        "--table",
        type=Path,
        default=None,
        help="print the table of an earlier run's JSON (samples read again from the run folders; the PNG "
        "too with --plot); no play",
    )
    add_results_dir(p)
    a = p.parse_args(argv)
    if a.table is not None:
        again = [remeasure(r, a.runs_dir) for r in json.loads(a.table.read_text())["runs"]]
        print(table(again))
        if a.plot is not None:
            plot(again, a.plot)
            print(f"plot: {a.plot}")
        return 0
    try:
        plan = parse_plan(a.plan)
    except ValueError as exc:
        p.error(str(exc))
    if a.noise_seeds < 1:
        p.error("--noise-seeds must be >= 1 (the band needs another seed)")
    # faulted right after clean: when time or the lab runs out, the pair is there
    schedule = [("clean", a.seed, []), ("faulted", a.seed, plan)]
    schedule += [(f"noise{k}", a.seed + k, []) for k in range(1, a.noise_seeds + 1)]
    try:
        train_overrides(a.extra)
        reuse = parse_reuse(a.reuse, a.seed, a.noise_seeds)
        for label, seed, _ in schedule:
            if label in reuse:
                check_reuse(a, label, seed, reuse[label])
    except ValueError as exc:  # ReuseError, or an -e the check cannot read
        print(f"error: {exc}", file=sys.stderr)
        return 2
    stamp = time.strftime("%Y%m%d-%H%M%S")
    out = a.out or a.runs_dir / f"bench-fault-loss-{stamp}.json"
    png = a.plot or out.with_suffix(".png")
    load_before = loadavg()
    runs: list[dict] = []
    try:
        for label, seed, faults_of in schedule:
            if label in reuse:
                runs.append(reused_run(a, label, seed, reuse[label]))
            else:
                runs.append(one_run(a, label, seed, faults_of))
            out.write_text(json.dumps({"engine": a.engine, "plan": a.plan, "runs": runs}, indent=1) + "\n")
    except BenchError as exc:
        print(f"error: {exc}", file=sys.stderr)
        if runs:
            print(table(runs))
        return 2
    heading = f"loss with and without faults, engine {a.engine} (val loss in nats/char)"
    text = table(runs)
    print(f"\n{heading}\n{text}")
    plot(runs, png)
    print(f"\nraw figures: {out}\nplot: {png}")
    folder = results.results_dir(a.results_dir)
    folder.mkdir(parents=True, exist_ok=True)
    plot(runs, folder / "fault_loss.png")
    path = results.write(
        "fault_loss", f"{heading}; plan `{a.plan}`, {a.nodes} nodes\n\n{results.code_block(text)}\n\n"
        "![validation loss of each run](fault_loss.png)",
        title="Loss of a run with faults beside fault-free runs", load_before=load_before,
        notes=[f"raw figures (JSON, on the machine that ran it): {out}"], out_dir=folder)
    print(f"results: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
