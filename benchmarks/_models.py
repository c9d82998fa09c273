"""The benchmark's models and input shapes.

NB: the HF models get an explicit padding mask. Without one, HF's eager code skips the mask
after looking at the input's values, which a captured graph cannot do; the two would then
run different computations.

Five models, each with three input shapes: a *single* request and a small *serving* batch
(where re-casting weights on every forward is a large part of the cost), and a *large* batch
(more tokens per weight, where it is not). ``--quick`` keeps the first two. Weights are random and nothing is downloaded. Dropout is 0 and every model is put in
``eval()``, so that all variants compute the same function in forward and backward.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["Case", "build_cases", "first_tensor"]


@dataclasses.dataclass
class Case:
    """One model with the inputs of each shape (``shapes[name] = (args, description)``)."""

    name: str
    model: nn.Module
    shapes: dict[str, tuple[tuple[Any, ...], str]]


class MLP(nn.Module):
    def __init__(self, d_in: int = 512, hidden: int = 1024, depth: int = 4) -> None:
        super().__init__()
        dims = [d_in] + [hidden] * (depth - 1) + [d_in]
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(dims, dims[1:]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = F.gelu(x)
        return x


class CNN(nn.Module):
    """A small ResNet-style image classifier (conv, batch norm, residual adds, pooling)."""

    def __init__(self, width: int = 64, classes: int = 100) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 3, padding=1), nn.BatchNorm2d(width),
                                  nn.ReLU())
        blocks = []
        for _ in range(3):
            blocks.append(nn.Sequential(nn.Conv2d(width, width, 3, padding=1),
                                        nn.BatchNorm2d(width), nn.ReLU(),
                                        nn.Conv2d(width, width, 3, padding=1),
                                        nn.BatchNorm2d(width)))
        self.blocks = nn.ModuleList(blocks)
        self.head = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for block in self.blocks:
            x = F.relu(x + block(x))
            x = F.max_pool2d(x, 2) if x.shape[-1] > 8 else x
        return self.head(x.mean((2, 3)))


class Block(nn.Module):
    """Pre-norm GPT block: causal self-attention (sdpa) and a GELU MLP."""

    def __init__(self, d_model: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.ln2 = nn.LayerNorm(d_model)
        self.fc1 = nn.Linear(d_model, 4 * d_model)
        self.fc2 = nn.Linear(4 * d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, vocab: int = 4096, d_model: int = 256, heads: int = 4, layers: int = 4,
                 max_len: int = 512) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d_model)
        self.pos = nn.Embedding(max_len, d_model)
        self.blocks = nn.ModuleList(Block(d_model, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(ids.shape[1], device=ids.device)
        x = self.tok(ids) + self.pos(pos)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


class HFEncoder(nn.Module):
    """A HF model called as servers call it: token ids with a padding mask, returning the
    last hidden state."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=ids, attention_mask=mask).last_hidden_state


def _hf(kind: str) -> nn.Module:
    import transformers

    common = dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
                  intermediate_size=1024, vocab_size=8192, max_position_embeddings=512,
                  hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    if kind == "bert":
        config = transformers.BertConfig(**common)
        config._attn_implementation = "eager"
        return HFEncoder(transformers.BertModel(config, add_pooling_layer=False))
    config = transformers.GPT2Config(n_embd=256, n_layer=4, n_head=4, n_inner=1024,
                                     vocab_size=8192, n_positions=512, resid_pdrop=0.0,
                                     embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False)
    config._attn_implementation = "eager"
    return HFEncoder(transformers.GPT2Model(config))


def _ids(batch: int, seq: int, vocab: int, device: str) -> tuple[torch.Tensor]:
    return (torch.randint(0, vocab, (batch, seq), device=device),)


def _padded(batch: int, seq: int, vocab: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and an attention mask where every other sequence, the first included, has a
    padded tail (requests of unequal lengths, or one request padded to a length bucket)."""
    mask = torch.ones(batch, seq, dtype=torch.long, device=device)
    mask[::2, seq - seq // 4:] = 0
    return _ids(batch, seq, vocab, device)[0], mask


def build_cases(device: str, quick: bool) -> list[Case]:
    """The models on ``device`` with their single-request, serving and large input shapes."""
    torch.manual_seed(0)
    cases: list[Case] = []

    def add(name: str, model: nn.Module, make: Callable[[int, int], tuple],
            shapes: tuple[tuple[int, int], ...], unit: str) -> None:
        model = model.to(device).eval()
        labels = ("single", "serving", "large")
        chosen = list(zip(labels, shapes))[:2 if quick else 3]
        cases.append(Case(name, model, {label: (make(*shape), f"{shape[0]}x{shape[1]} {unit}")
                                        for label, shape in chosen}))

    add("MLP 4x1024", MLP(), lambda b, _: (torch.randn(b, 512, device=device),),
        ((1, 512), (4, 512), (256, 512)), "feat")
    add("CNN (ResNet-ish, 64ch)", CNN(),
        lambda b, s: (torch.randn(b, 3, s, s, device=device),), ((1, 32), (2, 32), (16, 32)),
        "img")
    add("GPT stack 4L d256", GPT(), lambda b, s: _ids(b, s, 4096, device),
        ((1, 32), (2, 64), (8, 64)), "tok")
    for kind, label in (("bert", "HF BertModel 4L d256"), ("gpt2", "HF GPT2Model 4L d256")):
        add(label, _hf(kind), lambda b, s: _padded(b, s, 8192, device),
            ((1, 32), (2, 64), (8, 64)), "tok")
    return cases


def first_tensor(out: Any) -> torch.Tensor:
    """The main output of a model: a tensor, ``last_hidden_state``, or the first element."""
    if isinstance(out, torch.Tensor):
        return out
    if hasattr(out, "last_hidden_state"):
        return out.last_hidden_state
    if isinstance(out, dict):
        return first_tensor(next(iter(out.values())))
    return first_tensor(out[0])
