"""ddplab.cpushare: a process's CPU share (cgroup v1/v2 limits over its cgroup and ancestors,
affinity, physical cores) and the thread rule, on fake /proc and cgroup trees; and the rule as the
training program applies it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import read_metrics
from ddplab import cpushare

LIBPOD = "/libpod_parent/libpod-45c2"


def fake_proc(tmp_path: Path, mountinfo: list[str], cgroup: list[str]) -> Path:
    proc = tmp_path / "proc"
    proc.mkdir()
    (proc / "mountinfo").write_text("\n".join(mountinfo) + "\n")
    (proc / "cgroup").write_text("\n".join(cgroup) + "\n")
    return proc


def v1_level(folder: Path, quota: int, period: int = 100000) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "cpu.cfs_quota_us").write_text(f"{quota}\n")
    (folder / "cpu.cfs_period_us").write_text(f"{period}\n")


def v2_level(folder: Path, text: str) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "cpu.max").write_text(text + "\n")


def v1_mount(point: Path, root: str = "/", opts: str = "rw,cpu") -> str:
    return f"89 88 0:29 {root} {point} ro,nosuid,nodev,noexec,relatime - cgroup cgroup {opts}"


def v2_mount(point: Path, root: str = "/") -> str:
    return f"30 23 0:26 {root} {point} rw,nosuid,nodev,noexec,relatime shared:4 - cgroup2 cgroup2 rw"


def test_a_lab_container_reads_its_own_cgroup_as_the_mount_root(tmp_path):
    """cgroup v1 inside a podman container (this machine's lab): /proc/self/cgroup names the host's
    path, the mount shows that cgroup as its root; a systemd unit's sub-cgroup has no limit."""
    cpu = tmp_path / "sys/fs/cgroup/cpu"
    v1_level(cpu, 60000)
    v1_level(cpu / "system.slice" / "ddp-lab-agent.service", -1)
    v1_level(cpu / "system.slice", -1)
    acct = tmp_path / "sys/fs/cgroup/cpuacct"
    proc = fake_proc(
        tmp_path,
        [v1_mount(cpu, LIBPOD), v1_mount(acct, LIBPOD, "rw,cpuacct")],
        [f"2:cpuacct:{LIBPOD}/system.slice/ddp-lab-agent.service",
         f"1:cpu:{LIBPOD}/system.slice/ddp-lab-agent.service", f"0::{LIBPOD}"],
    )
    limit, source = cpushare.cgroup_limit(proc)
    assert limit == pytest.approx(0.6)
    assert source == str(cpu / "cpu.cfs_quota_us")


def test_the_tightest_level_wins_and_a_period_other_than_100ms_counts(tmp_path):
    """cgroup v1 with cpu,cpuacct joined (Ubuntu's v1 layout): a unit limit under a slice limit."""
    cpu = tmp_path / "cpu,cpuacct"
    v1_level(cpu, -1)
    v1_level(cpu / "user.slice", 150000)
    v1_level(cpu / "user.slice" / "job.service", 25000, period=50000)  # 0.5 CPU
    proc = fake_proc(tmp_path, [v1_mount(cpu, "/", "rw,cpu,cpuacct")],
                     ["4:cpu,cpuacct:/user.slice/job.service"])
    assert cpushare.cgroup_limit(proc) == (0.5, str(cpu / "user.slice/job.service/cpu.cfs_quota_us"))


def test_cgroup_v2_cpu_max_of_a_unit_and_max_means_no_limit(tmp_path):
    """An Ubuntu laptop (cgroup v2): a unit with CPUQuota=150% has cpu.max "150000 100000"."""
    root = tmp_path / "sys/fs/cgroup"
    v2_level(root / "system.slice", "max 100000")
    v2_level(root / "system.slice/ddp-lab-agent.service", "150000 100000")
    mount = [v2_mount(root)]
    proc = fake_proc(tmp_path, mount, ["0::/system.slice/ddp-lab-agent.service"])
    assert cpushare.cgroup_limit(proc)[0] == pytest.approx(1.5)
    (root / "system.slice/ddp-lab-agent.service/cpu.max").write_text("max 100000\n")
    assert cpushare.cgroup_limit(proc) == (None, None)


def test_no_cgroup_filesystem_means_no_limit(tmp_path):
    proc = fake_proc(tmp_path, ["22 1 0:21 / /proc rw - proc proc rw"], ["0::/"])
    assert cpushare.cgroup_limit(proc) == (None, None)
    assert cpushare.cgroup_limit(tmp_path / "absent") == (None, None)


def test_a_cgroup_outside_the_mount_reads_the_mount_root(tmp_path):
    """Another cgroup namespace: the process's path is not under the mount's root."""
    cpu = tmp_path / "cpu"
    v1_level(cpu, 30000)
    proc = fake_proc(tmp_path, [v1_mount(cpu, LIBPOD)], ["1:cpu:/elsewhere"])
    assert cpushare.cgroup_limit(proc)[0] == pytest.approx(0.3)


def test_the_share_is_the_least_of_quota_affinity_and_physical_cores(tmp_path, monkeypatch):
    cpu = tmp_path / "cpu"
    v1_level(cpu, 250000)
    proc = fake_proc(tmp_path, [v1_mount(cpu)], ["1:cpu:/"])
    monkeypatch.setattr(cpushare, "affinity", lambda: 8)
    monkeypatch.setattr(cpushare, "physical_cores", lambda: 4)
    share = cpushare.read_share(proc)
    assert (share.share, share.quota, share.affinity, share.physical_cores) == (2.5, 2.5, 8, 4)
    monkeypatch.setattr(cpushare, "affinity", lambda: 2)  # taskset -c 0,1
    assert cpushare.read_share(proc).share == 2.0
    (cpu / "cpu.cfs_quota_us").write_text("-1\n")
    share = cpushare.read_share(proc)
    assert (share.share, share.quota, share.quota_file) == (2.0, None, None)


@pytest.mark.parametrize(
    ("share", "workers", "threads"),
    [(0.3, 1, 1), (0.6, 1, 1), (0.9999999, 1, 1), (1.0, 1, 1), (1.5, 1, 1), (2.0, 1, 2),
     (3.99, 1, 3), (4.0, 2, 2), (3.0, 2, 1), (1.0, 4, 1), (8, 1, 8)],
)
def test_one_thread_per_whole_cpu_of_share_per_worker_at_least_one(share, workers, threads):
    assert cpushare.threads_for(share, workers) == threads


@pytest.mark.parametrize(
    ("share", "workers"), [(0, 1), (-1, 1), (float("nan"), 1), ("2", 1), (2, 0), (2, True)]
)
def test_the_rule_refuses_bad_input(share, workers):
    with pytest.raises(ValueError, match="share must be|local_workers must be"):
        cpushare.threads_for(share, workers)


def test_run_as_a_bare_script_it_prints_the_share_as_json():
    """The lab runs the file with a bare python3 in a container; Ansible runs it before ddplab is
    installed: no ddplab import, one JSON line."""
    path = Path(cpushare.__file__)
    out = subprocess.run([sys.executable, "-I", str(path), "--local-workers", "1"], capture_output=True,
                         text=True, check=True, cwd="/")
    got = json.loads(out.stdout)
    assert set(got) == {"share", "quota", "quota_file", "affinity", "physical_cores", "threads"}
    assert got["threads"] == cpushare.threads_for(got["share"], 1)
    bad = subprocess.run([sys.executable, "-I", str(path), "--local-workers", "0"], capture_output=True,
                         text=True, cwd="/")
    assert bad.returncode == 2
    assert bad.stderr.strip() == "cpushare: local_workers must be an integer >= 1, got 0"


@pytest.mark.parametrize(("share", "threads"), [(0.6, 1), (2.0, 2)])
def test_the_training_program_follows_the_share_when_threads_is_null(
    share, threads, tmp_path, tiny, data_path, clean_env, monkeypatch
):
    """threads null: torch gets threads_for(the process's share, local workers), the start record
    says so; an explicit threads value still wins."""
    import torch
    from ddplab import train as train_mod


    monkeypatch.setattr(cpushare, "read_share", lambda: cpushare.CpuShare(share, share, "q", 2, 2))
    before = torch.get_num_threads()
    try:
        out = tmp_path / "run"
        assert train_mod.main(tiny(out, data_path, threads="null", max_steps=4, warmup_steps=1,
                                   eval_interval=4, ckpt_interval=4)) == 0
        assert [r["threads"] for r in read_metrics(out) if r["event"] == "start"] == [threads]
        out = tmp_path / "given"
        assert train_mod.main(tiny(out, data_path, threads=3, max_steps=4, warmup_steps=1, eval_interval=4,
                                   ckpt_interval=4)) == 0
        assert [r["threads"] for r in read_metrics(out) if r["event"] == "start"] == [3]
    finally:
        torch.set_num_threads(before)
