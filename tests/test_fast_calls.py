"""The generated code calls torch's Python bindings for ATen ops, proven to run the same op;
the graph keeps its OpOverloads. Also: weight casts batched or one per weight, by device."""

from __future__ import annotations

import pytest
import torch
import torch.fx as fx
import torch.nn as nn

import amprewrite
from amprewrite.graph.codegen import recompile_with_bindings
from amprewrite.runtime import weight_cache as _weight_cache


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.norm = nn.LayerNorm(8)
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(self.norm(x)).view(2, -1)
        return (x.view(2, -1) + h).softmax(-1)


def test_code_calls_bindings_and_graph_keeps_overloads() -> None:
    model, x = Block(), torch.randn(2, 8)
    gm = amprewrite.convert(model, (x,), policy=amprewrite.Policy.autocast("cpu", torch.bfloat16))
    code = gm.code
    for call in ("torch.layer_norm(", "torch._C._nn.linear(", "torch.add(", "torch.softmax("):
        assert call in code, call
    assert "torch.ops.aten.view.default(" in code  # a Tensor method only: kept
    targets = {n.target for n in gm.graph.nodes if n.op == "call_function"}
    assert torch.ops.aten.layer_norm.default in targets
    assert torch.ops.aten.linear.default in targets
    with torch.no_grad():
        fast = gm(x)
        gm.recompile()  # the plain code: OpOverload calls, the same results
        assert "torch.ops.aten.layer_norm.default(" in gm.code
        assert torch.equal(gm(x), fast)
    with torch.no_grad(), torch.autocast("cpu", torch.bfloat16):
        assert torch.equal(model(x), fast)


def test_an_overload_the_binding_would_not_choose_stays() -> None:
    """``torch.add(x, 2)`` runs ``aten.add.Tensor``, not ``aten.add.Scalar``: the proof
    (comparing the ops each dispatches) keeps the OpOverload there."""
    graph = fx.Graph()
    x = graph.placeholder("x")
    x.meta["val"] = torch.randn(3)
    scalar = graph.call_function(torch.ops.aten.add.Scalar, (x, 2))
    scalar.meta["val"] = torch.randn(3)
    tensor = graph.call_function(torch.ops.aten.mul.Tensor, (scalar, x))
    tensor.meta["val"] = torch.randn(3)
    graph.output(tensor)
    gm = recompile_with_bindings(fx.GraphModule(nn.Module(), graph))
    assert "torch.ops.aten.add.Scalar(x, 2)" in gm.code
    assert "torch.mul(add_scalar, x)" in gm.code
    x = torch.randn(3)
    assert torch.equal(gm(x), (x + 2) * x)


def test_nodes_without_values_keep_overloads() -> None:
    graph = fx.Graph()
    x = graph.placeholder("x")  # no meta["val"]: nothing to prove the binding on
    graph.output(graph.call_function(torch.ops.aten.relu.default, (x,)))
    gm = recompile_with_bindings(fx.GraphModule(nn.Module(), graph))
    assert "torch.ops.aten.relu.default(x)" in gm.code


class Two(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)
        self.unused = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


def _grads(opt_level: str, batched_on_cpu: bool, monkeypatch: pytest.MonkeyPatch
           ) -> tuple[list, set[str]]:
    types = {"cpu", "cuda"} if batched_on_cpu else {"cuda"}
    monkeypatch.setattr(_weight_cache, "BATCHED_DEVICE_TYPES", frozenset(types))
    model, x = Two(), torch.randn(4, 8)
    gm = amprewrite.convert(model, (x,), opt_level=opt_level, dtype=torch.bfloat16)
    if opt_level == "O2":
        amprewrite.MasterWeights(gm, torch.optim.SGD(gm.parameters(), lr=0.1))
    out = gm(x)
    nodes, stack = set(), [out.grad_fn]
    while stack:  # every autograd node of the forward
        fn = stack.pop()
        if fn is not None and type(fn).__name__ not in nodes:
            nodes.add(type(fn).__name__)
            stack += [f for f, _ in fn.next_functions]
    out.float().square().sum().backward()
    return [p.grad for p in model.parameters()], nodes


def test_batched_and_per_weight_casts_give_the_same_gradients(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """On the CPU each weight is cast by its own ``.to`` (cheaper there); where casts are
    kernel launches (CUDA) they are batched into one autograd node. Same gradients, bit for
    bit; an unused weight gets none either way."""
    each, each_nodes = _grads("O1", False, monkeypatch)
    batch, batch_nodes = _grads("O1", True, monkeypatch)
    assert "ToCopyBackward0" in each_nodes and "_BatchCastBackward" not in each_nodes
    assert "_BatchCastBackward" in batch_nodes
    for g, h in zip(each, batch):
        assert (g is None) == (h is None)
        assert g is None or (g.dtype == torch.float32 and torch.equal(g, h))
    assert each[-1] is None and each[-2] is None  # the unused layer
