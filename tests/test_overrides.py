"""Overrides by op, module (glob) and node, their precedence, and op registration."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import amprewrite
from amprewrite import OpCategory, Policy
from amprewrite.explain import explain_records
from amprewrite.graph.meta import decision

L, F32, P = OpCategory.LOWER, OpCategory.FP32, OpCategory.PASSTHROUGH


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.lin(x))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


X = (torch.randn(2, 8),)


def linears(gm: torch.fx.GraphModule) -> list[tuple[str, OpCategory, str]]:
    """(node name, category, rule) of the linear nodes, in graph order."""
    out = []
    for node in gm.graph.nodes:
        rec = decision(node)
        if rec is not None and rec.op == "linear":
            out.append((node.name, rec.category, rec.rule))
    return out


def categories(policy: Policy, capture: str = "export") -> list[OpCategory]:
    return [c for _, c, _ in linears(amprewrite.convert(Net(), X, policy=policy,
                                                        capture=capture))]


@pytest.mark.parametrize("capture", ["export", "symbolic"])
def test_op_override(capture: str) -> None:
    gm = amprewrite.convert(Net(), X, policy=Policy().override(ops={"linear": F32}),
                            capture=capture)
    assert [(c, r) for _, c, r in linears(gm)] == [(F32, "op override 'linear'")] * 3
    assert gm(*X).dtype == torch.float32


@pytest.mark.parametrize("capture", ["export", "symbolic"])
def test_module_override_glob(capture: str) -> None:
    policy = Policy().override(modules={"blocks.*": F32})
    assert categories(policy, capture) == [F32, F32, L]


def test_keep_fp32_is_a_module_override() -> None:
    gm = amprewrite.convert(Net(), X, policy=Policy().override(keep_fp32=["head"]))
    assert [(c, r) for _, c, r in linears(gm)] == [
        (L, "default table"), (L, "default table"), (F32, "module override 'head'")]
    assert gm(*X).dtype == torch.float32
    # The head computes in fp32 from the bf16 activations of the blocks.
    assert gm.code.count(".float()") == 1


def test_node_override() -> None:
    names = [n for n, _, _ in linears(amprewrite.convert(Net(), X))]
    policy = Policy().override(nodes={names[1]: F32})
    assert categories(policy) == [L, F32, L]


def test_precedence_node_over_module_over_op() -> None:
    names = [n for n, _, _ in linears(amprewrite.convert(Net(), X))]
    policy = Policy().override(
        ops={"linear": F32},                      # all three, unless something more specific
        modules={"blocks.1.*": L, "head": L},     # beats the op override
        nodes={names[2]: P},                      # beats the module override of the head
    )
    gm = amprewrite.convert(Net(), X, policy=policy)
    assert [(c, r.split(" '")[0]) for _, c, r in linears(gm)] == [
        (F32, "op override"), (L, "module override"), (P, "node override")]


def test_innermost_module_override_wins() -> None:
    policy = Policy().override(modules={"blocks.*": F32, "blocks.0.lin": L})
    assert categories(policy) == [L, F32, L]


def test_later_override_replaces_earlier_same_name() -> None:
    policy = Policy().override(keep_fp32=["head"]).override(modules={"head": L})
    assert policy.module_overrides == (("head", L),)


def test_unknown_op_lists_near_matches() -> None:
    with pytest.raises(ValueError, match=r"'sofmax' \(did you mean 'softmax'"):
        Policy().override(ops={"sofmax": F32})


def test_unknown_module_lists_near_matches() -> None:
    with pytest.raises(ValueError, match=r"'heda' \(near: head"):
        amprewrite.convert(Net(), X, policy=Policy().override(keep_fp32=["heda"]))


def test_unknown_node_lists_near_matches() -> None:
    with pytest.raises(ValueError, match=r"'linaer_1' \(near: linear_1"):
        amprewrite.convert(Net(), X, policy=Policy().override(nodes={"linaer_1": F32}))


def test_conflicting_names_in_one_override() -> None:
    with pytest.raises(ValueError, match=r"'head' is given two categories \(LOWER and FP32\)"):
        Policy().override(modules={"head": L}, keep_fp32=["head"])


def test_bad_category_type() -> None:
    with pytest.raises(TypeError, match="expected an OpCategory member"):
        Policy().override(ops={"linear": "fp32"})  # type: ignore[dict-item]


# -- registration -----------------------------------------------------------------------------
@torch.library.custom_op("amprewrite_test::scale", mutates_args=())
def scale(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return x * y


@scale.register_fake
def _(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


class UsesCustomOp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return scale(self.lin(x), x)   # a bf16 activation and an fp32 input


@pytest.fixture
def registered():
    added = []

    def register(fn, category):
        amprewrite.register_op(fn, category)
        added.append(fn)

    yield register
    for fn in added:
        amprewrite.unregister_op(fn)


def custom_node(gm: torch.fx.GraphModule) -> torch.fx.Node:
    return next(n for n in gm.graph.nodes if decision(n) is not None
                and decision(n).op == "amprewrite_test::scale")


def test_custom_op_unregistered_passes_through() -> None:
    gm = amprewrite.convert(UsesCustomOp(), X)
    node = custom_node(gm)
    assert (decision(node).category, decision(node).rule) == (P, "not listed")
    # torch's own promotion inside the op: bf16 * fp32 → fp32.
    assert gm(*X).dtype == torch.float32


@pytest.mark.parametrize("category, in_dtypes, out_dtype", [
    (L, (torch.bfloat16, torch.bfloat16), torch.bfloat16),
    (F32, (torch.float32, torch.float32), torch.float32),
    (OpCategory.PROMOTE, (torch.float32, torch.float32), torch.float32),
])
def test_register_custom_op(registered, category, in_dtypes, out_dtype) -> None:
    registered(scale, category)
    gm = amprewrite.convert(UsesCustomOp(), X)
    node = custom_node(gm)
    assert (decision(node).category, decision(node).rule) == (category, "register_op")
    assert tuple(a.meta["val"].dtype for a in node.args) == in_dtypes
    assert gm(*X).dtype == out_dtype


def test_op_override_beats_registration(registered) -> None:
    registered(scale, L)
    gm = amprewrite.convert(UsesCustomOp(), X, policy=Policy().override(ops={scale: F32}))
    assert decision(custom_node(gm)).rule == "op override 'amprewrite_test::scale'"
    assert gm(*X).dtype == torch.float32


def test_registering_twice_with_another_category_raises(registered) -> None:
    registered(scale, L)
    amprewrite.register_op(scale, L)   # same category: fine
    with pytest.raises(ValueError, match="already registered as OpCategory.LOWER"):
        amprewrite.register_op(scale, F32)


def test_register_rejects_other_categories() -> None:
    with pytest.raises(ValueError, match="category must be one of"):
        amprewrite.register_op(scale, OpCategory.BANNED)


def squash(x: torch.Tensor) -> torch.Tensor:
    """A user function: traced as one node once registered."""
    return torch.tanh(x) * 0.5


class UsesFunction(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return squash(self.lin(x))


def test_register_user_function_symbolic(registered) -> None:
    registered(squash, F32)
    gm = amprewrite.convert(UsesFunction(), X, capture="symbolic")
    node = next(n for n in gm.graph.nodes if n.target is squash)
    assert decision(node).category is F32
    assert decision(node).op == f"{__name__}.squash"
    assert gm(*X).dtype == torch.float32
    # The same function, unregistered, is traced into (tanh and mul pass bf16 through).
    amprewrite.unregister_op(squash)
    assert amprewrite.convert(UsesFunction(), X, capture="symbolic")(*X).dtype == torch.bfloat16


def test_function_as_op_override_key() -> None:
    policy = Policy().override(ops={squash: F32})
    assert policy.op_overrides == ((f"{__name__}.squash", F32),)


def test_unknown_custom_op_name_lists_near_matches() -> None:
    with pytest.raises(ValueError, match=r"'amprewrite_test::scael' \(did you mean "
                                         r"'amprewrite_test::scale'"):
        Policy().override(ops={"amprewrite_test::scael": F32})


@pytest.mark.parametrize("capture", ["export", "symbolic"])
def test_register_torch_function_beats_the_table(registered, capture: str) -> None:
    """Apex's register_float_function(torch, "sigmoid") / register_half_function."""
    registered(torch.sigmoid, F32)
    registered(torch.softmax, L)
    model = nn.Sequential(nn.Linear(8, 8), nn.Sigmoid(), nn.Softmax(-1))
    gm = amprewrite.convert(model, X, capture=capture)
    (rec,) = explain_records(gm)
    assert [(r["op"], r["category"], r["rule"]) for r in rec["nodes"]] == [
        ("linear", "lower", "default table"), ("sigmoid", "fp32", "register_op"),
        ("softmax", "lower", "register_op")]
    assert gm(*X).dtype == torch.bfloat16
