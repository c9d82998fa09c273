"""amprewrite.lint(gm): each rule fires on a planted pitfall, names the node, and stays quiet
on a clean graph."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import amprewrite
from amprewrite import Lint


class MaskedAttention(nn.Module):
    def __init__(self, fill: float, dim: int = 16) -> None:
        super().__init__()
        self.q = nn.Linear(dim, dim)
        self.fill = fill

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        q = self.q(x)
        scores = q @ q.transpose(-1, -2)
        return scores.masked_fill(mask, self.fill).softmax(-1)


class Normalize(nn.Module):
    def __init__(self, eps: float) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        return h / (h.abs() + self.eps)


def _attn_inputs(dim: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(2, 8, dim), torch.zeros(2, 8, 8, dtype=torch.bool)


def _rules(lints: list[Lint]) -> list[tuple[str, str]]:
    return [(l.rule, l.node) for l in lints]


@pytest.mark.parametrize("fill", [-1e9, torch.finfo(torch.float32).min])
def test_fill_constant_that_is_inf_in_fp16(fill):
    args = _attn_inputs()
    gm = amprewrite.convert(MaskedAttention(fill), args, dtype=torch.float16)
    lints = amprewrite.lint(gm)
    assert _rules(lints) == [("fill-overflow", "masked_fill")]
    assert "overflows fp16" in lints[0].message
    assert "torch.finfo(torch.float16).min" in lints[0].fix
    # What the lint predicts: the converted graph cannot run.
    with pytest.raises(RuntimeError, match="without overflow"):
        gm(*args)
    assert "masked_fill" in str(lints[0]) and "fix:" in str(lints[0])


def test_fill_constants_that_fit_are_fine():
    args = _attn_inputs()
    assert amprewrite.lint(amprewrite.convert(MaskedAttention(-1e4), args,
                                              dtype=torch.float16)) == []
    # bf16 holds -1e9, but fp32's min rounds to -inf in bf16.
    assert amprewrite.lint(amprewrite.convert(MaskedAttention(-1e9), args,
                                              dtype=torch.bfloat16)) == []
    lints = amprewrite.lint(amprewrite.convert(
        MaskedAttention(torch.finfo(torch.float32).min), args, dtype=torch.bfloat16))
    assert _rules(lints) == [("fill-overflow", "masked_fill")] and "bf16" in lints[0].message


def test_eps_below_fp16_tiny():
    x = torch.randn(4, 8)
    lints = amprewrite.lint(amprewrite.convert(Normalize(1e-8), (x,), dtype=torch.float16))
    assert _rules(lints) == [("eps-underflow", "add")]
    assert "rounds to 0" in lints[0].message
    lints = amprewrite.lint(amprewrite.convert(Normalize(1e-6), (x,), dtype=torch.float16))
    assert _rules(lints) == [("eps-underflow", "add")] and "subnormal" in lints[0].message
    assert amprewrite.lint(amprewrite.convert(Normalize(1e-4), (x,), dtype=torch.float16)) == []
    # In bf16 (smallest normal 1e-38) the same epsilon is fine.
    assert amprewrite.lint(amprewrite.convert(Normalize(1e-8), (x,), dtype=torch.bfloat16)) == []


def test_matmul_alignment_weighted_by_flops():
    class Mixed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.aligned = nn.Linear(64, 64)
            self.odd = nn.Linear(64, 10)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.odd(self.aligned(x))

    gm = amprewrite.convert(Mixed(), (torch.randn(4, 64),), dtype=torch.float16)
    (lint,) = amprewrite.lint(gm, device="cuda")
    assert (lint.rule, lint.node) == ("matmul-alignment", "linear_1")
    # FLOPs: aligned 2*4*64*64, odd 2*4*64*10: share 10 / 74.
    assert lint.flops_share == pytest.approx(10 / 74)
    assert "N=10" in lint.message and "N=16" in lint.fix


def test_conv_alignment():
    conv = nn.Conv2d(3, 16, 3)
    gm = amprewrite.convert(nn.Sequential(conv), (torch.randn(1, 3, 8, 8),),
                            dtype=torch.float16)
    (lint,) = amprewrite.lint(gm, device=torch.device("cuda", 0))
    assert lint.rule == "matmul-alignment" and "in_channels=3" in lint.message
    assert lint.message.endswith("tensor cores are not used at full rate; 100.0% of this "
                                 "graph's fp16/bf16 matmul/conv FLOPs.")
    assert lint.fix.startswith("pad to in_channels=8 ")
    assert lint.flops_share == 1.0


def test_alignment_is_cuda_advice_only():
    """A CPU has no tensor cores: on it, an RGB convolution and an odd head are fine."""
    model = nn.Sequential(nn.Conv2d(3, 16, 3), nn.Flatten(), nn.Linear(16 * 36, 10))
    gm = amprewrite.convert(model, (torch.randn(2, 3, 8, 8),), dtype=torch.float16)
    assert next(gm.parameters()).device.type == "cpu"
    assert amprewrite.lint(gm) == [] == amprewrite.lint(gm, device="cpu")
    assert [(l.rule, l.node) for l in amprewrite.lint(gm, device="cuda")] == [
        ("matmul-alignment", "conv2d"), ("matmul-alignment", "linear")]  # most FLOPs first
    with pytest.raises(ValueError, match=r"device='gpu' is not a device; pass 'cuda', 'cpu'"):
        amprewrite.lint(gm, device="gpu")


def test_alignment_follows_the_device_of_the_modules_tensors():
    """By default the advice is for the device the parameters are on: a fake CUDA weight
    (no GPU needed) makes the module's device CUDA."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    conv = nn.Conv2d(3, 16, 3)
    gm = amprewrite.convert(nn.Sequential(conv), (torch.randn(1, 3, 8, 8),),
                            dtype=torch.float16)
    assert amprewrite.lint(gm) == []
    with FakeTensorMode():
        weight = torch.empty(16, 3, 3, 3, device="cuda")
    # NB: requires_grad=False: a fake CUDA leaf that requires grad aborts the process
    conv.weight = nn.Parameter(weight, requires_grad=False)  # the model's, read by gm
    assert [l.rule for l in amprewrite.lint(gm)] == ["matmul-alignment"]
    assert amprewrite.lint(gm, device="cpu") == []


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_alignment_on_a_real_cuda_module():
    model = nn.Sequential(nn.Linear(64, 10)).cuda()
    gm = amprewrite.convert(model, (torch.randn(4, 64, device="cuda"),), dtype=torch.float16)
    (lint,) = amprewrite.lint(gm)
    assert (lint.rule, lint.node) == ("matmul-alignment", "linear")
    assert amprewrite.lint(gm, device="cpu") == []


def test_fp16_parameters_that_require_grad():
    model = nn.Sequential(nn.Linear(8, 8)).half()
    gm = amprewrite.convert(model, (torch.randn(2, 8, dtype=torch.float16),),
                            dtype=torch.float16)
    lints = amprewrite.lint(gm)
    assert [(l.rule, l.node) for l in lints] == [("fp16-param-grad", "_0_weight"),
                                                  ("fp16-param-grad", "_0_bias")]
    assert "Attempting to unscale FP16 gradients" in lints[0].message
    assert amprewrite.lint(gm, grad_scaler=False) == []
    for p in model.parameters():
        p.requires_grad_(False)
    assert amprewrite.lint(gm) == []


def test_clean_graph_and_wrong_input():
    gm = amprewrite.convert(nn.Sequential(nn.Linear(16, 32), nn.ReLU()),
                            (torch.randn(8, 16),), dtype=torch.float16)
    assert amprewrite.lint(gm) == []
    with pytest.raises(TypeError, match="returned by amprewrite.convert, got Linear"):
        amprewrite.lint(nn.Linear(2, 2))
    with pytest.raises(TypeError, match="got a GraphModule not made by amprewrite.convert"):
        amprewrite.lint(torch.fx.symbolic_trace(nn.Linear(2, 2)))
