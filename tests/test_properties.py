"""Property tests: invariants that must hold for any model, not only the zoo's.

1. EliminateCastsPass never changes a bit: any chain of dtype conversions gives the same
   values, dtype and gradient after elimination, with no more cast nodes than before.
2. Random compositions of listed and unlisted ops converted with ``Policy.autocast("cpu")``
   compute bitwise what ``torch.autocast("cpu")`` computes, outputs and gradients.
"""

from __future__ import annotations

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import amprewrite
from amprewrite import Policy
from amprewrite.graph.queries import cast_source
from amprewrite.passes.eliminate_casts import EliminateCastsPass

_DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64]
_SETTINGS = settings(max_examples=30, deadline=None,
                     suppress_health_check=[HealthCheck.too_slow])


def _cast_chain(dtypes: list[torch.dtype], fork: int | None) -> fx.GraphModule:
    """x -> cast -> cast -> ... (each a `.to(dtype)`), optionally with a second consumer
    branching off step ``fork``, summed into the output in fp64 so nothing is dropped."""
    graph = fx.Graph()
    x = graph.placeholder("x")
    value, branch = x, None
    for i, dtype in enumerate(dtypes):
        value = graph.call_method("to", (value, dtype))
        if fork == i:
            branch = graph.call_method("to", (value, torch.float64))
    out = graph.call_method("to", (value, torch.float64))
    if branch is not None:
        out = graph.call_function(torch.add, (out, branch))
    graph.output(out)
    return fx.GraphModule(nn.Module(), graph)


def _with_meta(gm: fx.GraphModule, x: torch.Tensor) -> fx.GraphModule:
    from torch.fx.passes.shape_prop import ShapeProp

    ShapeProp(gm).propagate(x)
    for node in gm.graph.nodes:  # the passes read dtypes from meta["val"]
        if "tensor_meta" in node.meta:
            tm = node.meta["tensor_meta"]
            node.meta["val"] = torch.empty(tm.shape, dtype=tm.dtype)
    return gm


@_SETTINGS
@given(dtypes=st.lists(st.sampled_from(_DTYPES), min_size=1, max_size=5),
       start=st.sampled_from(_DTYPES[:3]),
       fork=st.one_of(st.none(), st.integers(0, 4)))
def test_cast_elimination_never_changes_a_bit(dtypes: list[torch.dtype],
                                              start: torch.dtype, fork: int | None) -> None:
    torch.manual_seed(0)
    # Values across fp16's range, tiny ones included: rounding differences would show.
    x = (torch.randn(64) * torch.logspace(-8, 4, 64)).to(start).requires_grad_()
    gm = _with_meta(_cast_chain(dtypes, fork if fork is None or fork < len(dtypes) else None), x)
    expected = gm(x)
    (grad_expected,) = torch.autograd.grad(expected.sum(), x)
    casts_before = sum(cast_source(n) is not None for n in gm.graph.nodes)
    EliminateCastsPass(Policy())(gm)
    gm.recompile()
    out = gm(x)
    (grad,) = torch.autograd.grad(out.sum(), x)
    assert out.dtype == expected.dtype
    assert torch.equal(out, expected)
    assert torch.equal(grad, grad_expected)
    assert sum(cast_source(n) is not None for n in gm.graph.nodes) <= casts_before
    assert EliminateCastsPass(Policy())(gm).modified is False  # idempotent


_OPS = ["linear", "relu", "gelu", "softmax", "layer_norm", "matmul_w", "residual", "exp",
        "sum_keep", "cat_self", "mul_scalar", "tanh"]


class RandomNet(nn.Module):
    """A chain of ops drawn by hypothesis over a (batch, 8) activation."""

    def __init__(self, ops: list[str]) -> None:
        super().__init__()
        self.ops = ops
        self.linears = nn.ModuleList(nn.Linear(8, 8) for _ in ops)
        self.norms = nn.ModuleList(nn.LayerNorm(8) for _ in ops)
        self.weights = nn.ParameterList(nn.Parameter(torch.randn(8, 8) / 3) for _ in ops)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skip = x
        for i, op in enumerate(self.ops):
            if op == "linear":
                x = self.linears[i](x)
            elif op == "relu":
                x = F.relu(x)
            elif op == "gelu":
                x = F.gelu(x)
            elif op == "softmax":
                x = F.softmax(x, dim=-1)
            elif op == "layer_norm":
                x = self.norms[i](x)
            elif op == "matmul_w":
                x = x @ self.weights[i]
            elif op == "residual":
                x = x + skip
            elif op == "exp":
                x = torch.exp(x.clamp(max=4))
            elif op == "sum_keep":
                x = x - x.sum(-1, keepdim=True) / 8
            elif op == "cat_self":
                x = torch.cat([x, skip], dim=0)[: x.shape[0]]
            elif op == "mul_scalar":
                x = x * 0.5
            elif op == "tanh":
                x = torch.tanh(x)
        return x


@_SETTINGS
@given(ops=st.lists(st.sampled_from(_OPS), min_size=1, max_size=6),
       dtype=st.sampled_from([torch.bfloat16, torch.float16]),
       capture=st.sampled_from(["export", "symbolic"]))
def test_random_models_match_autocast_bitwise(ops: list[str], dtype: torch.dtype,
                                              capture: str) -> None:
    torch.manual_seed(0)
    model = RandomNet(ops)
    x = torch.randn(4, 8, requires_grad=True)
    gm = amprewrite.convert(model, (x,), policy=Policy.autocast("cpu", dtype), capture=capture)
    wrt = [x, *model.parameters()]  # the input too: some chains have no parameter in use
    out = gm(x)
    grads = torch.autograd.grad(out.float().sum(), wrt, allow_unused=True)
    with torch.autocast("cpu", dtype=dtype):
        expected = model(x)
    expected_grads = torch.autograd.grad(expected.float().sum(), wrt, allow_unused=True)
    assert out.dtype == expected.dtype
    assert torch.equal(out, expected)
    for g, e in zip(grads, expected_grads):
        assert (g is None) == (e is None)
        if g is not None:
            assert g.dtype == e.dtype and torch.equal(g, e)
