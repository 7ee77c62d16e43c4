"""Bytes on the wire of two "laptops": two network namespaces joined by a veth pair (the fixture of
tests/test_gloo_bind.py; laptop-a's address labelled ``veth:1`` beside an IPv6 one), one ddplab.train
rank in each with its own folder, DDPLAB_GLOO_ADDR as the ddp_job unit sets it. Only this test's
traffic crosses the veth, so the NIC counts are the training's: each rank's step records name the
veth and count, per step, the ring model's bytes plus headers and acknowledgements; bf16 halves
them."""

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, dataset_path, subprocess_env, tiny_args
from test_gloo_bind import two_laptops  # noqa: F401  (the fixture)

pytestmark = pytest.mark.slow
RUN_TIMEOUT_S = 240


def train_pair(sides: dict, tmp: Path, compression: str) -> dict[str, list[dict]]:
    """Rank 0 in ``b`` (hosts the env:// store), rank 1 in ``a``: 9 tiny steps, step records every
    3; returns each side's step records."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    procs = {}
    for side, rank in (("b", 0), ("a", 1)):
        out = tmp / compression / side
        env = subprocess_env(RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR=sides["b"]["addr"], MASTER_PORT=port,
                             DDPLAB_GLOO_ADDR=sides[side]["addr"])
        env.pop("GLOO_SOCKET_IFNAME", None)
        args = tiny_args(out, dataset_path(), max_steps=9, log_interval=3, eval_interval=9, ckpt_interval=9,
                         sample_chars=0, grad_compression=compression)
        procs[side] = (out, subprocess.Popen(
            ["ip", "netns", "exec", sides[side]["ns"], sys.executable, "-m", "ddplab.train", *args],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO))
    steps = {}
    try:
        for side, (out, proc) in procs.items():
            _, err = proc.communicate(timeout=RUN_TIMEOUT_S)
            assert proc.returncode == 0, err[-3000:]
            (metrics,) = (out / "metrics").glob("*.jsonl")
            steps[side] = [r for line in metrics.read_text().splitlines()
                           if (r := json.loads(line))["event"] == "step"]
    finally:
        for _, proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return steps


def test_each_laptop_counts_its_nic_bytes_beside_the_ring_model(two_laptops, tmp_path):  # noqa: F811
    sides = two_laptops("labelled")
    runs = {c: train_pair(sides, tmp_path, c) for c in ("none", "bf16")}
    sent = {}
    for compression, by_side in runs.items():
        for side, steps in by_side.items():
            assert [r["step"] for r in steps] == [3, 6, 9]
            for r in steps:
                assert r["nic"] == sides[side]["ifname"], r  # a's labelled address: its device
                assert r["grad_compression"] == compression and r["nic_steps"] == 3
                assert r["wire_model_bytes"] == r["grad_bytes"]  # N = 2
                # what the veth carried: the model's bytes, plus TCP/IP headers, acknowledgements
                # and the loss all-reduce of the divergence guard; nothing else crosses it
                for key in ("nic_sent_bytes", "nic_recv_bytes"):
                    assert 1.0 <= r[key] / r["wire_model_bytes"] < 1.15, (compression, side, key, r)
            sent[compression, side] = sum(r["nic_sent_bytes"] for r in steps)
    for side in "ab":
        assert 0.45 < sent["bf16", side] / sent["none", side] < 0.6
