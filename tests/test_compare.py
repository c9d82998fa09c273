"""``amprewrite.compare``: per-op error against an fp64 shadow run, and per-parameter gradient
error; numbers checked against what the arithmetic says they must be."""

from __future__ import annotations

import json
import math
import warnings

import pytest
import torch
import torch.nn as nn

import amprewrite
from amprewrite import OpCategory, Policy
from amprewrite.precision.shadow import (
    node_numbers,
    op_nodes,
    record,
    reference_module,
    rel_error,
)

pytestmark = pytest.mark.usefixtures("one_thread")

BF16_U = 2.0 ** -8  # unit roundoff of bf16: half the spacing of its 8-bit significand


class Overflow(nn.Module):
    """A Linear whose outputs (~1.6e5) overflow fp16, and a LayerNorm that brings them back."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.big, self.norm, self.head = nn.Linear(16, 16), nn.LayerNorm(16), nn.Linear(16, 4)
        with torch.no_grad():
            self.big.weight.mul_(1e5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.big(x)))


def chain(*layers: nn.Module) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*layers)


def report(model: nn.Module, x: torch.Tensor, dtype: torch.dtype = torch.float16,
           **kwargs) -> amprewrite.PrecisionReport:
    gm = amprewrite.convert(model, (x,), dtype=dtype)
    return amprewrite.compare(gm, model, (x,), **kwargs)


def by_node(rep: amprewrite.PrecisionReport) -> dict[str, amprewrite.NodeError]:
    return {r.node: r for r in rep.nodes}


def test_overflowing_op_adds_inf_and_has_negative_headroom() -> None:
    model, x = Overflow(), torch.randn(4, 16, generator=torch.Generator().manual_seed(0))
    rep = report(model, x)
    rows = by_node(rep)
    big = rows["linear"]
    assert big.added == math.inf and big.error == math.inf and big.inherited == 0
    assert big.max_abs > 65504 and big.headroom == pytest.approx(math.log2(65504 / big.max_abs))
    assert big.headroom < 0
    # Downstream nodes inherit the inf; the fp32 LayerNorm adds nothing of its own.
    assert rows["layer_norm"].inherited == math.inf and rows["layer_norm"].added == 0
    assert rows["layer_norm"].headroom > 0
    assert rep.output_error == math.inf
    assert rep.worst(1)[0].node == "linear"


def test_passthrough_relu_adds_nothing() -> None:
    model = chain(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 8))
    rows = by_node(report(model, torch.randn(8, 32)))
    relu = rows["relu"]
    assert relu.dtype == "f16"
    assert relu.added == 0
    # What relu outputs wrong is the fp16 rounding of the Linear before it, passed on.
    assert relu.inherited == pytest.approx(relu.error)
    assert 0 < relu.error < 2 * rows["linear"].error


def test_added_and_inherited_split_along_a_chain() -> None:
    model = chain(nn.Linear(64, 64), nn.Linear(64, 64), nn.Linear(64, 64))
    rows = by_node(report(model, torch.randn(16, 64), dtype=torch.bfloat16))
    first, second, third = rows["linear"], rows["linear_1"], rows["linear_2"]
    # The first op sees the exact model input: all its error is its own.
    assert first.inherited == 0 and first.added == first.error > 0
    for node in (second, third):
        assert node.added > 0 and node.inherited > 0
        # First order: the error is about what the node adds plus what it inherits.
        assert max(node.added, node.inherited) / 2 <= node.error <= 1.5 * (
            node.added + node.inherited)
    assert third.inherited >= second.added / 4  # upstream error does reach the end


def test_single_bf16_linear_adds_rounding_of_bf16() -> None:
    torch.manual_seed(0)
    model, x = nn.Linear(64, 32), torch.randn(16, 64)
    rows = by_node(report(model, x, dtype=torch.bfloat16, backward=False))
    added = rows["linear"].added
    with torch.no_grad():
        y = model(x).double()
        scale = (x.double().abs() @ model.weight.double().abs().T
                 + model.bias.double().abs()).max() / y.abs().max()
    # Rounding x, W, b to bf16 (u each, first order) and the output (u) bound the error;
    # the output rounding of the largest elements alone is of order u.
    bound = BF16_U * (2 * scale.item() + 1) * 1.01
    assert 2.0 ** -9 / 8 <= added <= bound, (added, bound)


def test_fp32_ops_add_about_fp32_rounding() -> None:
    model = chain(nn.Linear(16, 16), nn.Softmax(-1))
    rows = by_node(report(model, torch.randn(4, 16)))
    assert rows["softmax"].dtype == "f32"
    assert rows["softmax"].added < 1e-6 < rows["linear"].added


def test_backward_has_one_row_per_trainable_parameter_and_leaves_model_alone() -> None:
    model = chain(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 4)).train()
    model[0].bias.requires_grad_(False)
    x = torch.randn(6, 8)
    sentinel = {name: torch.full_like(p, 7.0) for name, p in model.named_parameters()}
    for name, p in model.named_parameters():
        p.grad = sentinel[name].clone()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    gm = amprewrite.convert(model, (x,), dtype=torch.bfloat16)
    rep = amprewrite.compare(gm, model, (x,))
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert [g.parameter for g in rep.grads] == trainable
    assert all(0 < g.error < 0.1 for g in rep.grads[:-1]), rep.grad_table()
    # d(sum of outputs)/d(last bias) is the batch size, exact in any precision.
    assert rep.grads[-1].error == 0 and rep.grads[-1].max_abs == 6
    assert rep.grads[0].shape == (16, 8)
    for name, value in model.state_dict().items():  # incl. BatchNorm's running statistics
        assert torch.equal(value, before[name]), name
    for name, p in model.named_parameters():
        assert torch.equal(p.grad, sentinel[name]), name


def test_loss_fn_is_used_for_both_runs() -> None:
    model = chain(nn.Linear(8, 4))
    x = torch.randn(3, 8)
    seen = []

    def loss_fn(out: torch.Tensor) -> torch.Tensor:
        seen.append(out.dtype)
        return out[:, 0].float().sum() if out.dtype != torch.float64 else out[:, 0].sum()

    rep = report(model, x, dtype=torch.bfloat16, loss_fn=loss_fn)
    assert seen == [torch.bfloat16, torch.float64]
    grads = {g.parameter: g for g in rep.grads}
    # d(sum of column 0)/d bias is (3, 0, 0, 0): exact in any precision.
    assert grads["0.bias"].error == 0 and grads["0.bias"].max_abs == 3
    with pytest.raises(TypeError, match="loss_fn returned Tensor\\(3,\\)"):
        report(model, x, loss_fn=lambda out: out[:, 0])


def test_op_node_names_match_the_reference_and_extra_nodes_are_skipped() -> None:
    model, x = chain(nn.Linear(16, 16), nn.LayerNorm(16), nn.Linear(16, 4)), torch.randn(4, 16)
    gm = amprewrite.convert(model, (x,), dtype=torch.float16)
    ref_gm, _, _ = reference_module(model, (x,), None, torch.float64, "export")
    ops = [n.name for n in op_nodes(gm)]
    assert set(ops) <= {n.name for n in ref_gm.graph.nodes}
    rep = amprewrite.compare(gm, model, (x,), backward=False)
    assert [r.node for r in rep.nodes] == ops and rep.unmatched == []
    # A node the reference lacks (here: renamed) has no row but does not stop the others.
    node = next(n for n in gm.graph.nodes if n.name == "layer_norm")
    node._rename("renamed_norm")
    gm.recompile()
    rep = amprewrite.compare(gm, model, (x,), backward=False)
    assert rep.unmatched == ["renamed_norm"]
    rows = by_node(rep)
    assert "renamed_norm" not in rows and 0 < rows["linear_1"].added < 1e-2


def test_symbolic_capture_and_keyword_inputs() -> None:
    class Scaled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, x: torch.Tensor, *, scale: torch.Tensor) -> torch.Tensor:
            return torch.relu(self.lin(x)) * scale

    torch.manual_seed(0)
    model, x, scale = Scaled(), torch.randn(2, 8), torch.tensor(3.0)
    for capture in ("export", "symbolic"):
        gm = amprewrite.convert(model, (x,), example_kwargs={"scale": scale},
                                dtype=torch.bfloat16, capture=capture)
        rep = amprewrite.compare(gm, model, (x,), example_kwargs={"scale": scale})
        rows = by_node(rep)
        assert rows["relu"].added == 0 and 0 < rows["linear"].added < 0.05, capture
        assert rep.unmatched == [] and len(rep.grads) == 2


def test_table_dict_and_worst() -> None:
    model = chain(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16), nn.GELU(), nn.Linear(16, 4))
    rep = report(model, torch.randn(4, 16))
    added = [r.added for r in rep.worst(len(rep.nodes))]
    assert added == sorted(added, reverse=True)
    lines = rep.table().splitlines()
    assert lines[0].split()[:6] == ["node", "op", "dtype", "error", "added", "inherited"]
    assert lines[2].split()[0] == rep.worst(1)[0].node
    assert rep.table(top=2).endswith(f"... {len(rep.nodes) - 2} more nodes")
    assert "grad error" in str(rep) and rep.summary() in str(rep)
    data = json.loads(json.dumps(rep.to_dict()))
    assert data["low_dtype"] == "f16" and len(data["nodes"]) == len(rep.nodes)
    assert data["grads"][0]["parameter"] == "0.weight"


def test_rel_error() -> None:
    ref = torch.tensor([1.0, -2.0, 4.0], dtype=torch.float64)
    assert rel_error(torch.tensor([1.0, -2.0, 5.0]), ref) == 0.25
    assert rel_error(torch.tensor([1.0, float("inf"), 4.0]), ref) == math.inf
    assert rel_error(torch.tensor([1.0, float("nan"), 4.0]), ref) == math.inf
    assert rel_error(ref.float(), ref) == 0
    assert rel_error((ref, ref * 2), (ref, ref)) == 1.0  # the worst of several outputs


def test_bad_arguments() -> None:
    model = nn.Linear(2, 2)
    with pytest.raises(TypeError, match="GraphModule amprewrite.convert returned, got Linear"):
        amprewrite.compare(model, model, (torch.randn(1, 2),))
    gm = amprewrite.convert(model, (torch.randn(1, 2),), dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="reference_dtype=torch.float16"):
        amprewrite.compare(gm, model, (torch.randn(1, 2),), reference_dtype=torch.float16)
    with pytest.raises(TypeError, match="example_inputs must be a tuple.*got list"):
        amprewrite.compare(gm, model, [torch.randn(1, 2)])


def test_random_ops_warn() -> None:
    model = chain(nn.Linear(8, 8), nn.Dropout(0.5)).train()
    x = torch.randn(2, 8)
    gm = amprewrite.convert(model, (x,), dtype=torch.bfloat16)
    with pytest.warns(UserWarning, match="draw random numbers"):
        amprewrite.compare(gm, model, (x,), backward=False)
    model.eval()
    gm = amprewrite.convert(model, (x,), dtype=torch.bfloat16)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        amprewrite.compare(gm, model, (x,), backward=False)


def test_node_numbers_of_a_forced_fp16_reduction() -> None:
    """A mean of large values that cancel, forced into fp16: its own casts lose the result."""
    class Drift(nn.Module):
        def forward(self, y: torch.Tensor) -> torch.Tensor:
            return (y * 4000).mean(-1)

    y = torch.randn(4, 1024, generator=torch.Generator().manual_seed(0))
    y = y - y.mean(-1, keepdim=True) + 2.5e-4  # the mean of y * 4000 is 1
    policy = Policy().override(ops={"mean": OpCategory.LOWER})
    gm = amprewrite.convert(Drift(), (y,), dtype=torch.float16, policy=policy)
    ref_gm, ref_args, _ = reference_module(Drift(), (y,), None, torch.float64, "export")
    low, ref = record(gm, (y,), None), record(ref_gm, ref_args, None)
    mean = node_numbers(low.by_name["mean"], low, ref)
    # Inputs up to ~1.6e4 rounded to fp16 (spacing up to 8) lose ~1e-2 of a mean of 1.
    assert 3e-3 < mean.added < 0.2 and mean.inherited < 1e-5
    assert mean.error == pytest.approx(mean.added, rel=1e-3)
