"""O2 runs a norm whose kernel takes fp16/bf16 input with fp32 parameters on the low-precision
activation as it arrives (``kernels.MIXED_INPUT_NORMS``): no casts around it, fp32 master
parameters and fp32 running statistics, output in the low dtype."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F
from _fake_cuda import fake_cuda
from _graphs import weight_entries
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

import amprewrite
from amprewrite import Policy
from amprewrite.capture.symbolic import capture_symbolic
from amprewrite.graph.meta import Decision, cast_info, decision
from amprewrite.passes.classify import ClassifyPass
from amprewrite.policy.kernels import MIXED_INPUT_NORMS, takes_mixed_input
from amprewrite.policy.tables import NORM_OPS, OpCategory

pytestmark = pytest.mark.usefixtures("one_thread")

BF16 = torch.bfloat16
X = torch.randn(4, 3, 8, 8, generator=torch.Generator().manual_seed(1))


class ConvBN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv = nn.Conv2d(3, 6, 3, padding=1)
        self.bn = nn.BatchNorm2d(6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.bn(self.conv(x)))


def _eager_o2(model: ConvBN, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """What O2 computes, written out: a low-precision conv, then batch norm on its output with
    the fp32 parameters and statistics, the output widened at the end."""
    conv, bn = model.conv, model.bn
    y = F.conv2d(x.to(dtype), conv.weight.to(dtype), conv.bias.to(dtype), padding=1)
    y = F.batch_norm(y, bn.running_mean, bn.running_var, bn.weight, bn.bias, bn.training,
                     bn.momentum, bn.eps)
    return F.relu(y).float()


def _casts(gm: fx.GraphModule) -> list[fx.Node]:
    """The activation cast nodes (weight reads excluded)."""
    return [n for n in gm.graph.nodes if (info := cast_info(n)) is not None and not info.weight]


@pytest.mark.parametrize("inputs", [(X,), None], ids=["export", "symbolic"])
def test_o2_batch_norm_has_no_casts_around_it(inputs: tuple | None) -> None:
    gm = amprewrite.convert(ConvBN().eval(), inputs, opt_level="O2", dtype=BF16)
    assert len(_casts(gm)) == 2  # the input down, the output up: none around the norm
    # the fp32 master (or the layer itself), read as stored
    assert not any(e[0] == "bn.weight" and len(e) > 1 for e in weight_entries(gm))
    norm = next(rec for n in gm.graph.nodes if isinstance(rec := decision(n), Decision)
                and "batch_norm" in rec.op)
    rule = norm.rule
    assert norm.category is OpCategory.PASSTHROUGH and norm.casts == ()
    assert rule.startswith("O2: ") and "on cpu takes low-precision input with fp32" in rule
    assert rule in amprewrite.explain(gm)


@pytest.mark.parametrize("training", [False, True], ids=["eval", "train"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_o2_batch_norm_numerics(dtype: torch.dtype, training: bool) -> None:
    model, ref = ConvBN().train(training), ConvBN().train(training)
    gm = amprewrite.convert(model, (X,), opt_level="O2", dtype=dtype)
    with torch.no_grad():
        out = gm(X)
        expected = _eager_o2(ref, X, dtype)
        fp32 = ConvBN().train(training)(X)
    assert out.dtype == torch.float32
    assert torch.equal(out, expected)  # bitwise: batch norm called the same way eagerly
    torch.testing.assert_close(out, fp32, atol=0.1, rtol=0.05)
    for name in ("running_mean", "running_var"):
        stat, ref_stat = getattr(model.bn, name), getattr(ref.bn, name)
        assert stat.dtype == torch.float32 and torch.equal(stat, ref_stat)


def test_o2_batch_norm_training_step_updates_fp32_masters_and_stats() -> None:
    model, ref = ConvBN(), ConvBN()
    gm = amprewrite.convert(model, (X,), opt_level="O2", dtype=BF16)
    opt = torch.optim.SGD(gm.parameters(), lr=0.1)
    amprewrite.MasterWeights(gm, opt)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    gm(X).square().mean().backward()
    _eager_o2(ref, X, BF16).square().mean().backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert p.grad.dtype == torch.float32 and torch.equal(p.grad, q.grad), name
    opt.step()
    for name in ("bn.weight", "bn.bias", "bn.running_mean", "bn.running_var"):
        now = model.state_dict()[name]
        assert now.dtype == torch.float32 and not torch.equal(now, before[name]), name
    with torch.no_grad():  # the next forward reads the refreshed copies and the new masters
        torch.testing.assert_close(gm(X), model.train()(X), atol=0.1, rtol=0.05)


_NEEDS_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _norm_calls(device: str) -> dict[str, Any]:
    """One call per mixed-input norm entry: ``(x, weight, bias) -> output``, statistics on
    ``device``."""
    def stats() -> tuple[torch.Tensor, torch.Tensor]:
        return torch.zeros(4, device=device), torch.ones(4, device=device)

    calls = {
        "batch_norm": lambda x, w, b: F.batch_norm(x, *stats(), w, b, True),
        "instance_norm": lambda x, w, b: F.instance_norm(x, weight=w, bias=b),
        "layer_norm": lambda x, w, b: F.layer_norm(x, (4,), w, b),
        "group_norm": lambda x, w, b: F.group_norm(x, 2, w, b),
    }
    calls["native_batch_norm"] = lambda x, w, b: torch.native_batch_norm(
        x, w, b, *stats(), True, 0.1, 1e-5)[0]
    calls["native_layer_norm"] = lambda x, w, b: torch.native_layer_norm(x, (4,), w, b, 1e-5)[0]
    calls["native_group_norm"] = lambda x, w, b: torch.native_group_norm(
        x, w, b, 2, 4, 16, 2, 1e-5)[0]
    legit = {"_native_batch_norm_legit": (True,), "_native_batch_norm_legit_functional": (True,),
             "_native_batch_norm_legit_no_training": ()}
    for name, train in legit.items():
        op = getattr(torch.ops.aten, name)
        calls[name] = lambda x, w, b, op=op, train=train: op(
            x, w, b, *stats(), *train, 0.1, 1e-5)[0]
    return {name: call for name, call in calls.items() if name in MIXED_INPUT_NORMS[device]}


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=_NEEDS_CUDA)])
def test_the_mixed_input_norms_take_both_low_dtypes(device: str) -> None:
    """Each entry of the device takes fp16 and bf16 input with fp32 parameters, forward and
    backward, and returns the input's dtype, with fp32 parameter gradients, on this torch."""
    calls = _norm_calls(device)
    assert set(calls) == MIXED_INPUT_NORMS[device]
    for dtype in (torch.float16, torch.bfloat16):
        for name, call in calls.items():
            x = torch.randn(2, 4, 4, 4, device=device).to(dtype).requires_grad_()
            w = torch.randn(4, device=device, requires_grad=True)
            b = torch.randn(4, device=device, requires_grad=True)
            out = call(x, w, b)
            out.float().sum().backward()
            assert out.dtype == x.grad.dtype == dtype, (name, dtype)
            assert w.grad.dtype == b.grad.dtype == torch.float32, (name, dtype)


@_NEEDS_CUDA
@pytest.mark.parametrize("training", [False, True], ids=["eval", "train"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_o2_batch_norm_on_cuda(dtype: torch.dtype, training: bool) -> None:
    """On a GPU: batch norm runs on the low-precision activation (no casts around it), as
    eager code calls it, with fp32 statistics and fp32 gradients on the masters."""
    model, ref = ConvBN().cuda().train(training), ConvBN().cuda().train(training)
    x = X.cuda()
    gm = amprewrite.convert(model, (x,), opt_level="O2", dtype=dtype)
    amprewrite.MasterWeights(gm, torch.optim.SGD(gm.parameters(), lr=0.1))
    assert len(_casts(gm)) == 2
    assert "O2: batch_norm on cuda takes low-precision input with fp32 parameters" in \
        amprewrite.explain(gm)
    out, expected = gm(x), _eager_o2(ref, x, dtype)
    assert out.dtype == torch.float32 and torch.equal(out, expected)
    for name in ("running_mean", "running_var"):
        stat = getattr(model.bn, name)
        assert stat.dtype == torch.float32 and torch.equal(stat, getattr(ref.bn, name))
    out.square().mean().backward()
    expected.square().mean().backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert p.grad.dtype == torch.float32, name
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6)


def test_the_mixed_input_table() -> None:
    assert all(MIXED_INPUT_NORMS[d] <= NORM_OPS for d in MIXED_INPUT_NORMS)
    assert MIXED_INPUT_NORMS["cuda"] <= MIXED_INPUT_NORMS["cpu"]
    assert takes_mixed_input("batch_norm", "cuda") and takes_mixed_input("layer_norm", "cpu")
    assert not takes_mixed_input("layer_norm", "cuda") and not takes_mixed_input("rms_norm", "cpu")
    assert not takes_mixed_input("batch_norm", "mps") and not takes_mixed_input("batch_norm", None)
    o2, o3 = Policy(preset="O2", dtype=BF16), Policy(preset="O3", dtype=BF16)
    assert o2.mixed_input_rule("batch_norm", "cuda") is not None
    assert o3.mixed_input_rule("batch_norm", "cuda") is None  # O3 has no fp32 parameters


class _Norms(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.bn, self.ln = nn.BatchNorm1d(4).eval(), nn.LayerNorm(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ln(self.bn(x))


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_o2_rules_follow_the_device_of_the_values(device: str) -> None:
    """With fake CUDA values, batch norm runs on the low input and layer norm in fp32 (CUDA's
    entry); on a CPU both run on the low input."""
    gm = capture_symbolic(_Norms())
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        FakeTensorProp(gm, mode).propagate(torch.empty(2, 4, dtype=BF16))
        if device == "cuda":
            for node in gm.graph.nodes:
                node.meta["val"] = fake_cuda(mode, node.meta["val"])
    classify = ClassifyPass(Policy(preset="O2", dtype=BF16), BF16).classify
    decisions = {(rec := classify(n)).op: rec for n in gm.graph.nodes
                 if n.op in ("call_function", "call_module")}
    assert decisions["batch_norm"].category is OpCategory.PASSTHROUGH
    assert decisions["batch_norm"].rule == f"O2: batch_norm on {device} takes " \
                                           "low-precision input with fp32 parameters"
    expected = OpCategory.FP32 if device == "cuda" else OpCategory.PASSTHROUGH
    assert decisions["layer_norm"].category is expected


def test_batch_norm_on_fake_cuda_keeps_the_low_dtype() -> None:
    """The ATen batch norms that export records, on fake CUDA tensors: a bf16/fp16 input with
    fp32 parameters and statistics gives the input's dtype and fp32 statistics."""
    with FakeTensorMode() as mode:
        for dtype in (torch.float16, torch.bfloat16):
            x = fake_cuda(mode, torch.empty(2, 4, 3, 3, dtype=dtype))
            w, b, mean, var = (fake_cuda(mode, torch.empty(4)) for _ in range(4))
            eval_out = torch.ops.aten._native_batch_norm_legit_no_training(
                x, w, b, mean, var, 0.1, 1e-5)
            train_out = torch.ops.aten._native_batch_norm_legit_functional(
                x, w, b, mean, var, True, 0.1, 1e-5)
            assert eval_out[0].dtype == train_out[0].dtype == dtype
            assert eval_out[0].is_cuda
            assert all(t.dtype == torch.float32 for t in train_out[1:])
