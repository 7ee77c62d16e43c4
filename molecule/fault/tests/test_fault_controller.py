"""Scenario `fault`, on the controller: the recoveries were measured and the run came home whole."""

import json
import os
import sys
from pathlib import Path

import pytest
import yaml

testinfra_hosts = ["controller"]

PROJECT = Path(os.environ.get("MOLECULE_PROJECT_DIRECTORY", Path(__file__).resolve().parents[3]))
EPHEMERAL = Path(os.environ["MOLECULE_EPHEMERAL_DIRECTORY"])
# The fault run's settings, from the file that sets them for converge.yml (its max_steps is
# derived from a measured step time: the run's own run.json says what it was).
SETTINGS = yaml.safe_load((Path(__file__).resolve().parents[1] / "run_vars.yml").read_text())
RUNS = EPHEMERAL / "runs-fault"
NODES = 3
PG_TIMEOUT_S = float(SETTINGS["ddp_job_train_overrides"]["pg_timeout_s"])
FREEZE_S = float(SETTINGS["molecule_fault_freeze_s"])
RDZV_PORT = int(SETTINGS["rendezvous_port"])

sys.path.insert(0, str(PROJECT / "train"))


@pytest.fixture(scope="module")
def run_dir() -> Path:
    current = RUNS / "current"
    assert current.is_symlink(), f"{current} missing: converge did not launch a run"
    return current.resolve()


@pytest.fixture(scope="module")
def summary(run_dir):
    return json.loads((run_dir / "summary.json").read_text())


@pytest.fixture(scope="module")
def trainers(run_dir):
    from ddplab.controller.rundir import host_dirs  # the one reader's notion of a host's folder

    return sorted(p.name for p in host_dirs(run_dir))


@pytest.fixture(scope="module")
def faults(summary):
    return {f["mode"]: f for f in summary["faults"]}


def test_three_faults_were_recorded_and_measured(run_dir, summary):
    from ddplab.controller.rundir import load_events
    from ddplab.faults import injections

    recorded = [(i.mode, i.node) for i in injections(load_events(run_dir))]
    assert [m for m, _ in recorded] == ["poweroff", "rejoin", "freeze"]
    assert [(f["mode"], f["node"]) for f in summary["faults"]] == recorded
    for f in summary["faults"]:
        for key in ("injected_at", "detected_s", "recovered_s", "steps_lost", "world_size_before",
                    "world_size_after"):
            assert key in f, (f["mode"], key)


def test_world_size_timeline_shrinks_and_grows_back(summary):
    sizes = [e["world_size"] for e in summary["world_size_timeline"]]
    assert sizes[:3] == [3, 2, 3], sizes
    assert sizes[-1] == 3, sizes


def test_poweroff_of_the_rank0_node(faults):
    f = faults["poweroff"]
    assert f["rank"] == 0
    assert (f["world_size_before"], f["world_size_after"], f["outcome"]) == (3, 2, "recovered")
    assert f["steps_lost"] == 0
    assert 0 < f["detected_s"] <= f["recovered_s"]


def test_rejoin_grows_back_without_losing_steps(faults):
    f = faults["rejoin"]
    assert f["node"] == faults["poweroff"]["node"]
    assert (f["world_size_before"], f["world_size_after"], f["outcome"]) == (2, 3, "recovered")
    assert f["steps_lost"] == 0


def test_freeze_is_given_up_after_the_gloo_timeout(faults):
    f = faults["freeze"]
    assert f["node"] != faults["poweroff"]["node"]
    assert f["duration_s"] == FREEZE_S
    assert f["outcome"] == "recovered" and f["steps_lost"] == 0
    # the survivors notice the silent peer when the process-group timeout expires, not before
    assert PG_TIMEOUT_S - 1 <= f["detected_s"] <= PG_TIMEOUT_S + 15, f
    assert f["world_size_after"] == 2, f


def test_training_completed(summary, run_dir, trainers):
    configured = {json.loads((run_dir / h / "run.json").read_text())["max_steps"] for h in trainers}
    assert len(configured) == 1, configured
    max_steps = configured.pop()
    assert summary["steps_completed"] == max_steps
    assert summary["final_train_loss"] is not None and summary["final_val_loss"] is not None
    results = [json.loads(p.read_text()) for p in run_dir.glob("*/result.json")]
    assert [r["steps"] for r in results] == [max_steps]


def test_artefacts_from_every_node(run_dir, summary, trainers):
    from ddplab.records import read_metrics_dir

    assert len(trainers) == NODES and sorted(summary["hosts"]) == trainers
    for host in trainers:
        d = run_dir / host
        recs, _skipped = read_metrics_dir(d / "metrics")
        assert any(r["event"] == "end" for r in recs), f"{host}: no end record"
        assert (d / "journal.txt").stat().st_size > 0, host
        assert list((d / "checkpoints").glob("ckpt-*.pt")), f"{host}: no checkpoint collected"


def test_store_stopped():
    assert not (EPHEMERAL / "rdzv" / f"store-{RDZV_PORT}.json").exists()
