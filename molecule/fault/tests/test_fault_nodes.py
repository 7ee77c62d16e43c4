"""Scenario `fault`, on every trainer: the job ended cleanly and no fault is left behind."""

import os
from pathlib import Path

from testinfra.utils.ansible_runner import AnsibleRunner

# The trainers of the scenario's inventory, reached with testinfra's podman backend (one
# `podman exec` per check; its ansible backend costs an ansible run per check).
testinfra_hosts = [
    f"podman://{name}"
    for name in AnsibleRunner(str(Path(os.environ["MOLECULE_INVENTORY_FILE"]).parent)).get_hosts("trainers")
]


def test_agent_finished(host):
    show = host.check_output("systemctl show ddp-lab-agent -p ActiveState,SubState,Result")
    state = dict(line.split("=", 1) for line in show.splitlines())
    assert state == {"ActiveState": "active", "SubState": "exited", "Result": "success"}


def test_no_training_process_left(host):
    assert host.run("pgrep -u ddp -f 'ddplab.train|torch.distributed.run|ddplab.agent'").rc == 1


def test_no_partition_rules_or_heal_timers_left(host):
    assert "DDP_LAB_FAULT" not in host.check_output("iptables -S")
    timers = host.check_output("systemctl list-timers --all --no-legend --plain")
    assert "ddp-lab-fault-heal" not in timers
