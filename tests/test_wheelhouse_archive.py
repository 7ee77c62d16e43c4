"""The wheelhouse goes to a node in one transfer (issue 25 item 5): the controller packs it into one
uncompressed tar with the manifest (SHA256SUMS) as its last member (``ddplab.controller.wheelhouse
pack``, roles/python_env/tasks/wheelhouse.yml) and each node unpacks it (tasks/copy.yml,
``ansible.builtin.unarchive``) when its own manifest differs. Before, ``ansible.builtin.copy`` ran
once per wheel and node (28 wheels x 3 nodes: the largest part of provisioning in CI). Shown with
hand-made wheels on this machine as the node (``-c local``)."""

from __future__ import annotations

import hashlib
import json
import re
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import yaml
from ddplab.controller import wheelhouse
from labharness import ansible_env, recap, run_playbooks
from test_wheelhouse_markers import NODE_312, make_wheel

REPO = Path(__file__).resolve().parents[1]
TORCH = yaml.safe_load((REPO / "roles/python_env/defaults/main.yml").read_text())["python_env_torch_version"]
NODE = {**NODE_312, "python_version": f"{sys.version_info[0]}.{sys.version_info[1]}",
        "python_full_version": ".".join(map(str, sys.version_info[:3])),
        "implementation_version": ".".join(map(str, sys.version_info[:3]))}  # fmt: skip
CP = f"cp{sys.version_info[0]}{sys.version_info[1]}"


def _manifest(folder: Path) -> list[str]:
    return [f"{hashlib.sha256(w.read_bytes()).hexdigest()}  {w.name}" for w in sorted(folder.glob("*.whl"))]


def _wheels(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    make_wheel(folder, "ddplabt-a", "1.0", ["ddplabt-b"])
    make_wheel(folder, "ddplabt-b", "1.0", [])
    return folder


def test_pack_puts_the_wheels_then_the_manifest_owned_by_root(tmp_path):
    folder = _wheels(tmp_path / "wh")
    archive = tmp_path / "wh.tar"
    manifest = _manifest(folder)
    assert wheelhouse.pack(folder, manifest, archive) is True
    with tarfile.open(archive, "r:") as tar:
        members = tar.getmembers()
        assert [m.name for m in members] == [*(line.split("  ")[1] for line in manifest), "SHA256SUMS"]
        assert all(m.isfile() and m.uid == 0 and m.gid == 0 and m.mode == 0o644 for m in members)
        assert tar.extractfile("SHA256SUMS").read().decode() == "".join(f"{x}\n" for x in manifest)
        assert tar.extractfile(members[0]).read() == (folder / members[0].name).read_bytes()
    assert not list(tmp_path.glob(".wh.tar.*")), "the temporary file is renamed, not left behind"

    written = archive.stat().st_mtime_ns
    assert wheelhouse.pack(folder, manifest, archive) is False  # the same manifest: left as it is
    assert archive.stat().st_mtime_ns == written

    make_wheel(folder, "ddplabt-c", "1.0", [])
    assert wheelhouse.pack(folder, _manifest(folder), archive) is True
    with tarfile.open(archive, "r:") as tar:
        assert "ddplabt_c-1.0-py3-none-any.whl" in tar.getnames()


def test_pack_refuses_a_line_that_is_no_manifest_line_and_a_missing_wheel(tmp_path):
    folder = _wheels(tmp_path / "wh")
    with pytest.raises(ValueError, match="not a manifest line"):
        wheelhouse.pack(folder, ["abc  ddplabt_a-1.0-py3-none-any.whl"], tmp_path / "x.tar")
    with pytest.raises(FileNotFoundError, match="not in the wheelhouse"):
        wheelhouse.pack(folder, [f"{'0' * 64}  gone-1.0-py3-none-any.whl"], tmp_path / "x.tar")
    assert not (tmp_path / "x.tar").exists()
    cli = [sys.executable, "-m", "ddplab.controller.wheelhouse", "pack", "--dest", str(folder), "--archive",
           str(tmp_path / "y.tar")]  # fmt: skip
    bad = subprocess.run(cli, input="abc  x.whl\n", capture_output=True, text=True, check=False)
    assert bad.returncode == 1 and json.loads(bad.stdout)["error"].startswith("not a manifest line"), bad
    good = subprocess.run(cli, input="\n".join(_manifest(folder)), capture_output=True, text=True,
                          check=False)  # fmt: skip
    assert good.returncode == 0, good.stderr
    mb = round((tmp_path / "y.tar").stat().st_size / 1e6, 1)
    assert json.loads(good.stdout) == {"changed": True, "archive": str(tmp_path / "y.tar"), "wheels": 2,
                                       "mb": mb, "label": f"2 wheels, {mb} MB"}  # fmt: skip


def _play(tmp_path: Path, name: str, build: bool) -> Path:
    """wheelhouse.yml (when ``build``) then copy.yml, this machine as the node."""
    play = tmp_path / f"{name}.yml"
    build_tasks = [{"name": "Build",
                    "ansible.builtin.include_role": {"name": "python_env", "tasks_from": "wheelhouse"}}]
    play.write_text(yaml.safe_dump([{
        "name": "The wheelhouse to this machine as the node", "hosts": "localhost", "gather_facts": False,
        "tasks": [
            {"name": "The node's Python", "ansible.builtin.set_fact": {
                "__python_env_node": {"version": NODE["python_full_version"], "machine": "x86_64",
                                      "libc": ["glibc", "2.36"], "markers": NODE}}},
            *(build_tasks if build else []),
            {"name": "Copy", "ansible.builtin.include_role": {"name": "python_env", "tasks_from": "copy"}},
        ]}]))  # fmt: skip
    return play


def test_the_node_gets_the_wheelhouse_in_one_transfer_and_a_second_run_changes_nothing(tmp_path):
    """The first run builds the controller's wheelhouse and archive and copies it; the others run
    copy.yml alone with what wheelhouse.yml publishes (the manifest, the archive)."""
    src = _wheels(tmp_path / "index")
    node_dir = tmp_path / "node"
    extra = {
        "__python_env_requirements": ["ddplabt-a==1.0"],
        "python_env_wheelhouse_dir": str(tmp_path / "controller"),
        "python_env_wheelhouse_pip_args": ["--no-index", "--find-links", str(src)],
        "python_env_node_wheelhouse_dir": str(node_dir),
        "ansible_python_interpreter": sys.executable,
        "ansible_become_method": "su",
    }
    env = dict(ansible_env(), ANSIBLE_BECOME_ALLOW_SAME_USER="0")

    def run(play: Path, *args: str, **more: object) -> str:
        rc, out = run_playbooks(env, "localhost,", [str(play)], "-c", "local", "-e",
                                json.dumps({**extra, **more}),
                                *args, timeout=300)  # fmt: skip
        assert rc == 0, out[-3000:]
        return out

    target = node_dir / f"{TORCH}-{CP}"
    out = run(_play(tmp_path, "build-copy", build=True))
    controller = tmp_path / "controller" / f"{TORCH}-{CP}"
    assert re.search(r"Copy the wheelhouse to the node in one archive, 2 wheels, [\d.]+ MB", out), out[-3000:]
    assert sorted(p.name for p in target.iterdir()) == [
        "SHA256SUMS", "ddplabt_a-1.0-py3-none-any.whl", "ddplabt_b-1.0-py3-none-any.whl"]  # fmt: skip
    assert (target / "SHA256SUMS").read_text() == "".join(f"{x}\n" for x in _manifest(controller))
    assert all((p.stat().st_mode & 0o777) == 0o644 and p.stat().st_uid == 0 for p in target.iterdir())

    archive = controller.parent / f"{controller.name}.tar"
    mb = round(archive.stat().st_size / 1e6, 1)
    published = {"__python_env_manifest": _manifest(controller),
                 "__python_env_archive": {"archive": str(archive), "wheels": 2, "mb": mb,
                                          "label": f"2 wheels, {mb} MB"}}  # fmt: skip
    copy = _play(tmp_path, "copy", build=False)
    out = run(copy, **published)  # current: nothing transferred, nothing changed (molecule's idempotence)
    assert recap(out)["localhost"]["changed"] == 0, out[-3000:]

    fresh = tmp_path / "fresh"  # a node without the wheelhouse: nothing made or sent there; both would be
    out = run(copy, "--check", **published, python_env_node_wheelhouse_dir=str(fresh))
    assert not fresh.exists() and recap(out)["localhost"]["changed"] == 2, out[-3000:]
    would = r"localhost: would copy the wheelhouse \S+\.tar \(2 wheels, [\d.]+ MB\) to"
    assert re.search(would, out), out[-3000:]

    (target / "SHA256SUMS").write_text("stale\n")  # e.g. another numpy pin: the folder exists
    out = run(copy, "--check", **published)
    assert recap(out)["localhost"]["changed"] == 1, out[-3000:]
    assert (target / "SHA256SUMS").read_text() == "stale\n" and re.search(would, out), out[-3000:]
    run(copy, **published)
    assert (target / "SHA256SUMS").read_text() == "".join(f"{x}\n" for x in _manifest(controller))
