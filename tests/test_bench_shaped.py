"""The shaped bench on the lab's path (issue 27 item 17): ``bench.yml -e bench_shape_rate_mbit=1000``
over SSH as the sudo account, whose PATH has no sbin folder, shapes every link (tc runs with become)
and removes the shaping after. Ubuntu's /etc/environment (which the lab image may carry) puts the
sbin folders on every login's PATH; it is moved aside on the nodes for the test, so the PATH the
roles meet is Debian's sshd default, as on a laptop without that file. Asserted on the effective
values: the account's PATH as a fresh SSH session reports it, and the qdisc the kernel shows.

Runs against the nodes of tests/labharness.py (the molecule default scenario's verifier in CI; the
lab, or DDP_LAB_TEST_INVENTORY): they must be provisioned (the training venv)."""

from __future__ import annotations

import contextlib
import json
import subprocess

import pytest
from conftest import dataset_path
from labharness import BINDIR, REPO, free_port, lab_or_skip, node_exec, run_playbooks

ASIDE = "/etc/environment.ddp-lab-test-aside"


@contextlib.contextmanager
def without_etc_environment(lab):
    moved = []
    try:
        for host in lab.trainers:
            if node_exec(lab, host, "test", "-e", "/etc/environment").returncode == 0:
                assert node_exec(lab, host, "mv", "/etc/environment", ASIDE).returncode == 0
                moved.append(host)
        yield
    finally:
        for host in moved:
            node_exec(lab, host, "mv", ASIDE, "/etc/environment")


@pytest.fixture
def lab():
    return lab_or_skip()


def _fresh_ssh(lab) -> dict[str, str]:
    """ansible's environment with SSH sessions of their own (no control master of an earlier
    session, whose environment was set when it logged in)."""
    return dict(lab.env, ANSIBLE_SSH_ARGS="-o ControlMaster=no -o ControlPath=none")


def test_shaped_bench_runs_without_sbin_on_the_accounts_path(lab, tmp_path):
    with without_etc_environment(lab):
        env = _fresh_ssh(lab)
        # the PATH a fresh SSH session of the account gets (the shell module runs `echo $PATH`)
        probe = subprocess.run(
            [str(BINDIR / "ansible"), "-i", lab.inventory, "trainers", "-m", "ansible.builtin.shell",
             "-a", "echo PATH=$PATH"], env=env, capture_output=True, text=True, cwd=REPO, timeout=300)
        assert probe.returncode == 0, probe.stdout + probe.stderr
        paths = [line.split("PATH=", 1)[1].strip().strip('",') for line in probe.stdout.splitlines()
                 if "PATH=" in line and "echo" not in line]
        assert len(paths) == len(lab.trainers) and not any("sbin" in p for p in paths), probe.stdout
        rc, out = run_playbooks(
            env, lab.inventory, [str(REPO / "playbooks" / "bench.yml")],
            "-e", "bench_shape_rate_mbit=1000", "-e", "bench_allreduce=false", "-e", "bench_scaling=false",
            "-e", "bench_links_mb=8", "-e", "bench_links_repeats=1", "-e", "bench_id=shaped-test",
            "-e", f"bench_runs_dir={tmp_path / 'runs'}", "-e", f"rendezvous_port={free_port()}",
            "-e", f"ddp_job_dataset_src={dataset_path()}",
            "-e", f"rendezvous_state_dir={tmp_path / 'rdzv'}", "-e", f"rendezvous_stop_only_under={tmp_path}",
            timeout=1500)
        assert rc == 0, out[-4000:]
        assert "cannot shape" not in out, out[-4000:]
    doc = json.loads((tmp_path / "runs" / "bench-shaped-test" / "bench.json").read_text())
    assert doc["shape_rate_mbit"] == 1000, doc
    for host in lab.trainers:  # the shaping is gone after the bench (the kernel's qdisc)
        qdisc = node_exec(lab, host, "tc", "qdisc", "show", "dev", "eth0", "root").stdout
        assert "tbf" not in qdisc, (host, qdisc)
