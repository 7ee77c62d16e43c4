"""ddp_job's launch under each recovery engine (ddp_job_fault_tolerance), rendered by Ansible from
the role's own defaults and vars: torchelastic stays as it was; per_step is the per-laptop replica
group of docs/CONTRACTS.md "Processes" (own torchrun around a local store, TORCHFT_LIGHTHOUSE, the
engine's run.json keys); the fault role's filters (rejoin compares command lines, the run's engine)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml
from ansible_collections.ddp_lab.cluster.plugins.filter import fault as fault_filters
from labharness import REPO, ansible_env, render_agent_launch, run_playbooks

AGENT = ["/opt/ddp-lab/venv/bin/python", "-m", "ddplab.agent"]
# what both engines pass the same way: the node's own address, restarts, fork, logs, the program
TAIL = [
    "--local-addr",
    "192.168.50.11",
    "--max-restarts",
    "10",
    "--monitor-interval",
    "1",
    "--start-method",
    "fork",
    "--log-dir",
    "/var/lib/ddp-lab/runs/r1/logs",
    "--tee",
    "3",
    "-m",
    "ddplab.train",
    "--config",
    "/var/lib/ddp-lab/runs/r1/run.json",
]
ADDRESS_ENV = ["GLOO_SOCKET_IFNAME=enp3s0", "DDPLAB_GLOO_ADDR=192.168.50.11"]
RUN_ENV = ["OMP_NUM_THREADS=4", "PYTHONUNBUFFERED=1", "LOGLEVEL=INFO"]


def setenv(argv: list[str]) -> list[str]:
    return [argv[i + 1] for i, a in enumerate(argv) if a == "--setenv"]


def test_torchelastic_launch_is_unchanged(tmp_path: Path):
    argv, node_opts, config = render_agent_launch(tmp_path)
    conf = "is_host=false,join_timeout=120,last_call_timeout=3,close_timeout=10,keep_alive_interval=1,"
    conf += "keep_alive_max_attempt=3"
    elastic = (
        "--nnodes 1:2 --nproc-per-node 1 --rdzv-backend c10d --rdzv-endpoint 192.168.50.10:29400 --rdzv-id r1"
    )
    assert argv[argv.index("ddplab.agent") - 2 :] == AGENT + elastic.split() + ["--rdzv-conf", conf] + TAIL
    barrier = ["DDPLAB_AGENT_BARRIER=tok", "DDPLAB_AGENT_BARRIER_NODES=1", "DDPLAB_AGENT_BARRIER_TIMEOUT=120"]
    assert setenv(argv) == ADDRESS_ENV + ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1"] + RUN_ENV + barrier
    assert node_opts == ["--local-addr"]
    assert not [k for k in config if k == "fault_tolerance" or k.startswith("ft_")], config


def test_batch_balance_reaches_run_json_only_when_given(tmp_path: Path):
    """ddp_job_batch_balance -> run.json batch_balance; unset, run.json has none (the training
    program's off; a resume keeps the run's own)."""
    _, _, config = render_agent_launch(tmp_path, "-e", "ddp_job_batch_balance=speed")
    assert config["batch_balance"] == "speed"
    (tmp_path / "unset").mkdir()
    _, _, config = render_agent_launch(tmp_path / "unset")
    assert "batch_balance" not in config, config


def test_per_step_launch_is_one_replica_group_per_laptop(tmp_path: Path):
    argv, node_opts, config = render_agent_launch(tmp_path, "-e", "ddp_job_fault_tolerance=per_step")
    replica = "--nnodes 1 --nproc-per-node 1 --rdzv-backend c10d --rdzv-endpoint 192.168.50.11:29521 "
    replica += "--rdzv-id r1-t-a --rdzv-conf is_host=true"
    assert argv[argv.index("ddplab.agent") - 2 :] == AGENT + replica.split() + TAIL
    ft = ["TORCHFT_LIGHTHOUSE=http://192.168.50.10:29510", "RUST_LOG=warn"]
    assert setenv(argv) == ADDRESS_ENV + RUN_ENV + ft
    assert node_opts == ["--local-addr", "--rdzv-endpoint", "--rdzv-id"]
    # this launch: its one name, the start barrier's token (a rejoin keeps run.json, a resume
    # writes a new one)
    assert config.pop("ft_launch_id") == "tok", config
    assert {k: v for k, v in config.items() if k == "fault_tolerance" or k.startswith("ft_")} == {
        "fault_tolerance": "per_step",
        "ft_lighthouse": "http://192.168.50.10:29510",
        "ft_replica_id": "t-a",
        "ft_manager_port": 29520,
        "ft_min_replicas": 1,
        "ft_timeout_s": 1.5,
        "ft_quorum_timeout_s": 60.0,
        "ft_start_replicas": 2,  # the start barrier waits for every trainer (2 in this inventory)
        "ft_start_timeout_s": 120.0,
        "ft_rejoin_wait_s": 60.0,
    }


def test_per_step_settings_reach_the_launch(tmp_path: Path):
    argv, _, config = render_agent_launch(
        tmp_path,
        "-e",
        "ddp_job_fault_tolerance=per_step",
        "-e",
        "ddp_job_ft_store_port=30001",
        "-e",
        "rendezvous_lighthouse_port=30002",
        "-e",
        "ddp_job_ft_manager_port=30003",
    )
    assert argv[argv.index("--rdzv-endpoint") + 1] == "192.168.50.11:30001"
    assert "TORCHFT_LIGHTHOUSE=http://192.168.50.10:30002" in argv
    assert config["ft_manager_port"] == 30003 and config["ft_lighthouse"] == "http://192.168.50.10:30002"


def test_rejoin_compares_command_lines_without_the_laptops_own_values():
    ours = [
        "py",
        "-m",
        "ddplab.agent",
        "--rdzv-endpoint",
        "10.0.0.2:29521",
        "--rdzv-id",
        "r1-b",
        "--local-addr",
        "10.0.0.2",
        "--max-restarts",
        "10",
    ]
    theirs = [
        "py",
        "-m",
        "ddplab.agent",
        "--rdzv-endpoint",
        "10.0.0.3:29521",
        "--rdzv-id",
        "r1-c",
        "--local-addr",
        "10.0.0.3",
        "--max-restarts",
        "10",
    ]
    opts = ["--local-addr", "--rdzv-endpoint", "--rdzv-id"]
    assert (
        fault_filters.without_options(ours, opts)
        == fault_filters.without_options(theirs, opts)
        == ["py", "-m", "ddplab.agent", "--max-restarts", "10"]
    )
    assert fault_filters.without_options(["a", "--local-addr=1.2.3.4", "b", 7], ["--local-addr"]) == [
        "a",
        "b",
        "7",
    ]
    # another setting is still seen
    assert fault_filters.without_options(ours, opts) != fault_filters.without_options(
        [*theirs[:-1], "3"], opts
    )


def test_run_engine_from_the_nodes_run_json():
    """roles/fault rejoin-launch takes the engine from the node's run.json (the run's one record of
    its settings), not from a second reader of the controller's events.jsonl."""
    assert fault_filters.run_engine({"run_id": "r1", "fault_tolerance": "per_step"}) == "per_step"
    assert fault_filters.run_engine({"run_id": "old", "max_steps": 10}) == "torchelastic"
    assert fault_filters.run_engine({"fault_tolerance": None}) == "torchelastic"
    with pytest.raises(ValueError, match="not one of"):
        fault_filters.run_engine({"fault_tolerance": "bogus"})
    with pytest.raises(ValueError, match="not a JSON object"):
        fault_filters.run_engine(["per_step"])


def test_torchft_pinned_alike_on_controller_and_nodes():
    """The lighthouse (controller venv, requirements-torch.txt) and the replicas (the nodes'
    wheelhouse, roles/python_env) run the same torchft release, and the wheelhouse downloads it."""
    defaults = yaml.safe_load((REPO / "roles/python_env/defaults/main.yml").read_text())
    pins = yaml.safe_load((REPO / "roles/python_env/vars/main.yml").read_text())["__python_env_pins"]
    assert pins["torchft"] == "python_env_torchft_version"
    controller = [ln.strip() for ln in (REPO / "requirements-torch.txt").read_text().splitlines()]
    assert f"torchft=={defaults['python_env_torchft_version']}" in controller
    torch_pin = next(ln for ln in controller if ln.startswith("torch=="))
    assert torch_pin == f"torch=={defaults['python_env_torch_version']}"


def test_every_hosts_run_json_names_the_same_launch(tmp_path: Path):
    """ft_launch_id was now() in a role var, templated per host: each laptop's run.json named
    another launch (a rejoin then missed the group quorum id of its own launch), next to the start
    barrier's own token. It is now that one token, named once (run_once) before run.json is written."""
    main = yaml.safe_load((REPO / "roles/ddp_job/tasks/main.yml").read_text())
    launch = next(t for t in main if "block" in t)["block"]  # up to the agents' start: one block
    order = [t.get("ansible.builtin.import_tasks") for t in launch]
    assert order.index("launch_token.yml") < order.index("ship.yml") < order.index("launch.yml"), order
    local = {"ansible_connection": "local"}
    hosts = {f"t-{c}": {**local, "wired_network_address": f"192.168.50.1{i}"} for i, c in enumerate("abc")}
    inventory = tmp_path / "hosts.yml"
    inventory.write_text(yaml.safe_dump({"all": {"children": {
        "trainers": {"hosts": hosts},
        "rendezvous": {"hosts": {"controller": {**local, "rendezvous_address": "192.168.50.10"}}}}}}))
    play = tmp_path / "render.yml"
    play.write_text(yaml.safe_dump([{
        "name": "Render each host's run.json", "hosts": "trainers", "gather_facts": False,
        "vars_files": [str(REPO / f"roles/{f}/main.yml") for f in ("ddp_lab/defaults", "ddp_job/defaults",
                                                                   "ddp_job/vars")],
        "vars": {"ddp_lab_run_id": "r1", "wired_network_ifname": "enp3s0",
                 "__ddp_job_node": {"cores": 4, "cpu": {"threads": 4}}},
        "tasks": [
            {"name": "As main.yml",
             "ansible.builtin.import_tasks": str(REPO / "roles/ddp_job/tasks/launch_token.yml")},
            {"name": "Print it", "ansible.builtin.debug": {
                "msg": "RUNJSON {{ inventory_hostname }} {{ __ddp_job_config.ft_launch_id }} "
                       "{{ __ddp_job_launch_token }} END"}},
        ],
    }]))
    rc, out = run_playbooks(ansible_env(), str(inventory), [str(play)],
                            "-e", "ddp_job_fault_tolerance=per_step", timeout=120)
    assert rc == 0, out[-3000:]
    found = dict((h, (i, t)) for h, i, t in re.findall(r"RUNJSON (t-\w) (\S+) (\S+) END", out))
    assert sorted(found) == ["t-a", "t-b", "t-c"], out[-3000:]
    assert len(set(found.values())) == 1, found
    ((launch, token),) = set(found.values())
    assert launch == token and re.fullmatch(r"r1-\d{8}T\d{12}", launch), found
