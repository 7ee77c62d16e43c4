"""Which run a playbook acts on: the ddp_lab role's filter ``ddp_lab_run_id`` (tasks/run_id.yml)."""

from __future__ import annotations

import base64
import re
from datetime import UTC, datetime

import pytest
import yaml
from ansible_collections.ddp_lab.cluster.plugins.module_utils import run_ids as f
from labharness import REPO, ansible_env, errors, local_controller, recap, run_playbooks


def slurp(text: str) -> dict:
    return {"content": base64.b64encode(text.encode()).decode(), "encoding": "base64"}


def test_first_non_empty_candidate_wins_over_every_source():
    assert f.resolve_run_id(["", None, "r-resume", "r-new"], ["link", "nodes", "new"],
                            {"lnk_source": "/x/runs/r-link"}, [slurp("r-node")]) == "r-resume"
    assert f.resolve_run_id("r1") == "r1"


def test_link_then_nodes_in_the_order_given():
    link = {"exists": True, "islnk": True, "lnk_source": "/work/main/runs/20261130-101010-abcd",
            "lnk_target": "20261130-101010-abcd"}
    nodes = [{"skipped": True}, {"unreachable": True}, slurp("r-node\n")]
    assert f.resolve_run_id([""], ["link", "nodes"], link, nodes) == "20261130-101010-abcd"
    assert f.resolve_run_id([""], ["nodes", "link"], link, nodes) == "r-node"
    # no runs/current (stat of a missing path, or a skipped stat): the first node that records one
    assert f.resolve_run_id([], ["link", "nodes"], {"exists": False}, nodes) == "r-node"
    assert f.resolve_run_id([], ["link", "nodes"], {}, nodes) == "r-node"
    # a target given as a string (lnk_target only, relative)
    assert f.resolve_run_id([], ["link"], {"lnk_target": "r7"}) == "r7"


def test_nothing_found_is_empty_not_an_error():
    assert f.resolve_run_id([""], ["link", "nodes"], {}, [{"failed": True, "msg": "no file"}]) == ""
    assert f.resolve_run_id([], []) == ""
    # a node file that is not base64 counts as none
    assert f.resolve_run_id([], ["nodes"], None, [{"content": "%%%"}]) == ""


def test_new_id_has_the_documented_shape():
    when = datetime(2026, 11, 29, 17, 15, 2, tzinfo=UTC)
    assert f.new_run_id(when, "3fa1") == "20261129-171502-3fa1"
    got = f.resolve_run_id(["", ""], ["new"])
    assert re.fullmatch(r"\d{8}-\d{6}-[0-9a-f]{4}", got)
    assert f.resolve_run_id([], ["link", "new"], {"exists": False}) != ""


def test_bad_ids_and_sources_are_one_line_errors():
    with pytest.raises(ValueError, match="not 1-64 of the characters"):
        f.resolve_run_id(["../etc"])
    with pytest.raises(ValueError, match="not 1-64"):
        f.resolve_run_id([], ["nodes"], None, [slurp("a b")])
    with pytest.raises(ValueError, match="unknown source 'newest'"):
        f.resolve_run_id([], ["newest"])


def test_filter_names():
    from ansible_collections.ddp_lab.cluster.plugins.filter import ddp_lab

    assert set(ddp_lab.FilterModule().filters()) == {
        "ddp_lab_run_id", "ddp_lab_new_run_id", "ddp_lab_run_id_problems", "ddp_lab_interface_fact_name"}


@pytest.mark.parametrize("bad", ["../etc", "..", ".", ".rdzv", ".live", "a/b", "a b", "x" * 65])
def test_a_run_id_is_not_a_path_out_of_runs(bad):
    """-e ddp_job_resume_run_id=../etc (or '..', or the controller's runs/.rdzv) reached the resume's
    look into runs/<id>/checkpoints: the form is checked first, one line naming the variable."""
    (line,) = f.run_id_problems([bad], {"ddp_job_resume_run_id": bad, "run_id": "r1"})
    assert line.startswith(f"ddp_job_resume_run_id {bad!r} is not a run id: a run id is 1-64 of the"
                           " characters A-Z a-z 0-9 . _ -, not starting with '.'"), line
    assert "; fix: give the id of a run, e.g. 20261201-080234-3daa" in line
    with pytest.raises(ValueError, match="not starting with"):
        f.resolve_run_id([bad])


def test_good_and_absent_run_ids_pass_and_an_unnamed_one_is_a_run_id():
    assert f.run_id_problems(["", None, "20261201-080234-3daa", "r1", "bench-x.2"], {}) == []
    assert f.run_id_problems("../x", None)[0].startswith("run id '../x' is not a run id")
    assert f.run_id_problem("", "run_id") == "" and f.run_id_problem(None) == ""
    # -e run_id (status, attach, logs, kill-node) is named before the role variable it feeds
    assert f.run_id_problems(["../x"], {"run_id": "../x", "ddp_job_run_id": "../x"})[0].startswith("run_id ")


@pytest.mark.parametrize(("command", "name", "bad"), [
    (["status.yml"], "run_id", "../etc"),
    (["attach.yml"], "run_id", ".."),
    (["logs.yml", "-e", "node=t-a"], "run_id", "a/b"),
    (["playbooks/collect.yml"], "collect_run_id", "../etc"),
    (["playbooks/report.yml"], "report_run_id", ".rdzv"),
])
def test_every_playbook_that_takes_a_run_id_refuses_a_bad_one_in_one_line(tmp_path, command, name, bad):
    """status/attach/logs/collect/report: a run id not of a run id's form was a templating error of
    several lines (status) or a path built from it; now one line naming the variable, exit 2, and no
    trainer is contacted (their addresses are TEST-NET: one would be 'unreachable')."""
    inventory = tmp_path / "hosts.yml"
    inventory.write_text(yaml.safe_dump({"all": {"children": {
        "trainers": {"hosts": {"t-a": {"ansible_host": "192.0.2.11", "ansible_connection": "ssh"}}},
        "rendezvous": {"hosts": local_controller(tmp_path)}}}}))
    rc, out = run_playbooks(ansible_env(), str(inventory), [str(REPO / command[0]), *command[1:]],
                            "-e", f"{name}={bad}", timeout=300)
    assert rc == 2, out[-3000:]
    (line,) = errors(out)
    assert line.startswith(f"{name} {bad!r} is not a run id: a run id is 1-64 of the characters"), line
    assert all(r["unreachable"] == 0 for r in recap(out).values()), recap(out)
