"""The agent unit's ExecStart has one parser, ddplab.units: ddplab.status (on a node: the store a
run's launch used) and the validate role's filter unit_launch (the addresses the last launch passed)
both read it, so they cannot disagree on a command line."""

from __future__ import annotations

from pathlib import Path

import pytest
from ansible_collections.ddp_lab.cluster.plugins.filter import validate as val
from ddplab import status, units

ROOT = Path(__file__).resolve().parents[1]

AGENT = ("{ path=/opt/ddp-lab/venv/bin/python ; argv[]=/opt/ddp-lab/venv/bin/python -m ddplab.agent"
         " --nnodes 1:3 --rdzv-backend c10d %s --rdzv-id r1 --local-addr 10.89.0.5 -m ddplab.train"
         " --config /var/lib/ddp-lab/runs/r1/run.json ; ignore_errors=no ; start_time=[n/a] ; pid=1 }")


@pytest.mark.parametrize("spelled, endpoint", [
    ("--rdzv-endpoint 10.89.0.1:29400", "10.89.0.1:29400"),
    ("--rdzv_endpoint 10.89.0.1:29401", "10.89.0.1:29401"),  # torchrun takes both spellings
    ("--rdzv-endpoint=10.89.0.1:29402", "10.89.0.1:29402"),
    ("--rdzv_endpoint='10.89.0.1:29403'", "10.89.0.1:29403"),  # quoted as a shell would
    ("", None),
])
def test_status_and_validate_read_the_same_endpoint(tmp_path, spelled, endpoint):
    exec_start = AGENT % spelled
    assert units.option_value(units.exec_start_argv(exec_start), "--rdzv-endpoint") == endpoint
    node = status.run_endpoints(tmp_path, {"InvocationID": "i", "ExecStart": exec_start}, True)
    controller = val.unit_launch(f"ExecStart={exec_start}\nLoadState=loaded\n")
    assert node["store"] == controller["rdzv_endpoint"] == endpoint
    assert controller["local_addr"] == "10.89.0.5"


def test_exec_start_argv_of_no_command_and_broken_quoting():
    assert units.exec_start_argv("") == []
    assert units.exec_start_argv("{ path=/bin/true ; }") == []
    broken = "{ argv[]=python -m x --opt 'a b ; }"
    assert units.exec_start_argv(broken) == ["python", "-m", "x", "--opt", "'a", "b"]
    assert units.option_value(["--local-addr"], "--local-addr") is None  # no value after it
    assert units.option_value(["--a", "1", "--a", "2"], "--a") == "1"  # the first one


def test_both_callers_use_the_one_parser(tmp_path, monkeypatch):
    """ddplab.status had a regex of its own beside the filter's argv parser (issue 14 review)."""
    seen = []

    def spy(argv, name):
        seen.append(name)
        return "parsed"

    monkeypatch.setattr(units, "option_value", spy)
    unit = {"InvocationID": "i", "ExecStart": AGENT % "--rdzv-endpoint 10.89.0.1:29400"}
    assert status.run_endpoints(tmp_path, unit, True)["store"] == "parsed"
    assert val.unit_launch(f"ExecStart={unit['ExecStart']}\nLoadState=loaded\n")["rdzv_endpoint"] == "parsed"
    assert seen == ["--rdzv-endpoint", "--local-addr", "--rdzv-endpoint"]
