"""Scenario `fault`, on the controller: the diloco engine (torchft DiLoCo) rode out a killed agent
and its rejoin: the survivors lost no inner step and never restarted, and held no failed sync but
the one the kill cut short (a kill lands inside a sync now and then: that sync of three fails, each
survivor keeps its inner steps and syncs them with the next quorum), the killed replica came back
at a sync of the group and trained with it again, and the fault was measured by the same
kill-node/summary path as under the other engines (issue 26)."""

import os
import sys
from pathlib import Path

import pytest
import yaml

testinfra_hosts = ["controller"]

PROJECT = Path(os.environ.get("MOLECULE_PROJECT_DIRECTORY", Path(__file__).resolve().parents[3]))
EPHEMERAL = Path(os.environ["MOLECULE_EPHEMERAL_DIRECTORY"])
SETTINGS = yaml.safe_load((Path(__file__).resolve().parents[1] / "run_vars_diloco.yml").read_text())
RUNS = EPHEMERAL / "runs-diloco"
NODES = 3

sys.path.insert(0, str(PROJECT / "train"))


@pytest.fixture(scope="module")
def run():
    """The collected diloco run (ddplab.controller.rundir.RunFolder)."""
    from ddplab.controller.rundir import load_run

    assert (RUNS / "current").is_symlink(), f"{RUNS}/current missing: converge launched no diloco run"
    return load_run((RUNS / "current").resolve())


@pytest.fixture(scope="module")
def faults(run):
    return {f["mode"]: f for f in run.summary["faults"]}


def steps_of(run, host):
    return [r for r in run.per_host[host] if r["event"] == "step"]


def stop_time(run):
    """When stop.yml recorded the stop of the run (its ``kind: stop`` event; unix s), or infinity."""
    stops = [float(e["time"]) for e in run.events if e.get("kind") == "stop"]
    return min(stops) if stops else float("inf")


def assert_no_failed_sync_but_the_killed_one(run, host, kill):
    """``host``'s failed syncs (``uncommitted`` records) before stop.yml ended the run: at most one,
    and only the sync that was in flight with the killed replica: a quorum of all NODES, after the
    kill, before ``host``'s first committed sync without the killed replica. stop.yml stops the
    agents node by node: a sync in flight then fails on the nodes stopped last, which is the stop's
    doing, not the fault's."""
    failed = [r for r in run.per_host[host] if r["event"] == "uncommitted" and r["time"] < stop_time(run)]
    without = [r["time"] for r in steps_of(run, host)
               if r.get("sync") and r["sync_participants"] == NODES - 1]
    assert without, (host, "no sync without the killed replica")
    assert len(failed) <= 1, (host, failed)
    for r in failed:
        assert r.get("sync") and r["participants"] == NODES, (host, r)
        assert kill["injected_at"] <= r["time"] < without[0], (host, r, kill["injected_at"], without[0])


def test_the_run_was_diloco(run):
    assert run.summary["engine"] == "diloco"
    starts = [r for r in run.records if r["event"] == "start"]
    assert starts and {r.get("engine") for r in starts} == {"diloco"}
    assert {r.get("sync_every") for r in starts} == {SETTINGS["ddp_job_sync_every"]}


def test_the_kill_and_the_rejoin_lost_no_step(run, faults):
    assert [f["mode"] for f in run.summary["faults"]] == ["kill-agent", "rejoin"]
    for f in run.summary["faults"]:
        assert f["outcome"] == "recovered" and f["steps_lost"] == 0, f
    assert (faults["kill-agent"]["world_size_before"], faults["kill-agent"]["world_size_after"]) == (3, 2)
    assert (faults["rejoin"]["world_size_before"], faults["rejoin"]["world_size_after"]) == (2, 3)
    assert faults["rejoin"]["node"] == faults["kill-agent"]["node"]


def test_the_survivors_lost_no_inner_step_and_never_restarted(run, faults):
    killed = faults["kill-agent"]["node"]
    survivors = [h for h in run.per_host if h != killed]
    assert len(survivors) == NODES - 1
    for host in survivors:
        numbers = [r["step"] for r in steps_of(run, host)]
        assert numbers == list(range(numbers[0], numbers[-1] + 1)), host  # every step once, in order
        assert_no_failed_sync_but_the_killed_one(run, host, faults["kill-agent"])
        assert len([r for r in run.per_host[host] if r["event"] == "start"]) == 1, host
        # they synced without the killed replica, then with it again
        syncs = [r["sync_participants"] for r in steps_of(run, host) if r.get("sync")]
        assert 2 in syncs and syncs[-1] == 3, (host, syncs)


def test_the_rejoined_replica_came_back_at_a_sync_of_the_group(run, faults):
    killed = faults["kill-agent"]["node"]
    starts = [r for r in run.per_host[killed] if r["event"] == "start"]
    assert len(starts) == 2
    after = [r for r in steps_of(run, killed) if r["time"] > starts[-1]["time"]]
    every = SETTINGS["ddp_job_sync_every"]
    assert after and after[0].get("sync") and after[0]["step"] % every == 1, after[:1]
    assert after[0]["sync_participants"] >= 2 and after[-1]["participants"] == NODES
    # the step it came back at is the group's: a survivor synced there too
    survivor = next(h for h in run.per_host if h != killed)
    assert any(r["step"] == after[0]["step"] and r.get("sync") for r in steps_of(run, survivor))


def test_bytes_on_the_wire_only_at_syncs(run):
    for host in run.per_host:
        for r in steps_of(run, host):
            if not r.get("sync") and r.get("nic_steps") == 1:
                assert r["grad_bytes"] == 0 and r["allreduce_s"] == 0, r
