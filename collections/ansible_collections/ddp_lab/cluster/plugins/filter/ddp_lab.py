"""Filters of the ddp_lab defaults role: which run a playbook acts on (``tasks/run_id.yml``) and
the name under which Ansible's facts hold a network interface (the rules live in
module_utils/run_ids.py and module_utils/interfaces.py); the role's rules for its settings."""

from __future__ import annotations

from ansible_collections.ddp_lab.cluster.plugins.module_utils.interfaces import interface_fact_name
from ansible_collections.ddp_lab.cluster.plugins.module_utils.run_ids import (
    new_run_id,
    resolve_run_id,
    run_id_problems,
)

# The role's rules for its settings (module_utils/settings.py).
SETTINGS = [{"name": "rendezvous_port", "min": 1024, "max": 65535,
             "why": "below 1024 needs root; the store runs unprivileged"}]


class FilterModule:
    """ddp_lab filters."""

    def filters(self):
        return {"ddp_lab_run_id": resolve_run_id, "ddp_lab_new_run_id": new_run_id,
                "ddp_lab_run_id_problems": run_id_problems,
                "ddp_lab_interface_fact_name": interface_fact_name}
