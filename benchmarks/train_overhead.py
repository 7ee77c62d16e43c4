"""Overhead of the ddplab training loop at world size 1 versus a minimal plain loop.

Both loops train the same model (same config, same initial weights, AdamW with the same groups,
same gradient clipping) on tiny-shakespeare in this process, alternating A B A B ... so that
a change of machine load hits both. Throughput is measured between the end of step ``--skip``
and the end of step ``--steps`` (tokens of those steps / seconds), excluding start-up, the first
steps and the final evaluation. The ddplab loop includes everything it does per step: the
deterministic global-sample sampler, the LR schedule, metrics records every ``log_interval``
steps with CPU clock/temperature readings, signal guards. Target: overhead <= 5 %.

Writes the table to ``benchmarks/results/train_overhead.md`` (:mod:`ddplab.bench.results`).

Usage: PYTHONPATH=train .venv/bin/python benchmarks/train_overhead.py [--steps 200] [--repeats 3]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO / "train"), str(REPO / "benchmarks")]

from benchcli import HelpFormatter, add_results_dir, first_sentence  # noqa: E402  (benchmarks/benchcli.py)
from ddplab import cpushare  # noqa: E402
from ddplab import train as train_mod  # noqa: E402
from ddplab.bench import results  # noqa: E402
from ddplab.config import build_config  # noqa: E402
from ddplab.data import load_dataset  # noqa: E402
from ddplab.model import GPT, GPTConfig  # noqa: E402

DEFAULT_DATA = os.environ.get("DDP_LAB_DATA") or str(REPO.parent / "shared/data/tinyshakespeare/input.txt")


def ddplab_loop(args, out_dir: Path) -> float:
    """Tokens/s of ``python -m ddplab.train`` (in-process, world size 1) between steps skip..steps."""
    argv = ["--preset", args.preset, "--data-path", args.data_path, "--out-dir", str(out_dir),
            "--max-steps", str(args.steps), "--warmup-steps", "10", "--eval-interval", str(10 * args.steps),
            "--ckpt-interval", str(10 * args.steps), "--log-interval", str(args.log_interval),
            "--sample-chars", "0", "--threads", str(args.threads), "--eval-iters", "1"]
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        os.environ.pop(var, None)
    with contextlib.redirect_stdout(io.StringIO()):
        code = train_mod.main(argv)
    if code != 0:
        raise SystemExit(f"ddplab loop failed with exit code {code}")
    records = [json.loads(line) for path in (out_dir / "metrics").glob("*.jsonl")
               for line in path.read_text().splitlines()]
    times = {r["step"]: r["time"] for r in records if r["event"] == "step"}
    start = next(r for r in records if r["event"] == "start")
    if args.skip not in times or args.steps not in times:
        raise SystemExit("--skip and --steps must be multiples of --log-interval")
    block = build_config({"preset": args.preset}).block_size
    tokens = (args.steps - args.skip) * start["global_batch_size"] * block
    return tokens / (times[args.steps] - times[args.skip])


def plain_loop(args, data) -> float:
    """Tokens/s of a textbook loop: random windows, forward, backward, clip, AdamW step."""
    cfg = build_config({"preset": args.preset})
    torch.manual_seed(cfg.seed)
    model = GPT(GPTConfig(vocab_size=len(data.vocab), block_size=cfg.block_size, n_layer=cfg.n_layer,
                          n_head=cfg.n_head, n_embd=cfg.n_embd, dropout=cfg.dropout))
    opt = torch.optim.AdamW(model.param_groups(cfg.weight_decay), lr=1e-3, betas=(cfg.beta1, cfg.beta2))
    train = torch.from_numpy(data.train.astype("int64"))
    b, t = cfg.per_rank_batch_size, cfg.block_size
    gen = torch.Generator().manual_seed(cfg.seed)
    t_skip = None
    for step in range(1, args.steps + 1):
        starts = torch.randint(len(train) - t - 1, (b,), generator=gen)
        x = torch.stack([train[s:s + t] for s in starts])
        y = torch.stack([train[s + 1:s + t + 1] for s in starts])
        opt.zero_grad(set_to_none=True)
        _, loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        loss.item()
        if step == args.skip:
            t_skip = time.perf_counter()
    return (args.steps - args.skip) * b * t / (time.perf_counter() - t_skip)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=first_sentence(__doc__), formatter_class=HelpFormatter)
    parser.add_argument("--preset", default="small", help="the model (ddplab.config presets)")
    parser.add_argument("--steps", type=int, default=200, help="optimizer steps of each timed loop")
    parser.add_argument("--skip", type=int, default=20, help="steps excluded from the timing (warm-up)")
    parser.add_argument("--repeats", type=int, default=3, help="repeats: ddplab loop, then plain loop")
    parser.add_argument("--log-interval", type=int, default=10, help="steps between metric records")
    parser.add_argument("--threads", type=int, default=cpushare.threads_for(cpushare.read_share().share),
                        help="torch threads (default: this process's CPU share, ddplab.cpushare)")
    parser.add_argument("--data-path", default=DEFAULT_DATA, help="the tiny-shakespeare input.txt")
    add_results_dir(parser)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    data = load_dataset(args.data_path)
    ours, plain = [], []
    load_before = results.loadavg()
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.repeats):
            ours.append(ddplab_loop(args, Path(tmp) / f"run{rep}"))
            torch.set_num_threads(args.threads)
            plain.append(plain_loop(args, data))
            print(f"repeat {rep + 1}: ddplab {ours[-1]:,.0f} tok/s   plain {plain[-1]:,.0f} tok/s   "
                  f"overhead {(plain[-1] - ours[-1]) / plain[-1] * 100:+.1f} %", flush=True)
    load_after = results.loadavg()
    # paired: each repeat runs both loops back to back, so its ratio cancels most load drift
    overhead = statistics.median((p - o) / p * 100 for o, p in zip(ours, plain, strict=True))
    setting = (f"preset {args.preset}, world size 1, {args.threads} threads, "
               f"steps {args.skip + 1}..{args.steps}, {args.repeats} paired repeats")
    lines = [f"{'loop':<10}{'median tok/s':>14}{'min':>10}{'max':>10}"]
    for name, vals in (("ddplab", ours), ("plain", plain)):
        lines.append(f"{name:<10}{statistics.median(vals):>14,.0f}{min(vals):>10,.0f}{max(vals):>10,.0f}")
    verdict = f"overhead of the ddplab loop (median of paired repeats): {overhead:+.1f} % (target <= 5 %)"
    table = "\n".join(lines)
    print(f"\n{setting}, load average {load_before[0]:.1f} -> {load_after[0]:.1f}\n{table}\n{verdict}")
    path = results.write("train_overhead", f"{setting}\n\n{results.code_block(table)}\n\n{verdict}",
                         title="Overhead of the ddplab training loop against a plain loop (world size 1)",
                         load_before=load_before, load_after=load_after, out_dir=args.results_dir)
    print(f"results: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
