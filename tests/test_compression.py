"""Gradient compression (ddplab.compression): the hooks keep the replicas bit-identical and send
the bytes the payload model says; the gpt2 preset is the seed's 124M model; the setting through
ddplab.config (the trainer's records of it: tests/test_wire_laptops.py)."""

import json
import subprocess

import pytest
import torch
from conftest import REPO, VENV_BIN, subprocess_env, tiny_args
from ddplab import compression
from ddplab.config import GRAD_COMPRESSIONS, ConfigError, build_config
from ddplab.model import GPT, GPTConfig

WORKER = REPO / "tests" / "compression_worker.py"


def gpt2_shapes() -> list[tuple[int, ...]]:
    cfg = build_config({"preset": "gpt2"})
    with torch.device("meta"):
        model = GPT(GPTConfig(vocab_size=cfg.vocab_size, block_size=cfg.block_size, n_layer=cfg.n_layer,
                              n_head=cfg.n_head, n_embd=cfg.n_embd))
    return compression.grad_shapes(model)


def test_gpt2_preset_is_the_seeds_124m_model_and_its_496_mb_exchange():
    shapes = gpt2_shapes()
    params = sum(torch.Size(s).numel() for s in shapes)
    assert params == 124_439_808  # GPT-2 small with its 50257-token vocabulary (tied head)
    d = compression.payload_bytes("none", shapes)
    assert d == 4 * params and round(d / 1e6) == 498
    assert compression.payload_bytes("bf16", shapes) == compression.payload_bytes("fp16", shapes) == d // 2


def test_powersgd_payload_counts_factors_of_the_compressed_matrices_only():
    # 768 x 3072 at rank 4: (768 + 3072) * 4 elements; a bias and a 3 x 5 matrix stay whole
    assert compression.powersgd_elements((768, 3072), 4) == ((768 + 3072) * 4, True)
    assert compression.powersgd_elements((3072,), 4) == (3072, False)
    assert compression.powersgd_elements((3, 5), 4) == (15, False)  # (3 + 5) * 3 * 2 >= 15
    shapes = [(768, 3072), (3072,)]
    whole = 4 * (768 * 3072 + 3072)
    assert compression.payload_bytes("powersgd", shapes, step=9, powersgd_start_step=10) == whole
    assert compression.payload_bytes("powersgd", shapes, step=10, powersgd_start_step=10) == 4 * (
        (768 + 3072) * 4 + 3072)
    ratio = compression.payload_bytes("none", gpt2_shapes()) / compression.payload_bytes(
        "powersgd", gpt2_shapes(), step=10)
    assert ratio > 50  # the embedding and every block matrix compress


def test_unknown_compression_is_refused():
    with pytest.raises(ValueError, match="compression 'int8'"):
        compression.payload_bytes("int8", [(4, 4)])
    with pytest.raises(ValueError, match="compression 'none'"):
        compression.CompressedAllReduce(2, "none")


@pytest.mark.parametrize(("values", "match"), [
    ({"grad_compression": "int8"}, "'grad_compression' = 'int8': must be one of none, fp16, bf16, powersgd"),
    ({"grad_compression": "powersgd", "powersgd_rank": 0}, "'powersgd_rank' = 0: must be an integer >= 1"),
    ({"powersgd_start_step": 1}, "'powersgd_start_step' = 1: must be an integer >= 2"),
    ({"vocab_size": 0}, "'vocab_size' = 0: must be a positive integer or null"),
    ({"grad_compression": "bf16", "fault_tolerance": "per_step", "ft_lighthouse": "http://10.0.0.1:29510"},
     "'grad_compression' = 'bf16': compresses the gradients of the torchelastic engine"),
])
def test_bad_compression_settings_are_one_line_errors(values, match):
    with pytest.raises(ConfigError, match=match.replace("(", r"\(").replace(")", r"\)")):
        build_config(values)


def test_every_compression_is_accepted_under_torchelastic():
    for name in GRAD_COMPRESSIONS:
        assert build_config({"grad_compression": name}).grad_compression == name


@pytest.mark.slow
def test_replicas_stay_bit_identical_after_every_step_and_send_the_modelled_bytes():
    """Two gloo ranks, every mode: the parameters' SHA-256 is the same on both ranks after each of
    8 steps; the bytes the hook handed to all_reduce are payload_bytes (fp16/bf16 half of fp32,
    PowerSGD fp32 for its 3 start steps, then far less); the compressed modes change the result."""
    proc = subprocess.run(
        [str(VENV_BIN / "torchrun"), "--standalone", "--nproc-per-node=2", str(WORKER),
         ",".join(GRAD_COMPRESSIONS)], env=subprocess_env(), capture_output=True, text=True,
        timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    by_mode = {m: [r for r in rows if r["mode"] == m] for m in GRAD_COMPRESSIONS}
    assert all(len(v) == 8 for v in by_mode.values()), proc.stdout
    assert all(r["identical"] for r in rows)
    assert all(r["counted"] == r["modelled"] for r in rows)
    assert all(r["calls"] == 1 and r["seconds"] > 0 for r in rows)  # one bucket, timed
    fp32 = by_mode["none"][0]["counted"]
    for half in ("fp16", "bf16"):
        assert {r["counted"] for r in by_mode[half]} == {fp32 // 2}
        assert all(r["diff_to_fp32"] > 0 for r in by_mode[half])
    psgd = by_mode["powersgd"]
    assert [r["counted"] for r in psgd[:3]] == [fp32] * 3 and all(r["diff_to_fp32"] == 0 for r in psgd[:3])
    assert all(r["counted"] < fp32 / 5 and r["diff_to_fp32"] > 0 for r in psgd[3:])


def test_vocab_size_below_the_datasets_characters_is_refused_before_training(tmp_path, data_path):
    proc = subprocess.run([str(VENV_BIN / "python"), "-m", "ddplab.train",
                           *tiny_args(tmp_path, data_path, vocab_size=10)],
                          env=subprocess_env(), capture_output=True, text=True, timeout=120, cwd=REPO)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "ddplab.train: error: config key 'vocab_size' = 10: below the dataset's 65 characters; "
        "fix: null (the dataset's) or a larger number"]
    assert not (tmp_path / "metrics").exists() or not any((tmp_path / "metrics").iterdir())
