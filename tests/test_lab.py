"""lab/lab.py: containers.conf writing, runtime detection logic, recipe hash, generated inventory.

The podman calls are replaced by a fake runtime with this machine's failure modes (crun on a
cgroups-v1 host, rlimits above what the runtime may set); `make lab-up` and the molecule scenarios
exercise the real thing.
"""

import json
import re
import resource
import shlex
import subprocess
import tomllib
from pathlib import Path

import pytest
import yaml


@pytest.fixture
def lab(tmp_path, monkeypatch):
    import lab as module
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


def quota_of(args: list[str]) -> float | None:
    """The CPU quota podman ``run``/``update`` arguments give (``--cpu-quota`` over
    ``--cpu-period``), None without one."""
    if "--cpu-quota" not in args:
        return None
    return round(int(args[args.index("--cpu-quota") + 1]) / int(args[args.index("--cpu-period") + 1]), 4)


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

    def __init__(self, *existing: str, foreign: tuple[str, ...] = (), cpus: float | None = None) -> None:
        self.net: str | None = "10.89.0.0/24" if existing else None
        self.containers = {n: self._new(f"10.89.0.{11 + ord(n[-1]) - 97}", cpus) for n in existing}
        self.containers.update({n: {**self._new("10.89.0.99", None), "lab": False} for n in foreign})
        self.runs: list[tuple[str, str]] = []
        self.removed: list[str] = []
        self.updates: list[tuple[str, str]] = []

    @staticmethod
    def _new(ip: str, cpus: float | None) -> dict:
        """A container: made with quota ``cpus``; ``quota`` is its cgroup's (podman update changes it,
        as on podman 4.3, not the made-with value); ``files`` its files; ``qdisc`` tc's root line."""
        return {"ip": ip, "lab": True, "made": cpus, "quota": cpus, "files": {},
                "qdisc": "qdisc noqueue 0: root refcnt 2"}

    def node_exec(self, c: dict, argv: tuple[str, ...]) -> tuple[str, int]:
        """What a node answers to the limits' `podman exec` calls."""
        if argv[:2] == ("python3", "-c") and "def read_share" in argv[2]:
            q = c["quota"]
            share = {"share": min(q, 2.0) if q else 2.0, "quota": q, "affinity": 2, "physical_cores": 2,
                     "quota_file": q and "/sys/fs/cgroup/cpu/x"}
            return json.dumps({**share, "threads": max(1, int(share["share"]))}), 0
        if argv[:3] == ("ip", "-o", "route"):
            return "default via 10.89.0.1 dev eth0 proto static", 0
        if argv[:2] == ("tc", "qdisc"):
            return c["qdisc"], 0
        if argv[0] == "test":
            return "", 0 if argv[-1] in c["files"] else 1
        if argv[0] == "stat":
            return ("root:root 644", 0) if argv[-1] in c["files"] else ("", 1)
        if argv[0] == "cat":
            return c["files"].get(argv[-1], ""), 0 if argv[-1] in c["files"] else 1
        if argv[0] == "rm":
            c["files"].pop(argv[-1], None)
            return "", 0
        if argv[0] == "systemctl":
            unit = c["files"].get("/etc/systemd/system/ddp-lab-link.service", "")
            if argv[1] in ("restart", "enable") or argv[1:3] == ("enable", "--now"):
                rate = re.search(r"rate (\d+)mbit", unit)
                gbit = int(rate.group(1)) // 1000
                c["qdisc"] = f"qdisc tbf 1ab: root refcnt 2 rate {gbit}Gbit burst 1Mb lat 50ms"
            if argv[1] == "disable":
                c["qdisc"] = "qdisc noqueue 0: root refcnt 2"
            return "running", 0
        raise AssertionError(f"unexpected podman exec {argv}")

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
                "HostConfig": {"NanoCpus": int((c["made"] or 0) * 1e9)},
                "Config": {"Labels": {"ddp-lab.lab": "1"} if c["lab"] else {}},
                "Image": "sha256:node",
                "State": {"Running": True, "Status": "running"},
                "NetworkSettings": {"Networks": {"ddp-lab": {"IPAddress": c["ip"]}}},
            }
            return done(json.dumps([state]))
        if args[0] == "run":
            name, ip = args[args.index("--name") + 1], args[args.index("--ip") + 1]
            cpus = quota_of(args)
            self.containers[name] = self._new(ip, cpus)
            self.runs.append((name, ip))
            return done()
        if args[0] == "update":
            self.updates.append((args[-1], f"{quota_of(args):g}"))
            self.containers[args[-1]]["quota"] = quota_of(args)
            return done()
        if args[0] == "exec":
            text, rc = self.node_exec(self.containers[args[1]], args[2:])
            return done(text, rc)
        if args[0] == "rm":
            self.removed.append(args[-1])
            del self.containers[args[-1]]
            return done()
        raise AssertionError(f"unexpected podman call {args}")


@pytest.fixture
def fake_lab(lab, tmp_path, monkeypatch):
    def make(*existing: str, foreign: tuple[str, ...] = (), cpus: float | None = None) -> FakeLab:
        fake = FakeLab(*existing, foreign=foreign, cpus=cpus)
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


# --------------------------------------------------------------------------- CPU quotas and links


@pytest.fixture
def limits_lab(lab, fake_lab, monkeypatch):
    """fake_lab plus the limits' own calls: files written into a node, the CPU and link checks."""
    def make(*existing: str, cpus: float | None = None) -> FakeLab:
        fake = fake_lab(*existing, cpus=cpus)

        def put(name, path, text, owner, mode, check=""):
            files = fake.containers[name]["files"]
            changed = files.get(path) != text
            files[path] = text
            return changed

        fake.measured = {"cpu": [], "link": []}
        monkeypatch.setattr(lab, "put_node_file", put)
        monkeypatch.setattr(lab, "host_cpus", lambda: 2)
        monkeypatch.setattr(lab, "measure_cpu", lambda names: fake.measured["cpu"].append(names) or {
            n: fake.containers[n]["quota"] or 2.0 for n in names})

        def link(sender, receiver, address, ifname):
            fake.measured["link"].append((sender, receiver, address, ifname))
            return lab.node_limits.Transfer(sender, receiver, 64_000_000, 0.55, 66_300_000)

        monkeypatch.setattr(lab, "measure_link", link)
        return fake

    return make


def _hosts(lab) -> dict:
    return yaml.safe_load(lab.INVENTORY_FILE.read_text())["all"]["children"]["trainers"]


@pytest.mark.parametrize(
    ("text", "shares"),
    [("0.6", (0.6,)), ("0.6,0.6,0.3", (0.6, 0.6, 0.3)), (" 0.5 , off ,1", (0.5, None, 1.0)), ("OFF", (None,)),
     ("2", (2.0,)), ("0.01", (0.01,)), (None, None), ("", None)],
)
def test_cpu_shares_are_parsed_one_per_laptop_or_one_for_all(lab, text, shares):
    assert lab.node_limits.parse_cpus(text, 2) == shares


@pytest.mark.parametrize("text", ["0.6,x", "0", "-0.5", "2.5", "0.6,,0.3", "nan", "inf", "0.001", "1e9"])
def test_a_bad_cpu_share_is_one_line_that_says_what_to_give(lab, text):
    with pytest.raises(lab.node_limits.LimitError) as err:
        lab.node_limits.parse_cpus(text, 2)
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith(f"LAB_CPUS={text}: ") and "LAB_CPUS=0.6,0.6,0.3" in msg


@pytest.mark.parametrize(("text", "mbit"), [("1000", 1000), (" 100 ", 100), ("off", 0), ("0", 0), ("none", 0),
                                            (None, None), ("", None)])
def test_link_rates_are_whole_mbit_or_off(lab, text, mbit):
    assert lab.node_limits.parse_link_mbit(text) == mbit


@pytest.mark.parametrize("text", ["1e3", "1000mbit", "-5", "100001", "1.5", "fast"])
def test_a_bad_link_rate_is_one_line(lab, text):
    with pytest.raises(lab.node_limits.LimitError, match=rf"^LAB_LINK_MBIT={re.escape(text)}: give the link"):
        lab.node_limits.parse_link_mbit(text)


def test_shares_over_the_machines_cpus_give_a_warning(lab):
    warn = lab.node_limits.oversubscribed
    assert warn((0.6, 0.6, 0.3), 2) is None and warn((0.5, 0.5, 1.0), 2) is None
    assert warn((None, None, None), 2) is None  # the default lab: no quotas, no warning
    text = warn((1.0, 1.0, 0.5), 2)
    assert "add up to 2.5 CPUs, more than this machine's 2" in text and "depend on the load" in text
    assert "add up to 2.6 CPUs" in warn((0.6, None), 2)  # a node without a quota can take them all


def test_the_link_unit_shapes_the_egress_with_the_labs_tbf(lab):
    nl = lab.node_limits
    unit = nl.link_unit("eth0", 1000)
    assert ("ExecStart=/usr/sbin/tc qdisc replace dev eth0 root handle 1ab: tbf rate 1000mbit burst 1000000 "
            "latency 50ms") in unit
    assert "ExecStop=/usr/sbin/tc qdisc del dev eth0 root" in unit and "WantedBy=multi-user.target" in unit
    assert nl.burst_bytes(10) == 128 * 1024  # at least 128 KB
    show = "qdisc tbf 1ab: root refcnt 2 rate 1Gbit burst 1000000b lat 50ms \n"
    assert nl.shaped_mbit(show) == 1000.0
    assert nl.shaped_mbit("qdisc tbf 1ab: root refcnt 2 rate 500Mbit burst 512Kb lat 50ms") == 500.0
    assert nl.shaped_mbit("qdisc tbf d1ab: root refcnt 2 rate 1Gbit burst 1Mb lat 50ms") is None  # bench's
    assert nl.shaped_mbit("qdisc noqueue 0: root refcnt 2") is None
    stats = show + " Sent 66300000 bytes 45000 pkt (dropped 0, overlimits 9000 requeues 0)\n backlog 0b 0p\n"
    assert nl.qdisc_sent_bytes(stats) == 66_300_000 and nl.qdisc_sent_bytes("qdisc noqueue 0: root") is None


def test_a_transfer_line_gives_the_payload_rate_and_the_bytes_on_the_wire(lab):
    t = lab.node_limits.Transfer("laptop-a", "laptop-b", 64_000_000, 0.55, 66_300_000)
    assert t.line(1000.0) == ("laptop-a -> laptop-b: 64.0 MB in 0.55 s = 931 Mbit/s of payload; the sender's "
                              "qdisc sent 66.3 MB (tbf 1000 Mbit/s)")
    assert lab.node_limits.Transfer("a", "b", 10, 1.0, None).line(None).endswith("of payload (not shaped)")


def test_up_with_cpus_makes_each_laptop_with_its_quota(lab, limits_lab, capsys):
    fake = limits_lab()
    assert lab.main(["up", "--cpus", "0.6,0.6,0.3"]) == 0  # no LAB_NODES: one laptop per share
    made = {n: c["made"] for n, c in fake.containers.items()}
    assert made == {"laptop-a": 0.6, "laptop-b": 0.6, "laptop-c": 0.3}
    assert fake.updates == [] and fake.measured["cpu"] == [["laptop-a", "laptop-b", "laptop-c"]]
    trainers = _hosts(lab)
    assert {n: (h["lab_cpus"], h["ddp_job_threads"]) for n, h in trainers["hosts"].items()} == {
        "laptop-a": (0.6, None), "laptop-b": (0.6, None), "laptop-c": (0.3, None)}
    assert "lab_link_mbit" not in trainers["vars"]
    out = capsys.readouterr().out
    assert "laptop-c 10.89.0.13 (running, 0.3 CPU)" in out and "warning" not in out
    assert "laptop-c quota 0.3 (1 thread(s)), a busy loop got 0.30 CPU" in out


def test_up_changes_a_running_labs_quotas_live_and_says_a_restart_undoes_it(lab, limits_lab, capsys):
    fake = limits_lab(*lab.node_names(3))
    assert lab.main(["up", "--cpus", "0.5"]) == 0
    assert fake.runs == [] and fake.updates == [("laptop-a", "0.5"), ("laptop-b", "0.5"), ("laptop-c", "0.5")]
    out = capsys.readouterr().out
    assert "laptop-a: CPU quota none -> 0.5 (live: a restart of the container" in out
    assert "brings back the quota it was made with, none; `make lab-down lab-up" in out
    assert {h["lab_cpus"] for h in _hosts(lab)["hosts"].values()} == {0.5}
    assert lab.main(["up"]) == 0  # no LAB_CPUS: the quotas stay as they are
    assert len(fake.updates) == 3 and {h["lab_cpus"] for h in _hosts(lab)["hosts"].values()} == {0.5}
    assert lab.main(["up", "--cpus", "0.5"]) == 0 and len(fake.updates) == 3  # nothing to change
    assert lab.main(["up", "--cpus", "off"]) == 0  # podman cannot remove a quota: all of the host's CPUs
    assert fake.updates[3:] == [(n, "2") for n in lab.node_names(3)]


def test_up_warns_when_the_shares_add_up_to_more_than_the_machine(lab, limits_lab, capsys):
    limits_lab()
    assert lab.main(["up", "--cpus", "1,1,0.5"]) == 0
    out = capsys.readouterr().out
    assert "warning: the laptops' CPU shares add up to 2.5 CPUs, more than this machine's 2" in out


@pytest.mark.parametrize(
    ("argv", "error"),
    [(["--cpus", "0.6,0.6"], "LAB_CPUS has 2 shares for a lab of 3 laptops"),
     (["--cpus", "0.6,0.6,0.3", "--nodes", "5"], "LAB_CPUS has 3 shares for a lab of 5 laptops"),
     (["--cpus", "3"], "LAB_CPUS=3: '3' is not a CPU share"),
     (["--link-mbit", "fast"], "LAB_LINK_MBIT=fast: give the link rate")],
)
def test_up_refuses_bad_limits_in_one_line_before_changing_anything(lab, limits_lab, capsys, argv, error):
    fake = limits_lab(*lab.node_names(3))
    assert lab.main(["up", *argv]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"lab: error: {error}") and err.count("\n") == 1, err
    assert fake.runs == [] and fake.updates == [] and not lab.INVENTORY_FILE.exists()


def test_up_shapes_every_link_and_measures_each_node_sending_to_the_next(lab, limits_lab, capsys):
    fake = limits_lab(*lab.node_names(3))
    assert lab.main(["up", "--link-mbit", "1000"]) == 0
    for c in fake.containers.values():
        assert "tbf rate 1000mbit" in c["files"]["/etc/systemd/system/ddp-lab-link.service"]
    assert _hosts(lab)["vars"]["lab_link_mbit"] == 1000
    assert fake.measured["link"] == [("laptop-a", "laptop-b", "10.89.0.12", "eth0"),
                                     ("laptop-b", "laptop-c", "10.89.0.13", "eth0"),
                                     ("laptop-c", "laptop-a", "10.89.0.11", "eth0")]
    assert fake.measured["cpu"] == []  # no quotas: no CPU check
    out = capsys.readouterr().out
    assert "laptop-a: eth0 shaped to 1000 Mbit/s (ddp-lab-link.service)" in out
    assert "link: laptop-a -> laptop-b: 64.0 MB in 0.55 s = 931 Mbit/s of payload" in out
    assert "(running, link 1000 Mbit/s)" in out
    assert lab.main(["up", "--link-mbit", "off"]) == 0
    assert all(not c["files"] for c in fake.containers.values())
    assert "lab_link_mbit" not in _hosts(lab)["vars"]


def test_the_limits_command_gives_molecule_nodes_their_quotas(lab, limits_lab, capsys):
    fake = limits_lab()
    for i, name in enumerate(("m-laptop-a", "m-laptop-b")):
        fake.containers[name] = fake._new(f"10.89.211.{11 + i}", None)
    assert lab.main(["limits", "--cpus", "0.6,0.3", "--link-mbit", "1000", "m-laptop-a", "m-laptop-b"]) == 0
    assert fake.updates == [("m-laptop-a", "0.6"), ("m-laptop-b", "0.3")]
    assert "m-laptop-b, 0.3 CPU, link 1000 Mbit/s" in capsys.readouterr().out
    assert lab.main(["limits", "--cpus", "0.6,0.3,0.3", "m-laptop-a", "m-laptop-b"]) == 1


@pytest.mark.parametrize(("cpus", "args"), [
    (0.6, ["--cpu-period", "10000", "--cpu-quota", "6000"]),  # 10 ms periods: short stops
    (0.3, ["--cpu-period", "10000", "--cpu-quota", "3000"]),
    (2, ["--cpu-period", "10000", "--cpu-quota", "20000"]),
    (0.05, ["--cpu-period", "20000", "--cpu-quota", "1000"]),  # the kernel's 1 ms minimum quota
    (0.01, ["--cpu-period", "100000", "--cpu-quota", "1000"]),
])
def test_a_quota_is_given_in_short_periods(cpus, args):
    import node_limits

    assert node_limits.cpu_args(cpus) == args
    assert quota_of(args) == cpus


def _instructions(containerfile: str) -> list[list[str]]:
    """A Containerfile's instructions as word lists (continuation lines joined, comments left out)."""
    text = re.sub(r"\\\n", " ", "\n".join(line for line in containerfile.splitlines()
                                           if not line.lstrip().startswith("#")))
    return [line.split() for line in text.splitlines() if line.strip()]


def test_the_lab_image_carries_ubuntus_etc_environment_with_the_sbin_folders(lab):
    """Ubuntu puts the sbin folders on every login's PATH (SSH included) through /etc/environment;
    Debian, the lab image's base, has no such file. The image carries Ubuntu's (issue 27 item 17)."""
    steps = _instructions((lab.RECIPE_DIR / "Containerfile").read_text())
    assert ["COPY", "environment", "/etc/environment"] in steps, steps
    chmod = next(s for s in steps if s[:3] == ["RUN", "chmod", "0644"])
    assert "/etc/environment" in chmod, chmod
    values = dict(shlex.split(line)[0].split("=", 1)
                  for line in (lab.RECIPE_DIR / "environment").read_text().splitlines() if line.strip())
    path = values["PATH"].split(":")
    for folder in ("/usr/local/sbin", "/usr/sbin", "/sbin", "/usr/local/bin", "/usr/bin", "/bin"):
        assert folder in path, (folder, path)


def test_the_product_does_not_depend_on_etc_environment():
    """Laptops with another PATH (Debian, a trimmed /etc/environment) run the same roles: no role,
    playbook, plugin or node program reads /etc/environment (a tool in sbin runs with become and
    ddp_lab_system_path: tests/test_system_tools.py, tests/test_bench_qdisc.py)."""
    root = Path(__file__).resolve().parents[1]
    files = [*root.glob("*.yml"), *(p for d in ("roles", "playbooks", "collections", "train")
                                    for p in (root / d).rglob("*") if p.is_file() and p.suffix != ".pyc")]
    assert len(files) > 50, "the scan found almost nothing: is it broken?"
    readers = [f"{p.relative_to(root)}:{n}" for p in files
               for n, line in enumerate(p.read_text(errors="replace").splitlines(), 1)
               if "/etc/environment" in line.split("#", 1)[0]]  # comments may name it
    assert readers == [], readers


def test_a_podman_that_hangs_is_a_lab_error_naming_the_command(monkeypatch):
    """Every caller handles LabError (lab.py's commands, the benchmarks): a podman call that runs
    out of its timeout is one, not a subprocess.TimeoutExpired traceback."""
    import subprocess

    import lab

    def hung(argv, **kw):
        raise subprocess.TimeoutExpired(argv, kw["timeout"])

    monkeypatch.setattr(lab.shutil, "which", lambda name: "/usr/bin/podman")
    monkeypatch.setattr(lab.subprocess, "run", hung)
    with pytest.raises(lab.LabError, match=r"`podman exec laptop-a true` did not finish in 5 s") as err:
        lab.podman("exec", "laptop-a", "true", check=False, timeout=5)
    assert "\n" not in str(err.value)
