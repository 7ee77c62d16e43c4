"""Becoming the training user from the SSH sudo account, on a node without ``acl`` (issue 12).

Ansible connects to a laptop as an unprivileged sudo account (``labadmin``) and runs the job's file
tasks as the training user (``ddp``). A file it transfers (``copy``, ``template``) lands in the
connection user's temporary folder and must be handed to the other unprivileged user: without
setfacl that fails ("Failed to set permissions on the temporary files"), as on a minimal Ubuntu.
The provisioning installs ``acl`` (roles/python_env, tasks/packages.yml) before any task that
becomes the training user.

The case starts its own container from the lab image (as landed: no acl), gives it the lab's SSH
path (lab/lab.py's helpers: key pair, sudo account, known_hosts from inside the container) and a
``ddp`` user, then: the transfer as ``ddp`` fails; the provisioning's package step runs; the same
transfer passes. Needs podman, root and the lab image (``make image``); skipped otherwise (a failure
with ``DDP_LAB_TEST_REQUIRE_NODES=1``). Most of its time is apt on the node (the image keeps its package
lists, as a laptop does: the update fetches only what changed since the build).
"""

from __future__ import annotations

import os
import shlex
from pathlib import Path

import pytest
import yaml
from labharness import REPO, ansible_env, lab_image_or_skip, run_playbooks

TRAINING_USER = yaml.safe_load((REPO / "roles/ddp_lab/defaults/main.yml").read_text())["ddp_lab_user"]
PROBE = f"/home/{TRAINING_USER}/ddp-lab-become-probe"
TRANSFER_FAILS = "Failed to set permissions on the temporary files"

pytestmark = pytest.mark.lab


def _lab_module():
    import lab

    return lab


@pytest.fixture(scope="module")
def bare_node(tmp_path_factory):
    """A container of the lab image as landed, reachable over SSH as the sudo account, with a
    ``ddp`` user: (inventory path, container name). Removed afterwards."""
    lab = lab_image_or_skip()
    name = f"ddp-lab-become-{os.getpid()}"
    state = tmp_path_factory.mktemp("ssh")
    lab.podman("run", "--detach", "--name", name, "--hostname", name, "--systemd=always", lab.NODE_IMAGE)
    try:
        lab.wait_for_systemd(name)
        address = lab.container_address(name)
        lab.ensure_ssh_access(state, {name: address})
        lab.podman("exec", name, "useradd", "--system", "--create-home", TRAINING_USER)
        inventory = state / "hosts.yml"
        hostvars = {
            "ansible_host": address,
            "ansible_connection": "ssh",
            "ansible_user": lab.ADMIN_USER,
            "ansible_ssh_private_key_file": str(state / lab.KEY_NAME),
            "ansible_ssh_common_args": lab.ssh_common_args(state / lab.KNOWN_HOSTS_NAME),
            "ansible_python_interpreter": "/usr/bin/python3",
        }
        inventory.write_text(yaml.safe_dump({"all": {"hosts": {name: hostvars}}}))
        yield str(inventory), name
    finally:
        lab.podman("rm", "--force", "--time", "5", name, check=False)


def _play(inventory: str, tmp_path: Path, tasks: list[dict]) -> tuple[int, str]:
    playbook = tmp_path / "play.yml"
    play = {"name": "Probe", "hosts": "all", "gather_facts": False, "tasks": tasks}
    playbook.write_text(yaml.safe_dump([play]))
    return run_playbooks(ansible_env(), inventory, [str(playbook)], timeout=600)


def _transfer_as_training_user(inventory: str, tmp_path: Path) -> tuple[int, str]:
    """``copy content=`` as the training user (what roles/ddp_job/tasks/ship.yml does)."""
    task = {
        "name": "Write a file as the training user",
        "ansible.builtin.copy": {"content": "ddp-lab\n", "dest": PROBE, "mode": "0600"},
        "become": True,
        "become_user": TRAINING_USER,
    }
    return _play(inventory, tmp_path, [task])


def test_become_training_user_transfers_after_provisioning(bare_node, tmp_path):
    inventory, name = bare_node
    lab = _lab_module()

    rc, out = _play(
        inventory, tmp_path, [{"name": "Who connects", "ansible.builtin.command": "id -un", "register": "who",
                               "changed_when": False},
                              {"name": "Show", "ansible.builtin.debug": {"var": "who.stdout"}}],
    )  # fmt: skip
    assert rc == 0, out[-3000:]
    assert f'"who.stdout": "{lab.ADMIN_USER}"' in out, "Ansible must connect as the sudo account, not root"
    status = lab.podman("exec", name, "dpkg-query", "-W", "-f", "${Status}", "acl", check=False)
    assert "install ok installed" not in lab.out(status), (
        "the lab image has the acl package: it must not (a minimal Ubuntu has none)"
    )
    lists = lab.out(lab.podman("exec", name, "find", "/var/lib/apt/lists", "-name", "*_Packages"))
    assert lists, "the lab image has no package lists; a laptop keeps those of its last apt update"

    rc, out = _transfer_as_training_user(inventory, tmp_path)
    assert rc != 0 and TRANSFER_FAILS in out, (
        "on a node without acl the transfer as the training user should fail as Ansible documents; "
        f"the probe saw rc={rc}: {out[-2000:]}"
    )

    packages = {
        "name": "The provisioning's package step",
        "ansible.builtin.include_role": {"name": "python_env", "tasks_from": "packages"},
    }
    rc, out = _play(inventory, tmp_path, [packages])
    assert rc == 0, out[-3000:]

    rc, out = _transfer_as_training_user(inventory, tmp_path)
    assert rc == 0, out[-3000:]
    owner = lab.out(lab.podman("exec", name, "stat", "-c", "%U", PROBE))
    assert owner == TRAINING_USER, f"{PROBE} belongs to {owner}: {shlex.quote(out[-500:])}"
