"""ddp_job_grad_compression through the ddp_job role: the run.json keys Ansible renders from the
role's own defaults and vars (none: no key, so run.json stays as it was), and the training program
accepts what it renders."""

from pathlib import Path

import pytest
from ddplab.config import build_config
from labharness import render_agent_launch

KEYS = ("grad_compression", "powersgd_rank", "powersgd_start_step")


def compression_keys(config: dict) -> dict:
    return {k: v for k, v in config.items() if k in KEYS}


@pytest.mark.parametrize(("extra", "want"), [
    ((), {}),
    (("-e", "ddp_job_grad_compression=none"), {}),
    (("-e", "ddp_job_grad_compression=bf16"), {"grad_compression": "bf16"}),
    (("-e", "ddp_job_grad_compression=fp16"), {"grad_compression": "fp16"}),
    (("-e", "ddp_job_grad_compression=powersgd"),
     {"grad_compression": "powersgd", "powersgd_rank": 4, "powersgd_start_step": 10}),
    (("-e", "ddp_job_grad_compression=powersgd", "-e", "ddp_job_powersgd_rank=8",
      "-e", "ddp_job_powersgd_start_step=50"),
     {"grad_compression": "powersgd", "powersgd_rank": 8, "powersgd_start_step": 50}),
])
def test_run_json_carries_the_compression(tmp_path: Path, extra, want):
    _, _, config = render_agent_launch(tmp_path, *extra)
    assert compression_keys(config) == want
    merged = build_config({**config, "data_url": None})
    assert merged.grad_compression == want.get("grad_compression", "none")
