"""lab/lab.py: containers.conf writing, runtime detection logic, recipe hash, generated inventory.

The podman calls are replaced by a fake runtime with this machine's failure modes (crun on a
cgroups-v1 host, rlimits above what the runtime may set); `make lab-up` and the molecule scenarios
exercise the real thing.
"""

import importlib.util
import json
import resource
import subprocess
import tomllib
from pathlib import Path

import pytest
import yaml

LAB_PY = Path(__file__).resolve().parents[1] / "lab" / "lab.py"


@pytest.fixture
def lab(tmp_path, monkeypatch):
    spec = importlib.util.spec_from_file_location("ddp_lab_lab", LAB_PY)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setattr(module, "STATE_DIR", tmp_path / "state")
    monkeypatch.setattr(module, "CONTAINERS_CONF", tmp_path / "state" / "containers.conf")
    monkeypatch.setattr(module, "_system_conf_files", lambda: [])
    return module


def test_dump_toml_round_trips_containers_conf_shapes(lab):
    data = {
        "containers": {"default_ulimits": ["nofile=20000:20000", "nproc=32768:32768"], "init": False,
                       "log_size_max": -1, "tz": 'say "local"'},
        "engine": {"runtime": "runc", "runtimes": {"runc": ["/usr/bin/runc"], "crun": []},
                   "service_destinations": {"my host": {"uri": "ssh://x"}}},
        "network": {},
    }
    assert tomllib.loads(lab.dump_toml(data)) == data


def test_lower_walks_down_powers_of_two(lab):
    seq = [96364]
    while seq[-1] > 1024:
        seq.append(lab._lower(seq[-1]))
    assert seq[:4] == [96364, 65536, 32768, 16384]
    assert lab._lower(1048576) == 524288


class FakeRuntime:
    """`podman run` as on the ddp-lab build machine: crun fails, rlimits above the caps fail."""

    def __init__(self, caps: dict[str, int], crun_default: bool):
        self.caps, self.crun_default, self.calls = caps, crun_default, 0

    def __call__(self, image: str, conf: Path) -> tuple[bool, str]:
        self.calls += 1
        settings = tomllib.loads(conf.read_text())
        runtime = settings.get("engine", {}).get("runtime", "crun" if self.crun_default else "runc")
        if runtime == "crun":
            return False, "Error: crun: cgroups in hybrid mode not supported: OCI runtime error"
        limits = {"nofile": 1048576, "nproc": 4194304}
        for item in settings.get("containers", {}).get("default_ulimits", []):
            key, value = item.split("=")
            limits[key] = int(value.split(":")[0])
        if limits["nofile"] > self.caps["nofile"]:
            return False, "error setting rlimit type 7: operation not permitted: OCI permission denied"
        if limits["nproc"] > self.caps["nproc"]:
            return False, "error setting rlimit type 6: operation not permitted: OCI permission denied"
        return True, ""


def _hard(which: int, ceiling: int) -> int:
    return min({resource.RLIMIT_NOFILE: 20000, resource.RLIMIT_NPROC: 96364}[which], ceiling)


def test_detect_runtime_switches_to_runc_and_caps_rlimits(lab, monkeypatch):
    fake = FakeRuntime({"nofile": 20000, "nproc": 32768}, crun_default=True)
    monkeypatch.setattr(lab, "_probe", fake)
    monkeypatch.setattr(lab, "_hard_limit", _hard)
    monkeypatch.setattr(lab.shutil, "which", lambda name: f"/usr/bin/{name}")
    path = lab.detect_runtime("img")
    settings = tomllib.loads(path.read_text())
    assert settings["engine"]["runtime"] == "runc"
    assert settings["containers"]["default_ulimits"] == ["nofile=20000:20000", "nproc=32768:32768"]
    text = path.read_text()
    assert "runtime = runc (crun cannot run on cgroups v1/hybrid hosts)" in text
    # A second call trusts the file once the probe passes with it: one probe, nothing rewritten.
    fake.calls = 0
    before = path.stat().st_mtime_ns
    lab.detect_runtime("img")
    assert fake.calls == 1 and path.stat().st_mtime_ns == before
    assert sorted(p.name for p in path.parent.iterdir()) == ["containers.conf"]  # no probe files left


def test_detect_runtime_needs_nothing_on_a_permissive_host(lab, monkeypatch):
    fake = FakeRuntime({"nofile": 10**7, "nproc": 10**7}, crun_default=False)
    monkeypatch.setattr(lab, "_probe", fake)
    settings = tomllib.loads(lab.detect_runtime("img").read_text())
    assert "runtime" not in settings.get("engine", {})
    assert "default_ulimits" not in settings.get("containers", {})
    assert "nothing: podman's defaults work here" in lab.CONTAINERS_CONF.read_text()


def test_detect_runtime_reports_an_unknown_failure(lab, monkeypatch):
    monkeypatch.setattr(lab, "_probe", lambda image, conf: (False, "Error: no space left on device"))
    monkeypatch.setattr(lab.shutil, "which", lambda name: None)
    with pytest.raises(lab.LabError, match="no space left on device"):
        lab.detect_runtime("img")
    assert not lab.CONTAINERS_CONF.exists()  # nothing published when nothing works


def test_recipe_hash_follows_the_recipe_files(lab, tmp_path, monkeypatch):
    recipe = tmp_path / "image"
    recipe.mkdir()
    (recipe / "Containerfile").write_text("FROM x\n")
    monkeypatch.setattr(lab, "RECIPE_DIR", recipe)
    first = lab.recipe_hash()
    assert lab.recipe_hash() == first
    (recipe / "Containerfile").write_text("FROM x\nRUN true\n")
    assert lab.recipe_hash() != first


def test_inventory_matches_the_contract(lab, monkeypatch):
    monkeypatch.setenv("DDP_LAB_CONTROLLER_PYTHON", "/opt/ctl/.venv/bin/python")
    addresses = {"laptop-a": "10.89.0.11", "laptop-b": "10.89.0.12", "laptop-c": "10.89.0.13"}
    inv = yaml.safe_load(lab.render_inventory("10.89.0.1", addresses))["all"]["children"]
    trainers = inv["trainers"]
    assert trainers["hosts"] == {
        name: {"ansible_host": address, "lab_container": name} for name, address in addresses.items()
    }
    ssh_dir = lab.LAB_SSH_DIR
    # The laptops' path: SSH as the sudo account, the lab's key and known_hosts (no podman connection).
    assert trainers["vars"] == {
        "ansible_connection": "ssh",
        "ansible_user": "labadmin",
        "ansible_ssh_private_key_file": str(ssh_dir / "id_ed25519"),
        "ansible_ssh_common_args": f"-o UserKnownHostsFile={ssh_dir / 'known_hosts'}",
        "ansible_python_interpreter": "/usr/bin/python3",
    }
    assert inv["rendezvous"]["hosts"] == {"controller": {
        "ansible_connection": "local",
        "ansible_python_interpreter": "/opt/ctl/.venv/bin/python",
        "rendezvous_address": "10.89.0.1",
    }}


def test_node_addresses_are_fixed_host_numbers_of_the_lab_network(lab, monkeypatch):
    info = [{"subnets": [{"subnet": "fd00::/64"}, {"subnet": "10.89.3.0/24", "gateway": "10.89.3.1"}]}]
    answer = lambda *a, **k: subprocess.CompletedProcess(a, 0, json.dumps(info).encode())  # noqa: E731
    monkeypatch.setattr(lab, "podman", answer)
    want = {"laptop-a": "10.89.3.11", "laptop-b": "10.89.3.12", "laptop-c": "10.89.3.13"}
    assert lab.node_addresses() == want
    info[0]["subnets"] = [{"subnet": "10.89.3.0/29"}]
    with pytest.raises(lab.LabError, match="no IPv4 subnet with room"):
        lab.node_addresses()


class FakeNetworks:
    """podman stand-in for `network exists|create|inspect`: networks by name -> subnet."""

    def __init__(self, **networks: str) -> None:
        self.networks = dict(networks)
        self.created: list[tuple[str, ...]] = []

    def __call__(self, *args: str, check: bool = True, **_: object) -> subprocess.CompletedProcess:
        verb, name = args[1], args[-1]
        if verb == "exists":
            return subprocess.CompletedProcess(args, 0 if name in self.networks else 1, b"")
        if verb == "create":
            self.created.append(args)
            self.networks[name] = args[args.index("--subnet") + 1]
            return subprocess.CompletedProcess(args, 0, b"")
        info = [{"subnets": [{"subnet": self.networks[name]}]}]
        return subprocess.CompletedProcess(args, 0, json.dumps(info).encode())


def test_network_is_made_with_the_subnet_once(lab, monkeypatch):
    fake = FakeNetworks()
    monkeypatch.setattr(lab, "podman", fake)
    assert lab.main(["network", "ddp-lab-mol", "10.89.211.0/24"]) == 0
    assert lab.main(["network", "ddp-lab-mol", "10.89.211.0/24"]) == 0
    assert len(fake.created) == 1 and fake.networks == {"ddp-lab-mol": "10.89.211.0/24"}


def test_network_with_another_subnet_is_an_error(lab, monkeypatch, capsys):
    fake = FakeNetworks(**{"ddp-lab-mol": "10.89.7.0/24"})
    monkeypatch.setattr(lab, "podman", fake)
    assert lab.main(["network", "ddp-lab-mol", "10.89.211.0/24"]) == 1
    err = capsys.readouterr().err
    assert "exists with subnet 10.89.7.0/24, not 10.89.211.0/24" in err and "DDP_LAB_MOLECULE_NET" in err
    assert fake.created == []
