"""One launch at a time from a checkout, and a refused launch leaves nothing running (issue 27
item 6: two ``site.yml --tags train -e ddp_job_watch=false`` 0.5 s apart both passed "Refuse to
launch while a job runs", cleared each other's agent unit and both failed, leaving the store up;
and last session's newcomer finding: a launch refused after its store started left the store).

- ddplab.controller.launch_lock: the lock and its holder (the ansible-playbook process).
- Two real ansible-playbook runs taking ddp_job's lock (tasks/lock.yml) 0.5 s apart: the second is
  refused in one line naming the first; the first goes on.
- playbooks/train.yml while another launch holds the lock: refused in its first play, before the
  rendezvous play: no store pidfile, nothing listening on the store's port.
- ddp_job's launch refused after the rendezvous play started a store (a bad dataset, checked in
  prepare.yml): the rescue stops that store and gives the lock back; a store that ran before the
  launch is left.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import yaml
from ddplab.controller import launch_lock, rdzv_store, supervisor
from labharness import ansible_env, errors, free_port, run_playbooks

REPO = Path(__file__).resolve().parents[1]
LOCAL = {"ansible_connection": "local", "ansible_python_interpreter": sys.executable}


@pytest.fixture
def holder():
    """A live process standing in for another launch's ansible-playbook."""
    proc = subprocess.Popen(["sleep", "300"])
    try:
        yield psutil.Process(proc.pid)
    finally:
        proc.kill()
        proc.wait()


def test_the_lock_refuses_a_second_holder_until_the_first_is_gone(tmp_path, holder):
    lock = tmp_path / "runs" / ".launch.lock"
    first = launch_lock.acquire(lock, "laptop-a, laptop-b", holder=holder)
    assert first["changed"] and first["pid"] == holder.pid
    assert launch_lock.acquire(lock, holder=holder)["changed"] is False  # the same launch again
    me = psutil.Process()
    with pytest.raises(launch_lock.LockHeld) as err:
        launch_lock.acquire(lock, holder=me)
    line = str(err.value)
    assert line.startswith(
        f"another launch from this checkout is under way: ansible-playbook pid {holder.pid}"
        " (laptop-a, laptop-b), since "
    ), line
    assert "nothing was started; fix: wait for it" in line and "\n" not in line
    assert launch_lock.release(lock, holder=me)["changed"] is False  # not ours: kept
    holder.kill()
    holder.wait(10)
    taken = launch_lock.acquire(lock, holder=me)  # its holder is gone: taken over
    assert taken["changed"] and taken["took_over"] == holder.pid
    assert launch_lock.release(lock, holder=me)["changed"] and not lock.exists()


def _trainers_play(name: str, tasks: list) -> dict:
    """A play of the trainers as playbooks/train.yml runs them (any_errors_fatal, ddp_lab first)."""
    return {
        "name": name,
        "hosts": "trainers",
        "gather_facts": False,
        "any_errors_fatal": True,
        "roles": [{"role": "ddp_lab"}],
        "tasks": tasks,
    }


def _lock_play(tmp_path: Path) -> Path:
    """A play that takes the lock, holds it until the file ``release`` appears in ``tmp_path``,
    and gives it back."""
    play = tmp_path / "lock.yml"
    hold = {
        "name": "Hold it",
        "ansible.builtin.wait_for": {"path": str(tmp_path / "release"), "timeout": 300},
    }
    play.write_text(
        yaml.safe_dump(
            [
                _trainers_play(
                    "A launch's lock",
                    [
                        {
                            "name": "Take it",
                            "ansible.builtin.include_role": {"name": "ddp_job", "tasks_from": "lock"},
                        },
                        hold,
                        {
                            "name": "Give it back",
                            "ansible.builtin.include_role": {"name": "ddp_job", "tasks_from": "unlock"},
                        },
                    ],
                )
            ]
        )
    )
    return play


def _inventory(tmp_path: Path, port: int = 29498, **controller) -> Path:
    inv = tmp_path / "hosts.yml"
    inv.write_text(
        yaml.safe_dump(
            {
                "all": {
                    "vars": {"ddp_job_runs_dir": str(tmp_path / "runs")},
                    "children": {
                        "trainers": {"hosts": {"t-a": LOCAL, "t-b": LOCAL}},
                        "rendezvous": {
                            "hosts": {
                                "controller": {
                                    **LOCAL,
                                    "rendezvous_address": "127.0.0.1",
                                    "rendezvous_port": port,
                                    "rendezvous_state_dir": str(tmp_path / "rdzv"),
                                    **controller,
                                }
                            }
                        },
                    },
                }
            }
        )
    )
    return inv


def test_two_launches_half_a_second_apart_one_is_refused(tmp_path):
    """Whichever takes the lock first goes on (under load the one started second may win); the
    other is refused in one line naming the winner's pid. The winner holds the lock until the loser
    has ended, so the outcome does not depend on how fast either starts."""
    inv, play = _inventory(tmp_path), _lock_play(tmp_path)
    argv = ["ansible-playbook", "-i", str(inv), str(play)]
    env = ansible_env()
    procs = []
    for _ in range(2):
        procs.append(subprocess.Popen(
            argv, env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
        time.sleep(0.5)
    deadline = time.monotonic() + 300
    while all(p.poll() is None for p in procs) and time.monotonic() < deadline:
        time.sleep(0.2)
    (tmp_path / "release").touch()  # the loser has ended (or the deadline passed): let the winner go
    outs = [p.communicate(timeout=300)[0] for p in procs]
    won = [i for i, p in enumerate(procs) if p.returncode == 0]
    assert len(won) == 1, "\n---\n".join(o[-3000:] for o in outs)
    winner, loser = procs[won[0]], procs[1 - won[0]]
    (line,) = errors(outs[1 - won[0]])
    assert line.startswith(
        f"another launch from this checkout is under way: ansible-playbook pid {winner.pid}"
    ), line
    assert loser.returncode != 0
    assert not (tmp_path / "runs" / ".launch.lock").exists()  # the winner gave it back


def _listening(port: int) -> bool:
    return bool(supervisor._listening_pids(port)[0])


def test_train_yml_refused_by_the_lock_starts_no_store(tmp_path, holder):
    port = free_port()
    inv = _inventory(tmp_path, port)
    launch_lock.acquire(tmp_path / "runs" / ".launch.lock", "t-a, t-b", holder=holder)
    rc, out = run_playbooks(
        ansible_env(),
        str(inv),
        [str(REPO / "playbooks" / "train.yml")],
        "-e",
        "ddp_job_watch=false",
        timeout=300,
    )
    assert rc != 0, out[-3000:]
    (line,) = errors(out)
    assert line.startswith(
        f"another launch from this checkout is under way: ansible-playbook pid {holder.pid}"
    ), line
    assert "PLAY [Train | rendezvous store]" not in out, out[-3000:]
    assert not (tmp_path / "rdzv" / f"store-{port}.json").exists() and not _listening(port)


def _refused_after_the_store(tmp_path: Path, port: int, *dataset: str) -> tuple[int, str]:
    """playbooks/train.yml's rendezvous play, then ddp_job's launch whose dataset is not the one
    its sha256 names (prepare.yml refuses it after the store started). The read-only preflight is
    taken as done: this controller is no systemd node (the preflight refuses it), and playbooks/
    train.yml runs that part before the rendezvous play (test_train_yml_refused_by_the_lock_...).
    ``dataset``: -e arguments in place of the bad local copy."""
    bad = tmp_path / "input.txt"
    bad.write_text("not tiny shakespeare\n")
    play = tmp_path / "train.yml"
    play.write_text(
        yaml.safe_dump(
            [
                {
                    "name": "Train | rendezvous store",
                    "hosts": "rendezvous",
                    "gather_facts": False,
                    "any_errors_fatal": True,
                    "roles": [{"role": "ddp_lab"}, {"role": "rendezvous"}],
                },
                _trainers_play(
                    "Train | launch",
                    [
                        {
                            "name": "Take the lock",
                            "ansible.builtin.include_role": {"name": "ddp_job", "tasks_from": "lock"},
                        },
                        {
                            "name": "The read-only preflight passed",
                            "ansible.builtin.set_fact": {
                                "__ddp_job_preflight_done": True,
                                "__ddp_job_node": {"python": "3.11", "cores": 1},
                            },
                        },
                        {"name": "Launch", "ansible.builtin.include_role": {"name": "ddp_job"}},
                    ],
                ),
            ]
        )
    )
    return run_playbooks(
        ansible_env(),
        str(_inventory(tmp_path, port)),
        [str(play)],
        "-e",
        "ddp_job_watch=false",
        *(dataset or ("-e", f"ddp_job_dataset_src={bad}")),
        "-e",
        f"ddp_job_dataset_cache_dir={tmp_path / 'cache'}",
        timeout=600,
    )


def test_a_launch_refused_after_its_store_started_stops_that_store(tmp_path):
    port = free_port()
    rc, out = _refused_after_the_store(tmp_path, port)
    assert rc != 0, out[-3000:]
    found = errors(out)
    assert any(
        "has sha256" in e and "fix: point ddp_job_dataset_src at an intact copy" in e for e in found
    ), found
    assert any(
        e.startswith("the launch on t-a, t-b stopped before its agents ran")
        and e.endswith("stopped what it had started: the rendezvous store")
        for e in found
    ), found
    assert not _listening(port) and not (tmp_path / "rdzv" / f"store-{port}.json").exists()
    assert not (tmp_path / "runs" / ".launch.lock").exists()


def test_a_dataset_that_cannot_be_downloaded_says_how_to_give_a_local_copy(tmp_path):
    """No ddp_job_dataset_src and a URL nothing answers (a machine without internet): one line
    naming the URL and the fix, and the launch's store is stopped as for any refusal."""
    port, closed = free_port(), free_port()
    url = f"http://127.0.0.1:{closed}/input.txt"
    rc, out = _refused_after_the_store(tmp_path, port, "-e", "ddp_job_dataset_src=", "-e",
                                       f"ddp_job_dataset_url={url}")
    assert rc != 0, out[-3000:]
    found = [e for e in errors(out) if "could not be downloaded" in e]
    assert len(found) == 1, errors(out)
    assert found[0].startswith(f"the dataset could not be downloaded from {url} ("), found
    assert found[0].endswith("fix: give a local copy of it: make demo DATASET=/path/to/input.txt, or"
                             " -e ddp_job_dataset_src=/path/to/input.txt (or set ddp_job_dataset_url to a"
                             " mirror)"), found
    assert not _listening(port) and not (tmp_path / "runs" / ".launch.lock").exists()


def test_a_store_that_ran_before_the_launch_is_left(tmp_path):
    port = free_port()
    before = rdzv_store.start("127.0.0.1", port, tmp_path / "rdzv", wait_s=60)
    try:
        rc, out = _refused_after_the_store(tmp_path, port)
        assert rc != 0, out[-3000:]
        assert "stopped what it had started" not in out, out[-3000:]
        assert rdzv_store.status(port, tmp_path / "rdzv")["supervisor_pid"] == before["supervisor_pid"]
    finally:
        rdzv_store.stop(port, tmp_path / "rdzv")
    assert json.loads(json.dumps(before))["changed"]
