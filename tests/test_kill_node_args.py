"""kill-node.yml refuses a setting its fault role's argument spec refuses (a non-integer where an
integer is due, a non-boolean, a value outside the choices) in ONE line, once, before any node is
contacted (newcomer, 2026-12-01: `-e rank=abc` printed the role's whole argument spec three times,
once per host)."""

from pathlib import Path

import pytest
import yaml
from ansible_collections.ddp_lab.cluster.plugins.filter import fault as fault_filters
from test_fault_role import PLAYBOOK, assert_refused

ROOT = Path(__file__).resolve().parent.parent
SPEC = yaml.safe_load((ROOT / "roles/fault/meta/argument_specs.yml").read_text())
SPEC = SPEC["argument_specs"]["main"]["options"]


def _filters():
    return fault_filters


@pytest.mark.parametrize("values, problems", [
    ({"fault_rank": "abc"}, ["rank=abc is not an integer; fix: -e rank=<an integer>"]),
    ({"fault_rank": "2", "fault_duration_s": "1.5", "fault_wait": "yes", "fault_runs_dir": "/x"}, []),
    ({"fault_wait_timeout_s": "1.5"},
     ["fault_wait_timeout_s=1.5 is not an integer; fix: -e fault_wait_timeout_s=<an integer>"]),
    ({"fault_wait": "maybe"}, ["fault_wait=maybe is not true or false; fix: -e fault_wait=<true or false>"]),
    ({"fault_partition_scope": "half"},
     ["fault_partition_scope=half must be one of trainers, all; "
      "fix: -e fault_partition_scope=<trainers|all>"]),
    ({"not_in_the_spec": "abc"}, []),
])
def test_argument_problems(values, problems):
    assert _filters().argument_problems(values, SPEC, {"fault_rank": "rank"}) == problems


def test_checked_settings_are_the_typed_ones():
    checked = _filters().checked_settings(SPEC)
    assert {"fault_rank", "fault_duration_s", "fault_wait", "fault_partition_scope", "fault_mode"}\
        <= set(checked)
    assert "fault_runs_dir" not in checked and "fault_node" not in checked  # any string passes


@pytest.mark.skipif(PLAYBOOK is None, reason="ansible-playbook is not installed (make venv)")
@pytest.mark.parametrize("extra, message", [
    (("fault=kill-agent", "rank=abc"), "rank=abc is not an integer; fix: -e rank=<an integer>"),
    (("fault=kill-agent", "node=ghost-a", "fault_wait_timeout_s=abc"),
     "fault_wait_timeout_s=abc is not an integer"),
    (("fault=kill-agent", "node=ghost-a", "fault_probe_timeout_s=2.5"),
     "fault_probe_timeout_s=2.5 is not an integer"),
    (("fault=kill-agent", "node=ghost-a", "fault_wait=maybe"), "fault_wait=maybe is not true or false"),
    (("fault=partition", "node=ghost-a", "fault_partition_scope=half"),
     "fault_partition_scope=half must be one of trainers, all"),
])
def test_a_bad_setting_is_refused_once_in_one_line(tmp_path, extra, message):
    """One refusal (one `fatal:`), the message, no node contacted: the checks of kill-node's other
    bad input (tests/test_fault_role.py); and no argument spec printed."""
    out = assert_refused(tmp_path, extra, message)
    assert "argument_spec_data" not in out and "Validation of arguments failed" not in out, out
