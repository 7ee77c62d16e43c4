"""kill-node.yml refuses bad input before touching a node, and the node_status action plugin
(modes once and until: ``python -m ddplab.status`` on the node) reads a node's metrics as the play
waits on them.

The inventory's trainers are podman containers that do not exist: a task that reached one would
fail as unreachable, so a clean refusal proves that nothing was contacted.
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
PLAYBOOK = shutil.which("ansible-playbook", path=str(BIN)) or shutil.which("ansible-playbook")
ADHOC = shutil.which("ansible", path=str(BIN)) or shutil.which("ansible")

pytestmark = pytest.mark.skipif(PLAYBOOK is None, reason="ansible-playbook is not installed (make venv)")

INVENTORY = """\
all:
  children:
    trainers:
      hosts:
        ghost-a:
        ghost-b:
      vars:
        ansible_connection: containers.podman.podman
        ansible_python_interpreter: /usr/bin/python3
    rendezvous:
      hosts:
        controller:
          ansible_connection: local
          rendezvous_address: 10.255.0.1
"""


def _env(tmp_path):
    env = dict(os.environ, ANSIBLE_CONFIG=str(ROOT / "ansible.cfg"), ANSIBLE_NOCOLOR="1",
               ANSIBLE_LOCAL_TEMP=str(tmp_path / "tmp"), ANSIBLE_HOME=str(tmp_path / "home"))
    env["PATH"] = f"{BIN}:{env.get('PATH', '')}"
    return env


def run_play(tmp_path, *extra):
    inv = tmp_path / "hosts.yml"
    inv.write_text(INVENTORY)
    args = [PLAYBOOK, "-i", str(inv), str(ROOT / "kill-node.yml")]
    for e in extra:
        args += ["-e", e]
    return subprocess.run(args, capture_output=True, text=True, env=_env(tmp_path), timeout=180, cwd=ROOT)


@pytest.mark.parametrize("extra, message", [
    ((), "name the fault: -e fault=<kill-worker|kill-agent|poweroff|freeze|partition|throttle|rejoin>"),
    (("fault=explode", "node=ghost-a"),
     "fault=explode is not a fault this playbook injects; "
     "fix: -e fault=<kill-worker|kill-agent|poweroff|freeze|partition|throttle|rejoin>"),
    (("fault=freeze", "node=ghost-a", "duration=-5"), "duration=-5 is not a number of seconds"),
    (("fault=freeze", "node=ghost-a", "duration=abc"), "duration=abc is not a number of seconds"),
    (("fault=freeze", "node=ghost-a", "duration=0"), "duration=0 is not a number of seconds"),
    (("fault=kill-agent",), "name the target either by node (-e node=<inventory host>) or by rank"),
    (("fault=kill-agent", "node=ghost-a", "rank=0"), "not both"),
    (("fault=kill-agent", "node=laptop-z"), "node=laptop-z is not in the group 'trainers'"),
    (("fault=kill-agent", "node=ghost-a", "duration=30"), "duration=30 does not apply to fault=kill-agent"),
    (("fault=throttle", "node=ghost-a", "fault_throttle_percent=150"),
     "fault_throttle_percent=150 is not a share"),
    (("fault=partition", "node=ghost-a", "fault_partition_scope=half"),
     "fault_partition_scope=half must be one of trainers, all"),
])
def test_bad_input_is_refused_before_any_node_is_contacted(tmp_path, extra, message):
    assert_refused(tmp_path, extra, message)


def assert_refused(tmp_path, extra, message) -> str:
    """kill-node.yml with ``extra`` fails with ``message`` once, before any node is contacted;
    returns its output."""
    r = run_play(tmp_path, *extra)
    out = r.stdout + r.stderr
    assert r.returncode != 0, out
    assert " ".join(message.split()) in " ".join(out.split()), out
    assert "UNREACHABLE" not in out, out
    # one refusal, not one per host with the role's whole argument spec printed
    assert out.count("fatal:") == 1, out
    return out


def _records(host, t0, steps, world_size=3, restart=0, start_resumed=None):
    recs = []
    if start_resumed is not None:
        recs.append({"event": "start", "time": t0 - 0.5, "host": host, "rank": 0, "local_rank": 0,
                     "world_size": world_size, "restart_count": restart, "resumed_from_step": start_resumed})
    for i, s in enumerate(steps):
        recs.append({"event": "step", "time": t0 + i, "host": host, "rank": 0, "local_rank": 0,
                     "world_size": world_size, "restart_count": restart, "step": s, "step_time_s": 1.0})
    return recs


def run_module(tmp_path, args, extra_vars=()):
    env = _env(tmp_path)
    # the action plugin runs ``python -m ddplab.status`` on the node: here this Python, train/ on its path
    env.update(PYTHONPATH=os.pathsep.join(p for p in (str(ROOT / "train"), env.get("PYTHONPATH")) if p),
               ANSIBLE_LOAD_CALLBACK_PLUGINS="1", ANSIBLE_STDOUT_CALLBACK="ansible.posix.json")
    args = args if extra_vars else {"python": sys.executable, **args}
    r = subprocess.run([ADHOC, "localhost", "-c", "local", "-i", "localhost,",
                        "-m", "ddp_lab.cluster.node_status",
                        "-e", f"ansible_python_interpreter={sys.executable}", *extra_vars,
                        "-a", " ".join(f"{k}={v}" for k, v in args.items())],
                       capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode in (0, 2), r.stdout + r.stderr
    doc, _end = json.JSONDecoder().raw_decode(r.stdout[r.stdout.index("{"):])
    return doc["plays"][0]["tasks"][0]["hosts"]["localhost"]


def test_progress_module_reports_ranks_and_a_recovery(tmp_path):
    metrics = tmp_path / "metrics"
    metrics.mkdir()
    recs = _records("node-1", 1000.0, [1, 2, 3], start_resumed=0)
    recs += _records("node-1", 1010.0, [4, 5], world_size=2, restart=1, start_resumed=3)
    torn = '{"event": "st'  # a line being appended while the module reads
    (metrics / "node-1-local0.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs) + torn)
    res = run_module(tmp_path, {"out_dir": tmp_path, "label": "laptop-x"})
    assert res["records"] == 7 and res["skipped_lines"] == 1
    (w,) = res["workers"]
    assert (w["node"], w["host"], w["rank"], w["world_size"], w["step"]) == ("laptop-x", "node-1", 0, 2, 5)
    assert "phase" not in res
    res = run_module(tmp_path, {"out_dir": tmp_path, "mode": "until", "since": 1003.0, "fault": "kill-agent",
                                "node": "laptop-y"})
    assert res["phase"] == "recovered"
    m = res["measure"]
    assert (m["world_size_before"], m["world_size_after"], m["steps_lost"]) == (3, 2, 0)
    assert m["recovered_s"] == pytest.approx(7.0)
    assert res["timed_out"] is False


def test_progress_module_reads_in_check_mode_too(tmp_path):
    # kill-node.yml --check crashed with "list index out of range" (the command module skips in check
    # mode); the read runs the command itself over the connection, read-only, in check mode too
    metrics = tmp_path / "metrics"
    metrics.mkdir()
    (metrics / "n-local0.jsonl").write_text(json.dumps(_records("n", 1000.0, [3])[0]) + "\n")
    res = run_module(tmp_path, {"python": sys.executable, "out_dir": tmp_path}, extra_vars=("--check",))
    assert not res.get("failed") and res["records"] == 1 and res["progress"]["step"] == 3, res


def test_progress_module_waits_then_says_the_job_ended(tmp_path):
    metrics = tmp_path / "metrics"
    metrics.mkdir()
    (metrics / "n-local0.jsonl").write_text("".join(json.dumps(r) + "\n"
                                                    for r in _records("n", 1000.0, [1, 2], start_resumed=0)))
    # no agent unit runs on this machine: after the fault nothing moves and the agent is gone
    res = run_module(tmp_path, {"out_dir": tmp_path, "mode": "until", "since": 1002.0, "timeout_s": 1,
                                "interval_s": 0.2, "unit": "ddp-lab-test-absent"})
    assert res["phase"] == "ended" and res["agent"]["running"] is False
    assert res["measure"]["outcome"] == "no_data"


def test_progress_plugin_finds_the_venv_by_python_env_prefix(tmp_path):
    """Without ``python``, the node's venv is ``<python_env_prefix>/bin/python`` (here a link to this
    Python): the role's tasks pass no interpreter."""
    metrics = tmp_path / "run" / "metrics"
    metrics.mkdir(parents=True)
    (metrics / "n-local0.jsonl").write_text(json.dumps(_records("n", 1000.0, [7])[0]) + "\n")
    (tmp_path / "venv" / "bin").mkdir(parents=True)
    (tmp_path / "venv" / "bin" / "python").symlink_to(sys.executable)
    res = run_module(tmp_path, {"out_dir": metrics.parent}, ["-e", f"python_env_prefix={tmp_path / 'venv'}"])
    assert res["records"] == 1 and res["workers"][0]["step"] == 7
