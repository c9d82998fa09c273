"""FitConstantsPass: ``torch.finfo(fp32)`` literals recorded by an fp32 capture are fitted to
the low dtype of the op that now computes in it."""

from __future__ import annotations

import torch
import torch.fx as fx
import torch.nn as nn

import amprewrite
from amprewrite.capture.facts import TRACED_IN_FP32
from amprewrite.passes.fit_constants import FitConstantsPass

FP32_MIN = torch.finfo(torch.float32).min


class MaskedAttention(nn.Module):
    """Scores masked with the minimum of *their own* dtype, as HF attention code does."""

    def __init__(self) -> None:
        super().__init__()
        self.q = nn.Linear(8, 8)
        self.k = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        scores = self.q(x) @ self.k(x).transpose(-1, -2)
        scores = scores.masked_fill(mask, torch.finfo(scores.dtype).min)
        return scores.softmax(-1)


def _inputs() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 5, 8, generator=g)
    mask = torch.ones(5, 5, dtype=torch.bool).triu(1)
    return x, mask


def test_compiled_graph_masks_with_the_low_dtypes_minimum() -> None:
    """Dynamo traces in fp32 and records fp32's minimum; unfitted, masked_fill on the bf16
    scores raises. Fitted, the output is autocast's, bit for bit."""
    torch.manual_seed(0)
    model = MaskedAttention()
    x, mask = _inputs()
    with torch.no_grad(), torch.autocast("cpu", torch.bfloat16):
        expected = model(x, mask)
    compiled = amprewrite.compile(model, policy=amprewrite.Policy.autocast("cpu", torch.bfloat16),
                                  eager=True)
    with torch.no_grad():
        out = compiled(x, mask)
    assert torch.equal(out, expected)
    (gm,) = compiled.amprewrite_backend.graphs
    fills = [n for n in gm.graph.nodes if "masked_fill" in str(n.target)]
    assert len(fills) == 1
    assert torch.finfo(torch.bfloat16).min in fills[0].args
    assert FP32_MIN not in fills[0].args


def _graph(dtype: torch.dtype, value: float) -> fx.GraphModule:
    graph = fx.Graph()
    x = graph.placeholder("x")
    x.meta["val"] = torch.empty(3, dtype=dtype)
    mask = graph.placeholder("mask")
    mask.meta["val"] = torch.empty(3, dtype=torch.bool)
    fill = graph.call_function(torch.ops.aten.masked_fill.Scalar, (x, mask, value))
    fill.meta["val"] = torch.empty(3, dtype=dtype)
    graph.output(fill)
    gm = fx.GraphModule(nn.Module(), graph)
    gm.meta[TRACED_IN_FP32] = True
    return gm


def test_fits_fp32_extremes_once_and_nothing_else() -> None:
    half = torch.finfo(torch.float16)
    gm = _graph(torch.float16, FP32_MIN)
    assert FitConstantsPass()(gm).modified
    (fill,) = [n for n in gm.graph.nodes if n.op == "call_function"]
    assert fill.args[2] == half.min
    assert not FitConstantsPass()(gm).modified  # idempotent
    for dtype, value in [(torch.float32, FP32_MIN),   # fp32 ops keep fp32's values
                         (torch.bfloat16, -1e9),      # an ordinary large mask value
                         (torch.bfloat16, float("-inf"))]:
        gm = _graph(dtype, value)
        assert not FitConstantsPass()(gm).modified
        (fill,) = [n for n in gm.graph.nodes if n.op == "call_function"]
        assert fill.args[2] == value
    gm = _graph(torch.float16, FP32_MIN)
    gm.meta[TRACED_IN_FP32] = False  # traced in the AMP regime: the model wrote this literal
    assert not FitConstantsPass()(gm).modified
    gm = _graph(torch.bfloat16, torch.finfo(torch.float32).max)
    FitConstantsPass()(gm)
    assert [n for n in gm.graph.nodes if n.op == "call_function"][0].args[2] == \
        torch.finfo(torch.bfloat16).max
