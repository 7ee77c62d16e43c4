"""TrainConfig: defaults, presets, precedence (defaults < preset < JSON < CLI), validation."""

import json

import pytest
from ddplab.config import PRESETS, ConfigError, TrainConfig, build_config, parse_args


def test_default_is_the_small_cpu_config():
    cfg = TrainConfig().validate()
    assert (cfg.n_layer, cfg.n_head, cfg.n_embd, cfg.block_size, cfg.per_rank_batch_size, cfg.dropout) == (
        4, 4, 128, 64, 12, 0.0)
    assert cfg.preset == "small" and cfg.pg_timeout_s == 60.0 and cfg.peer_timeout_s == 5.0
    assert build_config() == cfg


def test_larger_preset_exists():
    cfg = build_config({"preset": "medium"})
    assert cfg.n_embd > 128 and cfg.n_layer > 4 and cfg.block_size > 64
    assert set(PRESETS) >= {"tiny", "small", "medium"}


def test_precedence(tmp_path):
    run = tmp_path / "run.json"
    run.write_text(json.dumps(
        {"preset": "tiny", "n_layer": 3, "max_steps": 7, "warmup_steps": 2, "global_batch_size": 24}
    ))
    cfg, check = parse_args(["--config", str(run), "--max-steps", "9", "--global_batch_size", "null"])
    assert not check
    assert cfg.n_embd == PRESETS["tiny"]["n_embd"]  # from the preset
    assert cfg.n_layer == 3  # JSON beats preset
    assert cfg.max_steps == 9  # CLI beats JSON (dash form)
    assert cfg.global_batch_size is None  # CLI null clears (underscore form)
    cfg, _ = parse_args(["--config", str(run), "--preset", "small"])
    assert cfg.n_embd == 128 and cfg.n_layer == 3


def test_integral_json_floats_are_accepted_for_ints():
    assert build_config({"max_steps": 100.0}).max_steps == 100
    with pytest.raises(ConfigError, match="'max_steps' = 100.5: must be int"):
        build_config({"max_steps": 100.5})


@pytest.mark.parametrize(("values", "match"), [
    ({"per_rank_batch_size": 0}, "'per_rank_batch_size' = 0: must be a positive integer"),
    ({"per_rank_batch_size": -1}, "'per_rank_batch_size' = -1"),
    ({"global_batch_size": 0}, "'global_batch_size' = 0"),
    ({"n_embd": 100, "n_head": 3}, "'n_embd' = 100: must be divisible by n_head = 3"),
    ({"batch_policy": "keep_both"}, "must be one of keep_per_rank, keep_global"),
    ({"preset": "huge"}, "'preset' = 'huge'"),
    ({"base_lr": 0}, "'base_lr' = 0.0: must be a number > 0"),
    ({"pg_timeout_s": -5}, "'pg_timeout_s' = -5.0"),
    ({"peer_timeout_s": 0.5}, "'peer_timeout_s' = 0.5: must be a number >= 1 (seconds) or null"),
    ({"dropout": 1.5}, "'dropout' = 1.5: must be a number in [0, 1)"),
    ({"min_lr_ratio": 2}, "'min_lr_ratio'"),
    ({"warmup_steps": 100, "max_steps": 100}, "'warmup_steps' = 100: must be smaller than max_steps"),
    ({"threads": 0}, "'threads' = 0"),
    ({"data_sha256": "xyz"}, "'data_sha256' = 'xyz': must be 64 lowercase hex digits"),
    ({"run_id": "a/b"}, "'run_id' = 'a/b'"),
    ({"keep_checkpoints": 0}, "'keep_checkpoints' = 0"),
    ({"colour": "blue"}, "unknown config key(s) in config file: colour"),
])
def test_validation_names_key_and_fix(values, match):
    with pytest.raises(ConfigError, match=match.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        build_config(values)


def test_fresh_start_ramp_and_divergence_keys():
    cfg, _ = parse_args(["--allow-fresh-start"])
    assert cfg.allow_fresh_start is True and cfg.ramp_steps() == cfg.warmup_steps == 30
    assert parse_args(["--allow-fresh-start", "false"])[0].allow_fresh_start is False
    assert build_config({"allow_fresh_start": True, "lr_ramp_steps": 0}).ramp_steps() == 0
    assert TrainConfig().allow_fresh_start is False and TrainConfig().divergence_margin == 3.0
    for bad, match in [({"allow_fresh_start": "maybe"}, "must be true or false"),
                       ({"lr_ramp_steps": -1}, "'lr_ramp_steps' = -1: must be an integer >= 0"),
                       ({"divergence_margin": 0}, "'divergence_margin' = 0.0: must be a number > 0")]:
        with pytest.raises(ConfigError, match=match):
            build_config(bad)
