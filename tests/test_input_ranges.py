"""Bad input that once ended in a traceback ends in one line, from ``--check`` and from a run,
before anything is written: integer keys out of what torch/numpy hold (the seed above all), a
dataset the training user cannot read, and a batch or model that cannot fit in memory
(ddplab.memory's estimate, checked against the node's available memory)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from conftest import REPO, TRAIN_DIR, subprocess_env, tiny_args
from ddplab import memory
from ddplab import train as train_mod
from ddplab.config import FIELD_TYPES, INT64_MAX, PRESETS, ConfigError, TrainConfig, build_config
from ddplab.model import GPT, GPTConfig

NOBODY = 65534
GiB = 1 << 30
E30 = int(1e30)  # 1000000000000000019884624838656: the float 1e30 of a JSON file, as an int


def one_error_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("ddplab.train: error:"), err
    assert "Traceback" not in err
    return lines[0]


def both_modes(argv: list[str], capsys) -> list[str]:
    """The error line of ``--check`` and of a run of ``argv`` (each must exit EXIT_BAD_INPUT)."""
    lines = []
    for extra in (["--check"], []):
        assert train_mod.main([*argv, *extra]) == train_mod.EXIT_BAD_INPUT
        lines.append(one_error_line(capsys.readouterr().err))
    return lines


# --- (a) integer ranges --------------------------------------------------------------------------

@pytest.mark.parametrize(("values", "match"), [
    ({"seed": 1e30}, f"'seed' = {E30}: must be an integer in [0, 9223372036854775807]"),
    ({"seed": 2**63}, "'seed' = 9223372036854775808: must be an integer in [0, 9223372036854775807]"),
    ({"seed": -1}, "'seed' = -1: must be an integer in [0, 9223372036854775807]"),
    ({"seed": 1.5}, "'seed' = 1.5: must be int (an integer in [0, 9223372036854775807])"),
    ({"seed": "1e30"}, "'seed' = '1e30': must be int (an integer in [0, 9223372036854775807])"),
    ({"max_steps": 1e30}, f"'max_steps' = {E30}: must be at most 9223372036854775807"),
    ({"block_size": 2**63}, "'block_size' = 9223372036854775808: must be at most 9223372036854775807"),
    ({"eval_iters": 10**30}, "'eval_iters' = 1000000000000000000000000000000: must be at most"),
    ({"threads": 100000}, "'threads' = 100000: must be at most 1024"),
])
def test_integer_keys_name_their_range(values, match):
    with pytest.raises(ConfigError, match=match.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        build_config(values)


def test_every_integer_key_is_capped_at_int64():
    ints = [k for k, t in FIELD_TYPES.items() if t is int]
    assert {"seed", "max_steps", "block_size", "per_rank_batch_size", "n_embd", "vocab_size"} <= set(ints)
    for key in ints:
        with pytest.raises(ConfigError, match=f"'{key}' = {2**63}: must be"):
            build_config({key: 2**63})
    assert build_config({"seed": INT64_MAX}).seed == INT64_MAX
    assert build_config({"seed": 0}).seed == 0


@pytest.mark.parametrize(("how", "expect"), [
    ("json 1e30", f"'seed' = {E30}: must be an integer in [0, 9223372036854775807]"),
    ("cli 2**64", "'seed' = 18446744073709551616: must be an integer in [0, 9223372036854775807]"),
    ("cli -5", "'seed' = -5: must be an integer in [0, 9223372036854775807]"),
    ("cli 1e30", "'seed' = '1e30': must be int (an integer in [0, 9223372036854775807])"),
])
def test_out_of_range_seed_is_one_line_from_check_and_run(how, expect, tmp_path, data_path, clean_env,
                                                         capsys):
    """Before: ``"seed": 1e30`` passed ``--check`` and the run died in torch.manual_seed
    ("Overflow when unpacking long long") after writing its metrics."""
    out = tmp_path / "run"
    argv = tiny_args(out, data_path)
    if how.startswith("json"):
        config = tmp_path / "run.json"
        config.write_text('{"seed": 1e30}')
        argv += ["--config", str(config)]
    else:
        argv += ["--seed", {"cli 2**64": str(2**64), "cli -5": "-5", "cli 1e30": "1e30"}[how]]
    for line in both_modes(argv, capsys):
        assert expect in line, line
    assert not out.exists()


def test_seed_at_the_top_of_its_range_trains(tmp_path, data_path, clean_env, capsys):
    out = tmp_path / "run"
    argv = tiny_args(out, data_path, max_steps=2, warmup_steps=1, eval_interval=2, ckpt_interval=2,
                     sample_chars=5, dropout=0.1, seed=INT64_MAX)
    assert train_mod.main(argv) == 0, capsys.readouterr().err


def test_powersgd_takes_any_valid_seed():
    from ddplab import compression

    state = compression.CompressedAllReduce(2, "powersgd", seed=INT64_MAX)
    assert state.powersgd is not None


# --- (b) a dataset the training user cannot read ------------------------------------------------

def _world_dir() -> Path:
    """A folder every user can enter and write (pytest's tmp_path is under a 0700 folder)."""
    folder = Path(tempfile.mkdtemp(prefix="ddplab-perm-", dir="/tmp"))
    folder.chmod(0o777)
    return folder


#: Run ddplab.train as another uid when started as root: the interpreter (and the standard
#: library) may live where that uid cannot go, so the trainer is imported first, then the
#: process gives up root, then main() runs.
_AS_USER = """
import os, sys
import ddplab.train as train
uid = int(sys.argv[1])
if uid != os.getuid():
    os.setgroups([])
    os.setgid(uid)
    os.setuid(uid)
sys.exit(train.main(sys.argv[2:]))
"""


def run_unprivileged(argv: list[str]) -> subprocess.CompletedProcess:
    """``python -m ddplab.train ARGV`` as uid 65534 when this is root, else as this user."""
    uid = NOBODY if os.getuid() == 0 else os.getuid()
    return subprocess.run([sys.executable, "-c", _AS_USER, str(uid), *argv], cwd="/tmp",
                          env=subprocess_env(PYTHONPATH=str(TRAIN_DIR)), capture_output=True,
                          text=True, timeout=120)


@pytest.mark.parametrize("sha", ["none", "given"])
@pytest.mark.parametrize("case", ["mode 000", "folder not searchable"])
def test_unreadable_dataset_is_one_line(case, sha, data_path):
    """Before: with no data_sha256, a mode-000 dataset gave a PermissionError traceback (run and
    ``--check``); a folder on its path the user cannot enter gave one from ``Path.exists``."""
    work = _world_dir()
    try:
        holder = work / "data"
        holder.mkdir()
        holder.chmod(0o755)
        dataset = holder / "input.txt"
        shutil.copyfile(data_path, dataset)
        if case == "mode 000":
            dataset.chmod(0o000)
        else:
            dataset.chmod(0o644)
            holder.chmod(0o700)  # root's: uid 65534 cannot enter it
        if os.getuid() != 0 and os.access(dataset, os.R_OK):
            pytest.skip("this user reads mode-000 files (a capability): cannot test unreadability")
        out = work / "out"
        argv = tiny_args(out, dataset)
        if sha == "none":
            argv += ["--data-sha256", "null"]
        for extra in (["--check"], []):
            proc = run_unprivileged([*argv, *extra])
            assert proc.returncode == train_mod.EXIT_BAD_INPUT, proc.stderr
            line = one_error_line(proc.stderr)
            uid = NOBODY if os.getuid() == 0 else os.getuid()
            if case == "mode 000":
                assert f"dataset {dataset} is not readable by uid {uid} (Permission denied" in line, line
                assert "mode 0000" in line and "fix its permissions" in line, line
            else:
                assert f"dataset {dataset} cannot be reached by uid {uid}" in line, line
                assert "a folder on its path is not searchable" in line, line
            assert not out.exists()
    finally:
        for sub in (work / "data",):
            if sub.exists():
                sub.chmod(0o755)
        shutil.rmtree(work, ignore_errors=True)


@pytest.mark.parametrize(("case", "expect"), [
    ("folder", "is a folder, not a regular file: point data_path at the text file"),
    ("dangling symlink", "is a symbolic link to {target}, which does not exist"),
    ("symlink loop", "cannot be reached: Too many levels of symbolic links"),
])
@pytest.mark.parametrize("url", ["null", "http://127.0.0.1:9/input.txt"])
def test_dataset_that_is_no_file_is_one_line(case, expect, url, tmp_path, clean_env, capsys):
    path = tmp_path / "input.txt"
    target = tmp_path / "gone.txt"
    if case == "folder":
        path.mkdir()
    elif case == "dangling symlink":
        path.symlink_to(target)
    else:
        path.symlink_to(path)
    out = tmp_path / "run"
    argv = [*tiny_args(out, path), "--data-sha256", "null", "--data-url", url]
    for line in both_modes(argv, capsys):
        assert f"dataset {path} " + expect.format(target=target) in line, line
    assert not out.exists() and not target.exists()


# --- (c) memory ----------------------------------------------------------------------------------

@pytest.mark.parametrize(("vocab", "block", "layers", "embd"), [(65, 32, 2, 32), (65, 64, 4, 128),
                                                                 (50257, 128, 1, 48)])
def test_param_count_is_the_models(vocab, block, layers, embd):
    model = GPT(GPTConfig(vocab_size=vocab, block_size=block, n_layer=layers, n_head=2, n_embd=embd))
    assert memory.param_count(vocab, block, layers, embd) == model.num_params()


@pytest.mark.parametrize("dropout", [0.0, 0.2])
def test_saved_activations_are_what_autograd_keeps(dropout):
    """The formula's saved tensors against the storages autograd really saves for the backward."""
    vocab, block, layers, heads, embd, batch = 65, 64, 2, 4, 64, 8
    model = GPT(GPTConfig(vocab, block, layers, heads, embd, dropout))
    model.train()
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    x = torch.randint(0, vocab, (batch, block))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(x, x)
    formula = memory.saved_activation_bytes(batch, block, layers, heads, embd, vocab, dropout)
    assert 0.9 < sum(saved.values()) / formula < 1.1, (sum(saved.values()), formula)


_PEAK = """
import json, resource, sys
import psutil, torch
from ddplab.config import build_config
from ddplab.model import GPT, GPTConfig
from ddplab import memory
torch.set_num_threads(1)
cfg = build_config(json.loads(sys.argv[1]))
base = psutil.Process().memory_info().rss
model = GPT(GPTConfig(65, cfg.block_size, cfg.n_layer, cfg.n_head, cfg.n_embd, cfg.dropout))
opt = torch.optim.AdamW(model.param_groups(0.1), lr=1e-3)
x = torch.randint(0, 65, (cfg.per_rank_batch_size, cfg.block_size))
for _ in range(2):
    _, loss = model(x, x)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base
est = memory.estimate(cfg, 65)
print(json.dumps({"measured": peak, "estimate": est.fixed_bytes + est.state_bytes + est.activation_bytes}))
"""


@pytest.mark.parametrize("dropout", [0.0, 0.2])
def test_estimate_is_the_size_of_the_measured_peak(dropout):
    """Two training steps of a model whose activations dominate (about 0.5-1 GB): the estimate of
    the training phase is within a factor of the process's measured peak RSS growth."""
    values = {"preset": "tiny", "n_layer": 2, "n_head": 4, "n_embd": 128, "block_size": 256,
              "per_rank_batch_size": 48, "dropout": dropout}
    proc = subprocess.run([sys.executable, "-c", _PEAK, json.dumps(values)], env=subprocess_env(),
                          capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout)
    assert 0.7 < got["estimate"] / got["measured"] < 1.5, got


_CKPT_PEAK = """
import json, resource, sys, torch
from ddplab.checkpoint import CheckpointStore
from ddplab import memory
params = int(sys.argv[2])
model = {f"h.{i}.w": torch.randn(params // 8) for i in range(8)}  # a model's tensors: P in all
state = {"step": 1, "samples_seen": 0, "model": model,
         "optimizer": {"exp_avg": torch.randn(params), "exp_avg_sq": torch.rand(params)}}
store = CheckpointStore(sys.argv[1], keep=1)
store.save({"step": 0, "samples_seen": 0, "model": {"w": torch.ones(4)}})  # one-off (FIXED)
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
store.save(state)
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(json.dumps({"measured": peak - base, "estimate": (memory.BYTES_PER_ELEMENT + 1) * params}))
"""


def test_a_checkpoint_write_adds_no_copy_of_the_state(tmp_path):
    """A checkpoint of P parameters with AdamW state (12P bytes) is written with the peak RSS
    growing by at most the estimate's 5P (the weights read back to check them), not by copies of
    the serialized state (24P and more when it was serialized in memory and loaded back)."""
    params = 32 << 20
    proc = subprocess.run([sys.executable, "-c", _CKPT_PEAK, str(tmp_path / "ck"), str(params)],
                          env=subprocess_env(), capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout)
    assert got["measured"] <= got["estimate"], got


def test_presets_and_test_configs_are_not_refused():
    """The normal presets fit a laptop of 8 GB (one worker), and the tests' configurations fit
    this machine."""
    limits = {"tiny": 0.5 * GiB, "small": 0.5 * GiB, "medium": 2 * GiB, "gpt2": 6 * GiB}
    assert set(limits) == set(PRESETS)
    for name, limit in limits.items():
        cfg = build_config({"preset": name})
        assert memory.estimate(cfg, 65, world_size=3).peak_bytes < limit, name
        memory.check_fits(cfg, 65, world_size=3, available=(8 * GiB, "an 8 GB laptop"))
    tests = build_config({"preset": "tiny", "max_steps": 20, "warmup_steps": 3, "eval_iters": 2,
                          "sample_chars": 20, "reference_batch_size": 12})
    assert memory.check_fits(tests, 65, 3, 3).node_bytes < GiB


@pytest.mark.parametrize(("values", "fix"), [
    ({"preset": "tiny", "per_rank_batch_size": 100000, "block_size": 1024}, "lower per_rank_batch_size"),
    ({"preset": "tiny", "n_embd": 20000}, "a smaller model: lower n_layer, n_embd or vocab_size"),
    ({"preset": "tiny", "eval_iters": 10**12}, "lower eval_iters"),
    ({"preset": "tiny", "sample_chars": 10**12}, "lower sample_chars"),
    ({"preset": "tiny", "batch_policy": "keep_global", "global_batch_size": 10**12},
     "lower global_batch_size"),
])
def test_too_much_memory_is_one_line_naming_what_to_lower(values, fix):
    cfg = build_config(values)
    with pytest.raises(memory.MemoryFitError) as err:
        memory.check_fits(cfg, 65, local_workers=2, available=(16 * GiB, "test figure"))
    line = str(err.value)
    assert "\n" not in line and fix in line, line
    assert "more than the 16.0 GiB available (test figure)" in line, line
    assert "2 local workers x " in line and "fewer workers per node" in line, line


def test_cgroup_headroom_reads_v2_and_v1_limits(tmp_path):
    v2, v1, free = tmp_path / "v2", tmp_path / "v1", tmp_path / "free"
    for folder in (v2, v1, free):
        folder.mkdir()
    (v2 / "memory.max").write_text(f"{GiB}\n")
    (v2 / "memory.current").write_text(f"{600 << 20}\n")
    (v2 / "memory.stat").write_text(f"anon 1\ninactive_file {100 << 20}\nactive_file 5\n")
    (free / "memory.max").write_text("max\n")
    (v1 / "memory.limit_in_bytes").write_text(f"{2 * GiB}\n")
    (v1 / "memory.usage_in_bytes").write_text(f"{GiB}\n")
    (v1 / "memory.stat").write_text(f"total_inactive_file {GiB // 2}\n")
    room, source = memory.cgroup_headroom([(v2, 2), (free, 2)])
    assert room == GiB - (500 << 20) and "memory.max" in source
    assert memory.cgroup_headroom([(free, 2)]) is None
    assert memory.cgroup_headroom([(v1, 1)])[0] == 2 * GiB - GiB // 2
    (v1 / "memory.limit_in_bytes").write_text("9223372036854771712\n")  # v1's "no limit"
    assert memory.cgroup_headroom([(v1, 1), (tmp_path / "missing", 2)]) is None


def test_available_memory_is_the_smaller_of_machine_and_cgroup(tmp_path, monkeypatch):
    class VM:
        available = 8 * GiB

    monkeypatch.setattr(memory.psutil, "virtual_memory", lambda: VM)
    (tmp_path / "memory.max").write_text(f"{GiB}\n")
    (tmp_path / "memory.current").write_text("0\n")
    assert memory.available_memory([(tmp_path, 2)])[0] == GiB
    assert memory.available_memory([]) == (8 * GiB, "available memory of the machine")


def test_fmt_bytes():
    assert [memory.fmt_bytes(n) for n in (512, 3 << 20, 5 * GiB, 10**20)] == [
        "512 B", "3.0 MiB", "5.0 GiB", "8.9e+04 TiB"]


def test_check_reports_the_estimate(tmp_path, data_path, clean_env, capsys):
    assert train_mod.main([*tiny_args(tmp_path / "x", data_path), "--check"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert 0 < shown["memory_estimate_bytes"] < GiB
    assert shown["memory"]["params"] == GPT(GPTConfig(65, 32, 2, 2, 32)).num_params()
    assert shown["memory"]["available_bytes"] > shown["memory_estimate_bytes"]


@pytest.mark.parametrize(("overrides", "fix"), [
    ({"per_rank_batch_size": 100000, "block_size": 1024}, "lower per_rank_batch_size"),
    ({"n_embd": 20000}, "a smaller model"),
])
def test_run_that_cannot_fit_is_one_line_before_anything_is_written(overrides, fix, tmp_path, data_path,
                                                                    clean_env, capsys, monkeypatch):
    """Before: these passed ``--check`` and the run died in an allocation traceback."""
    monkeypatch.setattr(memory, "available_memory", lambda folders=None: (16 * GiB, "test figure"))
    out = tmp_path / "run"
    for line in both_modes(tiny_args(out, data_path, **overrides), capsys):
        assert "ddplab.train: error: the run needs about " in line and fix in line, line
        assert "more than the 16.0 GiB available (test figure)" in line, line
    assert not out.exists()


def test_memory_check_sees_no_dataset_vocabulary_before_download(tmp_path, clean_env, capsys, monkeypatch):
    """``--check`` of a dataset a run would download: the estimate assumes a vocabulary."""
    monkeypatch.setattr(memory, "available_memory", lambda folders=None: (16 * GiB, "test figure"))
    argv = [*tiny_args(tmp_path / "run", tmp_path / "data" / "input.txt"), "--data-url",
            "http://127.0.0.1:9/input.txt", "--check"]
    assert train_mod.main(argv) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["dataset"].startswith("missing") and shown["memory"]["params"] == memory.param_count(
        memory.ASSUMED_VOCAB, 32, 2, 32)
    cfg = TrainConfig(vocab_size=None)
    assert memory.estimate(cfg).params == memory.param_count(memory.ASSUMED_VOCAB, 64, 4, 128)

