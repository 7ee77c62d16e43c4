"""The project's plugins are the collection ddp_lab.cluster (collections/ansible_collections/ddp_lab/
cluster), found through ansible.cfg's collections_path: every ``ddp_lab.cluster.<name>`` that a task,
template or the config names resolves through Ansible's own plugin loaders to a filter, an action,
a module or the callback of the collection, and no task calls one of them by its short name."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
COLLECTION = REPO / "collections" / "ansible_collections" / "ddp_lab" / "cluster"
FQCN = re.compile(r"\bddp_lab\.cluster\.([a-z_][a-z0-9_]*)")
PATTERNS = ("roles/**/*.yml", "roles/**/*.j2", "playbooks/*.yml", "*.yml", "molecule/**/*.yml")
SOURCES = [p for pattern in PATTERNS for p in REPO.glob(pattern)]

# Resolved in a child process: Ansible's collection finder, once installed, stays in sys.meta_path.
RESOLVE = """
import json, sys
from ansible import constants as C
from ansible.plugins.loader import (action_loader, callback_loader, filter_loader, init_plugin_loader,
                                    module_loader)
init_plugin_loader(C.COLLECTIONS_PATHS)
found = {}
for name in json.loads(sys.argv[1]):
    fq = "ddp_lab.cluster." + name
    kinds = [kind for kind, hit in (
        ("filter", filter_loader.get(fq) is not None), ("action", action_loader.find_plugin(fq) is not None),
        ("module", module_loader.find_plugin(fq) is not None),
        ("callback", callback_loader.find_plugin(fq) is not None)) if hit]
    found[name] = kinds
print(json.dumps(found))
"""


@pytest.fixture(scope="module")
def resolved() -> dict[str, list[str]]:
    """``{name: [the plugin kinds ddp_lab.cluster.<name> resolves to]}`` for every name the project's
    YAML, templates and ansible.cfg give with the collection's prefix."""
    names = {m.group(1) for path in [*SOURCES, REPO / "ansible.cfg"] for m in FQCN.finditer(path.read_text())}
    assert names, "no ddp_lab.cluster.* name found"
    out = subprocess.run([sys.executable, "-c", RESOLVE, json.dumps(sorted(names))], cwd=REPO,
                         env={"ANSIBLE_CONFIG": str(REPO / "ansible.cfg"), "PATH": "/usr/bin:/bin",
                              **{k: v for k, v in os.environ.items() if k == "PYTHONPATH"}},
                         capture_output=True, text=True, timeout=120, check=True)
    return json.loads(out.stdout)


def test_every_fqcn_the_project_names_resolves_to_a_plugin_of_the_collection(resolved):
    assert {name: kinds for name, kinds in resolved.items() if not kinds} == {}


def test_the_callback_and_the_action_and_module_names_resolve(resolved):
    assert "callback" in resolved["ddp_lab"]  # ansible.cfg stdout_callback
    assert "action" in resolved["validate_check"] and "module" in resolved["ddp_lab_nm_setting"]


def test_no_task_calls_a_plugin_of_the_collection_by_its_short_name():
    short = {p.stem for kind in ("action", "modules") for p in (COLLECTION / "plugins" / kind).glob("*.py")}
    found = []
    for path in REPO.glob("roles/*/tasks/*.yml"):
        for task in yaml.safe_load(path.read_text()) or []:
            for block in [task, *task.get("block", []), *task.get("rescue", []), *task.get("always", [])]:
                found += [f"{path.relative_to(REPO)}: {key}" for key in block if key in short]
    assert found == []


def test_the_collection_builds(tmp_path):
    galaxy = REPO / ".venv" / "bin" / "ansible-galaxy"
    if not galaxy.exists():
        pytest.skip("no .venv (make venv)")
    subprocess.run([str(galaxy), "collection", "build", str(COLLECTION), "--output-path", str(tmp_path)],
                   capture_output=True, text=True, timeout=120, check=True)
    assert [p.name for p in tmp_path.iterdir()] == ["ddp_lab-cluster-0.1.0.tar.gz"]
