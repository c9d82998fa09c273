"""Capture in the AMP regime: model code that reads dtypes off its tensors follows the
converted graph's dtypes, as it follows autocast's in eager; device moves are not casts; the
model's own no_grad regions are inlined and respected; custom autograd Functions are
reported; conversion leaves the process's global state as it found it."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from _graphs import weight_casts

import amprewrite
from amprewrite import AmpRewriteError, Policy
from amprewrite.capture.converted import capture_converted
from amprewrite.capture.facts import GRAD_KEY
from amprewrite.graph.queries import cast_source

CPU_BF16 = Policy.autocast("cpu", torch.bfloat16)


def _autocast(model: nn.Module, *args: torch.Tensor) -> torch.Tensor:
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return model(*args)


class DtypeReader(nn.Module):
    """Every way HF models read a dtype at run time."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.q = nn.Linear(8, 8)
        self.o = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        q = self.q(x)                                    # bf16 under autocast
        scores = q + bias.to(q.dtype)                    # x.to(y.dtype)
        scores = scores.masked_fill(bias > 1.0, torch.finfo(scores.dtype).min)
        probs = F.softmax(scores, -1, dtype=torch.float32).to(q.dtype)
        if probs.dtype == torch.float16:                 # a dtype branch (T5's clamp)
            probs = probs.clamp(max=1.0)
        zeros = torch.zeros(probs.shape, dtype=q.dtype)  # dtype= argument
        return self.o(probs + zeros)


def test_dtypes_read_off_tensors_follow_the_converted_graph() -> None:
    model = DtypeReader()
    x, bias = torch.randn(2, 4, 8), torch.randn(2, 4, 8) * 2
    gm = amprewrite.convert(model, (x, bias), policy=CPU_BF16)
    # recorded under autocast: the conversions and the fill constant are bf16's
    conversions = [cast_source(n)[1] for n in gm.graph.nodes
                   if cast_source(n) is not None and n.op == "call_function"]
    assert torch.float32 not in conversions, gm.code
    fill = next(n for n in gm.graph.nodes if "masked_fill" in str(n.target))
    assert fill.args[2] == torch.finfo(torch.bfloat16).min
    want = _autocast(model, x, bias)
    got = gm(x, bias)
    assert got.dtype == want.dtype == torch.bfloat16 and torch.equal(got, want)


def test_fp32_minimum_is_never_filled_into_a_low_precision_tensor() -> None:
    """deberta-v2's failure: torch.finfo(fp32).min does not fit bf16 (overflow error)."""

    class Mask(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
            scores = self.proj(x) @ x.transpose(-1, -2)
            return scores.masked_fill(mask, torch.finfo(scores.dtype).min).softmax(-1)

    x, mask = torch.randn(2, 3, 4), torch.rand(2, 3, 3) > 0.5
    for policy in (Policy(), CPU_BF16):
        gm = amprewrite.convert(Mask(), (x, mask), policy=policy)
        assert torch.isfinite(gm(x, mask)).all()


class DeviceMove(nn.Module):
    """wav2vec2's positional embedding: ``pos.to(hidden_states.device)``."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv1d(4, 4, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pos = self.conv(x)
        return x + pos.to(x.device)


def test_a_device_move_is_not_a_cast() -> None:
    model, x = DeviceMove(), torch.randn(2, 4, 6)
    gm = amprewrite.convert(model, (x,), policy=CPU_BF16)
    moves = [n for n in gm.graph.nodes if n.target is torch.ops.aten.to.dtype_layout]
    assert len(moves) == 1 and "dtype" not in moves[0].kwargs
    want = _autocast(model, x)
    assert gm(x).dtype == want.dtype == torch.float32  # x (fp32) + pos (bf16) promotes
    assert torch.equal(gm(x), want)


class NoGradRotary(nn.Module):
    """HF rotary embeddings: cos/sin under ``@torch.no_grad()`` and autocast disabled."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.q = nn.Linear(8, 8)
        self.register_buffer("inv_freq", 1.0 / 10000 ** (torch.arange(0, 8, 2).float() / 8),
                             persistent=False)

    @torch.no_grad()
    def rope(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        with torch.autocast("cpu", enabled=False):
            pos = torch.arange(x.shape[1], dtype=torch.float32)
            freqs = torch.outer(pos, self.inv_freq.float())
            emb = torch.cat((freqs, freqs), -1)
            return emb.cos().to(x.dtype), emb.sin().to(x.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = self.q(x)
        cos, sin = self.rope(q)
        return q * cos + q.flip(-1) * sin


@pytest.mark.parametrize("opt_level", ["O1", "O2", "O3"])
def test_no_grad_region_is_inlined_and_trains(opt_level: str) -> None:
    model, x = NoGradRotary(), torch.randn(2, 5, 8)
    kwargs = {"policy": CPU_BF16} if opt_level == "O1" else {"opt_level": opt_level}
    gm = amprewrite.convert(model, (x,), dtype=torch.bfloat16, **kwargs)
    targets = [n.target for n in gm.graph.nodes]
    assert torch.ops.higher_order.wrap_with_set_grad_enabled not in targets
    assert targets.count(torch._C._set_grad_enabled) == 2
    assert any(n.meta.get(GRAD_KEY) is False for n in gm.graph.nodes)
    if opt_level == "O2":
        opt = torch.optim.SGD(gm.parameters(), lr=0.1)
        amprewrite.MasterWeights(gm, opt)
    out = gm(x)
    assert torch.is_grad_enabled()  # the region restored grad mode
    out.float().sum().backward()
    grads = [p.grad for p in gm.parameters() if p.requires_grad]
    assert grads and all(g is not None and torch.isfinite(g).all() for g in grads)
    if opt_level == "O1":
        reference = NoGradRotary()
        want = _autocast(reference, x)
        want.float().sum().backward()
        assert torch.equal(out, want)
        assert torch.equal(model.q.weight.grad, reference.q.weight.grad)


def test_a_cast_is_not_shared_into_a_no_grad_region() -> None:
    """A weight used inside and outside a no_grad region: the graph keeps one cast per region
    (a cast made under no_grad has no gradient for a consumer outside), each where its region
    uses the weight, reading one gathered item; the weight's gradient is autocast's."""

    class Shared(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)

        @torch.no_grad()
        def frozen(self, x: torch.Tensor) -> torch.Tensor:
            return self.lin(x)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.frozen(x) + self.lin(x)

    model, x = Shared(), torch.randn(2, 4)
    gm = amprewrite.convert(model, (x,))
    ungathered = capture_converted(gm)
    casts = [n for n in ungathered.graph.nodes if n.op == "call_method" and n.target == "cast"
             and n.args[1].target == "lin.weight"]
    assert sorted(n.meta.get(GRAD_KEY, True) for n in casts) == [False, True]
    # the bias first: autocast casts an op's arguments last one first
    assert weight_casts(gm) == [("lin.bias", torch.bfloat16), ("lin.weight", torch.bfloat16)] * 2
    assert sorted(n.meta.get(GRAD_KEY, True) for n in gm.graph.nodes
                  if n.op == "call_method" and n.target == "cast"
                  and n.args[1].name == "lin_weight") == [False, True]
    gm(x).float().sum().backward()
    reference = Shared()
    reference.load_state_dict(model.state_dict())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = reference(x)
    want.float().sum().backward()
    assert torch.equal(model.lin.weight.grad, reference.lin.weight.grad)


class _Swish(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(x)
        return x * torch.sigmoid(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        (x,) = ctx.saved_tensors
        s = torch.sigmoid(x)
        return grad * (s * (1 + x * (1 - s)))


def test_custom_autograd_function_is_reported() -> None:
    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return _Swish.apply(self.lin(x))

    apply = torch.autograd.Function.__dict__["apply"]
    with pytest.warns(UserWarning, match=r"custom torch\.autograd\.Function.*_Swish"):
        amprewrite.convert(Model(), (torch.randn(2, 4),))
    assert torch.autograd.Function.__dict__["apply"] is apply  # restored as it was
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch's own Functions are not reported
        amprewrite.convert(nn.Linear(4, 4), (torch.randn(2, 4),))


# -- global state ------------------------------------------------------------------------------
class FailsInsideNoGrad(nn.Module):
    """Export succeeds; the conversion then fails inside the model's no_grad region."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            y = torch.nn.functional.binary_cross_entropy(torch.sigmoid(self.lin(x)),
                                                         torch.ones_like(x))
        return y


def _state() -> tuple:
    return (torch.is_grad_enabled(), torch.get_default_dtype(),
            torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"),
            torch.is_autocast_cache_enabled())


def test_convert_leaves_global_state_as_it_found_it_even_on_errors(monkeypatch) -> None:
    before = _state()
    with pytest.raises(AmpRewriteError, match="binary_cross_entropy"):
        amprewrite.convert(FailsInsideNoGrad(), (torch.rand(2, 4),),
                           policy=Policy.autocast("cpu").override(
                               ops={"binary_cross_entropy": amprewrite.OpCategory.BANNED}))
    assert _state() == before

    # An error raised while the capture runs under autocast and no_grad.
    import amprewrite.capture.export as export_module

    def broken(*args, **kwargs):
        torch.set_grad_enabled(False)
        torch.set_autocast_enabled("cpu", True)
        torch.set_default_dtype(torch.float64)
        raise RuntimeError("planted")

    monkeypatch.setattr(export_module.torch.export, "export", broken)
    with pytest.raises(AmpRewriteError, match="planted"):
        amprewrite.convert(nn.Linear(2, 2), (torch.randn(1, 2),))
    assert _state() == before


def test_torch_cond_converts_and_runs_both_branches() -> None:
    """The branches of a torch.cond stay as they are (run in what arrives); the ops around it
    are converted, and conversion never fails on the higher-order op."""

    class Branchy(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.lin(x)
            return torch.cond(h.sum() > 0, lambda t: t.relu() + 1, lambda t: t * 2, (h,))

    model = Branchy()
    torch.manual_seed(0)
    x = torch.randn(2, 4)
    gm = amprewrite.convert(model, (x,), policy=CPU_BF16)
    for sign in (1, -1):
        want = _autocast(model, sign * x)
        got = gm(sign * x)
        assert got.dtype == want.dtype == torch.bfloat16 and torch.equal(got, want)
