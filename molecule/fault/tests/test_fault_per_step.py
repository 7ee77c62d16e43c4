"""Scenario `fault`, on the controller: the per_step engine (torchft) rode out a power-off of the
replica holding rank 0, its rejoin and a freeze without losing a step or restarting a survivor, no
committed step saw a sample twice or skipped one, and every node's artefacts came home (issue 13)."""

import os
import sys
from pathlib import Path

import pytest
import yaml

testinfra_hosts = ["controller"]

PROJECT = Path(os.environ.get("MOLECULE_PROJECT_DIRECTORY", Path(__file__).resolve().parents[3]))
EPHEMERAL = Path(os.environ["MOLECULE_EPHEMERAL_DIRECTORY"])
SETTINGS = yaml.safe_load((Path(__file__).resolve().parents[1] / "run_vars_per_step.yml").read_text())
RUNS = EPHEMERAL / "runs-per-step"
NODES = 3

sys.path.insert(0, str(PROJECT / "train"))


@pytest.fixture(scope="module")
def run():
    """The collected per_step run (ddplab.controller.rundir.RunFolder: path, summary, records)."""
    from ddplab.controller.rundir import load_run

    assert (RUNS / "current").is_symlink(), f"{RUNS}/current missing: converge launched no per_step run"
    return load_run((RUNS / "current").resolve())


@pytest.fixture(scope="module")
def faults(run):
    return {f["mode"]: f for f in run.summary["faults"]}


def test_the_run_was_per_step(run):
    assert run.summary["engine"] == "per_step"
    starts = [r for r in run.records if r["event"] == "start"]
    assert starts and {r.get("engine") for r in starts} == {"per_step"}


def test_three_faults_recovered_without_losing_a_step(faults, run):
    assert [f["mode"] for f in run.summary["faults"]] == ["poweroff", "rejoin", "freeze"]
    for f in run.summary["faults"]:
        assert f["outcome"] == "recovered" and f["steps_lost"] == 0, f
    assert faults["poweroff"]["rank"] == 0
    assert (faults["poweroff"]["world_size_before"], faults["poweroff"]["world_size_after"]) == (3, 2)
    assert (faults["rejoin"]["world_size_before"], faults["rejoin"]["world_size_after"]) == (2, 3)
    assert faults["rejoin"]["node"] == faults["poweroff"]["node"]
    assert faults["freeze"]["node"] != faults["poweroff"]["node"]
    assert faults["freeze"]["world_size_after"] == 2


def test_no_survivor_restarted(faults, run):
    """Only the rejoining replica starts a process: the survivors of the power-off and the freeze
    keep theirs (one start record per node, plus the rejoined node's second one)."""
    assert faults["poweroff"]["restarts"] == 0 and faults["freeze"]["restarts"] == 0
    assert faults["rejoin"]["restarts"] == 1
    starts = {}
    for r in run.records:
        if r["event"] == "start":
            starts[r["host"]] = starts.get(r["host"], 0) + 1
    off = faults["poweroff"]["node"]
    assert starts == {h: 2 if h == off else 1 for h in starts} and len(starts) == NODES, starts


def test_every_committed_step_has_distinct_samples(run, faults):
    """The sample ranges of the committed steps ([first, stop) of each replica) never overlap and
    leave no gap: no sample seen twice or skipped when the participants changed. A gap is allowed
    only beside a committed step that lacks a participant's record, at most one such step per
    fault (a replica powered off between its all-reduce and its record, or frozen in its vote
    while its peers committed: tests/test_per_step_e2e.py assert_samples_distinct, the same rule)."""
    # A step's quorum either updated the model or not. On the step of a fault one replica's vote may
    # fail after the all-reduce that others completed (ddplab.engines.torchft_replica, CONTRACTS.md):
    # a completed gloo all-reduce holds every participant's gradient, so the samples of every
    # participant of a (step, quorum) that any replica committed were used, whatever its own record
    # says.
    attempts: dict[tuple, dict[str, dict]] = {}
    for r in run.records:
        if r["event"] == "step" and r.get("samples"):
            attempts.setdefault((r["step"], r.get("quorum_id")), {})[r["host"]] = r
    committed, incomplete = {}, set()
    for (step, _quorum), per in attempts.items():
        if any(r.get("committed") is True for r in per.values()):
            committed.setdefault(step, {}).update({h: tuple(r["samples"]) for h, r in per.items()})
            if len(per) < max(r.get("participants") or 0 for r in per.values()):
                incomplete.add(step)
    assert len(committed) > 20, len(committed)
    ranges = sorted((a, b, step, host) for step, per in committed.items() for host, (a, b) in per.items())
    gaps = []
    for (a0, b0, s0, h0), (a1, b1, s1, h1) in zip(ranges, ranges[1:], strict=False):
        assert b0 <= a1, f"step {s0} on {h0} [{a0},{b0}) overlaps step {s1} on {h1} [{a1},{b1})"
        if b0 != a1:
            where = f"samples [{b0},{a1}) skipped between step {s0} on {h0} and step {s1} on {h1}"
            assert {s0, s1} & incomplete, f"{where}, both steps with every participant's record"
            gaps.append(where)
    assert len(gaps) <= len(faults), f"{len(gaps)} gaps for {len(faults)} faults: {gaps}"


def test_artefacts_from_every_node(run):
    from ddplab.records import read_metrics_dir

    hosts = sorted(run.summary["hosts"])
    assert len(hosts) == NODES, hosts
    for host in hosts:
        d = run.path / host
        recs, _skipped = read_metrics_dir(d / "metrics")
        assert any(r["event"] == "step" and r.get("committed") for r in recs), f"{host}: no committed step"
        assert (d / "journal.txt").stat().st_size > 0, host
        assert list((d / "checkpoints").glob("ckpt-*.pt")), f"{host}: no checkpoint collected"


def test_lighthouse_and_store_stopped():
    rdzv = EPHEMERAL / "rdzv"
    assert not (rdzv / f"lighthouse-{SETTINGS['rendezvous_lighthouse_port']}.json").exists()
    assert not (rdzv / f"store-{SETTINGS['rendezvous_port']}.json").exists()
