"""The benchmark's models and input shapes, at two sizes.

NB: the HF models get an explicit padding mask. Without one, HF's eager code skips the mask
after looking at the input's values, which a captured graph cannot do; the two would then
run different computations.

``small`` (the default, sized for a CPU): each model runs a *single* request and a small
*serving* batch (where re-casting weights on every forward is a large part of the cost), and
a *large* batch (more tokens per weight, where it is not). ``realistic`` (for a GPU): the
transformers at BERT-base / GPT-2-small size (12 layers, d_model 768, 12 heads) on a single
128-token request and a *batch* of 8 x 512 tokens, the MLP and CNN at a matching size.
``tiny``: the same transformers at 4 layers and d_model 32 on 8 and 2x16 tokens, the MLP at
4x64 and the CNN at 8 channels: every op costs little more than its dispatch, so, as for the
``launch`` model, host overhead per op (casts included) weighs, on a CPU as in eager GPU
training of small models. ``quick`` keeps at most the first two shapes of each model; shapes
can also be chosen by label.

The ``launch`` model is the same at every size: 50 tiny blocks at batch 2, where every op
costs far less than launching it, the regime of eager GPU training of small models, in which
per-op CPU overhead (casts included) decides the step time.

Weights are random and nothing is downloaded. Dropout is 0 and every model is put in
``eval()``, so that all variants compute the same function in forward and backward.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Collection

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["Case", "MODEL_KEYS", "SHAPE_LABELS", "SIZES", "build_case", "describe",
           "first_tensor"]

SIZES = ("small", "realistic", "tiny")


@dataclasses.dataclass
class Case:
    """One model with the inputs of each shape (``shapes[name] = (args, description)``)."""

    key: str
    name: str
    model: nn.Module
    shapes: dict[str, tuple[tuple[Any, ...], str]]


class LaunchBound(nn.Module):
    """``depth`` pre-norm residual blocks ``x + Linear(LayerNorm(x))`` of width ``width``."""

    def __init__(self, width: int = 8, depth: int = 50) -> None:
        super().__init__()
        self.norms = nn.ModuleList(nn.LayerNorm(width) for _ in range(depth))
        self.fcs = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for norm, fc in zip(self.norms, self.fcs):
            x = x + fc(norm(x))
        return x


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


@dataclasses.dataclass(frozen=True)
class _Dims:
    """Transformer dimensions of one size; ``vocab[model key]``."""

    layers: int
    d_model: int
    heads: int
    max_len: int
    vocab: dict[str, int]

    @property
    def label(self) -> str:
        return f"{self.layers}L d{self.d_model}"


_TRANSFORMER = {
    "small": _Dims(4, 256, 4, 512, {"gpt": 4096, "bert": 8192, "gpt2": 8192, "llama": 8192}),
    "tiny": _Dims(4, 32, 2, 64, {"gpt": 256, "bert": 256, "gpt2": 256, "llama": 256}),
    # BERT-base's, GPT-2's and Llama 2's vocabularies; the GPT stack's is GPT-2's padded to a
    # multiple of 64, as GPT training code pads it for the GPU.
    "realistic": _Dims(12, 768, 12, 1024,
                       {"gpt": 50304, "bert": 30522, "gpt2": 50257, "llama": 32000}),
}


def _hf(kind: str, dims: _Dims) -> nn.Module:
    import transformers

    if kind == "bert":
        # BERT's learned positions end at 512, the longest sequence benchmarked.
        config = transformers.BertConfig(
            hidden_size=dims.d_model, num_hidden_layers=dims.layers,
            num_attention_heads=dims.heads, intermediate_size=4 * dims.d_model,
            vocab_size=dims.vocab["bert"], max_position_embeddings=512,
            hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
        config._attn_implementation = "eager"
        return HFEncoder(transformers.BertModel(config, add_pooling_layer=False))
    if kind == "llama":
        # RMSNorm, rotary embeddings (sliced per layer), SwiGLU MLP; no key/value cache.
        config = transformers.LlamaConfig(
            hidden_size=dims.d_model, num_hidden_layers=dims.layers,
            num_attention_heads=dims.heads, num_key_value_heads=dims.heads,
            intermediate_size=4 * dims.d_model, vocab_size=dims.vocab["llama"],
            max_position_embeddings=dims.max_len, use_cache=False)
        config._attn_implementation = "eager"
        return HFEncoder(transformers.LlamaModel(config))
    config = transformers.GPT2Config(
        n_embd=dims.d_model, n_layer=dims.layers, n_head=dims.heads, n_inner=4 * dims.d_model,
        vocab_size=dims.vocab["gpt2"], n_positions=dims.max_len, resid_pdrop=0.0,
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


def _features(batch: int, features: int, device: str) -> tuple[torch.Tensor]:
    return (torch.randn(batch, features, device=device),)


def _images(batch: int, side: int, device: str) -> tuple[torch.Tensor]:
    return (torch.randn(batch, 3, side, side, device=device),)


Shapes = tuple[tuple[str, int, int], ...]
"""``(label, batch, size)`` per shape; size is features, image side or tokens."""


@dataclasses.dataclass(frozen=True)
class _Spec:
    """How to build one model and its inputs: ``inputs(batch, size, device)``."""

    name: str
    model: Callable[[], nn.Module]
    inputs: Callable[[int, int, str], tuple]
    shapes: Shapes
    unit: str


def _specs(size: str) -> dict[str, _Spec]:
    dims = _TRANSFORMER[size]
    if size == "small":
        tokens: Shapes = (("single", 1, 32), ("serving", 2, 64), ("large", 8, 64))
        mlp, mlp_shapes = (512, 1024), (("single", 1, 512), ("serving", 4, 512),
                                        ("large", 256, 512))
        cnn, cnn_shapes = 64, (("single", 1, 32), ("serving", 2, 32), ("large", 16, 32))
    elif size == "tiny":
        tokens = (("single", 1, 8), ("serving", 2, 16))
        mlp, mlp_shapes = (32, 64), (("single", 1, 32), ("serving", 4, 32))
        cnn, cnn_shapes = 8, (("single", 1, 16), ("serving", 2, 16))
    else:
        tokens = (("single", 1, 128), ("batch", 8, 512))
        # 4096 rows: as many as the transformers' batch has tokens
        mlp, mlp_shapes = (1024, 4096), (("single", 1, 1024), ("batch", 4096, 1024))
        cnn, cnn_shapes = 128, (("single", 1, 224), ("batch", 8, 224))

    def tokens_of(key: str) -> Callable[[int, int, str], tuple]:
        vocab = dims.vocab[key]
        if key == "gpt":
            return lambda b, s, d: _ids(b, s, vocab, d)
        return lambda b, s, d: _padded(b, s, vocab, d)

    # The launch model's one shape is a small batch: "serving" except at the realistic size.
    launch_label = "batch" if size == "realistic" else "serving"
    return {
        "launch": _Spec("Launch-bound 50x(LN+Linear) d8", LaunchBound, _features,
                        ((launch_label, 2, 8),), "feat"),
        "mlp": _Spec(f"MLP 4x{mlp[1]}", lambda: MLP(*mlp), _features, mlp_shapes, "feat"),
        "cnn": _Spec(f"CNN (ResNet-ish, {cnn}ch)", lambda: CNN(cnn), _images, cnn_shapes,
                     "img"),
        "gpt": _Spec(f"GPT stack {dims.label}",
                     lambda: GPT(dims.vocab["gpt"], dims.d_model, dims.heads, dims.layers,
                                 dims.max_len), tokens_of("gpt"), tokens, "tok"),
        "bert": _Spec(f"HF BertModel {dims.label}", lambda: _hf("bert", dims),
                      tokens_of("bert"), tokens, "tok"),
        "gpt2": _Spec(f"HF GPT2Model {dims.label}", lambda: _hf("gpt2", dims),
                      tokens_of("gpt2"), tokens, "tok"),
        "llama": _Spec(f"HF LlamaModel {dims.label}", lambda: _hf("llama", dims),
                       tokens_of("llama"), tokens, "tok"),
    }


MODEL_KEYS = tuple(_specs("small"))
SHAPE_LABELS = ("single", "serving", "large", "batch")


def describe(key: str, size: str, quick: bool, labels: Collection[str] | None
             ) -> tuple[str, list[str]]:
    """The name of model ``key`` at ``size`` and the descriptions of its chosen shapes (see
    :func:`build_case`), without building it."""
    spec = _specs(size)[key]
    return spec.name, [f"{b}x{s} {spec.unit}" for _, b, s in _chosen(spec, quick, labels)]


def _chosen(spec: _Spec, quick: bool, labels: Collection[str] | None) -> Shapes:
    shapes = spec.shapes[:2] if quick else spec.shapes
    return tuple(s for s in shapes if labels is None or s[0] in labels)


def build_case(key: str, size: str, device: str, quick: bool,
               labels: Collection[str] | None = None) -> Case:
    """Model ``key`` at ``size`` on ``device``, with the inputs of its shapes: at most two
    if ``quick``, and only those whose label is in ``labels`` when given. Seeded, so that
    every run builds the same weights and inputs."""
    torch.manual_seed(0)
    spec = _specs(size)[key]
    # Built on the device: initialising a 100M-parameter model on the host takes seconds.
    with torch.device(device):
        model = spec.model().eval()
    return Case(key, spec.name, model,
                {label: (spec.inputs(b, s, device), f"{b}x{s} {spec.unit}")
                 for label, b, s in _chosen(spec, quick, labels)})


def first_tensor(out: Any) -> torch.Tensor:
    """The main output of a model: a tensor, ``last_hidden_state``, or the first element."""
    if isinstance(out, torch.Tensor):
        return out
    if hasattr(out, "last_hidden_state"):
        return out.last_hidden_state
    if isinstance(out, dict):
        return first_tensor(next(iter(out.values())))
    return first_tensor(out[0])
