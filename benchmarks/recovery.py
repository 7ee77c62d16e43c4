"""Elastic recovery figures on the cluster: how fast a node loss is survived, how many steps it costs.

Launches a run (playbooks/train.yml, no watch, a step record every step), waits until the group
trains at full size, then for each planned fault runs ``kill-node.yml`` (node loss, then
``rejoin`` of the same node so that the next fault starts from full size again), and at the end
stops the job, collects the run and prints one line per injection from ``summary.json``'s
``faults``: detected_s, recovered_s (injection -> first completed step at the new world size),
steps_lost, world size before -> after, against the targets of docs/faults.md (training again
at world size N-1 within 10 s, 0 steps lost; rejoin back to N). Figures, not assertions: the exit
status is 0 whenever every play ran, whatever the figures.

Usage (controller, lab up and provisioned - or --launch site.yml):
  .venv/bin/python benchmarks/recovery.py [-i inventory/lab] [--plan kill-agent@rank0,poweroff@rank0]
      [--preset small] [--runs-dir runs] [-e key=value ...]
``--plan``: comma-separated ``<mode>@<target>``, mode kill-agent | poweroff | kill-worker | freeze
| partition; target ``rank<R>`` or an inventory host. kill-agent and poweroff are followed by a
rejoin of the node. Extra ``-e`` values go to every playbook (e.g. ``rendezvous_port``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "train"))

from ddplab import faults  # noqa: E402
from ddplab.controller.rundir import load_events, load_run  # noqa: E402

BIN = Path(sys.executable).parent
TARGET_RECOVERY_S = 10.0
LOST_AFTER = ("kill-agent", "poweroff")  # modes that take the node out: a rejoin follows


class BenchError(Exception):
    """A playbook failed: the figures would be meaningless."""


def _tool(name: str) -> str:
    path = shutil.which(name, path=str(BIN)) or shutil.which(name)
    if path is None:
        raise BenchError(f"{name} not found: run `make venv` and use .venv/bin/python")
    return path


def _env() -> dict[str, str]:
    env = dict(os.environ, ANSIBLE_CONFIG=str(REPO / "ansible.cfg"))
    env["PATH"] = f"{BIN}:{env.get('PATH', '')}"
    conf = REPO / "lab/.state/containers.conf"
    if conf.is_file():
        env.setdefault("CONTAINERS_CONF", str(conf))
    return env


def play(inventory: str, playbook: str, extra: list[str], label: str) -> float:
    """Run one playbook; return its wall time (s). Raises BenchError naming the play on failure."""
    args = [_tool("ansible-playbook"), "-i", inventory, str(REPO / playbook)]
    for e in extra:
        args += ["-e", e]
    t0 = time.monotonic()
    print(f"--- {label}: ansible-playbook {playbook} {' '.join('-e ' + e for e in extra)}", flush=True)
    proc = subprocess.run(args, env=_env(), cwd=REPO, capture_output=True, text=True)
    took = time.monotonic() - t0
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-25:])
        raise BenchError(f"{label} failed (exit {proc.returncode}) after {took:.0f} s:\n{tail}")
    return took


def progress(inventory: str, run_id: str) -> list[dict]:
    """Every trainer's newest worker record (roles/fault's ddp_lab_progress module, read-only)."""
    env = _env()
    env.update(ANSIBLE_LIBRARY=str(REPO / "roles/fault/library"),
               ANSIBLE_MODULE_UTILS=str(REPO / "roles/fault/module_utils"),
               ANSIBLE_LOAD_CALLBACK_PLUGINS="1", ANSIBLE_STDOUT_CALLBACK="ansible.posix.json")
    proc = subprocess.run([_tool("ansible"), "trainers", "-i", inventory, "-m", "ddp_lab_progress", "-a",
                           f"metrics_dir=/var/lib/ddp-lab/runs/{run_id}/metrics"],
                          env=env, cwd=REPO, capture_output=True, text=True)
    text = proc.stdout
    if "{" not in text:
        return []
    doc, _ = json.JSONDecoder().raw_decode(text[text.index("{"):])
    out = []
    for host, res in doc["plays"][0]["tasks"][0]["hosts"].items():
        for w in res.get("workers", []):
            out.append({**w, "node": host, "running": res.get("agent_running", False)})
    return out


def wait_full_size(inventory: str, run_id: str, nodes: int, min_step: int, timeout_s: float) -> None:
    """Wait until every node's newest record is a step >= min_step at world size ``nodes``."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        ws = progress(inventory, run_id)
        ok = [w for w in ws if w["event"] == "step" and w["world_size"] == nodes and w["running"]
              and (w["step"] or 0) >= min_step]
        if len({w["node"] for w in ok}) >= nodes:
            return
        time.sleep(2)
    raise BenchError(f"the run did not train at world size {nodes} within {timeout_s:.0f} s")


def current_run(runs: Path) -> str:
    link = runs / "current"
    if not link.is_symlink():
        raise BenchError("runs/current does not exist after site.yml: did the launch fail?")
    return Path(os.readlink(link)).name


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("-i", "--inventory", default="inventory/lab")
    p.add_argument("--plan", default="kill-agent@rank0,poweroff@rank0,kill-agent@rank2,poweroff@rank1")
    p.add_argument("--steps", type=int, default=100000,
                   help="max_steps of the run: more than the plan needs (the run is stopped at the end)")
    p.add_argument("--preset", default="small")
    p.add_argument("--launch", default="playbooks/train.yml",
                   help="playbook that launches the run (site.yml to validate and provision first)")
    p.add_argument("--nodes", type=int, default=3, help="trainers of the inventory")
    p.add_argument("--runs-dir", type=Path, default=REPO / "runs",
                   help="the controller's runs folder (ddp_job_runs_dir), default runs/")
    p.add_argument("-e", "--extra", action="append", default=[], help="extra var for every playbook")
    a = p.parse_args(argv)
    plan = []
    for item in filter(None, a.plan.split(",")):
        mode, _, target = item.partition("@")
        if mode not in ("kill-agent", "poweroff", "kill-worker", "freeze", "partition") or not target:
            p.error(f"--plan item {item!r}: expected <mode>@<rank R|host>")
        plan.append((mode, target))

    overrides = json.dumps({"ddp_job_train_overrides": {"log_interval": 1, "eval_interval": 10 ** 6,
                                                        "ckpt_interval": 50, "warmup_steps": 5}})
    try:
        took = play(a.inventory, a.launch, [*a.extra, "ddp_job_watch=false", f"ddp_job_preset={a.preset}",
                                               f"ddp_job_max_steps={a.steps}", overrides], "launch")
        run_id = current_run(a.runs_dir)
        print(f"run {run_id} launched in {took:.0f} s", flush=True)
        wait_full_size(a.inventory, run_id, a.nodes, 5, 600)
        for mode, target in plan:
            tgt = f"rank={target[4:]}" if target.startswith("rank") else f"node={target}"
            play(a.inventory, "kill-node.yml", [*a.extra, f"fault={mode}", tgt, f"run_id={run_id}"], mode)
            if mode in LOST_AFTER:
                node = faults.injections(load_events(a.runs_dir / run_id))[-1].node
                back = [*a.extra, "fault=rejoin", f"node={node}", f"run_id={run_id}"]
                play(a.inventory, "kill-node.yml", back, "rejoin")
            wait_full_size(a.inventory, run_id, a.nodes, 0, 300)
        play(a.inventory, "stop.yml", a.extra, "stop")
        play(a.inventory, "playbooks/collect.yml", [*a.extra, f"collect_run_id={run_id}"], "collect")
    except BenchError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2

    summary = load_run(a.runs_dir / run_id).summary
    print(f"\nrecovery figures, run {run_id} (targets: training again at world size {a.nodes - 1} "
          f"within {TARGET_RECOVERY_S:.0f} s, 0 steps lost; rejoin back to {a.nodes})")
    print(f"{'mode':<12}{'node':<12}{'rank':>5}{'world':>8}{'detected_s':>12}{'recovered_s':>13}"
          f"{'steps_lost':>12}  target")
    for f in summary.get("faults", []):
        rec, lost = f.get("recovered_s"), f.get("steps_lost")
        if f["mode"] == "rejoin":
            met = f.get("world_size_after") == a.nodes
        else:
            met = rec is not None and rec <= TARGET_RECOVERY_S and lost == 0
        fmt = lambda v: "-" if v is None else (f"{v:.1f}" if isinstance(v, float) else str(v))  # noqa: E731
        print(f"{f['mode']:<12}{f['node']:<12}{fmt(f.get('rank')):>5}"
              f"{fmt(f.get('world_size_before')) + '->' + fmt(f.get('world_size_after')):>8}"
              f"{fmt(f.get('detected_s')):>12}{fmt(rec):>13}{fmt(lost):>12}  {'met' if met else 'missed'}")
    print(f"\nsummary: {a.runs_dir / run_id / 'summary.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
