"""Gradient compression for the torchelastic engine: DDP communication hooks around the timed
all-reduce (``grad_compression``, :data:`ddplab.config.GRAD_COMPRESSIONS`).

``none``
    :class:`ddplab.distributed.TimedAllReduce` as it is: the fp32 bucket all-reduced and averaged.
``fp16``
    torch's ``fp16_compress_wrapper`` around the same all-reduce: the bucket is cast to float16,
    all-reduced, averaged and cast back. Half the bytes.
``bf16``
    the same with bfloat16 (8 exponent bits: fp32's range, 8 mantissa bits), by this module's own
    wrapper (:func:`bf16_compress_wrapper`): torch's refuses, by the hook's name, any setup but CUDA
    with NCCL >= 2.10 or XPU with XCCL, although gloo reduces bfloat16 on the CPU. Half the bytes.
``powersgd``
    torch's layer-wise ``powerSGD_hook`` (Vogels, Karimireddy, Jaggi, "PowerSGD: Practical low-rank
    gradient compression for distributed optimization", NeurIPS 2019): each gradient matrix
    ``n x m`` is sent as two rank-``r`` factors P (``n x r``) and Q (``m x r``), with error feedback
    (what compression lost is added to the next step's gradient) and warm start (Q reused from the
    step before). The first ``powersgd_start_step`` steps are plain fp32 all-reduces.

Every mode keeps the replicas bit-identical after every step: each all-reduce leaves the same bytes
on every rank (gloo reduces each chunk on one rank and sends the result to all), and what follows
(the cast back, PowerSGD's orthogonalisation and ``P Q^T``) is a deterministic function of them;
the error-feedback memory differs per rank but only feeds the next step's input.

Timing and overlap: as :class:`ddplab.distributed.TimedAllReduce`, a bucket's compression and
all-reduce start when DDP hands it over and travel while the backward pass goes on; the last
bucket's hook waits for all of them (polling, ddplab.distributed.wait, so SIGTERM can interrupt
it). :attr:`CompressedAllReduce.seconds` is the time the step waited for its gradient
synchronisation beyond the backward pass, ``allreduce_s`` of the step records.

Bytes: :func:`payload_bytes` is ``D``, the bytes one step's all-reduces hand to the ring (per rank
on the wire: ``2(N-1)/N * D``, :func:`ddplab.bench.costmodel.ring_factor`).
"""

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import fp16_compress_wrapper

from ddplab.config import GRAD_COMPRESSIONS
from ddplab.distributed import TimedAllReduce, all_reduce_mean

#: PowerSGD leaves a matrix uncompressed unless the factors are this many times smaller (torch's
#: ``PowerSGDState`` default ``min_compression_rate``).
POWERSGD_MIN_COMPRESSION_RATE = 2
BYTES_PER_ELEMENT = {"none": 4, "fp16": 2, "bf16": 2, "powersgd": 4}

Hook = Callable[[Any, dist.GradBucket], torch.futures.Future[torch.Tensor]]


def bf16_compress_wrapper(hook: Hook) -> Hook:
    """Cast the bucket to bfloat16 for ``hook``, and ``hook``'s result back to the bucket's dtype.

    The twin of torch's ``fp16_compress_wrapper`` (``default_hooks``) for bfloat16, under a name
    DDP's ``_check_comm_hook`` does not refuse: it refuses ``bf16_compress_wrapper_hook`` without
    CUDA + NCCL 2.10 or XPU + XCCL. Returns the wrapped hook.
    """
    def ddplab_bf16_hook(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        original = bucket.buffer()
        bucket.set_buffer(original.to(torch.bfloat16))
        fut = hook(state, bucket)

        def decompress(done: torch.futures.Future) -> torch.Tensor:
            original.copy_(done.value())
            return original

        return fut.then(decompress)

    return ddplab_bf16_hook


def _powersgd(state: "CompressedAllReduce", bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    return psgd.powerSGD_hook(state.powersgd, bucket)


#: The untimed hook of each compression (:class:`CompressedAllReduce` times and waits for it).
INNER_HOOKS: dict[str, Hook] = {"fp16": fp16_compress_wrapper(all_reduce_mean),
                                "bf16": bf16_compress_wrapper(all_reduce_mean), "powersgd": _powersgd}


class CompressedAllReduce(TimedAllReduce):
    """DDP communication hook state: the bucket compressed (``compression``), all-reduced and
    averaged, the whole hook timed (:attr:`seconds`, :attr:`calls`; :meth:`reset` per step).

    Args:
        world_size: ranks of ``group`` (the mean divides by it).
        compression: ``fp16``, ``bf16`` or ``powersgd`` (``none`` is :class:`TimedAllReduce`).
        group: the process group (None: the default group).
        powersgd_rank: rank ``r`` of PowerSGD's factors.
        powersgd_start_step: plain fp32 steps before PowerSGD compresses (>= 2).
        seed: seeds PowerSGD's random initial Q, the same on every rank (modulo 2**32: numpy's
            RandomState takes 32 bits; the run's seed may have 63).

    Raises:
        ValueError: an unknown compression, or PowerSGD settings torch refuses.
    """

    def __init__(self, world_size: int, compression: str, group=None, powersgd_rank: int = 4,
                 powersgd_start_step: int = 10, seed: int = 0) -> None:
        super().__init__(world_size, group)
        if compression not in INNER_HOOKS:
            raise ValueError(f"compression {compression!r}: expected one of {', '.join(INNER_HOOKS)}")
        self.compression = compression
        self.powersgd_rank = powersgd_rank
        self.powersgd_start_step = powersgd_start_step
        self.seed = seed
        self.powersgd = None  # PowerSGD: torch's PowerSGDState (start)
        self._inner: Hook = INNER_HOOKS[compression]
        self.start(0)

    def start(self, step: int) -> None:
        """(Re)start the compression state at optimizer step ``step`` (0: a new run): after the
        pass that settles DDP's buckets, and at every (re)start of a worker. PowerSGD's state is
        made anew (no error feedback, Q from ``seed``) and counts ``step`` steps done, so a
        resumed run compresses at once when ``step >= powersgd_start_step``; its error feedback
        is not in checkpoints (it differs per rank), so a resumed powersgd run is not bit-identical
        to an uninterrupted one. fp16 and bf16 keep no state. The count is torch's
        ``PowerSGDState.iter`` (tests/test_agent_torch_patches.py)."""
        if self.compression != "powersgd":
            return
        self.powersgd = psgd.PowerSGDState(
            process_group=self.group, matrix_approximation_rank=self.powersgd_rank,
            start_powerSGD_iter=self.powersgd_start_step,
            min_compression_rate=POWERSGD_MIN_COMPRESSION_RATE, use_error_feedback=True,
            warm_start=True, random_seed=self.seed % 2**32)  # numpy's RandomState: 32-bit seeds
        self.powersgd.iter = step

    # (no ``from __future__ import annotations`` in this module: DDP's register_comm_hook compares
    # the hook's annotations with dist.GradBucket and torch.futures.Future[torch.Tensor])
    def launch(self, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        """Start the bucket's compressed synchronisation (:data:`INNER_HOOKS`); its future."""
        return self._inner(self, bucket)

    @staticmethod
    def hook(state: "CompressedAllReduce", bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        return TimedAllReduce.hook(state, bucket)


def comm_hook(compression: str, world_size: int, group=None, powersgd_rank: int = 4,
              powersgd_start_step: int = 10, seed: int = 0) -> tuple[TimedAllReduce, Hook]:
    """The state and hook to give ``DistributedDataParallel.register_comm_hook`` for
    ``compression``: ``none`` -> (:class:`TimedAllReduce`, its hook), else
    (:class:`CompressedAllReduce`, its hook). Both states time the step's sync (``seconds``)."""
    if compression == "none":
        return TimedAllReduce(world_size, group), TimedAllReduce.hook
    state = CompressedAllReduce(world_size, compression, group, powersgd_rank, powersgd_start_step, seed)
    return state, CompressedAllReduce.hook


def powersgd_elements(shape: Sequence[int], rank: int,
                      min_compression_rate: float = POWERSGD_MIN_COMPRESSION_RATE) -> tuple[int, bool]:
    """Elements PowerSGD all-reduces for one gradient of ``shape``, and whether it compresses it:
    the gradient as a matrix ``n x m`` (``n = shape[0]``, ``m`` the rest; a 1-D gradient is
    ``n x 1``), ``r = min(n, m, rank)``; compressed to ``(n + m) r`` elements when that times
    ``min_compression_rate`` is below ``n m``, else sent whole (torch's ``_should_compress``)."""
    n = int(shape[0]) if len(shape) else 1
    numel = 1
    for size in shape:
        numel *= int(size)
    m = numel // n if n else 0
    r = min(n, m, rank)
    compressed = (n + m) * r
    if compressed * min_compression_rate < numel:
        return compressed, True
    return numel, False


def payload_bytes(compression: str, shapes: Iterable[Sequence[int]], step: int = 0,
                  powersgd_rank: int = 4, powersgd_start_step: int = 10) -> int:
    """``D``: bytes the gradient all-reduces of one optimizer step hand to the ring, for gradients
    of ``shapes`` (each trained parameter's once), under ``compression``.

    ``none``: 4 bytes per element; ``fp16``/``bf16``: 2; ``powersgd``: 4 per element of the factors
    P and Q of each compressed matrix plus the uncompressed gradients (:func:`powersgd_elements`),
    from the step whose update is step ``powersgd_start_step + 1`` on (``step``: the steps done
    before this one), 4 per element before. Raises ValueError for an unknown compression.
    """
    if compression not in GRAD_COMPRESSIONS:
        raise ValueError(f"compression {compression!r}: expected one of {', '.join(GRAD_COMPRESSIONS)}")
    shapes = [tuple(s) for s in shapes]
    if compression == "powersgd" and step >= powersgd_start_step:
        return 4 * sum(powersgd_elements(s, powersgd_rank)[0] for s in shapes)
    numel = sum(int(torch.Size(s).numel()) for s in shapes)
    return BYTES_PER_ELEMENT[compression] * numel


def grad_shapes(model: torch.nn.Module) -> list[tuple[int, ...]]:
    """The shapes of ``model``'s trained parameters (a tied weight once), as DDP buckets them."""
    return [tuple(p.shape) for p in model.parameters() if p.requires_grad]
