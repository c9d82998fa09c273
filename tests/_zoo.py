"""A zoo of small models that exercise autocast's corners, for parity tests and benchmarks.

Each entry is a :class:`ZooCase`: a factory for the model (seeded, so two calls build equal
models) and one for its example inputs. Shapes are tiny; the models are meant to run in
milliseconds on a CPU.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["ZooCase", "ZOO", "zoo_case"]


class MLPResidual(nn.Module):
    """Linear → GELU → Linear, residual add, LayerNorm, log_softmax."""

    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        self.up = nn.Linear(dim, 2 * dim)
        self.down = nn.Linear(2 * dim, dim)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.down(F.gelu(self.up(x)))
        return F.log_softmax(self.head(self.norm(h)), dim=-1)


class ConvBN(nn.Module):
    """Conv2d → BatchNorm2d → ReLU → max-pool → flatten → Linear (BatchNorm's running stats
    are buffers the forward updates in training)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.fc = nn.Linear(4 * 4 * 4, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.max_pool2d(F.relu(self.bn(self.conv(x))), 2)
        return self.fc(torch.flatten(h, 1))


class MaskedAttention(nn.Module):
    """Single-head attention with a boolean mask and dropout, written out by hand, plus the
    same through ``scaled_dot_product_attention``."""

    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)
        self.drop = nn.Dropout(0.25)
        self.dim = dim

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        scores = q @ k.transpose(-2, -1) / math.sqrt(self.dim)
        scores = scores.masked_fill(~mask, float("-inf"))
        attn = self.drop(torch.softmax(scores, dim=-1))
        manual = attn @ v
        fused = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.out(manual + fused)


class EmbeddingLoss(nn.Module):
    """Embedding of integer tokens → Linear → cross-entropy against integer targets."""

    def __init__(self, vocab: int = 20, dim: int = 16) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.proj = nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, ...]:
        logits = self.proj(self.emb(tokens))
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        return loss, logits.argmax(-1)


class Float64Buffers(nn.Module):
    """fp64 buffers mixed with fp32 math: fp64 values are never cast, and ordinary type
    promotion lifts low-precision results that meet them."""

    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        self.a = nn.Linear(dim, dim)
        self.b = nn.Linear(dim, dim)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, dim, dtype=torch.float64))
        self.register_buffer("mix", torch.randn(dim, dim, dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.a(x) * self.scale              # bf16 * fp64 → fp64
        h64 = torch.mm(h, self.mix)             # fp64 matmul: ineligible, stays fp64
        y = self.b(h64.float())                 # back to fp32, then a low-precision linear
        return y, torch.cat([h64, x.double()], dim=-1)


class MultiOutput(nn.Module):
    """Ops with several outputs: topk, max over a dim, split, and gather with their indices."""

    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        self.a = nn.Linear(dim, dim)
        self.b = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        h = self.a(x)
        values, indices = torch.topk(h, 4, dim=-1)
        best, where = h.max(dim=-1)
        left, right = torch.split(h, 8, dim=-1)
        picked = torch.gather(x, -1, indices)
        y = self.b(left * right.sigmoid())
        return y, values + picked, best.unsqueeze(-1) * values, where, indices


class InPlace(nn.Module):
    """In-place ops on low-precision activations keep the mutated tensor's dtype."""

    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        self.a = nn.Linear(dim, dim)
        self.b = nn.Linear(dim, dim)
        self.bias = nn.Parameter(torch.linspace(-1.0, 1.0, dim))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.a(x)
        h = h * 1.0          # a fresh tensor, so the in-place ops below are legal in autograd
        h.add_(self.bias)
        h.mul_(0.5)
        h += x               # stays low precision (out of place it would promote to fp32)
        h.relu_()
        return self.b(h).clamp_(-3.0, 3.0), h


class BatchedMatmul(nn.Module):
    """bmm / baddbmm / matmul, and cat / stack of mixed-dtype tensors (CPU autocast promotes)."""

    def __init__(self, dim: int = 8) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(2, dim, dim) / dim)
        self.bias = nn.Parameter(torch.randn(2, dim, dim) / dim)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = torch.bmm(x, self.w)                                   # low precision
        g = torch.baddbmm(self.bias, h, x.transpose(1, 2), alpha=0.5)
        mixed = torch.cat([h, x], dim=-1)                          # low + fp32 → fp32
        same = torch.stack([h, g], dim=0)                          # low + low → low
        return mixed @ mixed.transpose(1, 2), same.sum(0).exp()


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


class RotaryNoAutocast(nn.Module):
    """A rotary embedding computed in fp32 inside the model's own
    ``torch.autocast(<device>, enabled=False)`` region, with views and reshapes around it."""

    def __init__(self, dim: int = 16, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.q = nn.Linear(dim, dim)
        self.k = nn.Linear(dim, dim)
        self.o = nn.Linear(dim, dim)
        inv = 1.0 / (10000 ** (torch.arange(0, dim // heads, 2).float() / (dim // heads)))
        self.register_buffer("inv_freq", inv)

    def rotate(self, t: torch.Tensor) -> torch.Tensor:
        # The buffer's device, not t's: a symbolic tracer sees t as a proxy.
        device = self.inv_freq.device
        with torch.autocast(device.type, enabled=False):
            t = t.float()
            pos = torch.arange(t.shape[2], dtype=torch.float32, device=device)
            freqs = torch.outer(pos, self.inv_freq)
            emb = torch.cat((freqs, freqs), dim=-1)
            rotated = t * emb.cos() + _rotate_half(t) * emb.sin()
            return torch.matmul(rotated, rotated.transpose(-2, -1)).softmax(-1) @ rotated

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q = self.q(x).view(b, s, self.heads, d // self.heads).transpose(1, 2)
        k = self.k(x).reshape(b, s, self.heads, -1).permute(0, 2, 1, 3)
        mixed = self.rotate(q) + self.rotate(k)            # fp32 out of the disabled region
        return self.o(mixed.transpose(1, 2).contiguous().view(b, s, d))


class Reductions(nn.Module):
    """Norms and reductions autocast treats specially on one device or another."""

    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        self.a = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        h = self.a(x)
        return (torch.norm(h, dim=-1), h.sum(-1), torch.prod(h[:, :4], dim=-1),
                F.normalize(h, dim=-1), torch.cumsum(h, dim=-1), h.mean())


class Composites(nn.Module):
    """Composite ops autocast does not list but decomposes into listed ones: einsum and
    tensordot reach bmm/mm, and the RNN cells reach linear while their state stays fp32."""

    def __init__(self, dim: int = 8) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(dim, dim) / dim)
        self.w_ih = nn.Parameter(torch.randn(4 * dim, dim) / dim)
        self.w_hh = nn.Parameter(torch.randn(4 * dim, dim) / dim)
        self.b_ih = nn.Parameter(torch.randn(4 * dim) / dim)
        self.b_hh = nn.Parameter(torch.randn(4 * dim) / dim)

    def forward(self, x: torch.Tensor, h: torch.Tensor) -> tuple[torch.Tensor, ...]:
        a = torch.einsum("bi,ij->bj", x, self.w)
        b = torch.tensordot(x, self.w, dims=([1], [0]))
        c = torch.inner(x, self.w)
        hy, cy = torch.lstm_cell(x, (h, h), self.w_ih, self.w_hh, self.b_ih, self.b_hh)
        gru = torch.gru_cell(x, h, self.w_ih[: 3 * x.shape[1]], self.w_hh[: 3 * x.shape[1]])
        return a + b + c, hy, cy, gru


class Recurrent(nn.Module):
    """Sequence RNNs fed a low-precision activation: autocast lowers the kernel beneath
    ``aten.lstm`` (oneDNN's ``mkldnn_rnn_layer``, cuDNN's ``_cudnn_rnn``), so input, states and
    weights all run in the low dtype."""

    def __init__(self, dim: int = 8) -> None:
        super().__init__()
        self.proj = nn.Linear(dim, dim)
        self.lstm = nn.LSTM(dim, dim, num_layers=2, batch_first=True, bidirectional=True)
        self.gru = nn.GRU(2 * dim, dim, batch_first=True)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        y, (h, c) = self.lstm(self.proj(x))
        z, g = self.gru(y)
        return z, h, c, g


@dataclasses.dataclass(frozen=True)
class ZooCase:
    name: str
    make_model: Callable[[], nn.Module]
    make_inputs: Callable[[], tuple]
    train: bool = True
    """Whether the parity test runs the model in training mode."""


def _seeded(build: Callable[[], nn.Module]) -> Callable[[], nn.Module]:
    def make() -> nn.Module:
        torch.manual_seed(0)
        return build()
    return make


def _inputs(build: Callable[[torch.Generator], tuple]) -> Callable[[], tuple]:
    def make() -> tuple:
        return build(torch.Generator().manual_seed(1))
    return make


def _mask(g: torch.Generator) -> torch.Tensor:
    mask = torch.rand(2, 5, 5, generator=g) > 0.3
    return mask | torch.eye(5, dtype=torch.bool)   # every row keeps one position


ZOO: tuple[ZooCase, ...] = (
    ZooCase("mlp_residual", _seeded(MLPResidual), _inputs(lambda g: (torch.randn(4, 16, generator=g),))),
    ZooCase("conv_bn_train", _seeded(ConvBN), _inputs(lambda g: (torch.randn(2, 3, 8, 8, generator=g),))),
    ZooCase("conv_bn_eval", _seeded(ConvBN), _inputs(lambda g: (torch.randn(2, 3, 8, 8, generator=g),)),
            train=False),
    ZooCase("masked_attention", _seeded(MaskedAttention),
            _inputs(lambda g: (torch.randn(2, 5, 16, generator=g), _mask(g)))),
    ZooCase("embedding_loss", _seeded(EmbeddingLoss),
            _inputs(lambda g: (torch.randint(0, 20, (2, 6), generator=g),
                               torch.randint(0, 20, (2, 6), generator=g)))),
    ZooCase("float64_buffers", _seeded(Float64Buffers), _inputs(lambda g: (torch.randn(4, 16, generator=g),))),
    ZooCase("multi_output", _seeded(MultiOutput), _inputs(lambda g: (torch.randn(4, 16, generator=g),))),
    ZooCase("in_place", _seeded(InPlace), _inputs(lambda g: (torch.randn(4, 16, generator=g),))),
    ZooCase("batched_matmul", _seeded(BatchedMatmul), _inputs(lambda g: (torch.randn(2, 8, 8, generator=g),))),
    ZooCase("rotary_no_autocast", _seeded(RotaryNoAutocast),
            _inputs(lambda g: (torch.randn(2, 6, 16, generator=g),))),
    ZooCase("reductions", _seeded(Reductions), _inputs(lambda g: (torch.randn(4, 16, generator=g),))),
    ZooCase("composites", _seeded(Composites),
            _inputs(lambda g: (torch.randn(4, 8, generator=g), torch.randn(4, 8, generator=g)))),
)


def zoo_case(name: str) -> ZooCase:
    for case in ZOO:
        if case.name == name:
            return case
    raise KeyError(f"no zoo model named {name!r}; known: {', '.join(c.name for c in ZOO)}")
