"""A small decoder-only transformer (GPT) for character-level language modelling.

Architecture after Radford et al. 2019 (GPT-2): learned token and position embeddings, ``n_layer``
pre-norm blocks (LayerNorm -> causal multi-head self-attention -> residual, LayerNorm -> MLP with
4x expansion and GELU -> residual), a final LayerNorm and an output head tied to the token
embedding (Press & Wolf 2017). Residual output projections are initialised with std
``0.02 / sqrt(2 * n_layer)`` as in GPT-2.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F


@dataclass(frozen=True)
class GPTConfig:
    """Shape of the model. ``n_embd`` must be divisible by ``n_head``."""

    vocab_size: int
    block_size: int
    n_layer: int
    n_head: int
    n_embd: int
    dropout: float = 0.0

    def __post_init__(self) -> None:
        for key in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
            if getattr(self, key) <= 0:
                raise ValueError(f"GPTConfig.{key} = {getattr(self, key)} must be > 0")
        if self.n_embd % self.n_head:
            raise ValueError(f"GPTConfig.n_embd = {self.n_embd} must be divisible by n_head = {self.n_head}")
        if not 0 <= self.dropout < 1:
            raise ValueError(f"GPTConfig.dropout = {self.dropout} must be in [0, 1)")


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention where position t attends to positions <= t."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.dropout = cfg.dropout
        self.resid_drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x``: (B, T, C) -> (B, T, C)."""
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        # (B, T, C) -> (B, heads, T, C / heads)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
        )
        y = y.transpose(1, 2).contiguous().view(b, t, c)
        return self.resid_drop(self.proj(y))


class MLP(nn.Module):
    """Position-wise feed-forward network, hidden width 4 * n_embd."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd)
        self.proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x``: (B, T, C) -> (B, T, C)."""
        return self.drop(self.proj(F.gelu(self.fc(x))))


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln_attn = nn.LayerNorm(cfg.n_embd)
        self.attn = CausalSelfAttention(cfg)
        self.ln_mlp = nn.LayerNorm(cfg.n_embd)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x``: (B, T, C) -> (B, T, C)."""
        x = x + self.attn(self.ln_attn(x))
        return x + self.mlp(self.ln_mlp(x))


class GPT(nn.Module):
    """Character-level GPT. Input token ids (B, T) with T <= block_size; output logits (B, T, V)."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.pos_emb = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_out = nn.LayerNorm(cfg.n_embd)
        self.head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.head.weight = self.tok_emb.weight  # weight tying
        self._init_weights()

    def _init_weights(self) -> None:
        resid_std = 0.02 / math.sqrt(2 * self.cfg.n_layer)
        for name, module in self.named_modules():
            if isinstance(module, nn.Linear):
                std = resid_std if name.endswith(".proj") else 0.02
                nn.init.normal_(module.weight, mean=0.0, std=std)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def num_params(self) -> int:
        """Number of distinct parameters (the tied head counted once)."""
        return sum(p.numel() for p in self.parameters())

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits (B, T, V) and, with ``targets`` (B, T), the mean cross-entropy (nats/char).

        Raises:
            ValueError: T exceeds ``block_size``.
        """
        _, t = idx.shape
        if t > self.cfg.block_size:
            raise ValueError(f"sequence length {t} exceeds block_size {self.cfg.block_size}")
        pos = torch.arange(t, device=idx.device)
        x = self.drop(self.tok_emb(idx) + self.pos_emb(pos))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_out(x))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
        return logits, loss

    def param_groups(self, weight_decay: float) -> list[dict]:
        """Optimizer groups: matrices and embeddings decayed, biases and LayerNorm weights not."""
        decay = [p for p in self.parameters() if p.dim() >= 2]
        no_decay = [p for p in self.parameters() if p.dim() < 2]
        return [
            {"params": decay, "weight_decay": weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ]

    @torch.no_grad()
    def generate(
        self, idx: torch.Tensor, new_tokens: int, temperature: float = 0.8, top_k: int | None = None,
        generator: torch.Generator | None = None, vocab_limit: int | None = None,
    ) -> torch.Tensor:
        """Append ``new_tokens`` sampled tokens to ``idx`` (B, T0) -> (B, T0 + new_tokens).

        ``vocab_limit``: only token ids below it are sampled (a vocabulary padded beyond the
        dataset's tokens, ``TrainConfig.vocab_size``, never yields a padding id); None: all.

        Raises:
            ValueError: ``temperature`` <= 0.
        """
        if temperature <= 0:
            raise ValueError(f"temperature {temperature} must be > 0")
        was_training = self.training
        self.eval()
        for _ in range(new_tokens):
            context = idx[:, -self.cfg.block_size:]
            logits, _ = self(context)
            logits = logits[:, -1, :vocab_limit] / temperature
            if top_k is not None:
                kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, [-1]]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            probs = F.softmax(logits, dim=-1)
            idx = torch.cat([idx, torch.multinomial(probs, 1, generator=generator)], dim=1)
        self.train(was_training)
        return idx
