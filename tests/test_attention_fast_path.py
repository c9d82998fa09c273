"""``nn.MultiheadAttention`` under ``Policy.autocast("cpu")``: eager runs its fused kernel in
eval mode when nothing needs a gradient (its autocast check reads CUDA's state only), its
composite ops otherwise; the converted module chooses as eager does, bitwise both ways."""

from __future__ import annotations

import copy
import pickle
from typing import Any, Callable

import pytest
import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode

import amprewrite
from amprewrite import Policy
from amprewrite.passes.pipeline import amp_passes

pytestmark = pytest.mark.usefixtures("one_thread")

FUSED = "aten._native_multi_head_attention.default"
PRESET = Policy.autocast("cpu", torch.bfloat16)


class Block(nn.Module):
    """A vision transformer's attention block (torchvision's EncoderBlock): the shapes for
    which the fused kernel and the composite ops round differently."""

    def __init__(self, mask: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.norm = nn.LayerNorm(32)
        self.attention = nn.MultiheadAttention(32, 4, batch_first=True)
        self.head = nn.Linear(32, 3)
        self.mask = mask

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        mask = torch.ones(x.shape[1], x.shape[1], dtype=torch.bool).triu(1) if self.mask else None
        h = self.attention(h, h, h, need_weights=False, attn_mask=mask)[0]
        return self.head(x + h)


X = torch.randn(2, 9, 32, generator=torch.Generator().manual_seed(1))


class _Ops(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def _ops(fn: Callable[[], torch.Tensor]) -> tuple[torch.Tensor, list[str]]:
    with _Ops() as seen:
        out = fn()
    return out, seen.ops


def _autocast(model: nn.Module) -> torch.Tensor:
    with torch.autocast("cpu", torch.bfloat16):
        return model(X)


def test_no_grad_runs_the_fused_kernel_as_eager_autocast_does() -> None:
    model = Block().eval()
    gm = amprewrite.convert(model, (X,), policy=PRESET)
    assert "multi_head_attention(" in gm.code
    with torch.no_grad():
        want, eager_ops = _ops(lambda: _autocast(model))
        got, ops = _ops(lambda: gm(X))
        assert FUSED in eager_ops and FUSED in ops
    assert torch.equal(got, want)


class Projected(nn.Module):
    """A Linear before the attention: under autocast its query arrives in bf16, where the
    module's weights are fp32, so eager declines the fused kernel."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.proj = nn.Linear(32, 32)
        self.attention = nn.MultiheadAttention(32, 4, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(x)
        return self.attention(h, h, h, need_weights=False)[0]


def test_a_query_in_bf16_keeps_the_composite_ops_as_eager_does() -> None:
    """The choice is made on the weights' dtype, as eager makes it, not on the query's."""
    model = Projected().eval()
    gm = amprewrite.convert(model, (X,), policy=PRESET)
    with torch.no_grad():
        want, eager_ops = _ops(lambda: _autocast(model))
        got, ops = _ops(lambda: gm(X))
    assert FUSED not in eager_ops and FUSED not in ops
    assert torch.equal(got, want)


def test_with_gradients_the_composite_ops_give_autocasts_outputs_and_gradients() -> None:
    model = Block().eval()
    ref = copy.deepcopy(model)
    gm = amprewrite.convert(model, (X,), policy=PRESET)
    want, eager_ops = _ops(lambda: _autocast(ref))
    got, ops = _ops(lambda: gm(X))
    assert FUSED not in eager_ops and FUSED not in ops
    assert torch.equal(got, want)
    got.float().pow(2).sum().backward()
    want.float().pow(2).sum().backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(p.grad, q.grad), name


def test_train_mode_and_masks_keep_the_composite_ops() -> None:
    """In train mode eager never fuses (the converted module reads its sub-graph's training
    flag, which gm.train() sets); a call with a mask is left as captured."""
    model = Block().eval()
    gm = amprewrite.convert(model, (X,), policy=PRESET)
    gm.train()
    model.train()
    with torch.no_grad():
        got, ops = _ops(lambda: gm(X))
        assert FUSED not in ops and torch.equal(got, _autocast(model))
    masked = amprewrite.convert(Block(mask=True).eval(), (X,), policy=PRESET)
    assert "multi_head_attention(" not in masked.code


def test_other_policies_keep_the_captured_ops() -> None:
    """CUDA autocast (whose state the check reads) never fuses; the default policy follows
    CUDA's rules, and O2 is the model in the low dtype, not autocast."""
    for options in ({}, {"opt_level": "O2"}):
        gm = amprewrite.convert(Block().eval(), (X,), **options)
        assert "multi_head_attention(" not in gm.code


def test_copies_pickles_and_a_second_run_of_the_passes() -> None:
    model = Block().eval()
    gm = amprewrite.convert(model, (X,), policy=PRESET)
    for p in amp_passes(PRESET, torch.bfloat16):
        assert p(gm).modified is False, type(p).__name__
    with torch.no_grad():
        want = gm(X)
        for clone in (copy.deepcopy(gm), pickle.loads(pickle.dumps(gm))):
            assert torch.equal(clone(X), want)
    table = amprewrite.explain(gm, all_nodes=True)
    assert "nn.MultiheadAttention's fused kernel in bfloat16 where eager runs it" in table
