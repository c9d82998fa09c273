"""EliminateCastsPass: cast-node counts before/after each rule and its negative case,
idempotence, and bitwise parity with torch.autocast after elimination."""

from __future__ import annotations

from typing import Callable

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F
from _graphs import weight_casts
from torch.fx.experimental.proxy_tensor import make_fx

import amprewrite
from amprewrite import Policy
from amprewrite.graph.queries import cast_source
from amprewrite.passes.eliminate_casts import EliminateCastsPass

aten = torch.ops.aten
f16, bf16, f32, f64 = torch.float16, torch.bfloat16, torch.float32, torch.float64


def traced(fn: Callable, *inputs: torch.Tensor) -> fx.GraphModule:
    """An ATen graph of ``fn`` with ``meta["val"]`` on every node (in-place ops kept)."""
    return make_fx(fn, tracing_mode="fake")(*inputs)


def n_casts(gm: fx.GraphModule) -> int:
    return sum(cast_source(n) is not None for n in gm.graph.nodes)


def eliminate(gm: fx.GraphModule, policy: Policy | None = None) -> bool:
    return EliminateCastsPass(policy or Policy())(gm).modified


def cast(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return aten._to_copy.default(x, dtype=dtype)


def eliminated(gm: fx.GraphModule) -> dict[str, int]:
    return dict(gm.meta["amprewrite"].eliminated)


def check_same(gm: fx.GraphModule, fn: Callable, *inputs: torch.Tensor) -> None:
    """The rewritten graph computes bitwise what ``fn`` computes (on fresh input copies)."""
    got = gm(*[x.clone() for x in inputs])
    want = fn(*[x.clone() for x in inputs])
    for g, w in zip(torch.utils._pytree.tree_leaves(got), torch.utils._pytree.tree_leaves(want)):
        assert g.dtype == w.dtype
        assert torch.equal(g, w)


# -- identity --------------------------------------------------------------------------------
def test_identity_cast_removed() -> None:
    def fn(x: torch.Tensor) -> torch.Tensor:
        return cast(x, f32) * 2

    x = torch.randn(4, 4)
    gm = traced(fn, x)
    assert n_casts(gm) == 1
    assert eliminate(gm)
    assert n_casts(gm) == 0
    assert eliminated(gm) == {"identity": 1}
    check_same(gm, fn, x)


def test_identity_copy_kept_when_result_mutated() -> None:
    def fn(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = cast(x, f32)
        y.add_(1)
        return x * 2, y

    x = torch.randn(4, 4)
    gm = traced(fn, x)
    assert not eliminate(gm)
    assert n_casts(gm) == 1
    check_same(gm, fn, x)


def test_identity_copy_kept_when_view_of_result_mutated() -> None:
    def fn(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = cast(x, f32)
        y.view(-1)[:3].mul_(5)
        return x + 1, y

    x = torch.randn(4, 4)
    gm = traced(fn, x)
    assert not eliminate(gm)
    assert n_casts(gm) == 1
    check_same(gm, fn, x)


def test_identity_copy_kept_when_input_mutated_later() -> None:
    def fn(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = cast(x, f32)
        x.mul_(3)
        return x, y

    x = torch.randn(4, 4)
    gm = traced(fn, x)
    assert not eliminate(gm)
    assert n_casts(gm) == 1
    check_same(gm, fn, x)


# -- duplicates ------------------------------------------------------------------------------
def test_duplicate_activation_casts_merged_when_shared() -> None:
    def fn(x: torch.Tensor) -> torch.Tensor:
        return cast(x, bf16) + cast(x, bf16).sin()

    x = torch.randn(4, 4)
    gm = traced(fn, x)
    assert n_casts(gm) == 2
    assert eliminate(gm, Policy())
    assert n_casts(gm) == 1
    assert eliminated(gm) == {"duplicate": 1}
    check_same(gm, fn, x)


def test_duplicate_activation_casts_kept_under_autocast_preset() -> None:
    # autocast casts once per use; sharing would sum the gradients in bf16.
    gm = traced(lambda x: cast(x, bf16) + cast(x, bf16).sin(), torch.randn(4, 4))
    assert not eliminate(gm, Policy.autocast("cpu", bf16))
    assert n_casts(gm) == 2


def test_duplicates_kept_when_value_mutated_between() -> None:
    def fn(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        a = cast(x, bf16)
        x.mul_(2)
        return a, cast(x, bf16)

    x = torch.randn(4, 4)
    gm = traced(fn, x)
    assert not eliminate(gm, Policy())
    assert n_casts(gm) == 2
    check_same(gm, fn, x)


def test_duplicates_kept_when_one_copy_mutated() -> None:
    def fn(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        a = cast(x, bf16)
        b = cast(x, bf16)
        b.add_(1)
        return a, b

    x = torch.randn(4, 4)
    gm = traced(fn, x)
    assert not eliminate(gm, Policy())
    assert n_casts(gm) == 2
    check_same(gm, fn, x)


def test_weight_used_twice_gets_one_cast_even_under_autocast_preset() -> None:
    class TwoUses(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.randn(8, 8))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return F.linear(x, self.w) + F.linear(x.sin(), self.w)

    gm = amprewrite.convert(TwoUses(), (torch.randn(2, 8),), policy=Policy.autocast("cpu"))
    assert weight_casts(gm) == [("w", torch.bfloat16)]


# -- chains ----------------------------------------------------------------------------------
@pytest.mark.parametrize("a, b", [(f16, f32), (bf16, f32), (f32, f64), (f16, f64)])
def test_lossless_round_trip_removed(a: torch.dtype, b: torch.dtype) -> None:
    def fn(x: torch.Tensor) -> torch.Tensor:
        return cast(cast(x, b), a) * 2

    x = torch.randn(4, 4).to(a)
    gm = traced(fn, x)
    assert n_casts(gm) == 2
    assert eliminate(gm)
    assert n_casts(gm) == 0
    assert eliminated(gm) == {"lossless chain": 1, "dead": 1}
    check_same(gm, fn, x)


@pytest.mark.parametrize("a, c", [(f16, bf16), (bf16, f16)])
def test_chain_through_wider_middle_becomes_one_cast(a: torch.dtype, c: torch.dtype) -> None:
    def fn(x: torch.Tensor) -> torch.Tensor:
        return cast(cast(x, f32), c)

    x = (torch.randn(64, 64) * 100).to(a)
    gm = traced(fn, x)
    assert eliminate(gm)
    remaining = [cast_source(n) for n in gm.graph.nodes if cast_source(n) is not None]
    assert len(remaining) == 1 and remaining[0][1] == c and remaining[0][0].op == "placeholder"
    check_same(gm, fn, x)


def test_chain_gradient_bitwise() -> None:
    # fp16 -> fp32 -> bf16 replaced by fp16 -> bf16: the backward must match too.
    def fn(x: torch.Tensor) -> torch.Tensor:
        return cast(cast(x, f32), bf16)

    gm = traced(fn, torch.randn(8, 8).half())
    assert eliminate(gm)
    x = (torch.randn(8, 8) * 30).half().requires_grad_()
    g = (torch.randn(8, 8) * 1e3).bfloat16()
    (gx,) = torch.autograd.grad(gm(x), x, g)
    (want,) = torch.autograd.grad(fn(x), x, g)
    assert torch.equal(gx, want)


def test_narrowing_round_trip_kept_by_default() -> None:
    gm = traced(lambda x: cast(cast(x, bf16), f32) + 1, torch.randn(4, 4))
    assert not eliminate(gm)
    assert n_casts(gm) == 2


def test_narrowing_round_trip_folded_when_policy_opts_in() -> None:
    gm = traced(lambda x: cast(cast(x, bf16), f32) + 1, torch.randn(4, 4))
    assert eliminate(gm, Policy(fold_rounding_casts=True))
    assert n_casts(gm) == 0
    assert eliminated(gm) == {"rounding round trip": 1, "dead": 1}


@pytest.mark.parametrize("policy", [Policy(), Policy(fold_rounding_casts=True)])
def test_int_round_trip_kept(policy: Policy) -> None:
    def fn(x: torch.Tensor) -> torch.Tensor:
        return cast(cast(x, torch.int32), f32)

    x = torch.randn(4, 4) * 10
    gm = traced(fn, x)
    assert not eliminate(gm, policy)
    assert n_casts(gm) == 2
    check_same(gm, fn, x)


def test_chain_kept_when_middle_mutated() -> None:
    def fn(x: torch.Tensor) -> torch.Tensor:
        m = cast(x, f32)
        m.mul_(1.001)
        return cast(m, f16)

    x = torch.randn(16, 16).half()
    gm = traced(fn, x)
    assert not eliminate(gm)
    assert n_casts(gm) == 2
    check_same(gm, fn, x)


# -- dead ------------------------------------------------------------------------------------
def test_dead_casts_removed() -> None:
    class Dead(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x.half()
            x.to(torch.bfloat16)
            return x * 2

    gm = fx.symbolic_trace(Dead())
    assert n_casts(gm) == 2
    assert eliminate(gm)
    assert n_casts(gm) == 0
    assert eliminated(gm) == {"dead": 2}


# -- idempotence and whole conversions ----------------------------------------------------------
class Block(nn.Module):
    """Attention-ish block with casts the model writes itself (identity and chains)."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.out = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(self.ln(x.float())).chunk(3, -1)
        a = torch.softmax(q @ k.transpose(-1, -2) / 4, -1)
        h = self.out((a @ v).float())
        return x + h.float()


@pytest.mark.parametrize("policy", [Policy(), Policy.autocast("cpu"),
                                    Policy(fold_rounding_casts=True)])
def test_second_run_changes_nothing(policy: Policy) -> None:
    gm = amprewrite.convert(Block(), (torch.randn(2, 5, 16),), policy=policy)
    code = gm.code
    before = n_casts(gm)
    assert not eliminate(gm, policy)
    assert n_casts(gm) == before
    assert gm.code == code


def test_parity_with_autocast_after_elimination() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(Block(), Block())
    x = torch.randn(2, 5, 16)
    gm = amprewrite.convert(model, (x,), policy=Policy.autocast("cpu", bf16))
    assert sum(eliminated(gm).values()) > 0  # the model's own .float() calls were removed

    out = gm(x)
    out.float().square().mean().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    with torch.autocast("cpu", bf16):
        want = model(x)
    want.float().square().mean().backward()
    assert out.dtype == want.dtype
    assert torch.equal(out, want)
    for g, p in zip(grads, model.parameters()):
        assert torch.equal(g, p.grad)


def test_no_identity_cast_left_after_convert() -> None:
    gm = amprewrite.convert(Block(), (torch.randn(2, 5, 16),))
    for node in gm.graph.nodes:  # no cast is left to the dtype its input already has
        src = cast_source(node)
        if src is not None and src[0].op != "get_attr":
            assert src[0].meta["val"].dtype != src[1], node.format_node()
