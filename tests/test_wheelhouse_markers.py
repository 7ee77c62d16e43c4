"""The nodes' wheelhouse is resolved for the node's interpreter (issue 27 item 10): pip evaluates
environment markers with the Python that runs it, so a dependency conditioned on the node's Python
version was dropped from the wheelhouse the controller (3.11) built for 3.12 nodes. Shown with
hand-made wheels: ddplabt-root requires ddplabt-new on python_version >= "3.12" (and ddplabt-old
below it), through roles/python_env/tasks/wheelhouse.yml as provisioning runs it."""

from __future__ import annotations

import json
import re
import sys
import zipfile
from pathlib import Path

import yaml
from ddplab.controller import wheelhouse
from labharness import ansible_env, run_playbooks

REPO = Path(__file__).resolve().parents[1]
NODE_312 = {
    "implementation_name": "cpython",
    "implementation_version": "3.12.3",
    "os_name": "posix",
    "platform_machine": "x86_64",
    "platform_release": "6.8.0",
    "platform_system": "Linux",
    "platform_version": "#1 SMP",
    "python_full_version": "3.12.3",
    "platform_python_implementation": "CPython",
    "python_version": "3.12",
    "sys_platform": "linux",
}


def make_wheel(folder: Path, name: str, version: str, requires: list[str]) -> Path:
    """A minimal pure-Python wheel (METADATA, WHEEL, RECORD) with these Requires-Dist lines."""
    dist = f"{name.replace('-', '_')}-{version}"
    path = folder / f"{dist}-py3-none-any.whl"
    meta = "".join(
        [
            f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
            *(f"Requires-Dist: {r}\n" for r in requires),
        ]
    )
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr(f"{name.replace('-', '_')}/__init__.py", "")
        zf.writestr(f"{dist}.dist-info/METADATA", meta)
        zf.writestr(
            f"{dist}.dist-info/WHEEL",
            "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
        )
        zf.writestr(f"{dist}.dist-info/RECORD", "")
    return path


def _source(tmp_path: Path) -> Path:
    src = tmp_path / "index"
    src.mkdir()
    make_wheel(
        src,
        "ddplabt-root",
        "1.0",
        ['ddplabt-new>=1.0; python_version >= "3.12"', 'ddplabt-old; python_version < "3.12"'],
    )
    make_wheel(src, "ddplabt-new", "1.0", [])
    make_wheel(src, "ddplabt-old", "1.0", [])
    return src


def test_missing_reads_the_nodes_markers(tmp_path):
    src = _source(tmp_path)
    only_root = tmp_path / "wh"
    only_root.mkdir()
    (only_root / "ddplabt_root-1.0-py3-none-any.whl").write_bytes(
        (src / "ddplabt_root-1.0-py3-none-any.whl").read_bytes()
    )
    assert [str(r) for r in wheelhouse.missing(only_root, NODE_312, ["ddplabt-root==1.0"])] == [
        "ddplabt-new>=1.0"
    ]
    node_311 = {**NODE_312, "python_version": "3.11", "python_full_version": "3.11.2"}
    assert [str(r) for r in wheelhouse.missing(only_root, node_311, ["ddplabt-root==1.0"])] == ["ddplabt-old"]


def test_the_wheelhouse_for_a_312_node_holds_its_python_conditioned_dependency(tmp_path):
    assert sys.version_info[:2] != (3, 12), "the controller must not run the node's Python for this case"
    src = _source(tmp_path)
    play = tmp_path / "wheelhouse.yml"
    play.write_text(
        yaml.safe_dump(
            [
                {
                    "name": "Build the wheelhouse for a 3.12 node",
                    "hosts": "localhost",
                    "gather_facts": False,
                    "tasks": [
                        {
                            "name": "The node's Python",
                            "ansible.builtin.set_fact": {
                                "__python_env_node": {
                                    "version": "3.12.3",
                                    "machine": "x86_64",
                                    "libc": ["glibc", "2.36"],
                                    "markers": NODE_312,
                                }
                            },
                        },
                        {
                            "name": "Build",
                            "ansible.builtin.include_role": {
                                "name": "python_env",
                                "tasks_from": "wheelhouse",
                            },
                        },
                    ],
                }
            ]
        )
    )
    extra = {
        "__python_env_requirements": ["ddplabt-root==1.0"],
        "python_env_wheelhouse_dir": str(tmp_path / "wh"),
        "python_env_wheelhouse_pip_args": ["--no-index", "--find-links", str(src)],
        "ansible_python_interpreter": sys.executable,
    }
    rc, out = run_playbooks(
        ansible_env(), "localhost,", [str(play)], "-c", "local", "-e", json.dumps(extra), timeout=300
    )
    assert rc == 0, out[-3000:]
    wheels = sorted(p.name for p in (tmp_path / "wh").rglob("*.whl"))
    # failed before: [ddplabt_old, ddplabt_root] (resolved with the controller's 3.11)
    assert "ddplabt_new-1.0-py3-none-any.whl" in wheels and "ddplabt_root-1.0-py3-none-any.whl" in wheels, (
        wheels
    )


def test_a_venv_whose_python_is_gone_is_rebuilt_with_one_line(tmp_path):
    """The node venv's Python removed by a distro upgrade (issue 27 item 10): pip failed with
    "Error executing command." and an empty stderr. tasks/venv.yml says so and removes the venv,
    which the install then makes anew; a sound venv is left."""
    import subprocess

    prefix = tmp_path / "venv"
    subprocess.run(["/usr/bin/python3", "-m", "venv", "--without-pip", str(prefix)], check=True)
    sound = tmp_path / "sound"
    subprocess.run(["/usr/bin/python3", "-m", "venv", "--without-pip", str(sound)], check=True)
    for link in (prefix / "bin").glob("python*"):  # the interpreter it was made with is gone
        link.unlink()
        link.symlink_to("/usr/bin/python3.99")
    cfg = prefix / "pyvenv.cfg"
    cfg.write_text(cfg.read_text().replace("version = ", "version = 3.99.0\nold = "))
    node = subprocess.run(
        ["/usr/bin/python3", "-c", "import platform; print(platform.python_version())"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    play = tmp_path / "venv.yml"
    play.write_text(
        yaml.safe_dump(
            [
                {
                    "name": "Check the venvs",
                    "hosts": "localhost",
                    "gather_facts": False,
                    "tasks": [
                        {
                            "name": "The node's Python",
                            "ansible.builtin.set_fact": {"__python_env_node": {"version": node}},
                        },
                        *(
                            {
                                "name": f"Check {p.name}",
                                "ansible.builtin.include_role": {"name": "python_env", "tasks_from": "venv"},
                                "vars": {"python_env_prefix": str(p)},
                            }
                            for p in (prefix, sound)
                        ),
                    ],
                }
            ]
        )
    )
    extra = {"ansible_python_interpreter": sys.executable, "ansible_become_method": "su"}
    env = dict(ansible_env(), ANSIBLE_BECOME_ALLOW_SAME_USER="0")
    rc, out = run_playbooks(
        env, "localhost,", [str(play)], "-c", "local", "-e", json.dumps(extra), timeout=300
    )
    assert rc == 0, out[-3000:]
    out = re.sub(r"\s+", " ", out)  # the callback folds a long msg over lines
    assert (
        f"localhost: the venv {prefix} was made by Python 3.99.0 (/usr/bin), which no longer runs"
        f" ({prefix}/bin/python cannot be started)"
    ) in out, out[-3000:]
    assert f"rebuilding it with /usr/bin/python3 {node} from the wheelhouse" in out
    assert not prefix.exists() and (sound / "pyvenv.cfg").exists()
