"""One rank of the gradient-compression test (tests/test_compression.py), under
``torchrun --standalone --nproc-per-node 2``.

For each mode of argv[1] (comma list of ddplab.config.GRAD_COMPRESSIONS): a tiny GPT wrapped in DDP
with ddplab.compression's hook (the trainer's pass that settles the buckets, then ``start(0)``),
AdamW, ``STEPS`` steps on batches that differ per rank. After every step the ranks compare a
SHA-256 of all their parameters (all-gathered). Every ``torch.distributed.all_reduce`` the hook makes
is counted (elements x element size). Rank 0 prints one JSON line per step: mode, step, whether
every rank holds the same parameters, the bytes counted and ddplab.compression.payload_bytes, the
hook's seconds, the largest difference to the fp32 (``none``) run's parameters at that step.
"""

import hashlib
import json
import sys

import torch
import torch.distributed as dist
from ddplab import compression
from ddplab.model import GPT, GPTConfig
from torch.nn.parallel import DistributedDataParallel as DDP

STEPS = 8
START_STEP = 3  # PowerSGD: plain all-reduces before it compresses
RANK = 2

counted = [0]
_all_reduce = dist.all_reduce


def counting_all_reduce(tensor, *args, **kwargs):
    counted[0] += tensor.numel() * tensor.element_size()
    return _all_reduce(tensor, *args, **kwargs)


def digest(model: torch.nn.Module) -> torch.Tensor:
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().contiguous().numpy().tobytes())
    return torch.frombuffer(bytearray(h.digest()), dtype=torch.uint8)


def train(mode: str, rank: int, world: int, reference: list | None) -> list:
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=65, block_size=16, n_layer=2, n_head=2, n_embd=32))
    ddp = DDP(model)
    state, hook = compression.comm_hook(mode, world, powersgd_rank=RANK, powersgd_start_step=START_STEP,
                                        seed=0)
    ddp.register_comm_hook(state, hook)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x = torch.zeros(1, 16, dtype=torch.long)  # the trainer's bucket-settling pass
    ddp(x, x)[1].backward()
    opt.zero_grad(set_to_none=True)
    if hasattr(state, "start"):
        state.start(0)
    shapes = compression.grad_shapes(model)
    gen = torch.Generator().manual_seed(100 + rank)
    params = []
    for step in range(STEPS):
        state.reset()
        counted[0] = 0
        xb = torch.randint(0, 65, (4, 16), generator=gen)
        yb = torch.randint(0, 65, (4, 16), generator=gen)
        dist.all_reduce = counting_all_reduce
        try:
            ddp(xb, yb)[1].backward()
        finally:
            dist.all_reduce = _all_reduce
        opt.step()
        opt.zero_grad(set_to_none=True)
        mine = digest(model)
        every = [torch.empty_like(mine) for _ in range(world)]
        dist.all_gather(every, mine)
        snapshot = [p.detach().clone() for p in model.parameters()]
        params.append(snapshot)
        diff = None if reference is None else max(
            float((a - b).abs().max()) for a, b in zip(snapshot, reference[step], strict=True))
        if rank == 0:
            print(json.dumps({
                "mode": mode, "step": step + 1, "identical": all(torch.equal(d, mine) for d in every),
                "counted": counted[0],
                "modelled": compression.payload_bytes(mode, shapes, step, RANK, START_STEP),
                "seconds": state.seconds, "calls": state.calls, "diff_to_fp32": diff,
            }), flush=True)
    return params


def main() -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    reference = None
    for mode in sys.argv[1].split(","):
        params = train(mode, rank, world, reference)
        if mode == "none":
            reference = params
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
