"""pytest-testinfra checks of the provisioned lab laptops (molecule scenario `default`).

Runs under `molecule verify` (testinfra over the scenario's ansible inventory). Each check reads
the node's real state: systemd units, files, the venv, the route to the rendezvous host.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import testinfra
import yaml
from testinfra.utils.ansible_runner import AnsibleRunner

REPO = Path(__file__).resolve().parents[3]
DEFAULTS = {
    role: yaml.safe_load((REPO / "roles" / role / "defaults" / "main.yml").read_text())
    for role in ("ddp_lab", "cpu_governor", "power", "python_env", "wired_network", "wifi_powersave")
}
FACT_FILE = DEFAULTS["wired_network"]["wired_network_fact_file"]
VENV_PY = f"{DEFAULTS['python_env']['python_env_prefix']}/bin/python"
USER = DEFAULTS["ddp_lab"]["ddp_lab_user"]


def _inventory() -> str:
    """The scenario's inventory folder (molecule sets MOLECULE_INVENTORY_FILE inside it)."""
    return str(Path(os.environ["MOLECULE_INVENTORY_FILE"]).parent)


TRAINERS = AnsibleRunner(_inventory()).get_hosts("trainers")
# The podman driver names each container after its instance: testinfra's podman backend runs every
# check with one `podman exec` (its ansible backend costs an ansible run per check, ~10x slower).
testinfra_hosts = [f"podman://{name}" for name in TRAINERS]


def test_governor_unit_enabled(host):
    unit = DEFAULTS["cpu_governor"]["cpu_governor_unit"]
    governor = DEFAULTS["cpu_governor"]["cpu_governor_governor"]
    assert host.service(unit).is_enabled
    text = host.file(f"/etc/systemd/system/{unit}").content_string
    assert f"frequency-set --governor {governor}" in text
    # Harmless where there is no cpufreq (the lab): the unit's condition skips it at boot.
    assert "ConditionPathExists=/sys/devices/system/cpu/cpu0/cpufreq" in text
    assert not host.service(unit).is_running or host.file("/sys/devices/system/cpu/cpu0/cpufreq").exists


def test_logind_dropin_and_masked_targets(host):
    dropin = host.file(DEFAULTS["power"]["power_logind_dropin"])
    assert dropin.is_file
    lines = set(dropin.content_string.split())
    assert {"[Login]", "HandleLidSwitch=ignore", "HandleLidSwitchExternalPower=ignore",
            "HandleLidSwitchDocked=ignore"} <= lines
    for target in DEFAULTS["power"]["power_sleep_targets"]:
        assert host.run("systemctl is-enabled %s", target).stdout.strip() == "masked", target


def _nm_effective(host, section: str, key: str) -> str | None:
    """``key`` of ``section`` in NetworkManager's merged configuration (``--print-config`` reads
    every drop-in folder as the daemon does; it needs no running daemon)."""
    current = None
    for line in host.check_output("NetworkManager --print-config").splitlines():
        line = line.strip()
        if line.startswith("["):
            current = line.strip("[]")
        elif current == section and "=" in line and not line.startswith("#"):
            name, value = (part.strip() for part in line.split("=", 1))
            if name == key:
                return value
    return None


def test_networkmanager_effective_powersave(host):
    """The lab image carries Ubuntu's default-wifi-powersave-on.conf (wifi.powersave = 3): the
    setting NetworkManager ends up with must still be the role's 2 (disable)."""
    dropin = host.file(DEFAULTS["wifi_powersave"]["wifi_powersave_nm_dropin"])
    assert host.file("/usr/sbin/NetworkManager").exists, "the lab image installs NetworkManager"
    assert host.file("/etc/NetworkManager/conf.d/default-wifi-powersave-on.conf").exists
    assert dropin.is_file
    assert _nm_effective(host, "connection", "wifi.powersave") == "2"


def test_logind_effective_lid_switch(host):
    """What logind itself uses (the running daemon's property), not the drop-in's text."""
    assert host.service("systemd-logind").is_running
    out = host.check_output(
        "busctl get-property org.freedesktop.login1 /org/freedesktop/login1 "
        "org.freedesktop.login1.Manager HandleLidSwitch")
    assert out.split() == ["s", '"ignore"'], out


def test_own_name_resolves_to_127_0_1_1(host):
    """Ubuntu's /etc/hosts line `127.0.1.1 <hostname>` is in place (the lab image adds it at boot)."""
    first = host.check_output("getent hosts $(hostname)").splitlines()[0].split()
    assert first[0] == "127.0.1.1", first


def test_acl_installed_by_provisioning(host):
    """Becoming the training user from the sudo account needs setfacl (roles/python_env installs
    acl; the lab image has none, see tests/test_become_training_user.py)."""
    assert host.package("acl").is_installed
    assert host.exists("setfacl")


def test_ssh_host_keys_differ_between_nodes():
    """Host keys are made at each container's first boot, not baked into the image."""
    keys = {
        name: testinfra.get_host(f"podman://{name}").file("/etc/ssh/ssh_host_ed25519_key.pub").content_string.split()[1]
        for name in TRAINERS
    }
    assert len(set(keys.values())) == len(TRAINERS), keys


def test_ansible_connects_as_unprivileged_sudo_account():
    """The path under test is a laptop's: Ansible over SSH as a sudo account, not root."""
    for name in TRAINERS:
        node = testinfra.get_host(f"ansible://{name}?ansible_inventory={_inventory()}&force_ansible=True")
        assert node.backend.get_variables().get("ansible_connection") == "ssh"
        assert node.check_output("id -un") not in ("", "root")
        assert node.check_output("sudo -n id -un") == "root"


def test_venv_imports_pinned_torch_as_training_user(host):
    pinned = DEFAULTS["python_env"]["python_env_torch_version"]
    out = host.check_output(
        "runuser -u %s -- %s -c %s", USER, VENV_PY,
        "import json, torch, numpy, psutil; print(json.dumps([torch.__version__, numpy.__version__]))")
    torch_version, numpy_version = json.loads(out)
    assert torch_version.split("+")[0] == pinned
    assert numpy_version == DEFAULTS["python_env"]["python_env_numpy_version"]
    assert host.file(DEFAULTS["python_env"]["python_env_prefix"]).user == "root"


def test_wheelhouse_arrived_whole_from_its_archive(host):
    """The wheelhouse comes as one archive (roles/python_env, tasks/copy.yml): every wheel its
    SHA256SUMS names is there with that checksum, nothing else, each owned by root, mode 0644."""
    env = DEFAULTS["python_env"]
    folders = host.check_output(
        "ls -d %s/%s-cp*", env["python_env_node_wheelhouse_dir"], env["python_env_torch_version"]).split()
    assert len(folders) == 1, folders
    check = host.run("cd %s && sha256sum --check --strict --quiet SHA256SUMS", folders[0])
    assert check.rc == 0, check.stdout + check.stderr
    manifest = host.file(f"{folders[0]}/SHA256SUMS").content_string
    named = {line.split("  ", 1)[1] for line in manifest.splitlines()}
    present = set(host.check_output("ls %s", folders[0]).split()) - {"SHA256SUMS"}
    assert named == present and len(named) > 4, (named ^ present)
    owners = host.check_output("cd %s && stat -c '%%U %%G %%a %%n' *", folders[0]).splitlines()
    assert sorted(line.split(" ", 3)[3] for line in owners) == sorted([*named, "SHA256SUMS"]), owners
    assert all(line.startswith("root root 644 ") for line in owners), owners


def test_training_user_has_no_sudo(host):
    user = host.user(USER)
    assert user.exists
    assert not {"sudo", "admin", "wheel"} & set(user.groups)
    assert "not allowed" in host.run("sudo -l -U %s", USER).stdout


def test_gloo_interface_recorded(host):
    fact = json.loads(host.file(FACT_FILE).content_string)
    ifname, address = fact["gloo_socket_ifname"], fact["address"]
    route = host.check_output("ip -4 -o route get %s", fact["rendezvous_address"]).split()
    assert route[route.index("dev") + 1] == ifname
    assert route[route.index("src") + 1] == address
    assert not host.file(f"/sys/class/net/{ifname}/wireless").exists
    assert address in host.check_output("ip -4 -o addr show dev %s", ifname)


@pytest.mark.parametrize("package", ["torch", "numpy", "psutil", "torchft"])
def test_same_versions_on_every_node(package):
    """Every trainer has the same version of each pinned package (DDP hangs on a mismatch)."""
    assert len(TRAINERS) >= 2
    versions = {}
    for name in TRAINERS:
        node = testinfra.get_host(f"podman://{name}")
        versions[name] = node.check_output(
            "%s -c %s", VENV_PY, f"import importlib.metadata as m; print(m.version('{package}'))")
    assert len(set(versions.values())) == 1, versions


@pytest.mark.parametrize("matrix", ["test_bad_input_provision.py", "test_bad_input_preflight.py",
                                    "test_bench_shaped.py"])
def test_bad_input_matrix_is_part_of_this_run(request, matrix):
    """molecule.yml lists the matrices as additional paths, and molecule silently drops a path that
    matches no file: make sure each one was collected with its node cases."""
    collected = [item.nodeid for item in request.session.items if matrix in item.nodeid]
    assert collected, f"{matrix} was not collected: fix verifier.additional_files_or_dirs in molecule.yml"
