"""The model of ``python -m amprewrite demo``: a one-block decoder-only transformer.

Small enough that its rewritten graph fits on a screen, and it has every kind of op a policy
sorts: matmuls and linears (low precision), softmax and layer norms (fp32), a GELU and
residual adds (passthrough), an embedding lookup on integer ids (never cast).
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["TinyTransformer", "demo_factory"]


class CausalSelfAttention(nn.Module):
    def __init__(self, dim: int, heads: int, max_len: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.register_buffer("future", torch.ones(max_len, max_len, dtype=torch.bool).triu(1),
                             persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=-1)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(c // self.heads)
        # NB: -1e4, not -inf or finfo.min: a fill value every low dtype (fp16 too) can hold.
        scores = scores.masked_fill(self.future[:t, :t], -1e4)
        y = F.softmax(scores, dim=-1) @ v
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, max_len: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = CausalSelfAttention(dim, heads, max_len)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TinyTransformer(nn.Module):
    """Token ids ``(batch, length)`` → next-token logits ``(batch, length, vocab)``."""

    def __init__(self, vocab: int = 64, dim: int = 32, heads: int = 2, layers: int = 1,
                 max_len: int = 16) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(max_len, dim)
        self.blocks = nn.ModuleList(Block(dim, heads, max_len) for _ in range(layers))
        self.ln_f = nn.LayerNorm(dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(ids.shape[1], device=ids.device)
        x = self.tok(ids) + self.pos(positions)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def demo_factory() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """``(model, example_inputs)``, seeded: the same weights and ids on every run."""
    torch.manual_seed(0)
    model = TinyTransformer()
    ids = torch.randint(0, 64, (2, 16))
    return model, (ids,)
