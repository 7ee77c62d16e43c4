"""The trainer core runs any engine behind ddplab.engines.base.Engine (issue 22).

A third engine is a module and one registry line, nothing in the core: the test-only engine of
tests/local_engine.py is registered here (``ENGINES["local"]``) and trained end to end through
``ddplab.train.main``, with an attempt it holds back (Retry), one it does not commit, its own state
in the checkpoints and its own exception mapped to its own exit code; a run it stops resumes
bit-exactly.
"""

from __future__ import annotations

import ast
import json
from pathlib import Path

import local_engine
import pytest
from conftest import REPO, read_metrics, tiny_args
from ddplab import engines, memory
from ddplab import train as train_mod
from ddplab.checkpoint import CheckpointStore
from ddplab.config import ConfigError, build_config


@pytest.fixture
def local(monkeypatch, clean_env):
    """The test engine, registered the way a new engine is: one line in the registry."""
    monkeypatch.setitem(engines.ENGINES, "local", "local_engine")
    for name in ("HOLD_EVERY", "REFUSE_STEP", "STOP_AT_STEP"):
        monkeypatch.setattr(local_engine, name, None)
    return local_engine


def params(out: Path) -> dict:
    store = CheckpointStore(out / "checkpoints")
    return store.load(store.steps()[-1])


def test_the_registry_is_the_list_of_engines_a_run_may_choose(monkeypatch):
    with pytest.raises(ConfigError, match="'fault_tolerance' = 'local': must be one of torchelastic, "
                                          "per_step, diloco$"):
        build_config({"fault_tolerance": "local"})
    monkeypatch.setitem(engines.ENGINES, "local", "local_engine")
    assert build_config({"fault_tolerance": "local"}).fault_tolerance == "local"
    assert engines.engine_class("local") is local_engine.Local


def test_an_engine_of_one_module_and_one_registry_line_trains_end_to_end(tmp_path, data_path, local,
                                                                          capsys):
    local.HOLD_EVERY, local.REFUSE_STEP = 4, 3
    out = tmp_path / "run"
    assert train_mod.main(tiny_args(out, data_path, fault_tolerance="local", log_interval=5)) == 0
    records = read_metrics(out)
    (start,) = [r for r in records if r["event"] == "start"]
    assert start["engine"] == "local" and start["local_engine"] is True
    steps = [r for r in records if r["event"] == "step"]
    # step 3 was refused once: its commit is logged (Commit.log) although log_interval is 5
    assert [r["step"] for r in steps] == [3, 5, 10, 15, 20] and {r["engine"] for r in steps} == {"local"}
    (refused,) = [r for r in records if r["event"] == "uncommitted"]
    assert refused["attempted_step"] == 3 and refused["committed"] is False
    assert refused["engine"] == "local" and "step" not in refused
    assert "step 3 not committed (the test refused it once): attempted again" in capsys.readouterr().out
    # held-back attempts (every 4th) and the refused one changed nothing: every sample once
    assert steps[-1]["samples_seen"] == 20 * 4
    state = params(out)
    assert state["local_engine"]["commits"] == 20 and state["local_engine"]["attempts"] > 21
    assert [h["world_size"] for h in state["world_size_history"]] == [1]
    result = json.loads((out / "result.json").read_text())
    assert result["engine"] == "local" and result["steps"] == 20


def test_its_own_failure_has_its_exit_code_and_the_run_resumes_exactly(tmp_path, data_path, local):
    ref, broken = tmp_path / "ref", tmp_path / "broken"
    assert train_mod.main(tiny_args(ref, data_path, fault_tolerance="local")) == 0

    local.STOP_AT_STEP, local.HOLD_EVERY, local.REFUSE_STEP = 13, 3, 7
    assert train_mod.main(tiny_args(broken, data_path, fault_tolerance="local")) == local.EXIT_LOCAL_STOP
    failure = read_metrics(broken)[-1]
    assert failure["event"] == "failure" and failure["cause"] == "local_stop"
    assert failure["step"] == 12 and failure["saved"] is True and failure["local_commits"] == 12
    assert CheckpointStore(broken / "checkpoints").steps() == [10, 12]

    local.STOP_AT_STEP = None
    assert train_mod.main(tiny_args(broken, data_path, fault_tolerance="local")) == 0
    starts = [r for r in read_metrics(broken) if r["event"] == "start"]
    assert [s["resumed_from_step"] for s in starts] == [None, 12]
    a, b = params(ref)["model"], params(broken)["model"]
    assert max(float((a[k] - b[k]).abs().max()) for k in a) == 0.0


def test_the_memory_estimate_asks_the_engine_for_its_buffers(local):
    """ddplab.memory's ``engine`` term is 4 bytes x parameters x the engine's parameter_copies: a
    new engine brings its own count (here the interface's default, none), no line in the core."""
    def copies(name: str, world_size: int, **settings) -> float:
        found = memory.estimate(build_config({"fault_tolerance": name, **settings}), 65, world_size)
        return found.engine_bytes / (memory.BYTES_PER_ELEMENT * found.params)

    assert copies("torchelastic", 1) == 0 and copies("torchelastic", 3) == 1
    assert copies("torchelastic", 3, grad_compression="powersgd") == 2
    lighthouse = {"ft_lighthouse": "http://127.0.0.1:29510"}
    assert copies("per_step", 1, **lighthouse) == 1 and copies("diloco", 1, **lighthouse) == 4
    assert copies("local", 3) == 0  # before: DDP's buckets, the fall-through of a list of names


#: The trainer core: ddplab.train and the modules it builds a run from that are no engine's.
CORE = ("train", "records", "metrics", "balance", "lr", "data", "checkpoint", "memory", "model",
        "divergence", "outputs", "signals", "telemetry", "wire", "distributed")
#: Engine names and what only an engine knows about (torchft, its quorums and lighthouse).
ENGINE_WORDS = ("torchelastic", "per_step", "diloco", "torchft", "quorum", "lighthouse")


def engine_words_in_code(path: Path) -> list[str]:
    """The strings, names, attributes and imported modules of ``path``'s code (not its docstrings) that
    hold one of :data:`ENGINE_WORDS`."""
    tree = ast.parse(path.read_text())
    docstrings = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Expr)
                  and isinstance(n.value, ast.Constant) and isinstance(n.value.value, str)}
    texts = [n.value for n in ast.walk(tree) if isinstance(n, ast.Constant)
             and isinstance(n.value, str) and id(n) not in docstrings]
    # texts as spelled (torch's own TORCHELASTIC_* variables are no engine), names in lower case
    names = [n.id for n in ast.walk(tree) if isinstance(n, ast.Name)]
    names += [n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)]
    names += imported_modules(path)
    return ([t for t in texts if any(word in t for word in ENGINE_WORDS)]
            + [n for n in names if any(word in n.lower() for word in ENGINE_WORDS)])


@pytest.mark.parametrize("module", CORE)
def test_the_core_names_no_engine(module):
    """Engines are named in their modules, the registry and the config only: the core's code
    (not its docstrings) holds no engine name, and asks the engine through the interface (an
    engine's memory buffers too: Engine.parameter_copies)."""
    assert engine_words_in_code(REPO / f"train/ddplab/{module}.py") == []


def imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    return ({a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
            | {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module})


def test_torchft_is_imported_under_ddplab_engines_only():
    """torchft and the adapter of its replica group (ddplab.engines.torchft_replica) live with
    the engines that use them, not beside the core."""
    package = REPO / "train/ddplab"
    outside = sorted(str(p.relative_to(package)) for p in package.rglob("*.py")
                     if "engines" not in p.relative_to(package).parts
                     and any(m.split(".")[0] == "torchft" for m in imported_modules(p)))
    assert outside == []
