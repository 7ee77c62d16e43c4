"""Progress on long steps (issue 14 item 6): the wheelhouse copy names how many wheels and MB go to
each node, the install into the venv runs async and ddp_lab_await prints which pinned packages are
in place every interval, instead of nothing for ~30 s and ~50 s."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from ansible_collections.ddp_lab.cluster.plugins.action import ddp_lab_await as await_plugin
from ansible_collections.ddp_lab.cluster.plugins.filter import python_env as filters

ROOT = Path(__file__).resolve().parent.parent




def test_dist_info_globs_of_pinned_requirements():
    globs = filters.dist_info_globs(["torch==2.13.0", "numpy==2.3.4", "typing-extensions==4.15.0"])
    assert globs == ["torch-2.13.0*.dist-info", "numpy-2.3.4*.dist-info",
                     "typing_extensions-4.15.0*.dist-info"]
    with pytest.raises(ValueError, match="not a pinned requirement"):
        filters.dist_info_globs(["torch>=2"])


def test_in_place_and_progress_line():
    pats = ["torch-2.13.0*.dist-info", "numpy-2.3.4*.dist-info", "psutil-7.1.0*.dist-info"]
    names = ["numpy-2.3.4.dist-info", "numpy", "psutil-7.1.0.dist-info", "torch"]
    done = await_plugin.in_place(pats, names)
    assert done == pats[1:]
    line = await_plugin.progress_line("laptop-a", "installing torch, numpy, psutil", 20.4, done, 3)
    assert line == "laptop-a     installing torch, numpy, psutil: 2 of 3 in place (numpy, psutil) after 20 s"
    assert await_plugin.progress_line("n", "copying", 12, None, 0) == "n            copying after 12 s"


class _FakeAwait(await_plugin.ActionModule):
    """The plugin's loop with async_status and find answered from lists (no node)."""

    def __init__(self, statuses, listings):
        self.statuses, self.listings, self.calls = list(statuses), list(listings), []

    def _status(self, jid, task_vars, mode="status"):
        self.calls.append((mode, jid))
        return self.statuses.pop(0) if mode == "status" else {"erased": "/root/.ansible_async/" + jid}

    def _probe(self, path, task_vars):
        self.calls.append(("find", path))
        return self.listings.pop(0)


def test_await_prints_a_line_per_interval_and_returns_the_job_result(monkeypatch):
    lines = []
    monkeypatch.setattr(await_plugin.display, "display", lambda msg, **kw: lines.append(msg))
    monkeypatch.setattr(await_plugin.time, "sleep", lambda s: None)
    args = {"jid": "j1", "what": "installing torch, numpy", "interval_s": 10.0, "timeout_s": 600.0,
            "probe_path": "/opt/venv/lib/python3.11/site-packages",
            "probe_patterns": ["torch-2.13.0*.dist-info", "numpy-2.3.4*.dist-info"]}
    plugin = _FakeAwait(
        [{"finished": 0}, {"finished": 0}, {"finished": 0},
         {"finished": 1, "changed": True, "rc": 0, "ansible_job_id": "j1", "results_file": "/x"}],
        [[], ["numpy-2.3.4.dist-info"]])
    monkeypatch.setattr(await_plugin.ActionBase, "run", lambda self, tmp=None, task_vars=None: {})
    monkeypatch.setattr(plugin, "validate_argument_spec", lambda argument_spec: (None, args), raising=False)
    res = plugin.run(task_vars={"inventory_hostname": "laptop-a"})
    assert len(lines) == 2  # polls 2 and 3; the first one is at once, the fourth found it done
    assert "0 of 2 in place" in lines[0] and "1 of 2 in place (numpy)" in lines[1]
    assert res["changed"] is True and res["rc"] == 0 and res["polls"] == 4
    assert "ansible_job_id" not in res and "results_file" not in res
    # the finished job's results file is removed from the node (a reset leaves nothing of it)
    assert plugin.calls[-1] == ("cleanup", "j1") and ("cleanup", "j1") not in plugin.calls[:-1]


def test_status_reads_the_job_where_async_put_it():
    """async_status's module needs the job folder the async_status action would give it."""
    plugin = await_plugin.ActionModule.__new__(await_plugin.ActionModule)
    calls = []
    plugin.get_shell_option = lambda name, default=None: default
    plugin._remote_expand_user = lambda path: path.replace("~", "/root")
    plugin._execute_module = lambda module_name, module_args, task_vars: calls.append(
        (module_name, module_args)) or {"finished": 0}
    assert plugin._status("j9", {}) == {"finished": 0}
    assert calls == [("ansible.legacy.async_status", {"jid": "j9", "mode": "status",
                                                      "_async_dir": "/root/.ansible_async"})]


def test_install_runs_async_with_the_waiting_task_after_it():
    tasks = yaml.safe_load((ROOT / "roles/python_env/tasks/main.yml").read_text())
    names = [t["name"] for t in tasks]
    i = next(k for k, n in enumerate(names) if n.startswith("Install torch"))
    assert tasks[i]["poll"] == 0 and "async" in tasks[i]
    assert "ddp_lab.cluster.ddp_lab_await" in tasks[i + 1]
    copy = yaml.safe_load((ROOT / "roles/python_env/tasks/copy.yml").read_text())
    wheels = next(t for t in copy if t["name"].startswith("Copy the wheelhouse"))
    assert wheels["name"].endswith("{{ __python_env_archive.label }}")


def test_long_steps_of_ship_and_collect_say_what_and_how_much():
    """The node runtime install runs async with ddp_lab_await after it; the dataset copy names its
    size; collect says how many MB come from each node before the fetch."""
    ship = yaml.safe_load((ROOT / "roles/ddp_job/tasks/ship.yml").read_text())
    names = [t["name"] for t in ship]
    i = names.index("Install the node runtime into the venv")
    assert ship[i]["poll"] == 0 and "ddp_lab.cluster.ddp_lab_await" in ship[i + 1]
    assert any(n.startswith("Ship the dataset") and "stat.size" in n for n in names)
    node = yaml.safe_load((ROOT / "roles/collect/tasks/node.yml").read_text())
    names = [t["name"] for t in node]
    say = names.index("Say what is fetched from the node")
    assert names[say + 1] == "Fetch the pack" and "fetching" in node[say]["ansible.builtin.debug"]["msg"]
