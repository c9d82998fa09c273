"""The auditor's loss-scale advice against the physical truth, on five models.

The truth T: the largest power of two by which the loss can be multiplied with every fp16
value of the backward still finite (fp16 policy, found by bisection), cross-checked with the
scale ``torch.amp.GradScaler`` settles at on the same batch. The advice R comes from one
audited step at scale 1, of the bf16 run (the default on a CPU: an fp16 what-if) and of the
fp16 run, and must satisfy ``T/4 <= R <= T``. Where the fp16 run could not see enough (every
gradient it held was subnormal) the advice says so, and the probe step it asks for gives an R
in the same bounds.

The models: a Llama whose batches are padded (a zero padding embedding row: rsqrt's fp32
backward is huge there, and must not count), an MLP whose loss is multiplied by 1e-6 (tiny
gradients), a CNN with batch norm, a BERT classifier with an attention mask, and a T5
(encoder-decoder) with a summed loss large enough that fp16 overflows below 2^9.
Dropout is off so that every step of a bisection sees the same values.
"""

from __future__ import annotations

import math
from typing import Callable

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import amprewrite

transformers = pytest.importorskip("transformers")

Case = tuple[nn.Module, tuple, Callable[[torch.Tensor], torch.Tensor]]


class _Logits(nn.Module):
    """An HF model called with keywords, returning its logits."""

    def __init__(self, model: nn.Module, first: str, second: str) -> None:
        super().__init__()
        self.model, self.names = model, (first, second)

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return self.model(**dict(zip(self.names, (a, b)))).logits


def _llama_padded() -> Case:
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32,
        attn_implementation="eager", pad_token_id=0)
    ids = torch.randint(1, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    ids[1, 8:] = 0  # padding tokens: the embedding's zero row
    model = _Logits(transformers.LlamaForCausalLM(config), "input_ids", "attention_mask")
    return model, (ids, (ids != 0).long()), \
        lambda out: F.cross_entropy(out.float().flatten(0, 1), ids.flatten())


def _mlp_tiny_loss() -> Case:
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(),
                          nn.Linear(64, 10))
    x, y = torch.randn(16, 32), torch.randint(0, 10, (16,))
    return model, (x,), lambda out: F.cross_entropy(out.float(), y) * 1e-6


def _cnn_batch_norm() -> Case:
    model = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
        nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 10))
    x, y = torch.randn(4, 3, 16, 16), torch.randint(0, 10, (4,))
    return model, (x,), lambda out: F.cross_entropy(out.float(), y)


def _bert_classifier() -> Case:
    config = transformers.BertConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=64, max_position_embeddings=32, num_labels=3,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    ids = torch.randint(1, 64, (2, 10))
    mask = torch.ones_like(ids)
    mask[1, 6:] = 0
    y = torch.tensor([0, 2])
    model = _Logits(transformers.BertForSequenceClassification(config), "input_ids",
                    "attention_mask")
    return model, (ids, mask), lambda out: F.cross_entropy(out.float(), y)


def _t5_overflowing() -> Case:
    config = transformers.T5Config(
        vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_decoder_layers=1,
        num_heads=2, decoder_start_token_id=0, pad_token_id=0, dropout_rate=0.0)
    t5 = transformers.T5ForConditionalGeneration(config)
    with torch.no_grad():
        for block in list(t5.encoder.block) + list(t5.decoder.block):
            block.layer[-1].DenseReluDense.wo.weight.mul_(50.0)
    ids, labels = torch.randint(1, 64, (2, 10)), torch.randint(1, 64, (2, 6))
    return _Logits(t5, "input_ids", "labels"), (ids, labels), \
        lambda out: F.cross_entropy(out.float().flatten(0, 1), labels.flatten()) * 3000.0


CASES = {"llama_padded": _llama_padded, "mlp_tiny_loss": _mlp_tiny_loss,
         "cnn_batch_norm": _cnn_batch_norm, "bert_classifier": _bert_classifier,
         "t5_overflowing": _t5_overflowing}


class _Fp16Finite(TorchDispatchMode):
    """Whether every fp16 value a backward op wrote was finite (uninitialised buffers, which
    an op fills later, left out)."""

    def __init__(self) -> None:
        super().__init__()
        self.finite = True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        out = func(*args, **(kwargs or {}))
        if torch._C._current_autograd_node() is not None and "empty" not in func.__name__:
            for t in out if isinstance(out, (list, tuple)) else [out]:
                if isinstance(t, torch.Tensor) and t.dtype == torch.float16:
                    self.finite = self.finite and bool(torch.isfinite(t).all())
        return out


def _finite_at(gm: nn.Module, case: Case, exponent: int) -> bool:
    _, inputs, loss_of = case
    check = _Fp16Finite()
    loss = loss_of(gm(*inputs)) * 2.0 ** exponent
    with check:
        loss.backward()
    return check.finite


def _truth(gm: nn.Module, case: Case) -> int:
    """log2 T by bisection: finite at ``low``, not at ``high``."""
    low, high = -24, 64
    assert _finite_at(gm, case, low) and not _finite_at(gm, case, high)
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if _finite_at(gm, case, mid) else (low, mid)
    return low


def _grad_scaler_settles(gm: nn.Module, case: Case, start: int) -> int:
    """log2 of the scale GradScaler keeps on this batch: it grows every step and halves on
    an overflow, so it steps between T and 2T; the lower is where it settles."""
    model, inputs, loss_of = case
    opt = torch.optim.SGD(model.parameters(), lr=0.0)  # the same batch, the same weights
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** start, growth_interval=1)
    seen = []
    for _ in range(8):
        opt.zero_grad()
        scaler.scale(loss_of(gm(*inputs))).backward()
        scaler.step(opt)
        scaler.update()
        seen.append(scaler.get_scale())
    return int(math.log2(min(seen[-4:])))


def _advice(gm: nn.Module, case: Case, scale: float = 1.0) -> amprewrite.GradHistogram:
    _, inputs, loss_of = case
    with amprewrite.audit() as report:
        (loss_of(gm(*inputs)) * scale).backward()
    return report.grad_histogram


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("name", sorted(CASES))
def test_the_recommended_loss_scale_is_safe_and_close(name: str) -> None:
    torch.manual_seed(0)
    case = CASES[name]()
    model, inputs, _ = case
    model.train()
    fp16 = amprewrite.convert(model, inputs, dtype=torch.float16)
    truth = _truth(fp16, case)
    assert _grad_scaler_settles(fp16, case, truth + 2) == truth
    # bf16: the default on a CPU; its advice is the fp16 what-if, and sees every value.
    hist = _advice(amprewrite.convert(model, inputs, dtype=torch.bfloat16), case)
    assert hist.what_if and not hist.needs_probe
    assert truth - 2 <= math.log2(hist.recommended_loss_scale) <= truth, hist.advice()
    assert "fp16 what-if" in hist.advice()
    # fp16: the run's own limits; a probe step where it says it could not see enough.
    hist = _advice(fp16, case)
    scale = hist.recommended_loss_scale
    if hist.needs_probe:
        assert "upper bound" in hist.advice()
        scale *= _advice(fp16, case, scale).recommended_loss_scale
    assert truth - 2 <= math.log2(scale) <= truth, (hist.advice(), truth)
    if name == "t5_overflowing":
        assert truth < 9  # a real fp16 overflow regime, not a loose bound
    if name == "mlp_tiny_loss":
        assert truth > 30 and hist.needs_probe
