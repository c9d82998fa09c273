"""fp8 linears (``Policy.fp8``): the rewrite in ``gm.code``, numerics against fp32 and bf16,
gradients to the fp32 masters, the rules in ``explain()``, the auditor's fp8 records."""

from __future__ import annotations

import copy
import io
import warnings

import pytest
import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode

import amprewrite
from amprewrite.graph.meta import fp8_step
from amprewrite.passes.classify import ClassifyPass
from amprewrite.passes.fp8 import Fp8LinearPass
from amprewrite.policy.fp8 import Fp8Rules
from amprewrite.runtime import fp8 as rt

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(),
                         nn.Linear(64, 64), nn.Linear(64, 16))


def _x() -> torch.Tensor:
    return torch.randn(4, 8, 32, generator=torch.Generator().manual_seed(1))


def _fp8(model: nn.Module, policy: amprewrite.Policy | None = None):
    return amprewrite.convert(model, (_x(),), policy=policy or amprewrite.Policy.fp8())


def test_scaled_mm_signature_and_numerics():
    """The private API the runtime calls: its schema on this torch, and its numerics."""
    schema = torch.ops.aten._scaled_mm.default._schema
    names = [a.name for a in schema.arguments]
    assert names[:8] == ["self", "mat2", "scale_a", "scale_b", "bias", "scale_result",
                         "out_dtype", "use_fast_accum"], str(schema)
    a, b = torch.randn(32, 64), torch.randn(48, 64)
    sa, sb = rt.scale(rt.amax(a), rt.E4M3), rt.scale(rt.amax(b), rt.E4M3)
    out = rt.scaled_mm(rt.quantize(a, sa, rt.E4M3), rt.quantize(b, sb, rt.E4M3), sa, sb,
                       torch.bfloat16)
    assert out.dtype == torch.bfloat16 and out.shape == (32, 48)
    assert _rel(out, a @ b.t()) < 5e-2


def test_code_shows_every_fp8_step():
    gm = _fp8(_mlp())
    code = gm.code
    for word in ("fp8_amax(", "fp8_scale(", "fp8_quantize(", "fp8_scaled_mm(",
                 "fp8_linear_grad(", "torch.float8_e4m3fn"):
        assert word in code, word
    # the middle two linears (the first and the last are skipped by default)
    assert code.count("fp8_scaled_mm(") == 2
    assert code.count("torch._C._nn.linear(") == 2
    # the input is quantised from the fp32 master weight, not from a bf16 copy
    assert "_2_weight_e4m3 = amprewrite_runtime_fp8_quantize(_2_weight," in code


def test_output_close_to_fp32_and_bf16():
    model = _mlp()
    x = _x()
    ref = model(x)
    out = _fp8(model)(x)
    assert out.dtype == torch.bfloat16
    assert _rel(out, ref) < 5e-2
    bf16 = amprewrite.convert(model, (x,))(x)
    assert _rel(out, bf16) < 5e-2


def test_gradients_reach_fp32_masters_close_to_bf16():
    model = _mlp()
    x = _x()
    gm = _fp8(model)
    assert all(p.dtype == torch.float32 for p in gm.parameters())
    assert {id(p) for p in gm.parameters()} == {id(p) for p in model.parameters()}
    gm(x).float().pow(2).mean().backward()
    fp8_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    amprewrite.convert(model, (x,))(x).float().pow(2).mean().backward()
    errors = {}
    for name, p in model.named_parameters():
        assert fp8_grads[name].dtype == torch.float32
        errors[name] = _rel(fp8_grads[name], p.grad)
    # e5m2 keeps 2 mantissa bits: each fp8 backward matmul adds a few % of error, and the
    # first layer's gradient comes through two of them
    assert max(errors.values()) < 0.25, errors
    assert errors["4.weight"] < 5e-2 and errors["2.weight"] < 0.15, errors


def _train(policy: amprewrite.Policy) -> list[float]:
    model = _mlp()
    gm = amprewrite.convert(model, (_x(),), policy=policy)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    x = _x()
    target = torch.randn(4, 8, 16, generator=torch.Generator().manual_seed(2))
    losses = []
    for _ in range(20):
        loss = (gm(x).float() - target).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss))
    return losses


def test_training_with_an_unchanged_optimizer_follows_bf16():
    fp8 = _train(amprewrite.Policy.fp8())
    bf16 = _train(amprewrite.Policy())
    assert fp8[-1] < 0.7 * fp8[0]
    # the curves agree to 5% of the starting loss (fitting noise: the last digits differ)
    assert abs(fp8[-1] - bf16[-1]) < 5e-2 * bf16[0]


def test_explain_names_each_rule():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.Linear(64, 24), nn.Linear(24, 64),
                          nn.Linear(64, 64), nn.Linear(64, 64), nn.Linear(64, 16))
    policy = amprewrite.Policy.fp8(exclude=["4"])
    gm = _fp8(model, policy)
    text = amprewrite.explain(gm)
    assert "fp8 skipped: first linear" in text
    assert "fp8 skipped: last linear" in text
    assert "fp8 skipped: weight [24, 64] has dims not divisible by 16" in text
    assert "fp8 skipped: weight [64, 24] has dims not divisible by 16" in text
    assert "fp8 skipped: '4' excluded by '4'" in text
    assert "fp8: e4m3 per-tensor dynamic" in text  # layer 3
    assert "fp8 linears" in text  # the policy line
    only = amprewrite.explain(_fp8(model, amprewrite.Policy.fp8(modules="3",
                                                                 skip_first_last=False)))
    assert "matches none of modules ['3']" in only
    assert only.count("fp8: e4m3 per-tensor dynamic") == 1


def test_options_are_validated():
    with pytest.raises(ValueError, match="dim_multiple"):
        Fp8Rules(dim_multiple=0)
    with pytest.raises(TypeError, match="modules"):
        amprewrite.Policy.fp8(modules=[3])
    with pytest.raises(ValueError, match="bf16"):
        amprewrite.Policy(fp8_rules=Fp8Rules(), dtype=torch.float16)
    with pytest.raises(ValueError, match="Drop dtype"):
        amprewrite.convert(_mlp(), (_x(),), policy=amprewrite.Policy.fp8(),
                           dtype=torch.float16)


def test_passes_are_idempotent():
    gm = _fp8(_mlp())
    policy = amprewrite.Policy.fp8()
    assert not Fp8LinearPass(policy)(gm).modified
    assert not ClassifyPass(policy, torch.bfloat16)(gm).modified


class _Ops(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def test_no_host_sync_forward_or_backward():
    gm = _fp8(_mlp())
    assert not [n for n in gm.graph.nodes if n.target == "item"
                or "_local_scalar_dense" in str(n.target)]
    x = _x()
    with _Ops() as seen:
        gm(x).float().sum().backward()
    assert "aten._scaled_mm.default" in seen.ops
    assert not [op for op in seen.ops if "_local_scalar_dense" in op or "item" in op]


def test_audit_reports_scales_amax_and_saturation():
    model = _mlp()
    gm = _fp8(model)
    x = _x()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # every op recorded
        with amprewrite.audit() as report:
            gm(x).float().sum().backward()
    flops = report.summary()["flops"]["by_dtype"]
    assert flops["float8_e4m3fn"] > 0 and flops["float8_e5m2"] > 0
    fwd = [r for r in report.fp8 if r.phase == "forward"]
    bwd = [r for r in report.fp8 if r.phase == "backward"]
    assert len(fwd) == 2 and len(bwd) == 4
    assert {r.a_dtype for r in bwd} == {"float8_e5m2"}
    assert {r.node for r in fwd} == {n.name for n in gm.graph.nodes
                                     if (s := fp8_step(n)) and s.role == "matmul"}
    w = model[2].weight
    rec = next(r for r in fwd if r.node == "linear_1_scaled_mm")
    assert rec.b_amax == pytest.approx(float(w.abs().max()), rel=1e-5)
    assert rec.b_scale == pytest.approx(float(w.abs().max()) / 448, rel=1e-5)
    for r in report.fp8:
        assert 0 < r.a_saturated <= 1 and 0 <= r.a_zero <= 1  # the amax itself lands on max
    assert "linear_1_scaled_mm" in report.fp8_table()
    again = amprewrite.AuditReport.from_dict(report.to_dict())
    assert again.fp8 == report.fp8


def test_state_dict_round_trip_and_no_grad():
    model = _mlp()
    gm = _fp8(model)
    x = _x()
    assert set(gm.state_dict()) == set(model.state_dict())
    buf = io.BytesIO()
    torch.save(gm.state_dict(), buf)
    fresh = _mlp()
    with torch.no_grad():
        for p in fresh.parameters():
            p.add_(1.0)
    buf.seek(0)
    fresh.load_state_dict(torch.load(buf))
    out = _fp8(fresh)(x)
    with torch.no_grad():
        again = gm(x)
    assert torch.equal(out.detach(), again)
    assert not again.requires_grad


def test_symbolic_capture_without_example_inputs():
    model = _mlp()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        gm = amprewrite.convert(copy.deepcopy(model), policy=amprewrite.Policy.fp8())
    assert gm.code.count("fp8_scaled_mm(") == 2
    assert _rel(gm(_x()), model(_x())) < 5e-2


def test_modes_copies_and_pickling():
    model = _mlp()
    gm = _fp8(model)
    x = _x()
    y = gm(x).detach()
    gm.eval()
    assert torch.equal(gm(x), y) and gm.code.count("fp8_scaled_mm(") == 2
    gm.train()
    assert torch.equal(copy.deepcopy(gm)(x).detach(), y)
    buf = io.BytesIO()
    torch.save(gm, buf)
    buf.seek(0)
    assert torch.equal(torch.load(buf, weights_only=False)(x).detach(), y)
    again = amprewrite.convert(gm, (x,), policy=amprewrite.Policy.fp8())
    assert again.code.count("fp8_scaled_mm(") == 2
    assert torch.equal(again(x).detach(), y)


def fp8_factory() -> tuple[nn.Module, tuple[torch.Tensor]]:
    return _mlp(), (_x(),)


def test_cli_policy_fp8(capsys):
    from amprewrite.cli.main import main

    assert main(["explain", f"{__file__}:fp8_factory", "--policy", "fp8"]) == 0
    assert "fp8: e4m3 per-tensor dynamic" in capsys.readouterr().out
    assert main(["audit", f"{__file__}:fp8_factory", "--policy", "fp8"]) == 0
    out = capsys.readouterr().out
    assert "fp8 matmuls" in out and "float8_e5m2" in out


def test_fp8_output_can_be_written_in_place():
    """The backward node hands the matmul's output itself back (no view), so a model that
    adds into a linear's output in place still trains."""
    x = torch.randn(8, 32, requires_grad=True)
    w = torch.randn(16, 32, requires_grad=True)
    xs, ws = rt.scale(rt.amax(x), rt.E4M3), rt.scale(rt.amax(w), rt.E4M3)
    xq, wq = rt.quantize(x, xs, rt.E4M3), rt.quantize(w, ws, rt.E4M3)
    y = rt.fp8_linear_grad(rt.scaled_mm(xq, wq, xs, ws, torch.bfloat16), x, w, xq, xs, wq, ws)
    y += 1
    y.float().sum().backward()
    ref_x = torch.ones(8, 16) @ w.detach()
    ref_w = torch.ones(16, 8) @ x.detach()
    assert _rel(x.grad, ref_x) < 0.1 and _rel(w.grad, ref_w) < 0.1
