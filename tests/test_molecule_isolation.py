"""Every molecule scenario keeps its store and lighthouse to itself, so that it can run beside a
lab job on this machine.

The rendezvous role's stop after a job also stops the lighthouse on ``rendezvous_lighthouse_port``
whose pidfile is in ``rendezvous_state_dir``. Scenario ``fault``'s short run (molecule/train's
extra_vars.yml) used the project's ``runs/.rdzv``, where the lab keeps its services, and stopped a
lab job's lighthouse (2026-12-01, port 29510). Each file of settings a scenario's plays run with
must name the scenario's own state folder, the guard ``rendezvous_stop_only_under`` on it, and a
store port of its own.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
MOLECULE = REPO / "molecule"
EPHEMERAL = "{{ lookup('ansible.builtin.env', 'MOLECULE_EPHEMERAL_DIRECTORY') }}"
DEFAULTS = yaml.safe_load((REPO / "roles/ddp_lab/defaults/main.yml").read_text())
SCENARIOS = sorted(p.parent for p in MOLECULE.glob("*/molecule.yml"))


def var_files(scenario: Path) -> list[Path]:
    """The files of settings the scenario's plays run with: molecule.yml's ``extra-vars: @file``
    and every ``include_vars`` file of its playbooks."""
    found = []
    config = yaml.safe_load((scenario / "molecule.yml").read_text()) or {}
    extra = (config.get("provisioner") or {}).get("options", {}).get("extra-vars")
    if extra is not None:
        assert str(extra).startswith("@"), (
            f"{scenario.name}: extra-vars {extra!r} inline; fix: a file of the scenario (@...)")
        found.append(scenario / str(extra).rpartition("/")[2])
    for play in scenario.glob("*.yml"):
        for name in re.findall(r"include_vars:\s*\n\s*file:\s*\"\{\{ playbook_dir \}\}/([^\"]+)\"",
                               play.read_text()):
            found.append((scenario / name).resolve())
    return sorted(set(found))


@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda p: p.name)
def test_each_scenario_keeps_its_store_and_lighthouse_to_itself(scenario):
    files = var_files(scenario)
    assert files, f"{scenario.name}: no file of settings; its store would use the lab's runs/.rdzv"
    for path in files:
        settings = yaml.safe_load(path.read_text())
        where = path.relative_to(REPO)
        assert settings.get("rendezvous_state_dir") == f"{EPHEMERAL}/rdzv", where
        assert settings.get("rendezvous_stop_only_under") == EPHEMERAL, where
        assert settings.get("rendezvous_port") not in (None, DEFAULTS["rendezvous_port"]), where
        assert settings.get("rendezvous_lighthouse_port", DEFAULTS["rendezvous_lighthouse_port"]) != (
            DEFAULTS["rendezvous_port"]), where


def test_scenarios_do_not_share_a_store_port():
    """Two scenarios side by side (DDP_LAB_MOLECULE_NAME) must not take each other's port."""
    ports: dict[int, Path] = {}
    for scenario in SCENARIOS:
        for path in var_files(scenario):
            settings = yaml.safe_load(path.read_text())
            for key in ("rendezvous_port", "rendezvous_lighthouse_port"):
                port = settings.get(key)
                if port is None:
                    continue
                assert ports.get(port, path) == path, f"{key} {port}: {path} and {ports[port]}"
                ports[port] = path
