"""ddplab.controller.rundir / ddplab.records: the one reader of a run folder; no import circle in ddplab."""

import ast
import json
from pathlib import Path

import pytest
from ddplab import records
from ddplab.controller import rundir

PACKAGE = Path(__file__).resolve().parent.parent / "train" / "ddplab"


def _rec(event, t, host, rank, ws=2, **kw):
    return {"event": event, "time": t, "host": host, "rank": rank, "local_rank": 0, "world_size": ws,
            "restart_count": 0, **kw}


def _write(path: Path, recs, tail: str = "") -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in recs) + tail)


def test_several_hosts_merged_by_time_with_host_from_the_folder(tmp_path):
    _write(tmp_path / "laptop-a" / "metrics" / "laptop-a-local0.jsonl",
           [_rec("start", 10.0, "laptop-a", 0), _rec("step", 12.0, "laptop-a", 0, step=1)])
    no_host = _rec("step", 11.0, "x", 1, step=1)
    del no_host["host"]
    _write(tmp_path / "laptop-b" / "metrics" / "laptop-b-local0.jsonl",
           [_rec("start", 10.5, "laptop-b", 1), no_host])
    (tmp_path / "laptop-c").mkdir()
    (tmp_path / "laptop-c" / "journal.txt").write_text("no metrics: the node never started\n")
    (tmp_path / "plots").mkdir()  # the report's folder, not a host
    run = rundir.load_run(tmp_path)
    assert run.hosts == ["laptop-a", "laptop-b", "laptop-c"]
    assert run.per_host["laptop-c"] == []
    assert [r["time"] for r in run.records] == [10.0, 10.5, 11.0, 12.0]
    assert run.records[2]["host"] == "laptop-b"  # the folder names a record without a host
    assert len(run.metrics_files) == 2 and run.skipped_lines == 0
    assert [e.step for e in rundir.group_starts(run.records)] == [0]


def test_torn_last_line_is_skipped_and_counted(tmp_path):
    _write(tmp_path / "h" / "metrics" / "h-local0.jsonl", [_rec("step", 1.0, "h", 0, step=1)],
           tail='{"event": "step", "ti')
    run = rundir.load_run(tmp_path)
    assert [r["step"] for r in run.records] == [1] and run.skipped_lines == 1
    # a tail read cuts the first line: skipped too, the rest is read
    recs, bad = records.read_jsonl(tmp_path / "h" / "metrics" / "h-local0.jsonl", tail_bytes=30)
    assert recs == [] and bad == 2
    assert records.parse_jsonl('[1]\n\n{"a": 1}\nnot json\n') == ([{"a": 1}], 2)


def test_missing_files_are_empty_and_a_missing_folder_is_an_error(tmp_path):
    run = rundir.load_run(tmp_path)
    assert (run.records, run.events, run.summary, run.configs, run.results) == ([], [], {}, {}, {})
    assert run.summary_error is None and run.run_id == tmp_path.name
    assert records.read_metrics_dir(tmp_path / "nothing") == ([], 0)
    with pytest.raises(rundir.RunFolderError, match="no such run folder"):
        rundir.load_run(tmp_path / "missing")
    with pytest.raises(rundir.RunFolderError, match="no such metrics folder"):
        rundir.load_run(tmp_path, tmp_path / ".live")


def test_run_files_events_and_a_bad_summary(tmp_path):
    host = tmp_path / "laptop-a"
    _write(host / "metrics" / "m.jsonl", [_rec("start", 1.0, "laptop-a", 0, run_id="from-start")])
    (host / "run.json").write_text(json.dumps({"run_id": "from-config", "max_steps": 40}))
    (host / "result.json").write_text(json.dumps({"final_val_loss": 1.5}))
    _write(tmp_path / "events.jsonl", [{"time": 2.0, "kind": "fault", "mode": "freeze", "node": "laptop-a"}],
           tail="{torn")
    (tmp_path / "summary.json").write_text("{not json")
    run = rundir.load_run(tmp_path)
    assert run.configs["laptop-a"]["max_steps"] == 40 and run.results["laptop-a"]["final_val_loss"] == 1.5
    assert [e["mode"] for e in run.events] == ["freeze"]
    assert run.summary == {} and "not valid JSON" in run.summary_error
    assert run.run_id == "from-start"


def test_one_definition_of_restarts_and_world_size_timeline():
    recs = [_rec("start", 0.0, "a", 0, 3, resumed_from_step=0),
            _rec("start", 0.1, "b", 1, 3, resumed_from_step=0),
            _rec("step", 1.0, "a", 0, 3, step=1), _rec("step", 1.0, "b", 1, 3, step=1),
            # a quick restart (kill-worker): the same world size, 2 s later
            _rec("start", 3.0, "a", 0, 3, resumed_from_step=1), _rec("step", 4.0, "a", 0, 3, step=2),
            _rec("start", 9.0, "a", 0, 2, resumed_from_step=2), _rec("step", 10.0, "a", 0, 2, step=3)]
    starts = rundir.group_starts(recs)
    assert [(s.step, s.world_size, s.initial) for s in starts] == [(0, 3, True), (1, 3, False), (2, 2, False)]
    assert rundir.group_restarts(recs) == 2
    tl = rundir.world_size_timeline(recs)
    assert [(e["step"], e["world_size"]) for e in tl] == [(0, 3), (2, 2)]
    assert [rundir.world_size_at(tl, t) for t in (-1.0, 4.0, 9.0, 10.0)] == [None, 3, 2, 2]


def test_numbers():
    assert [records.num(v) for v in (1, 2.5, True, "3", float("nan"), float("inf"), None)] == [
        1.0, 2.5, None, None, None, None, None]
    assert records.as_int(3.9) == 3 and records.as_int(False) is None


def _module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def import_graph() -> dict[str, set[str]]:
    """{module: the ddplab modules it imports (any import statement, at any depth)}."""
    files = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {m: set() for m in files}
    for mod, path in files.items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                # "from pkg import sub" imports the module pkg.sub when there is one
                targets = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in files else node.module
                           for a in node.names]
            graph[mod] |= {t for t in targets if t in files and t != mod}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle (a list of modules, the first repeated at the end), or None."""
    state: dict[str, int] = {}  # 1 on the stack, 2 done
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                return stack[stack.index(n):] + [n]
            if n not in state and (found := visit(n)):
                return found
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (found := visit(m)):
            return found
    return None


def test_no_import_cycle_in_ddplab():
    graph = import_graph()
    assert graph["ddplab.controller.summary"]  # the walk sees the package
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph) or [])


def test_the_cycle_finder_finds_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_the_node_runtime_does_not_import_the_controller_side():
    """The wheel shipped to the nodes leaves out ddplab.controller (train/pyproject.toml)."""
    graph = import_graph()
    node = {m: deps for m, deps in graph.items() if not m.startswith("ddplab.controller")}
    assert "ddplab.status" in node and "ddplab.bench.cluster" in node
    bad = {m: sorted(d for d in deps if d.startswith("ddplab.controller")) for m, deps in node.items()}
    assert not {m: d for m, d in bad.items() if d}
