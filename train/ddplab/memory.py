"""Will the run fit in this node's memory? An estimate of a training process's peak, checked
against the memory available (``--check`` and every start, before anything is written).

The estimate, in bytes, counts float32 tensors (4 bytes per element) of the GPT of
:mod:`ddplab.model`; B = ``per_rank_batch_size`` (the largest micro-batch a rank computes: a larger
global batch is reached by gradient accumulation, whose micro-batches run one after another),
T = ``block_size``, C = ``n_embd``, L = ``n_layer``, H = ``n_head``, V = the model's vocabulary,
N = B * T tokens::

    P      = V*C + T*C + L*(12*C**2 + 13*C) + 2*C           parameters (head tied to the embedding)
    state  = 16*P       weights 4P + gradients 4P + AdamW's exp_avg and exp_avg_sq 8P
    engine = 4P x the recovery engine's parameter-sized buffers (its ``parameter_copies``,
             ddplab.engines.base.Engine: e.g. DDP's gradient buckets, a flat all-reduce buffer)
    act    = 4 * (L*(17*N*C + [dropout > 0] (0.5*N*C + 3*B*H*T**2)) + 2*N*C + N*V     saved
                  + 9*N*C + 2*N*V + [dropout > 0] 3*B*H*T**2)                       backward
    ckpt   = 5*P        a checkpoint write: the weights read back (4P) and a finiteness mask (<= P)
    eval   = 8 * eval_iters * B / world size       the evaluation's sample indices (int64)
    sample = 16 * sample_chars                     the generated ids, copied by each torch.cat
    index  = 16 * the step's global batch           its sample indices and their micro-batch split
    peak   = FIXED + state + engine + max(act + index, ckpt, eval, sample)

Source of ``act``: the tensors autograd saves for the backward pass, read off the forward of
:mod:`ddplab.model`. Per block: the LayerNorm inputs x and x2 (2 N*C), their outputs (2), the qkv
output holding q, k and v (3), the attention output and its re-laid copy for the projection (2),
the MLP's fc output (4) and GELU output (4): 17 N*C. Without dropout torch's fused CPU attention
keeps no T x T matrix; with dropout it takes the math path, which keeps the softmax output, the
dropout mask and the dropped matrix (3 B*H*T**2), and the two residual dropouts keep their 1-byte
masks (0.5 N*C). After the blocks: the last residual and the final LayerNorm's output (2 N*C) and
the log-softmax of the logits (N*V). The backward adds, at its start, the logits' gradients
(2 N*V) and, in a block, the gradients of its widest activations (9 N*C, and 3 B*H*T**2 with
dropout). This is the count of Korthikanti et al. 2022 ("Reducing Activation Recomputation in
Large Transformer Models", sec. 4.1) done for this model in float32; the saved set was checked
with ``torch.autograd.graph.saved_tensors_hooks`` and the whole estimate against the peak RSS of
training steps (tests/test_input_ranges.py measures one). ``ckpt`` follows ddplab.checkpoint: the
state is streamed into its file and loaded back memory-mapped to be verified, so the write adds
the weights' pages read to check they are finite (4P, counted in the RSS though reclaimable) and
the check's boolean mask of one tensor at a time (at most P); tests/test_input_ranges.py measures
a write. FIXED covers the one-off allocations of a process's first step (autograd's engine, the
optimizer's first step).

Available memory: ``psutil.virtual_memory().available``, and the headroom of every memory-limited
cgroup of this process and its ancestors (v2 ``memory.max``, v1 ``memory.limit_in_bytes``) less
what the cgroup uses without its reclaimable page cache (``memory.current`` - ``inactive_file``),
whichever is smallest. The node's local workers (torchrun ``--nproc-per-node``) share it: the
check is ``local workers x peak <= available``. Every worker checks before its group forms, and
ddplab.train builds the model only after the group formed, so no worker has allocated its model
when another one reads the available memory.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

from ddplab import cpushare, engines
from ddplab.config import TrainConfig

BYTES_PER_ELEMENT = 4  # float32 weights, gradients, optimizer state and activations
#: One-off allocations of a process's first training step (autograd's engine and threads, the
#: optimizer's first step); measured below it on the tiny preset.
FIXED_BYTES = 128 << 20
#: The model's vocabulary assumed when it is not known yet (``--check`` of a dataset not yet
#: downloaded, no ``vocab_size``): more than the characters of an English text.
ASSUMED_VOCAB = 256
#: A cgroup v1 limit at or above this is "no limit" (the kernel shows its page-counter maximum).
_V1_UNLIMITED = 1 << 62


class MemoryFitError(ValueError):
    """The run's estimated memory exceeds what the node has available (one line, what to lower)."""


def param_count(vocab_size: int, block_size: int, n_layer: int, n_embd: int) -> int:
    """Parameters of :class:`ddplab.model.GPT` (the tied head counted once): embeddings
    ``V*C + T*C``, per block 2 LayerNorms (4C), qkv (3C*C + 3C), projection (C*C + C), MLP
    (8C*C + 5C), and the final LayerNorm (2C)."""
    c = n_embd
    return vocab_size * c + block_size * c + n_layer * (12 * c * c + 13 * c) + 2 * c


def saved_activation_bytes(batch: int, block_size: int, n_layer: int, n_head: int, n_embd: int,
                           vocab_size: int, dropout: float) -> int:
    """Bytes of the tensors autograd keeps from the forward of one micro-batch of ``batch``
    windows for the backward (the "saved" lines of the module doc)."""
    n, c, v = batch * block_size, n_embd, vocab_size
    attention = batch * n_head * block_size * block_size if dropout > 0 else 0
    per_block = 17 * n * c + ((n * c) // 2 + 3 * attention if dropout > 0 else 0)
    return BYTES_PER_ELEMENT * (n_layer * per_block + 2 * n * c + n * v)


def activation_bytes(batch: int, block_size: int, n_layer: int, n_head: int, n_embd: int,
                     vocab_size: int, dropout: float) -> int:
    """Peak activation bytes of one training micro-batch: the saved tensors and the backward's
    largest gradients on top of them (module doc)."""
    n, c, v = batch * block_size, n_embd, vocab_size
    attention = batch * n_head * block_size * block_size if dropout > 0 else 0
    backward = BYTES_PER_ELEMENT * (9 * n * c + 2 * n * v + 3 * attention)
    return saved_activation_bytes(batch, block_size, n_layer, n_head, n_embd, vocab_size, dropout) + backward


def engine_bytes(cfg: TrainConfig, params: int, world_size: int) -> int:
    """Extra parameter-sized buffers of the recovery engine (module doc); its module is imported
    (ddplab.engines.engine_class)."""
    copies = engines.engine_class(cfg.fault_tolerance).parameter_copies(cfg, world_size)
    return BYTES_PER_ELEMENT * params * copies


@dataclass(frozen=True)
class MemoryEstimate:
    """The estimated peak of one training process, by part (bytes), and the node's check.

    ``available_bytes``/``available_source``: what the check compared with (None when not read).
    """

    params: int
    state_bytes: int
    engine_bytes: int
    activation_bytes: int
    index_bytes: int
    checkpoint_bytes: int
    eval_bytes: int
    sample_bytes: int
    fixed_bytes: int
    batch: int
    block_size: int
    local_workers: int = 1
    available_bytes: int | None = None
    available_source: str | None = None

    @property
    def phases(self) -> dict[str, int]:
        """The parts that do not coexist: the largest sits on top of the state."""
        return {"activations": self.activation_bytes + self.index_bytes,
                "checkpoint": self.checkpoint_bytes, "evaluation": self.eval_bytes,
                "sample": self.sample_bytes}

    @property
    def peak_bytes(self) -> int:
        """One training process's estimated peak."""
        return self.fixed_bytes + self.state_bytes + self.engine_bytes + max(self.phases.values())

    @property
    def node_bytes(self) -> int:
        """All the node's local workers together."""
        return self.local_workers * self.peak_bytes

    def to_dict(self) -> dict[str, Any]:
        """The estimate as a JSON-ready dict (``--check``)."""
        return {"peak_bytes": self.peak_bytes, "node_bytes": self.node_bytes,
                "local_workers": self.local_workers, "params": self.params,
                "state_bytes": self.state_bytes, "engine_bytes": self.engine_bytes,
                **{f"{k}_bytes": v for k, v in self.phases.items()}, "fixed_bytes": self.fixed_bytes,
                "available_bytes": self.available_bytes, "available_source": self.available_source}

    def error(self) -> str:
        """The one-line refusal: the estimate by part, the available memory, what to lower."""
        phase, top = max(self.phases.items(), key=lambda kv: kv[1])
        parts = [f"weights, gradients and AdamW state {fmt_bytes(self.state_bytes)} "
                 f"({self.params:,} parameters)"]
        if self.engine_bytes:
            parts.append(f"the engine's gradient buffers {fmt_bytes(self.engine_bytes)}")
        what = {"activations": f"activations of a micro-batch of {self.batch} x {self.block_size} tokens",
                "checkpoint": "a checkpoint write's copies", "evaluation": "the evaluation's indices",
                "sample": "the generated sample"}[phase]
        parts.append(f"{what} {fmt_bytes(top)}")
        if phase == "activations" and top >= self.state_bytes + self.engine_bytes:
            fix = ("lower per_rank_batch_size (batch_policy keep_global with a global_batch_size keeps "
                   "the global batch by gradient accumulation), block_size, or the model size "
                   "(n_layer, n_embd)")
            if self.index_bytes > self.activation_bytes:
                fix = "lower global_batch_size"
        elif phase == "evaluation" and top >= self.state_bytes:
            fix = "lower eval_iters"
        elif phase == "sample" and top >= self.state_bytes:
            fix = "lower sample_chars"
        else:
            fix = "a smaller model: lower n_layer, n_embd or vocab_size (or a preset: tiny, small)"
        workers = ""
        if self.local_workers > 1:
            workers = f"{self.local_workers} local workers x "
            fix += ", or run fewer workers per node (torchrun --nproc-per-node, ddp_job_nproc_per_node)"
        return (f"the run needs about {fmt_bytes(self.node_bytes)} of memory on this node "
                f"({workers}{fmt_bytes(self.peak_bytes)} per training process, estimated: "
                f"{' + '.join(parts)}), more than the {fmt_bytes(self.available_bytes or 0)} available "
                f"({self.available_source}); fix: {fix}")


def estimate(cfg: TrainConfig, vocab_size: int | None = None, world_size: int = 1,
             local_workers: int = 1) -> MemoryEstimate:
    """The estimated peak memory of one training process of ``cfg`` (module doc).

    ``vocab_size``: the model's vocabulary (None: ``cfg.vocab_size``, else :data:`ASSUMED_VOCAB`);
    ``world_size``: the processes of the job (DDP's buckets exist above 1); ``local_workers``: the
    node's processes sharing its memory.
    """
    vocab = vocab_size or cfg.vocab_size or ASSUMED_VOCAB
    params = param_count(vocab, cfg.block_size, cfg.n_layer, cfg.n_embd)
    batch = cfg.per_rank_batch_size
    global_batch = max(batch * max(world_size, 1), cfg.global_batch_size or 0)
    return MemoryEstimate(
        params=params,
        state_bytes=4 * BYTES_PER_ELEMENT * params,
        engine_bytes=engine_bytes(cfg, params, world_size),
        activation_bytes=activation_bytes(batch, cfg.block_size, cfg.n_layer, cfg.n_head, cfg.n_embd,
                                          vocab, cfg.dropout),
        index_bytes=16 * global_batch,
        checkpoint_bytes=(BYTES_PER_ELEMENT + 1) * params,
        eval_bytes=8 * math.ceil(cfg.eval_iters * batch / max(world_size, 1)),
        sample_bytes=16 * cfg.sample_chars,
        fixed_bytes=FIXED_BYTES,
        batch=batch, block_size=cfg.block_size, local_workers=max(local_workers, 1),
    )


def _read_int(path: Path) -> int | None:
    try:
        return int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def _stat_value(path: Path, key: str) -> int:
    try:
        for line in path.read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key:
                return int(value)
    except (OSError, ValueError):
        pass
    return 0


def cgroup_headroom(folders: list[tuple[Path, int]] | None = None) -> tuple[int, str] | None:
    """The smallest headroom (limit - use without reclaimable page cache) over the memory-limited
    cgroup levels of this process (``folders``: :func:`ddplab.cpushare.cgroup_folders`), with a
    description; None when no level sets a limit."""
    if folders is None:
        folders = cpushare.cgroup_folders("memory")
    best: tuple[int, str] | None = None
    for folder, version in folders:
        if version == 2:
            raw = _read_text(folder / "memory.max")
            if raw is None or raw == "max":
                continue
            limit, name = _read_int(folder / "memory.max"), "memory.max"
            used = _read_int(folder / "memory.current")
            cache = _stat_value(folder / "memory.stat", "inactive_file")
        else:
            limit, name = _read_int(folder / "memory.limit_in_bytes"), "memory.limit_in_bytes"
            if limit is not None and limit >= _V1_UNLIMITED:
                continue
            used = _read_int(folder / "memory.usage_in_bytes")
            cache = _stat_value(folder / "memory.stat", "total_inactive_file")
        if limit is None:
            continue
        room = max(0, limit - max(0, (used or 0) - cache))
        if best is None or room < best[0]:
            best = (room, f"cgroup limit {fmt_bytes(limit)} in {folder / name}, "
                          f"{fmt_bytes(limit - room)} in use")
    return best


def _read_text(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def available_memory(folders: list[tuple[Path, int]] | None = None) -> tuple[int, str]:
    """The memory this process can still take, bytes, and where the figure comes from: the
    smaller of psutil's available memory and the cgroup headroom (:func:`cgroup_headroom`)."""
    free = int(psutil.virtual_memory().available)
    best = (free, "available memory of the machine")
    room = cgroup_headroom(folders)
    if room is not None and room[0] < free:
        best = room
    return best


def check_fits(cfg: TrainConfig, vocab_size: int | None = None, world_size: int = 1,
               local_workers: int = 1, available: tuple[int, str] | None = None) -> MemoryEstimate:
    """Estimate (:func:`estimate`) and compare with the available memory (``available``: (bytes,
    source), default :func:`available_memory`); return the estimate with what it was compared to.

    Raises:
        MemoryFitError: ``local_workers`` x the peak exceeds the available memory.
    """
    found = estimate(cfg, vocab_size, world_size, local_workers)
    avail, source = available if available is not None else available_memory()
    found = dataclasses.replace(found, available_bytes=avail, available_source=source)
    if found.node_bytes > avail:
        raise MemoryFitError(found.error())
    return found


def fmt_bytes(n: int) -> str:
    """``n`` bytes in binary units: ``512 B``, ``12.4 MiB``, ``3.1 GiB``, ``8.0e+06 TiB``."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024:
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    value /= 1024
    return f"{value:.1f} TiB" if value < 1e4 else f"{value:.1e} TiB"
