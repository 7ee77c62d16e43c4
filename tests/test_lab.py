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
    assert lab.node_addresses(lab.node_names(3)) == want
    info[0]["subnets"] = [{"subnet": "10.89.3.0/29"}]
    with pytest.raises(lab.LabError, match="no IPv4 subnet with room"):
        lab.node_addresses(lab.node_names(3))


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


# --------------------------------------------------------------------------- TOML (tomli_w)


def test_dump_toml_writes_what_containers_conf_may_hold(lab):
    """Shapes a host's containers.conf may carry that the former hand-written writer got wrong or
    refused: an array of tables, a date-time, a character outside the BMP, a dotted key."""
    import datetime

    data = {
        "containers": {"annotations": ["a=1"], "label": True, "tz": "Europe/Zürich 🕒"},
        "engine": {
            "helper_binaries_dir": ["/usr/libexec/podman"],
            "hooks": [{"name": "one", "path": "/x"}, {"name": "two", "path": "/y"}],
            "updated": datetime.datetime(2026, 11, 30, 21, 0, tzinfo=datetime.UTC),
            "service_destinations": {"a.b": {"uri": "ssh://x"}},
        },
        "network": {},
    }
    assert tomllib.loads(lab.dump_toml(data)) == data


def test_dump_toml_refuses_a_value_toml_has_no_type_for(lab):
    with pytest.raises(lab.LabError, match="cannot write these settings to containers.conf"):
        lab.dump_toml({"engine": {"runtime": None}})


def test_dump_toml_without_tomli_w_names_the_fix(lab, monkeypatch):
    monkeypatch.setattr(lab, "tomli_w", None)
    with pytest.raises(lab.LabError, match="needs tomli_w: run `make image`"):
        lab.dump_toml({"engine": {"runtime": "runc"}})


# --------------------------------------------------------------------------- N nodes


def test_node_names_and_fixed_addresses_for_five(lab):
    names = lab.node_names(5)
    assert names == ("laptop-a", "laptop-b", "laptop-c", "laptop-d", "laptop-e")
    assert [lab.node_index(n) for n in names] == [0, 1, 2, 3, 4]
    want = [f"10.89.64.{h}" for h in range(11, 16)]
    assert [lab.node_address("10.89.64.0/24", i) for i in range(5)] == want
    assert lab.node_names(3) == ("laptop-a", "laptop-b", "laptop-c")  # the default lab
    assert len(lab.node_names(26)) == 26


@pytest.mark.parametrize("count", [0, -1, 27])
def test_node_count_out_of_range_is_an_error(lab, count):
    with pytest.raises(lab.LabError, match=f"1 to 26 nodes, not {count}"):
        lab.node_names(count)


@pytest.mark.parametrize("name", ["laptop-", "laptop-ab", "laptop-A", "mol-laptop-a", "desktop-a"])
def test_node_index_refuses_other_names(lab, name):
    with pytest.raises(lab.LabError, match="is not a lab node's name"):
        lab.node_index(name)


def test_node_address_needs_room_in_the_subnet(lab):
    assert lab.node_address("10.89.3.0/27", 19) == "10.89.3.30"  # host 30 of 0-31: the last before broadcast
    with pytest.raises(lab.LabError, match="no room for node 21"):
        lab.node_address("10.89.3.0/27", 20)
    with pytest.raises(lab.LabError, match="no room"):
        lab.node_address("fd00::/64", 0)


def test_five_node_addresses_on_the_lab_network(lab, monkeypatch):
    info = [{"subnets": [{"subnet": "fd00::/64"}, {"subnet": "10.89.3.0/24", "gateway": "10.89.3.1"}]}]
    answer = lambda *a, **k: subprocess.CompletedProcess(a, 0, json.dumps(info).encode())  # noqa: E731
    monkeypatch.setattr(lab, "podman", answer)
    want = {f"laptop-{x}": f"10.89.3.{11 + i}" for i, x in enumerate("abcde")}
    assert lab.node_addresses(lab.node_names(5)) == want


def test_inventory_for_five_nodes(lab, monkeypatch):
    addresses = {f"laptop-{x}": f"10.89.0.{11 + i}" for i, x in enumerate("abcde")}
    text = lab.render_inventory("10.89.0.1", addresses)
    inv = yaml.safe_load(text)["all"]["children"]
    want = {n: {"ansible_host": a, "lab_container": n} for n, a in addresses.items()}
    assert inv["trainers"]["hosts"] == want
    assert list(inv["trainers"]["hosts"]) == list(addresses)  # address order
    assert "The 5 lab laptops" in text and "--nnodes 1:5" in text


def test_known_hosts_name_every_node_and_its_address(lab, tmp_path, monkeypatch):
    """known_hosts of a five-node lab: one line per node and key type, `name,address type key`."""
    names = lab.node_names(5)
    addresses = {n: lab.node_address("10.89.64.0/24", lab.node_index(n)) for n in names}

    def podman(*args, **_):
        assert args[:2] == ("exec", args[1]) and args[1] in names, args
        keys = f"ssh-ed25519 KEY-{args[1]} root@x\necdsa-sha2-nistp256 EC-{args[1]} root@x\n"
        return subprocess.CompletedProcess(args, 0, keys.encode())

    monkeypatch.setattr(lab, "podman", podman)
    monkeypatch.setattr(lab, "ensure_admin_account", lambda name, key: [])
    checked = []
    monkeypatch.setattr(lab, "check_ssh", lambda name, address, key, kh: checked.append((name, address)))
    state = tmp_path / "ssh"
    state.mkdir()
    (state / "id_ed25519").write_text("private")
    (state / "id_ed25519.pub").write_text("ssh-ed25519 PUB lab\n")
    lab.ensure_ssh_access(state, addresses)
    lines = (state / "known_hosts").read_text().splitlines()
    assert lines == [
        line
        for i, n in enumerate(names)
        for line in (f"{n},10.89.64.{11 + i} ecdsa-sha2-nistp256 EC-{n}",
                     f"{n},10.89.64.{11 + i} ssh-ed25519 KEY-{n}")
    ]
    assert checked == list(addresses.items())


class FakeLab:
    """podman stand-in for `lab up`/`down`/`status`: containers by name, one network, the node image."""

    def __init__(self, *existing: str, foreign: tuple[str, ...] = ()) -> None:
        self.net: str | None = "10.89.0.0/24" if existing else None
        self.containers = {n: {"ip": f"10.89.0.{11 + ord(n[-1]) - 97}", "lab": True} for n in existing}
        self.containers.update({n: {"ip": "10.89.0.99", "lab": False} for n in foreign})
        self.runs: list[tuple[str, str]] = []
        self.removed: list[str] = []

    def __call__(self, *args: str, check: bool = True, **_: object) -> subprocess.CompletedProcess:
        def done(text: str = "", rc: int = 0) -> subprocess.CompletedProcess:
            return subprocess.CompletedProcess(args, rc, text.encode(), b"")

        if args[:2] == ("network", "exists"):
            return done(rc=0 if self.net else 1)
        if args[:2] == ("network", "create"):
            self.net = "10.89.0.0/24"
            return done()
        if args[:2] == ("network", "inspect"):
            return done(json.dumps([{"subnets": [{"subnet": self.net, "gateway": "10.89.0.1"}]}]))
        if args[:2] == ("network", "rm"):
            self.net = None
            return done()
        if args[:2] == ("image", "inspect"):
            return done("sha256:node")
        if args[:2] == ("container", "ls"):
            return done("\n".join(n for n, c in self.containers.items() if c["lab"]))
        if args[:2] == ("container", "inspect"):
            c = self.containers.get(args[2])
            if c is None:
                return done(rc=1)
            state = {
                "Config": {"Labels": {"ddp-lab.lab": "1"} if c["lab"] else {}},
                "Image": "sha256:node",
                "State": {"Running": True, "Status": "running"},
                "NetworkSettings": {"Networks": {"ddp-lab": {"IPAddress": c["ip"]}}},
            }
            return done(json.dumps([state]))
        if args[0] == "run":
            name, ip = args[args.index("--name") + 1], args[args.index("--ip") + 1]
            self.containers[name] = {"ip": ip, "lab": True}
            self.runs.append((name, ip))
            return done()
        if args[:3] == ("exec", args[1], "systemctl"):
            return done("running")
        if args[0] == "rm":
            self.removed.append(args[-1])
            del self.containers[args[-1]]
            return done()
        raise AssertionError(f"unexpected podman call {args}")


@pytest.fixture
def fake_lab(lab, tmp_path, monkeypatch):
    def make(*existing: str, foreign: tuple[str, ...] = ()) -> FakeLab:
        fake = FakeLab(*existing, foreign=foreign)
        monkeypatch.setattr(lab, "podman", fake)
        monkeypatch.setattr(lab, "cmd_image", lambda args=None: None)
        monkeypatch.setattr(lab, "check_gateway_reachable", lambda gateway, node: None)
        monkeypatch.setattr(lab, "close_ssh_master", lambda address: False)
        fake.ssh = {}
        monkeypatch.setattr(lab, "ensure_ssh_access", lambda _state, addr: fake.ssh.update(addr) or [])
        monkeypatch.setattr(lab, "INVENTORY_FILE", tmp_path / "inventory" / "hosts.yml")
        monkeypatch.setattr(lab, "LAB_SSH_DIR", tmp_path / "ssh")
        return fake

    return make


def test_up_with_five_nodes_makes_them_at_fixed_addresses(lab, fake_lab):
    fake = fake_lab()
    assert lab.main(["up", "--nodes", "5"]) == 0
    want = {f"laptop-{x}": f"10.89.0.{11 + i}" for i, x in enumerate("abcde")}
    assert fake.runs == list(want.items())
    assert fake.ssh == want  # key pair, accounts and known_hosts for all five
    hosts = yaml.safe_load(lab.INVENTORY_FILE.read_text())["all"]["children"]["trainers"]["hosts"]
    assert {h: v["ansible_host"] for h, v in hosts.items()} == want


def test_up_without_a_count_keeps_the_running_labs_size(lab, fake_lab):
    fake = fake_lab(*lab.node_names(5))
    assert lab.main(["up"]) == 0
    assert fake.runs == []  # nothing made: all five are there
    assert len(yaml.safe_load(lab.INVENTORY_FILE.read_text())["all"]["children"]["trainers"]["hosts"]) == 5
    fake = fake_lab()
    assert lab.main(["up"]) == 0
    assert [name for name, _ in fake.runs] == ["laptop-a", "laptop-b", "laptop-c"]  # default 3


def test_up_grows_a_lab_and_refuses_to_shrink_it(lab, fake_lab, capsys):
    fake = fake_lab(*lab.node_names(3))
    assert lab.main(["up", "--nodes", "5"]) == 0
    assert fake.runs == [("laptop-d", "10.89.0.14"), ("laptop-e", "10.89.0.15")]
    assert lab.main(["up", "--nodes", "3"]) == 1
    err = capsys.readouterr().err
    assert "LAB_NODES=3 would leave laptop-d, laptop-e out of the inventory" in err and "LAB_NODES=5" in err
    assert fake.removed == [] and len(fake.containers) == 5  # nothing changed


def test_down_removes_every_lab_node_whatever_their_number(lab, fake_lab, capsys):
    fake = fake_lab(*lab.node_names(5), foreign=("laptop-f", "mol-laptop-a"))
    fake.containers["laptop-f"]["lab"] = False  # a container of that name without the lab's label
    lab.INVENTORY_FILE.parent.mkdir(parents=True)
    lab.INVENTORY_FILE.write_text("---\n")
    assert lab.main(["down"]) == 0
    assert fake.removed == [f"laptop-{x}" for x in "abcde"]
    assert sorted(fake.containers) == ["laptop-f", "mol-laptop-a"] and fake.net is None
    assert not lab.INVENTORY_FILE.exists()


def test_status_lists_every_lab_node(lab, fake_lab, capsys, monkeypatch):
    fake_lab(*lab.node_names(5))
    monkeypatch.setattr(lab, "image_label", lambda image, label: None)
    lab.cmd_status()
    lines = capsys.readouterr().out.splitlines()
    nodes = [line.split()[0] for line in lines if line.startswith("laptop-")]
    assert nodes == [f"laptop-{x}" for x in "abcde"]


# --------------------------------------------------------------------------- image build progress


def test_run_with_progress_says_what_the_step_is_at_every_interval(lab, tmp_path, capsys):
    script = "echo 'I: Retrieving Release'; sleep 0.5; echo 'STEP 2/9: RUN apt-get install'; echo unpacking"
    argv = ["sh", "-c", script + "; sleep 0.5"]
    code, tail = lab.run_with_progress(argv, "build", log_path=tmp_path / "b.log", interval=0.2)
    assert code == 0 and tail == ["I: Retrieving Release", "STEP 2/9: RUN apt-get install", "unpacking"]
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("lab: build: ")]
    assert len(lines) >= 3, lines  # ~1 s of work at a 0.2 s interval
    assert any("I: Retrieving Release" in line for line in lines)
    assert "STEP 2/9: RUN apt-get install | unpacking" in lines[-1]
    assert "unpacking" in (tmp_path / "b.log").read_text()


def test_run_with_progress_stops_a_step_past_its_timeout(lab, tmp_path):
    with pytest.raises(lab.LabError, match="ran longer than 0 s and was stopped"):
        lab.run_with_progress(["sleep", "30"], "slow", log_path=tmp_path / "b.log", interval=0.1, timeout=0.2)


def test_image_build_reports_progress_of_each_long_step(lab, tmp_path, monkeypatch):
    """From nothing, cmd_image runs debootstrap, tar, podman import and podman build, each through
    run_with_progress (a progress line every PROGRESS_INTERVAL_S), their output in BUILD_LOG."""
    seen = []

    def run(argv, what, **kw):
        seen.append((argv[0] if argv[0] != "podman" else " ".join(argv[:2]), what, kw["log_path"]))
        if argv[0] == "tar":
            Path(argv[argv.index("-cf") + 1]).write_bytes(b"")
        return 0, []

    monkeypatch.setattr(lab, "run_with_progress", run)
    monkeypatch.setattr(lab, "image_label", lambda image, label: None)
    monkeypatch.setattr(lab, "image_exists", lambda image: False)
    monkeypatch.setattr(lab, "detect_runtime", lambda image: None)
    monkeypatch.setattr(lab, "podman", lambda *a, **k: subprocess.CompletedProcess(a, 0, b""))
    monkeypatch.setattr(lab, "BUILD_LOG", tmp_path / "state" / "image-build.log")
    monkeypatch.setattr(lab.shutil, "which", lambda name: f"/usr/bin/{name}")
    monkeypatch.setattr(lab.os, "geteuid", lambda: 0)
    lab.cmd_image()
    assert [(tool, what.split(" ->")[0]) for tool, what, _ in seen] == [
        ("debootstrap", "debootstrap"),
        ("tar", "tar of the root filesystem"),
        ("podman import", "podman import"),
        ("podman build", "podman build"),
    ]
    assert {log_path for *_, log_path in seen} == {lab.BUILD_LOG}
    assert (lab.STATE_DIR / f"rootfs-{lab.SUITE}-minbase.tar").is_file()  # cached for the next build


def _degraded_podman(failed: dict[str, str]):
    """A podman whose containers' systemd is degraded with the ``failed`` units listed (name -> the
    lines of `systemctl --failed --plain --no-legend`)."""
    def fake(*args, check=True, **kwargs):
        name, cmd = args[1], args[2:]
        text = "degraded\n" if cmd == ("systemctl", "is-system-running") else failed[name]
        return subprocess.CompletedProcess(["podman", *args], 0, text.encode(), b"")
    return fake


def test_lab_up_names_a_job_stop_yml_stopped_instead_of_a_degraded_lab(lab, tmp_path, monkeypatch, capsys):
    """newcomer, 2026-12-01: after stop.yml, `make lab-up` printed "systemd is degraded; failed units:
    ddp-lab-agent.service" on every laptop. The laptops the run's stop event names have their job
    stopped, not a degraded lab; another failed unit, or an agent that failed on its own, still is."""
    run = tmp_path / "runs" / "20261201-070000-abcd"
    run.mkdir(parents=True)
    (tmp_path / "runs" / "current").symlink_to(run.name)
    (run / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in (
        {"kind": "launch", "time": 1.0, "hosts": ["laptop-a", "laptop-b", "laptop-c"]},
        {"kind": "stop", "time": 2.0, "run_id": run.name, "hosts": ["laptop-a", "laptop-c"]})))
    monkeypatch.setattr(lab, "RUNS_DIR", tmp_path / "runs")
    agent = "ddp-lab-agent.service loaded failed failed /opt/ddp-lab/venv/bin/python -m ddplab.agent\n"
    monkeypatch.setattr(lab, "podman", _degraded_podman({
        "laptop-a": agent, "laptop-b": agent,
        "laptop-c": agent + "foo.service loaded failed failed Foo\n"}))
    states = {name: lab.wait_for_systemd(name) for name in ("laptop-a", "laptop-b", "laptop-c")}
    text = capsys.readouterr().out
    assert states == {"laptop-a": "running, job stopped", "laptop-b": "degraded", "laptop-c": "degraded"}
    assert f"laptop-a: the agent of run {run.name} was stopped by stop.yml at" in text, text
    assert "laptop-a: systemd is degraded" not in text, text
    assert "laptop-b: systemd is degraded; failed units: ddp-lab-agent.service" in text, text
    assert "laptop-c: systemd is degraded; failed units: foo.service" in text, text
    (run / "events.jsonl").write_text(json.dumps({"kind": "launch", "time": 3.0}) + "\n")  # relaunched
    assert lab.wait_for_systemd("laptop-a") == "degraded"
