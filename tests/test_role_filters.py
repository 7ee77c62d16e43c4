"""Unit tests of the Python filter plugins shipped by the provisioning roles."""

from __future__ import annotations

import base64
from pathlib import Path

import pytest
from ansible_collections.ddp_lab.cluster.plugins.filter import python_env as py
from ansible_collections.ddp_lab.cluster.plugins.filter import validate as val
from ansible_collections.ddp_lab.cluster.plugins.filter import wifi_powersave as wifi
from ansible_collections.ddp_lab.cluster.plugins.filter import wired_network as net

ROLES = Path(__file__).resolve().parents[1] / "roles"




def test_manylinux_platforms_debian12():
    tags = py.manylinux_platforms("2.36", "x86_64")
    assert tags[0] == "manylinux_2_36_x86_64"
    assert tags[-1] == "manylinux1_x86_64"
    assert "manylinux_2_28_x86_64" in tags and "manylinux2014_x86_64" in tags
    assert "manylinux_2_37_x86_64" not in tags
    assert len(tags) == len(set(tags)) == (36 - 5 + 1) + 3


def test_manylinux_platforms_rejects_non_glibc_versions():
    with pytest.raises(ValueError):
        py.manylinux_platforms("", "x86_64")


def test_pip_error_prefers_the_versions_on_offer():
    err = ("ERROR: Could not find a version that satisfies the requirement torch==9.9.9 "
           "(from versions: 2.13.0+cpu)\nERROR: No matching distribution found for torch==9.9.9")
    assert py.pip_error(err) == ("Could not find a version that satisfies the requirement torch==9.9.9 "
                                 "(from versions: 2.13.0+cpu)")


def test_pip_error_explains_a_constraint_conflict_from_stdout():
    stderr = "ERROR: Cannot install torch==9.9.9 because these package versions have conflicting deps.\n"
    stdout = ("The conflict is caused by:\n    The user requested torch==9.9.9\n"
              "    The user requested (constraint) torch<=2.14.1\n\nAdditionally, some packages in these "
              "conflicts have no matching distributions available for your environment:\n    torch\n")
    msg = py.pip_error(stderr, stdout)
    assert "pip constraint torch<=2.14.1 excludes it" in msg
    assert "no matching distribution of torch" in msg
    assert py.pip_error(stderr).startswith("Cannot install torch==9.9.9")
    assert py.pip_error("") == "no output"


def test_mismatch_summary_names_the_odd_node():
    assert py.mismatch_summary({"a": "2.13.0", "b": "2.13.0"}) == ""
    assert (py.mismatch_summary({"a": "2.13.0", "b": "2.12.0", "c": "2.13.0"})
            == "b has 2.12.0 (a, c have 2.13.0)")
    # A tie goes to the first host's value.
    assert py.mismatch_summary({"a": "x", "b": "y"}) == "b has y (a has x)"


def test_ping_rtt_ms():
    out = ("--- 10.89.0.6 ping statistics ---\n3 packets transmitted, 3 received, 0% packet loss\n"
           "rtt min/avg/max/mdev = 0.045/0.061/0.080/0.013 ms\n")
    assert net.ping_rtt_ms(out) == pytest.approx(0.061)
    assert net.ping_rtt_ms("3 packets transmitted, 0 received, 100% packet loss") is None
    assert net.ping_rtt_ms(None) is None


def test_rtt_table():
    lines = net.rtt_table({"laptop-a": {"laptop-b": 0.0612}, "laptop-b": {"laptop-a": None}}, 3)
    assert lines[0].startswith("RTT in ms (mean of 3 pings)")
    assert lines[1].split() == ["from", "\\", "to", "laptop-a", "laptop-b"]
    assert set(lines[2]) <= {"─", " "}  # rich's rule under the heads
    assert lines[3].split() == ["laptop-a", "-", "0.061"]
    assert lines[4].split() == ["laptop-b", "x", "-"]
    # right-aligned numbers: the cells end in the same column as their heads
    assert lines[3].rindex("0.061") + 5 == lines[1].rindex("laptop-b") + 8


def _slurp(folder: str, attr: str, value: str) -> dict:
    return {"item": [{"path": folder}, attr], "content": base64.b64encode(value.encode()).decode()}


def test_wifi_radios_to_block():
    rf = "/sys/class/rfkill/rfkill"
    results = [
        _slurp(f"{rf}0", "type", "wlan\n"), _slurp(f"{rf}0", "soft", "0\n"),
        _slurp(f"{rf}1", "type", "bluetooth\n"), _slurp(f"{rf}1", "soft", "0\n"),
        _slurp(f"{rf}2", "type", "wlan\n"), _slurp(f"{rf}2", "soft", "1\n"),
        {"skipped": True, "item": [{"path": "/x"}, "type"]},
    ]
    assert wifi.wifi_radios_to_block(results) == ["/sys/class/rfkill/rfkill0"]


def test_shared_values_and_connection_targets():
    hostvars = {"a": {"ansible_host": "10.0.0.5"}, "b": {"ansible_host": "10.0.0.5"}, "c": {}}
    targets = val.connection_targets(["a", "b", "c"], hostvars)
    assert targets == {"a": "10.0.0.5", "b": "10.0.0.5", "c": "c"}
    assert val.shared_values(targets) == ["a and b share 10.0.0.5"]
    assert val.shared_values({"a": "x", "b": "y", "c": None, "d": None}) == []
