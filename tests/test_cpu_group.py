"""lab/cpu-group.sh: `make test` runs its unit-test and lint lanes each in a cpu cgroup of their own
so that the molecule scenarios' containers (podman's libpod_parent) get their share of a busy
cgroup-v1 host."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import uuid
from pathlib import Path

import pytest
from conftest import REPO

SCRIPT = REPO / "lab" / "cpu-group.sh"
CPU = Path("/sys/fs/cgroup/cpu")
V1 = os.access(CPU / "cgroup.procs", os.W_OK)


def cpu_cgroup_line(out: str) -> str:
    return next(line for line in out.splitlines() if line.split(":")[1].split(",").count("cpu"))


@pytest.mark.skipif(not V1, reason="needs a writable cgroup-v1 cpu hierarchy (root on a v1 host)")
def test_the_command_runs_in_its_group_with_its_shares_and_the_group_goes_after():
    name = f"ddp-lab-probe-{uuid.uuid4().hex[:8]}"
    res = subprocess.run([str(SCRIPT), name, "512", "sh", "-c",
                          f"cat /proc/self/cgroup; cat {CPU / name / 'cpu.shares'}; exit 3"],
                         capture_output=True, text=True, timeout=30)
    assert res.returncode == 3, res.stderr  # the command's status
    assert cpu_cgroup_line(res.stdout).endswith(f":/{name}")
    assert res.stdout.splitlines()[-1] == "512"
    assert not (CPU / name).exists()


def test_without_a_cgroup_hierarchy_it_may_use_the_command_runs_as_is():
    """Not root (or cgroup v2): no group, the same command and status (as nobody, from a copy
    of the script that nobody can read wherever the checkout is)."""
    with tempfile.TemporaryDirectory(dir="/tmp") as tmp:
        os.chmod(tmp, 0o755)
        script = Path(tmp) / SCRIPT.name
        shutil.copy(SCRIPT, script)
        os.chmod(script, 0o755)
        res = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", str(script),
                              "ddp-lab-probe-nobody", "512", "sh", "-c", "echo ran; exit 4"],
                             capture_output=True, text=True, timeout=30, cwd="/")
    assert (res.returncode, res.stdout, res.stderr) == (4, "ran\n", "")
    assert not (CPU / "ddp-lab-probe-nobody").exists()


def test_too_few_arguments_is_one_line():
    res = subprocess.run([str(SCRIPT), "name", "512"], capture_output=True, text=True, timeout=30)
    assert res.returncode == 2 and res.stderr.count("\n") == 1 and "usage" in res.stderr
