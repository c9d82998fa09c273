"""The generated code calls torch's Python bindings for ATen ops, proven to run the same op;
the graph keeps its OpOverloads."""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch
import torch.fx as fx
import torch.nn as nn

import amprewrite
from amprewrite.graph.codegen import plain_codegen, recompile_with_bindings
from amprewrite.runtime.functions import cast_to


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
    for call in ("torch.layer_norm(", "torch.nn.functional.linear(", "torch.add(",
                 "torch.softmax("):
        assert call in code, call
    # view is a Tensor method only: called as one, on its first argument
    assert "torch.ops.aten.view.default(" not in code and re.search(r"= linear\.view\(", code)
    targets = {n.target for n in gm.graph.nodes if n.op == "call_function"}
    assert torch.ops.aten.layer_norm.default in targets
    assert torch.ops.aten.linear.default in targets
    with torch.no_grad():
        fast = gm(x)
        gm.recompile()  # the graph keeps its code generator: the same code, the same results
        assert gm.code == code
        assert torch.equal(gm(x), fast)
        plain_codegen(gm.graph)
        gm.recompile()  # torch.fx's own: OpOverload calls, the same results
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


class Split(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.qkv = nn.Linear(8, 24)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).split(8, dim=-1)
        return q * k + v


def test_a_list_result_only_indexed_takes_the_tuple_binding() -> None:
    """``aten::split`` returns a list and ``Tensor.split`` a tuple; the graph only indexes it,
    so the method call is proven equal."""
    model, x = Split(), torch.randn(2, 8)
    gm = amprewrite.convert(model, (x,), policy=amprewrite.Policy.autocast("cpu", torch.bfloat16))
    assert "torch.ops.aten.split" not in gm.code and re.search(r"= linear\.split\(8, -1\)", gm.code)
    assert torch.ops.aten.split.Tensor in {n.target for n in gm.graph.nodes}
    with torch.no_grad(), torch.autocast("cpu", torch.bfloat16):
        expected = model(x)
    with torch.no_grad():
        assert torch.equal(gm(x), expected)


class Slices(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(8, 8)  # fixes the last dimension's size, as a head size does

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        half = h.shape[-1] // 2
        rotated = torch.cat([-h[..., half:], h[..., :half]], dim=-1)  # as rotary embeddings
        return rotated[:, 1:] * h[:, :-1]


def test_slices_are_generated_as_indexing() -> None:
    """``aten::slice`` runs as eager code writes it, ``h[..., 0:4]``; with the batch and
    sequence sizes symbolic, the proof picks the form whose ``:`` fall on known sizes."""
    class Leading(Slices):  # batch 1: its size is known, so ``h[:, 1:]`` is proven as such
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc(x)[:, 1:] * 2

    # A proof made for other nodes with the same argument types does not decide these.
    lead = amprewrite.convert(Leading(), (torch.randn(1, 5, 8),),
                              policy=amprewrite.Policy.autocast("cpu", torch.bfloat16))
    assert "= linear[:, 1:]" in lead.code
    model, x = Slices(), torch.randn(2, 5, 8)
    gm = amprewrite.convert(model, (x,), policy=amprewrite.Policy.autocast("cpu", torch.bfloat16))
    code = gm.code
    assert "torch.ops.aten.slice" not in code
    assert "= linear[..., 4:]" in code  # slice(4, sys.maxsize): what ``4:`` passes
    assert "= linear[..., 0:4]" in code
    assert "= linear[..., 0:-1, :]" in code
    assert sum(n.target is torch.ops.aten.slice.Tensor for n in gm.graph.nodes) == 4
    for shape in ((2, 5, 8), (3, 7, 8)):
        x = torch.randn(shape)
        with torch.no_grad(), torch.autocast("cpu", torch.bfloat16):
            expected = model(x)
        with torch.no_grad():
            assert torch.equal(gm(x), expected)


def test_casts_are_generated_as_the_dtype_method() -> None:
    """``x.to(torch.bfloat16)`` is generated as ``x.bfloat16()`` (the same op, no overload
    resolution); the graph keeps its ``to`` nodes, and values and gradients are the same."""
    model, x = Block(), torch.randn(2, 8)
    gm = amprewrite.convert(model, (x,), policy=amprewrite.Policy.autocast("cpu", torch.bfloat16))
    assert "layer_norm_bf16 = layer_norm.bfloat16()" in gm.code and ".to(torch." not in gm.code
    casts = [n for n in gm.graph.nodes if n.op == "call_method" and n.target == "to"]
    assert [n.args[1] for n in casts] == [torch.bfloat16]

    def run() -> tuple[torch.Tensor, ...]:
        out = gm(x)
        grads = torch.autograd.grad(out.float().square().sum(), list(model.parameters()))
        return out.grad_fn.name(), out, *grads

    fast = run()
    plain_codegen(gm.graph)
    gm.recompile()  # torch.fx's code: x.to(torch.bfloat16)
    assert "layer_norm.to(torch.bfloat16)" in gm.code
    plain = run()
    assert fast[0] == plain[0] and all(torch.equal(a, b) for a, b in zip(fast[1:], plain[1:]))


def test_a_cast_without_its_own_method_takes_to() -> None:
    x = torch.randn(3, requires_grad=True)
    assert cast_to(x, torch.float16).grad_fn.name() == "ToCopyBackward0"
    assert cast_to(x, torch.float32) is x  # already fp32: x itself, as x.to(torch.float32)
    assert cast_to(x, torch.complex64).dtype == torch.complex64


class _Batch:
    """A user's batch class: has ``.to(dtype)`` but no ``.half()``."""

    def __init__(self, x: torch.Tensor) -> None:
        self.x = x

    def to(self, dtype: torch.dtype) -> "_Batch":
        return _Batch(self.x.to(dtype))


class _TakesBatch(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, batch: Any) -> torch.Tensor:
        return self.fc(batch.to(torch.float16).x.float()).to(torch.float16).float()


class _UserCast(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x).to(torch.float16) * 2


def test_only_tensor_casts_take_the_dtype_method() -> None:
    """A user's cast of a tensor (``aten.to.dtype``) is generated as ``.half()``, the op both
    dispatch; ``.to(dtype)`` of an object the capture knows nothing of stays ``.to``."""
    x = torch.randn(2, 4)
    exported = amprewrite.convert(_UserCast(), (x,), dtype=torch.bfloat16)  # bf16 -> fp16
    assert torch.ops.aten.to.dtype in {n.target for n in exported.graph.nodes}
    assert re.search(r"= linear\.half\(\)", exported.code)
    symbolic = amprewrite.convert(_TakesBatch(), dtype=torch.float16)
    assert "batch.to(torch.float16)" in symbolic.code
    for gm, args in ((exported, (x,)), (symbolic, (_Batch(x),))):
        fast = gm(*args)
        plain_codegen(gm.graph)
        gm.recompile()  # torch.fx's code
        assert torch.equal(gm(*args), fast)
    assert exported(x).dtype == torch.float16


class _Optional(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, scale: torch.Tensor | None = None,
                extra: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
        y = self.fc(x)
        if scale is not None:
            y = y * scale
        return y if extra is None else y + extra["a"]


@pytest.mark.parametrize("args, kwargs, flattened", [
    ((torch.randn(2, 8),), None, False),
    ((torch.randn(2, 8),), {"scale": torch.rand(8)}, True),
    ((torch.randn(2, 8), None, {"a": torch.rand(8)}), None, True),
], ids=["positional-tensors", "keyword", "nested"])
def test_arguments_bound_directly_where_flattening_is_the_identity(
        args: tuple, kwargs: dict | None, flattened: bool) -> None:
    model = _Optional()
    gm = amprewrite.convert(model, args, example_kwargs=kwargs)
    assert ("tree_flatten_spec" in gm.code) == flattened
    out = gm(*args, **(kwargs or {}))
    with torch.autocast("cpu", torch.bfloat16):
        assert torch.equal(out, model(*args, **(kwargs or {})))
    plain_codegen(gm.graph)
    gm.recompile()  # torch.fx's code flattens again, with the same result
    assert "tree_flatten_spec" in gm.code and torch.equal(gm(*args, **(kwargs or {})), out)
