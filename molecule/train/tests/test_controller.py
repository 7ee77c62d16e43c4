"""Scenario `train`, on the controller: the run came home complete and trained as it should."""

import json
import os
import sys
from pathlib import Path

import pytest
import yaml

testinfra_hosts = ["controller"]

PROJECT = Path(os.environ.get("MOLECULE_PROJECT_DIRECTORY", Path(__file__).resolve().parents[3]))
RUNS = Path(os.environ["MOLECULE_EPHEMERAL_DIRECTORY"]) / "runs"
TRAINERS = [f"{os.environ.get('DDP_LAB_MOLECULE_NAME', 'mol')}-laptop-{x}" for x in "abc"]
# The run's settings, from the file that sets them (also loaded by scenario fault's converge).
SETTINGS = yaml.safe_load((Path(__file__).resolve().parents[1] / "extra_vars.yml").read_text())
MAX_STEPS = int(SETTINGS["ddp_job_max_steps"])
RDZV_PORT = int(SETTINGS["rendezvous_port"])

sys.path.insert(0, str(PROJECT / "train"))


@pytest.fixture(scope="module")
def run_dir() -> Path:
    current = RUNS / "current"
    assert current.is_symlink(), f"{current} missing: converge did not launch a run"
    path = current.resolve()
    assert path.is_dir()
    return path


@pytest.fixture(scope="module")
def summary(run_dir):
    return json.loads((run_dir / "summary.json").read_text())


def _records(host_dir: Path):
    from ddplab.records import read_metrics_dir

    return read_metrics_dir(host_dir / "metrics")[0]


def test_summary_fields(summary, run_dir):
    for key in (
        "run_id",
        "hosts",
        "steps_completed",
        "final_train_loss",
        "final_val_loss",
        "wall_s",
        "world_size_timeline",
        "restarts",
        "faults",
    ):
        assert key in summary, key
    assert summary["run_id"] == run_dir.name
    assert sorted(summary["hosts"]) == TRAINERS
    assert summary["steps_completed"] == MAX_STEPS
    assert summary["faults"] == []


def test_world_size_three_throughout(summary, run_dir):
    assert [e["world_size"] for e in summary["world_size_timeline"]] == [3]
    assert summary["restarts"] == 0
    for host in TRAINERS:
        steps = [r for r in _records(run_dir / host) if r["event"] == "step"]
        assert steps, host
        assert {r["world_size"] for r in steps} == {3}, host


def test_loss_went_down(summary):
    assert summary["final_train_loss"] < summary["first_train_loss"] - 0.5, summary
    assert summary["final_val_loss"] is not None and summary["final_val_loss"] < summary["first_train_loss"]


@pytest.mark.parametrize("host", TRAINERS)
def test_every_node_came_back(run_dir, host):
    d = run_dir / host
    assert (d / "journal.txt").stat().st_size > 0
    assert (
        "Rendezvous complete" in (d / "journal.txt").read_text()
        or "ddplab" in (d / "journal.txt").read_text()
    )
    assert list((d / "logs").rglob("*.log")), f"{host}: no torchrun worker logs"
    assert (d / "run.json").is_file()
    recs = _records(d)
    assert any(r["event"] == "end" for r in recs), f"{host}: no end record"


@pytest.mark.parametrize("host", TRAINERS)
def test_checkpoint_loads(run_dir, host):
    from ddplab.checkpoint import CheckpointStore

    store = CheckpointStore(run_dir / host / "checkpoints")
    steps = store.steps()
    assert steps == [MAX_STEPS], f"{host}: newest checkpoint only, of the last step; got {steps}"
    state = store.load(steps[-1])  # verifies the sha256 sidecar, then torch.load
    assert state, host


def test_sample_and_result(run_dir):
    samples = [h for h in TRAINERS if (run_dir / h / "sample.txt").is_file()]
    assert len(samples) == 1, samples  # written by rank 0
    assert len((run_dir / samples[0] / "sample.txt").read_text()) > 50
    result = json.loads((run_dir / samples[0] / "result.json").read_text())
    assert result["steps"] == MAX_STEPS


def test_store_stopped_after_the_job():
    # the scenario's own state folder (extra_vars.yml), never the project's runs/.rdzv
    rdzv = Path(os.environ["MOLECULE_EPHEMERAL_DIRECTORY"]) / "rdzv"
    assert not (rdzv / f"store-{RDZV_PORT}.json").exists()


def test_live_report_copies_and_final_report(summary, run_dir):
    """The watch kept byte-exact copies of every node's metrics for the live page (.watch); collect
    then wrote the final page (no reload, no banner), named in summary.json, with the sample."""
    for host in TRAINERS:
        for collected in sorted((run_dir / host / "metrics").glob("*.jsonl")):
            copy = run_dir / ".watch" / host / "metrics" / collected.name
            assert copy.read_bytes() == collected.read_bytes(), copy
    page = (run_dir / "report.html").read_text()
    assert summary["report"] == "report.html" and summary["outcome"] == "finished"
    assert "http-equiv" not in page and "live, step" not in page
    assert "train loss: last minibatch" in page and "train loss: evaluation estimate" in page
    assert "Generated sample" in page and f"{summary['sample']}" in page
