"""Scenario `train`, on every trainer: the job ended cleanly and left nothing running."""

import os
from pathlib import Path

from testinfra.utils.ansible_runner import AnsibleRunner

# The trainers of the scenario's inventory, reached with testinfra's podman backend (one
# `podman exec` per check; its ansible backend costs an ansible run per check).
testinfra_hosts = [
    f"podman://{name}"
    for name in AnsibleRunner(str(Path(os.environ["MOLECULE_INVENTORY_FILE"]).parent)).get_hosts("trainers")
]

# The short run, as collected on the controller (scenario fault makes another run after it).
RUNS = Path(os.environ["MOLECULE_EPHEMERAL_DIRECTORY"]) / "runs"


def test_agent_finished(host):
    show = host.check_output("systemctl show ddp-lab-agent -p ActiveState,SubState,Result,ExecMainStatus")
    state = dict(line.split("=", 1) for line in show.splitlines())
    assert state == {
        "ActiveState": "active",
        "SubState": "exited",
        "Result": "success",
        "ExecMainStatus": "0",
    }


def test_no_training_process_left(host):
    assert host.run("pgrep -u ddp -f 'ddplab.train|torch.distributed.run'").rc == 1


def test_run_folder_owned_by_training_user(host):
    run_id = (RUNS / "current").resolve().name
    d = f"/var/lib/ddp-lab/runs/{run_id}"
    # one command for both folders (each host.file attribute is a round trip to the node)
    run_dir, ckpt_dir = host.check_output(f"stat -c '%F %U %a' {d} {d}/checkpoints").splitlines()
    assert run_dir == "directory ddp 750"
    assert ckpt_dir.startswith("directory ddp ")
