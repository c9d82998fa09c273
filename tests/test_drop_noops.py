"""DropNoOpsPass: full slices and read-only fresh copies of constants leave the graph; a
constant that the graph writes to or returns keeps its copy."""

from __future__ import annotations

import torch
import torch.nn as nn

import amprewrite

aten = torch.ops.aten
BF16 = amprewrite.Policy.autocast("cpu", torch.bfloat16)


def targets(gm: torch.fx.GraphModule) -> list:
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


def exported(model: nn.Module, x: torch.Tensor) -> torch.fx.GraphModule:
    """The graph before the pass, captured as ``convert`` captures it (dynamic dimensions:
    with static ones, export itself drops full slices)."""
    auto = torch.export.Dim.AUTO
    return torch.export.export(model, (x,), dynamic_shapes=({0: auto, 1: auto},)).module()


def check_same_as_autocast(model: nn.Module, gm: torch.fx.GraphModule, x: torch.Tensor) -> None:
    with torch.no_grad(), torch.autocast("cpu", torch.bfloat16):
        expected = model(x)
    with torch.no_grad():
        for _ in range(2):  # a second call sees the constants as the first did
            got = gm(x)
            for a, b in zip(torch.utils._pytree.tree_leaves(got),
                            torch.utils._pytree.tree_leaves(expected)):
                assert a.dtype == b.dtype and torch.equal(a, b)


class ReadsConstantAndSlices(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        empty = torch.tensor([])                      # as HF's key/value cache starts
        h = torch.cat([empty, self.fc(x)[:, :]], 0)   # a full slice
        return h[:, None, :].sum(-1)


def test_full_slices_and_read_only_constant_copies_are_dropped() -> None:
    model, x = ReadsConstantAndSlices(), torch.randn(2, 8)
    plain = exported(model, x)
    assert aten.lift_fresh_copy.default in targets(plain)
    assert aten.slice.Tensor in targets(plain)
    gm = amprewrite.convert(model, (x,), policy=BF16)
    assert aten.lift_fresh_copy.default not in targets(gm)
    assert aten.detach_.default not in targets(gm)
    assert aten.slice.Tensor not in targets(gm)
    assert "lift_fresh_copy" not in gm.code and "slice" not in gm.code
    check_same_as_autocast(model, gm, x)


class PartialSlice(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x[:, 1:] + x[:, :7]


def test_a_slice_that_drops_elements_stays() -> None:
    model, x = PartialSlice(), torch.randn(2, 8)
    gm = amprewrite.convert(model, (x,), policy=BF16)
    assert targets(gm).count(aten.slice.Tensor) == 2
    check_same_as_autocast(model, gm, x)


class WritesConstant(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        acc = torch.tensor([0.0, 0.0])
        acc.add_(x.sum(0)[:2])                        # the graph writes to its copy
        return x[:, :2] * acc


class ReturnsConstant(nn.Module):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x * 2, torch.tensor([3.0])


def test_a_constant_the_graph_writes_to_keeps_its_copy() -> None:
    model, x = WritesConstant(), torch.randn(2, 8)
    gm = amprewrite.convert(model, (x,), policy=BF16)
    assert aten.lift_fresh_copy.default in targets(gm)
    check_same_as_autocast(model, gm, x)


def test_a_returned_constant_stays_a_fresh_tensor() -> None:
    model, x = ReturnsConstant(), torch.randn(2, 8)
    gm = amprewrite.convert(model, (x,), policy=BF16)
    assert aten.lift_fresh_copy.default in targets(gm)
    _, first = gm(x)
    first.add_(1.0)                                   # the caller owns what it was given
    _, second = gm(x)
    assert first is not second and second.tolist() == [3.0]


def test_the_pass_is_idempotent() -> None:
    from amprewrite.passes.drop_noops import DropNoOpsPass

    gm = exported(ReadsConstantAndSlices(), torch.randn(2, 8))
    assert DropNoOpsPass()(gm).modified
    code = gm.code
    assert not DropNoOpsPass()(gm).modified and gm.code == code
