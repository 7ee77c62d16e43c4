"""playbooks/bench.yml refuses bad input on the controller, before any node is contacted.

The inventory's trainers are TEST-NET addresses over ssh: a task that reached one would fail as
unreachable, so a recap without them (and without a bench folder) shows nothing was touched.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from labharness import REPO, ansible_env, errors, recap, run_playbooks

BENCH = str(REPO / "playbooks" / "bench.yml")


@pytest.fixture()
def inventory(tmp_path: Path) -> str:
    trainers = {f"t-{c}": {"ansible_host": f"192.0.2.{11 + i}", "ansible_connection": "ssh"}
                for i, c in enumerate("abc")}
    controller = {"ansible_connection": "local", "rendezvous_address": "192.0.2.10",
                  "ansible_python_interpreter": str(REPO / ".venv/bin/python")}
    inv = {"all": {"children": {"trainers": {"hosts": trainers},
                                "rendezvous": {"hosts": {"controller": controller}}}}}
    path = tmp_path / "hosts.yml"
    path.write_text(yaml.safe_dump(inv, sort_keys=False))
    return str(path)


def _run(inventory: str, tmp_path: Path, *args: str) -> tuple[int, str]:
    return run_playbooks(ansible_env(), inventory, [BENCH], "-e", f"bench_runs_dir={tmp_path / 'runs'}",
                         *args, timeout=300)


@pytest.mark.parametrize(("extra", "expected"), [
    (["-e", "bench_allreduce_max_mb=0"], "bad bench settings"),
    (["-e", "bench_scaling_max_steps=5"], "at least 10 steps"),
    (["-e", "bench_shape_rate_mbit=0"], "a rate of 1-100000 Mbit/s or null"),
    (["-e", "bench_links=false", "-e", "bench_allreduce=false", "-e", "bench_scaling=false"],
     "one of bench_links"),
    (["-e", "bench_id=../x"], "an id of letters, digits"),
    (["--limit", "t-a,t-b"], "--limit t-a,t-b would mix the stages' sizes"),
    (["-e", '{"bench_scaling_train_overrides": {"n_head": 5}}'],
     "config key 'n_embd' = 128: must be divisible by n_head = 5"),
    (["-e", "bench_scaling_preset=huge"], "config key 'preset' = 'huge'"),
])
def test_bad_input_stops_before_any_node(inventory, tmp_path, extra, expected):
    rc, out = _run(inventory, tmp_path, *extra)
    assert rc != 0, out[-3000:]
    (line,) = errors(out)
    assert expected in line and "fix:" in line, line
    table = recap(out)
    assert all(r["changed"] == 0 for r in table.values()), table
    assert all(r.get("unreachable", 0) == 0 for r in table.values()), table
    assert not (tmp_path / "runs").exists()


def test_wrong_type_is_named(inventory, tmp_path):
    rc, out = _run(inventory, tmp_path, "-e", "bench_links_repeats=three")
    assert rc != 0
    assert "bench_links_repeats" in out and "three" in out
    assert not (tmp_path / "runs").exists()
