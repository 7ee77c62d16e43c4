"""reset.yml: refused without -e reset_confirm=yes before any node is contacted; --check lists what
it would remove and changes nothing (a local "laptop" whose provisioned files live in a temporary
tree, a fake systemctl); the snapshot comparison molecule/default's side_effect.yml uses
(molecule/resources/snapshot.py)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import snapshot

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
PLAYBOOK = shutil.which("ansible-playbook", path=str(BIN)) or shutil.which("ansible-playbook")
needs_ansible = pytest.mark.skipif(PLAYBOOK is None, reason="ansible-playbook is not installed (make venv)")

FAKE_SYSTEMCTL = """#!/bin/sh
# Every unit is unknown: nothing to stop, reload or unmask.
echo "$*" >> "$FAKE_SYSTEMCTL_LOG"
[ "$1" = show ] && { echo "LoadState=not-found"; echo "ActiveState=inactive"; exit 0; }
exit 0
"""




def _env(tmp_path: Path) -> dict[str, str]:
    fakebin = tmp_path / "bin"
    fakebin.mkdir()
    (fakebin / "systemctl").write_text(FAKE_SYSTEMCTL)
    (fakebin / "systemctl").chmod(0o755)
    env = dict(os.environ, ANSIBLE_CONFIG=str(ROOT / "ansible.cfg"), ANSIBLE_NOCOLOR="1",
               ANSIBLE_LOCAL_TEMP=str(tmp_path / "tmp"), ANSIBLE_HOME=str(tmp_path / "home"),
               FAKE_SYSTEMCTL_LOG=str(tmp_path / "systemctl.log"))
    env["PATH"] = f"{fakebin}:{BIN}:{env.get('PATH', '')}"
    return env


def _play(tmp_path: Path, inventory: dict, *args: str, env: dict | None = None
          ) -> subprocess.CompletedProcess:
    inv = tmp_path / "hosts.yml"
    inv.write_text(json.dumps(inventory))
    return subprocess.run([PLAYBOOK, "-i", str(inv), str(ROOT / "reset.yml"), *args], capture_output=True,
                          text=True, env={**_env(tmp_path), **(env or {})}, timeout=300, cwd=ROOT)


UNREACHABLE = {"all": {"children": {
    "trainers": {"hosts": {"laptop-off": {
        "ansible_host": "192.0.2.1", "ansible_connection": "ssh",
        "ansible_ssh_common_args": "-o ConnectTimeout=2 -o ControlMaster=no"}}},
    "rendezvous": {"hosts": {"controller-off": {"ansible_host": "192.0.2.2", "ansible_connection": "ssh"}}},
}}}


@needs_ansible
@pytest.mark.parametrize("extra", [[], ["-e", "reset_confirm=no"], ["-e", "reset_confirm="]])
def test_refused_without_confirmation_before_any_node_is_contacted(tmp_path, extra):
    r = _play(tmp_path, UNREACHABLE, *extra)
    out = r.stdout + r.stderr
    assert r.returncode != 0, out
    assert "run again with -e reset_confirm=yes" in out, out
    assert "UNREACHABLE" not in out and "192.0.2" not in out, out  # no node was contacted
    assert "laptop-off" not in out, out


def _provisioned_tree(tmp_path: Path) -> tuple[dict, dict[str, Path]]:
    """A local trainer whose provisioned files live under tmp_path/node; returns the inventory and
    the paths the reset must list."""
    n = tmp_path / "node"
    paths = {
        "fact": n / "etc/ansible/facts.d/ddp_lab.fact",
        "logind": n / "etc/systemd/logind.conf.d/zz-ddp-lab-power.conf",
        "logind_old": n / "etc/systemd/logind.conf.d/ddp-lab-power.conf",
        "nm": n / "etc/NetworkManager/conf.d/zz-ddp-lab-wifi-powersave.conf",
        "nm_old": n / "etc/NetworkManager/conf.d/ddp-lab-wifi-powersave.conf",
        "venv": n / "opt/ddp-lab/venv",
        "wheelhouse": n / "opt/ddp-lab/wheelhouse",
        "state": n / "var/lib/ddp-lab",
        "src": n / "opt/ddp-lab/src",
    }
    for key, p in paths.items():
        if key in ("venv", "wheelhouse", "state", "src"):
            (p / "keep").mkdir(parents=True)
        else:
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_text("x\n")
    (n / "etc/NetworkManager/conf.d/default-wifi-powersave-on.conf").write_text("[connection]\n")
    local = {"ansible_connection": "local", "ansible_python_interpreter": sys.executable,
             "ansible_become_method": "su"}
    inv = {"all": {"children": {
        "trainers": {"hosts": {"laptop-a": {
            **local,
            "ddp_lab_user": "ddp-reset-test-nouser",
            "ddp_lab_base_dir": str(paths["state"]), "ddp_job_src_dir": str(paths["src"]),
            "python_env_prefix": str(paths["venv"]),
            "python_env_node_wheelhouse_dir": str(paths["wheelhouse"]),
            "power_logind_dropin": str(paths["logind"]), "power_sleep_targets": [],
            "wifi_powersave_nm_dropin": str(paths["nm"]), "wired_network_fact_file": str(paths["fact"]),
            "cpu_governor_unit": "ddp-reset-test-none.service", "cpu_governor_conflicting_units": [],
            "firewall_ufw_conf": str(n / "etc/ufw/ufw.conf")}}},
        "rendezvous": {"hosts": {"controller": {
            **local, "rendezvous_address": "127.0.0.1", "rendezvous_port": 29498,
            "rendezvous_state_dir": str(tmp_path / "rdzv"),
            "firewall_ufw_conf": str(n / "etc/ufw/ufw.conf")}}},
    }}}
    return inv, paths


def _would_remove(json_out: str, host: str) -> list[str]:
    """The paths of the changed file tasks of ``host`` in ansible.posix.json's output."""
    out = []
    for play in json.loads(json_out)["plays"]:
        for task in play["tasks"]:
            res = task["hosts"].get(host, {})
            for r in res.get("results", [res]):
                if r.get("changed") and r.get("path"):
                    out.append(r["path"])
    return out


@needs_ansible
def test_check_lists_what_it_would_remove_and_changes_nothing(tmp_path):
    inv, paths = _provisioned_tree(tmp_path)
    before = sorted(str(p) for p in (tmp_path / "node").rglob("*"))
    env_json = {"ANSIBLE_STDOUT_CALLBACK": "ansible.posix.json",
                "ANSIBLE_CALLBACKS_ENABLED": "ansible.posix.json"}
    r = _play(tmp_path, inv, "--check", env=env_json)  # no confirmation needed to list
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr
    listed = _would_remove(r.stdout, "laptop-a")
    expected = [str(p) for p in paths.values()] + [
        str(tmp_path / "node/etc/ansible/facts.d"), str(tmp_path / "node/etc/ansible"),
        str(tmp_path / "node/etc/systemd/logind.conf.d")]
    assert sorted(set(listed)) == sorted(expected), listed
    # a folder that holds something else stays (NetworkManager's conf.d, the state's parent)
    assert str(tmp_path / "node/etc/NetworkManager/conf.d") not in listed
    assert "would be reset (--check: nothing changed" in r.stdout
    assert sorted(str(p) for p in (tmp_path / "node").rglob("*")) == before  # nothing removed
    log = (tmp_path / "systemctl.log").read_text() if (tmp_path / "systemctl.log").exists() else ""
    assert not re.search(r"^(stop|reload|restart|reset-failed|unmask|disable)", log, re.M), log


@needs_ansible
def test_check_lists_the_running_store_and_lighthouse_and_stops_neither(tmp_path):
    """newcomer, 2026-12-01: reset.yml --check during a per_step job did not list the running
    lighthouse (nor, under torchelastic, the store) as something it would stop: the stop command
    was skipped in check mode. Two live stand-in supervisors (pidfiles in the state folder)."""
    import psutil

    inv, _ = _provisioned_tree(tmp_path)
    controller = inv["all"]["children"]["rendezvous"]["hosts"]["controller"]
    controller["rendezvous_lighthouse_port"] = 29497
    rdzv = tmp_path / "rdzv"
    rdzv.mkdir()
    procs = []
    try:
        for name, port in (("store", 29498), ("lighthouse", 29497)):
            proc = subprocess.Popen(["sleep", "infinity"])  # ended below: a play may outlast any sleep
            procs.append(proc)
            (rdzv / f"{name}-{port}.json").write_text(json.dumps({
                "host": "127.0.0.1", "port": port, "supervisor_pid": proc.pid,
                "supervisor_ctime": psutil.Process(proc.pid).create_time()}))
        env_json = {"ANSIBLE_STDOUT_CALLBACK": "ansible.posix.json",
                    "ANSIBLE_CALLBACKS_ENABLED": "ansible.posix.json"}
        r = _play(tmp_path, inv, "--check", env=env_json)
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr
        listed = [item["item"]["module"] for play in json.loads(r.stdout)["plays"] for task in play["tasks"]
                  if task["task"]["name"].endswith("Stop the rendezvous store and the lighthouse")
                  for item in task["hosts"]["controller"].get("results", []) if item.get("changed")]
        assert listed == ["rdzv_store", "lighthouse"], r.stdout[-3000:]
        assert all(p.poll() is None for p in procs), "--check stopped a service"
        assert sorted(f.name for f in rdzv.iterdir()) == ["lighthouse-29497.json", "store-29498.json"]
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


def test_compare_finds_what_a_reset_left_and_ignores_new_packages_files():
    before = {"files": {"/etc": ["dir", 0o755, 0, 0, None], "/etc/hosts": ["file", 0o644, 0, 0, "aa"]},
              "users": ["root"], "groups": ["root:"], "unit_files": {"sleep.target": "static"},
              "transient_units": [], "iptables": {"iptables-save": ["*filter"]}, "governors": {},
              "packages": ["base"], "package_files": {"/etc/hosts": "base"}}
    after = json.loads(json.dumps(before))
    assert snapshot.compare(before, after) == ([], [])
    after["files"]["/etc/acl.conf"] = ["file", 0o644, 0, 0, "bb"]  # owned by a package installed since
    after["package_files"]["/etc/acl.conf"] = "acl"
    after["packages"].append("acl")
    assert snapshot.compare(before, after) == ([], ["acl"])
    after["files"]["/etc/hosts"][4] = "cc"
    after["files"]["/etc/ansible"] = ["dir", 0o755, 0, 0, None]
    after["users"].append("ddp")
    after["unit_files"]["sleep.target"] = "masked"
    after["transient_units"].append("ddp-lab-agent.service")
    diffs, pkgs = snapshot.compare(before, after)
    assert pkgs == ["acl"]
    assert diffs == [
        "file: /etc/ansible: None -> ['dir', 493, 0, 0, None]",
        "file: /etc/hosts: ['file', 420, 0, 0, 'aa'] -> ['file', 420, 0, 0, 'cc']",
        "users: added ddp",
        "transient_units: added ddp-lab-agent.service",
        "unit file: sleep.target: static -> masked",
    ]
    del after["packages"][0]
    assert "packages: removed base" in snapshot.compare(before, after)[0]


def test_take_scans_a_tree_and_skips_churn(tmp_path, monkeypatch):
    (tmp_path / "etc/ansible").mkdir(parents=True)
    (tmp_path / "etc/ansible/x.fact").write_text("{}")
    (tmp_path / "etc/ld.so.cache").write_text("churn")
    (tmp_path / "etc/link").symlink_to("ansible")
    monkeypatch.setattr(snapshot, "ROOTS", (str(tmp_path / "etc"),))
    monkeypatch.setattr(snapshot, "IGNORE", ("*/ld.so.cache",))
    files = snapshot._files()
    assert files[str(tmp_path / "etc/link")][0::4] == ["link", "ansible"]
    assert files[str(tmp_path / "etc/ansible")][0] == "dir"
    assert files[str(tmp_path / "etc/ansible/x.fact")][4] == (
        "44136fa355b3678a1146ad16f7e8649e94fb4fc21fe77e8310c060f61caaff8a")
    assert str(tmp_path / "etc/ld.so.cache") not in files


def test_an_empty_accept_table_counts_as_no_table():
    empty = ("# Generated\n*filter\n:INPUT ACCEPT [3:180]\n:FORWARD ACCEPT [0:0]\n:OUTPUT ACCEPT [1:60]\n"
             "COMMIT\n")
    assert snapshot.rules_of(empty) == []
    assert snapshot.rules_of("") == []
    rule = "*filter\n:INPUT ACCEPT [0:0]\n-A INPUT -p tcp --dport 29400 -j ACCEPT\nCOMMIT\n"
    assert snapshot.rules_of(empty + rule) == [
        "*filter", ":INPUT ACCEPT", "-A INPUT -p tcp --dport 29400 -j ACCEPT", "COMMIT"]
    assert snapshot.rules_of("*filter\n:INPUT ACCEPT [0:0]\n:ddp - [0:0]\nCOMMIT\n") != []  # a new chain
    assert snapshot.rules_of("*filter\n:INPUT DROP [0:0]\nCOMMIT\n") == ["*filter", ":INPUT DROP", "COMMIT"]


FAKE_SYSTEMCTL_JOB = """#!/bin/sh
# The agent unit runs a job (invocation inv-r1); every other unit is unknown.
echo "$*" >> "$FAKE_SYSTEMCTL_LOG"
if [ "$1" = show ] && [ "$2" = ddp-lab-agent ]; then
  printf 'LoadState=loaded\\nActiveState=active\\nSubState=running\\nResult=success\\n'
  printf 'ExecMainStatus=0\\nMainPID=4242\\nInvocationID=inv-r1\\n'
  exit 0
fi
[ "$1" = show ] && { echo "LoadState=not-found"; echo "ActiveState=inactive"; exit 0; }
exit 0
"""


@needs_ansible
@pytest.mark.skipif(os.geteuid() != 0, reason="the job's files are read as ddp_lab_user (root here)")
def test_check_during_a_job_names_the_run_it_would_stop(tmp_path):
    """newcomer, session 8: reset.yml --check while a job ran listed the agent's stop as a change
    but never said which run it would stop. The node's agent runs run 20261201-120000-aaaa (its
    unit's invocation is in the run's invocations; the node's current_run names it)."""
    inv, paths = _provisioned_tree(tmp_path)
    run_id = "20261201-120000-aaaa"
    host = inv["all"]["children"]["trainers"]["hosts"]["laptop-a"]
    host.update({"ddp_lab_user": "root", "ddp_job_runs_dir": str(tmp_path / "runs")})
    (tmp_path / "runs").mkdir()
    run = paths["state"] / "runs" / run_id
    (run / "metrics").mkdir(parents=True)
    (run / "invocations").write_text("inv-r1\n")
    (paths["state"] / "current_run").write_text(f"{run_id}\n")
    t = time.time()
    records = [{"event": "start", "time": t - 20, "host": "laptop-a", "rank": 0, "local_rank": 0,
                "world_size": 1, "restart_count": 0, "run_id": run_id, "max_steps": 100},
               {"event": "step", "time": t - 10, "host": "laptop-a", "rank": 0, "local_rank": 0,
                "world_size": 1, "restart_count": 0, "step": 7, "loss": 3.1}]
    (run / "metrics" / "laptop-a-local0.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (paths["venv"] / "bin").mkdir(parents=True)
    (paths["venv"] / "bin" / "python").symlink_to(sys.executable)  # ddplab.status from the checkout
    fakebin = tmp_path / "jobbin"
    fakebin.mkdir()
    (fakebin / "systemctl").write_text(FAKE_SYSTEMCTL_JOB)
    (fakebin / "systemctl").chmod(0o755)
    env = {"PATH": f"{fakebin}:{BIN}:{os.environ.get('PATH', '')}",
           "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT / "train"), os.environ.get("PYTHONPATH")) if p)}
    r = _play(tmp_path, inv, "--check", env=env)
    text = r.stdout + r.stderr
    assert r.returncode == 0, text[-4000:]
    assert f"would stop run {run_id} on laptop-a (--check: nothing was stopped)" in text, text[-4000:]
    assert "laptop-a: would be reset (--check: nothing changed" in text, text[-4000:]
    assert run.is_dir() and (paths["venv"] / "bin" / "python").exists()  # nothing removed
    log = (tmp_path / "systemctl.log").read_text()
    assert not re.search(r"^(stop|reload|restart|reset-failed|unmask|disable)", log, re.M), log


def test_stopped_jobs_follow_ddp_jobs_rule_of_whose_agent_ran():
    """reset names the runs of the hosts module_utils.hostvars.agent_ran_hosts names (the rule stopped.yml
    records the stop with): a "True" from a template counts, a host without the fact or unknown
    to hostvars does not."""
    from ansible_collections.ddp_lab.cluster.plugins.filter import reset
    from ansible_collections.ddp_lab.cluster.plugins.module_utils.hostvars import agent_ran_hosts

    hostvars = {"a": {"__ddp_job_agent_runs": "True", "ddp_job_status": {"progress": {"run_id": "r1"}}},
                "b": {"__ddp_job_agent_runs": True, "ddp_lab_run_id": "r1"},
                "c": {"__ddp_job_agent_runs": False}, "d": {}}
    hosts = ["a", "b", "c", "d", "gone"]
    assert agent_ran_hosts(hosts, hostvars) == ["a", "b"]
    assert reset.reset_stopped_jobs(hosts, hostvars, True) == [
        "would stop run r1 on a, b (--check: nothing was stopped)"]
    assert reset.reset_stopped_jobs(["c", "d"], hostvars) == []
