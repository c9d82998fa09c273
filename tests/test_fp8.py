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
from _graphs import one_line
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
    assert code.count("torch.nn.functional.linear(") == 2
    # the input is quantised from the fp32 master weight, not from a bf16 copy
    assert "_2_weight_e4m3 = amprewrite_runtime_fp8_quantize(_2_weight," in one_line(code)


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


# -- CUDA's rules for torch._scaled_mm, checked on CPU tensors --------------------------------
def _cuda_violations(a: torch.Tensor, b: torch.Tensor) -> list[str]:
    """What CUDA's ``_scaled_mm`` refuses in ``a @ b`` (``at::_scaled_mm_cuda``, the checks of
    its meta function): ``a`` row-major, ``b`` column-major, ``a.size(1)`` and both dimensions
    of ``b`` multiples of 16."""
    found = []
    if not (a.stride(1) == 1 and a.stride(0) > 1):
        found.append(f"mat1 {tuple(a.shape)} is not row-major (stride {a.stride()})")
    if not (b.stride(0) == 1 and b.stride(1) > 1):
        found.append(f"mat2 {tuple(b.shape)} is not column-major (stride {b.stride()})")
    if a.size(1) % 16 or b.size(0) % 16 or b.size(1) % 16:
        found.append(f"{tuple(a.shape)} @ {tuple(b.shape)}: k and n must be multiples of 16")
    return found


class CudaScaledMmRules(TorchDispatchMode):
    """Records every ``aten._scaled_mm`` call with the CUDA rules it breaks."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[tuple[int, int], tuple[int, int], list[str]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._scaled_mm.default:
            a, b = args[0], args[1]
            self.calls.append((tuple(a.shape), tuple(b.shape), _cuda_violations(a, b)))
        return func(*args, **(kwargs or {}))

    @property
    def broken(self) -> list[str]:
        return [f"{a} @ {b}: {'; '.join(v)}" for a, b, v in self.calls if v]


def _six_linears() -> nn.Module:
    """Four fp8 linears (the first and last of six stay bf16): 12 scaled matmuls a step."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), *[nn.Linear(64, 64) for _ in range(4)],
                         nn.Linear(64, 16))


def _set_pad_to(gm: torch.fx.GraphModule, multiple: int) -> None:
    for node in gm.graph.nodes:
        if "pad_to" in node.kwargs:
            node.kwargs = {**node.kwargs, "pad_to": multiple}
    gm.recompile()


def _step(gm: nn.Module, model: nn.Module, x: torch.Tensor) -> dict[str, torch.Tensor]:
    model.zero_grad()
    gm(x).float().pow(2).mean().backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("tokens", [(2, 7), (3, 5), (4, 8)], ids=["2x7", "3x5", "4x8"])
def test_every_scaled_mm_of_a_training_step_keeps_cudas_rules(tokens: tuple[int, int]):
    """Any token count: the weight-gradient matmul contracts over batch x tokens (14, 15),
    which ``pad_to`` pads; padding with zeros changes no bit of the CPU result."""
    model = _six_linears()
    gm = _fp8(model)
    assert gm.code.count("pad_to = 16") == 8  # 4 forward matmuls, 4 backward nodes
    x = torch.randn(*tokens, 32, generator=torch.Generator().manual_seed(3))
    with CudaScaledMmRules() as rules:
        padded = _step(gm, model, x)
    assert len(rules.calls) == 12 and not rules.broken, rules.broken
    _set_pad_to(gm, 1)  # the matmuls as CUDA would refuse them
    with CudaScaledMmRules() as raw:
        unpadded = _step(gm, model, x)
    odd = tokens[0] * tokens[1] % 16 != 0
    assert len(raw.broken) == (4 if odd else 0), raw.broken
    if odd:
        assert all(f"k and n must be multiples of 16" in b for b in raw.broken)
    for name in padded:
        assert torch.equal(padded[name], unpadded[name]), name


def test_dim_multiple_one_pads_weights_of_any_shape():
    """``dim_multiple=1`` lets weights of any shape through; their matmuls pad the weight's
    dimensions too, and compute what the unpadded CPU matmuls compute."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(24, 40), nn.Linear(40, 20), nn.Linear(20, 8))
    gm = amprewrite.convert(model, (torch.randn(3, 24),),
                            policy=amprewrite.Policy.fp8(dim_multiple=1, skip_first_last=False))
    assert gm.code.count("fp8_scaled_mm(") == 3
    x = torch.randn(5, 24, generator=torch.Generator().manual_seed(4))
    with CudaScaledMmRules() as rules:
        out = gm(x)
        padded = _step(gm, model, x)
    # two forwards, and the backward's matmuls (no input gradient for the first layer)
    assert len(rules.calls) == 3 + 3 + 5 and not rules.broken, rules.broken
    assert _rel(out, model(x)) < 0.1  # three e4m3 matmuls in a row
    _set_pad_to(gm, 1)
    assert torch.equal(gm(x), out)
    unpadded = _step(gm, model, x)
    for name in padded:
        assert torch.equal(padded[name], unpadded[name]), name


def test_scaled_mm_takes_operands_of_any_layout():
    """A transposed (column-major) first operand and a row-major second one are laid out as
    CUDA wants them before the call."""
    a, b = torch.randn(64, 20).t(), torch.randn(64, 48)  # a: [20, 64] column-major
    sa, sb = rt.scale(rt.amax(a), rt.E4M3), rt.scale(rt.amax(b), rt.E4M3)
    qa, qb = rt.quantize(a, sa, rt.E4M3), rt.quantize(b, sb, rt.E4M3)
    assert qa.stride(0) == 1 and qb.stride(1) == 1  # quantize keeps the layouts
    with CudaScaledMmRules() as rules:
        out = rt.scaled_mm_2d(qa, qb, sa, sb, torch.float32)
    assert not rules.broken and out.shape == (20, 48)
    assert _rel(out, a @ b) < 5e-2


def test_the_checker_names_what_cuda_refuses():
    a = torch.randn(8, 24).to(rt.E4M3)
    b = torch.randn(24, 16).to(rt.E4M3)  # row-major, k = 24
    assert _cuda_violations(a, b) == [
        "mat2 (24, 16) is not column-major (stride (16, 1))",
        "(8, 24) @ (24, 16): k and n must be multiples of 16"]
    assert _cuda_violations(a.t().contiguous().t(), b.t().contiguous().t())[0] == \
        "mat1 (8, 24) is not row-major (stride (1, 8))"


# -- on a GPU with fp8 (sm_89 or newer) ---------------------------------------------------------
_FP8_GPU = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)
needs_fp8_gpu = pytest.mark.skipif(
    not _FP8_GPU, reason="needs a CUDA device with fp8 matmuls (compute capability 8.9 or newer)")


@needs_fp8_gpu
def test_scaled_mm_numerics_on_cuda():
    a, b = torch.randn(30, 40, device="cuda"), torch.randn(24, 40, device="cuda")
    sa, sb = rt.scale(rt.amax(a), rt.E4M3), rt.scale(rt.amax(b), rt.E4M3)
    out = rt.scaled_mm(rt.quantize(a, sa, rt.E4M3), rt.quantize(b, sb, rt.E4M3), sa, sb,
                       torch.bfloat16)
    assert out.dtype == torch.bfloat16 and out.shape == (30, 24) and out.is_cuda
    assert _rel(out, a @ b.t()) < 5e-2


@needs_fp8_gpu
@pytest.mark.parametrize("tokens", [(2, 7), (3, 5), (4, 8)], ids=["2x7", "3x5", "4x8"])
def test_training_step_on_cuda_with_any_token_count(tokens: tuple[int, int]):
    """The real ``_scaled_mm`` kernels: every call of a training step runs, and the
    gradients follow bf16's."""
    model = _six_linears().cuda()
    x = torch.randn(*tokens, 32, device="cuda")
    gm = amprewrite.convert(model, (torch.randn(4, 8, 32, device="cuda"),),
                            policy=amprewrite.Policy.fp8())
    with CudaScaledMmRules() as rules:
        fp8 = _step(gm, model, x)
    assert len(rules.calls) == 12 and not rules.broken
    bf16 = _step(amprewrite.convert(model, (x,), dtype=torch.bfloat16), model, x)
    for name, g in fp8.items():
        assert g.is_cuda and g.dtype == torch.float32 and torch.isfinite(g).all(), name
        assert _rel(g, bf16[name]) < 0.25, name


@needs_fp8_gpu
def test_dim_multiple_one_on_cuda():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(24, 40), nn.Linear(40, 20)).cuda()
    x = torch.randn(5, 24, device="cuda")
    gm = amprewrite.convert(model, (x,), policy=amprewrite.Policy.fp8(
        dim_multiple=1, skip_first_last=False))
    out = gm(x)
    assert _rel(out, model(x)) < 0.1  # two e4m3 matmuls in a row
    grads = _step(gm, model, x)
    assert all(torch.isfinite(g).all() for g in grads.values())
