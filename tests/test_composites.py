"""Composite ops split one level at a time, as autocast meets them (DecomposeCompositesPass,
``graph.composites``): the first listed op on the way down decides, and a composite is split
on the dtypes its inputs have once converted. Checked on fake CUDA tensors against the real
AutocastCUDA kernels (``_fake_cuda``), op for op (``_op_sequence``)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F
from _op_sequence import FakeCudaModel, autocast_sequence, converted_sequence, sequence_diff

import amprewrite
from amprewrite.graph.composites import one_level
from amprewrite.graph.meta import pending_split
from amprewrite.passes.pipeline import amp_passes

BF16 = torch.bfloat16
PATHS = ("export", "symbolic_static", "symbolic_guarded")


class Inner(nn.Module):
    def forward(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return torch.inner(x, w)


class MmCrossEntropy(nn.Module):
    """A low-precision matmul feeding cross-entropy: the split must see its bf16 output."""

    def forward(self, x: torch.Tensor, w: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(torch.mm(x, w), t)


class MmNormalize(nn.Module):
    def forward(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return F.normalize(torch.mm(x, w), dim=-1)


def _inputs(name: str) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(4, 8, generator=g), torch.randn(8, 6, generator=g)
    if name == "MmCrossEntropy":
        return x, w, torch.randint(0, 6, (4,), generator=g)
    return (x, w.t().contiguous()) if name == "Inner" else (x, w)


def _convert(fake: FakeCudaModel, path: str) -> fx.GraphModule:
    policy = amprewrite.Policy.autocast("cuda", BF16)
    if path == "symbolic_guarded":
        return amprewrite.convert(fake.model, policy=policy, capture="symbolic")
    return amprewrite.convert(fake.model, fake.inputs, policy=policy, capture=path.split("_")[0])


def _cases() -> list[Any]:
    cases = []
    for cls in (Inner, MmCrossEntropy, MmNormalize):
        for path in PATHS:
            marks = [pytest.mark.xfail(strict=True, reason="without example inputs a C++ "
                                       "composite cannot be split")] \
                if (cls, path) == (MmCrossEntropy, "symbolic_guarded") else []
            cases.append(pytest.param(cls, path, marks=marks, id=f"{cls.__name__}-{path}"))
    return cases


@pytest.mark.parametrize("cls,path", _cases())
def test_cuda_preset_splits_as_cuda_autocast(cls: type[nn.Module], path: str) -> None:
    fake = FakeCudaModel.of(cls(), _inputs(cls.__name__))
    gm = _convert(fake, path)
    diff = sequence_diff(converted_sequence(fake, gm), autocast_sequence(fake, BF16))
    assert not diff, f"{cls.__name__} ({path}):\n{diff}"


def _targets(gm: fx.GraphModule) -> list[str]:
    return [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]


@pytest.mark.parametrize("path", PATHS[:2])
def test_inner_stops_at_tensordot(path: str) -> None:
    """``inner`` meets ``tensordot`` (promote) first: fp32 inputs stay fp32, no bf16 mm."""
    fake = FakeCudaModel.of(Inner(), _inputs("Inner"))
    gm = _convert(fake, path)
    assert "aten.tensordot.default" in _targets(gm)
    assert not [n for n in gm.graph.nodes if "mm" in str(n.target)]
    assert "bfloat16" not in gm.code
    with fake.mode:
        assert gm(*fake.inputs).dtype == torch.float32


@pytest.mark.parametrize("path", PATHS[:2])
def test_cross_entropy_is_split_on_the_dtype_its_input_has_once_converted(path: str) -> None:
    """The matmul before it computes in bf16, so ``log_softmax`` gets ``dtype=bf16`` (the
    captured graph had fp32 there), and ``nll_loss`` reads an fp32 cast of its output."""
    fake = FakeCudaModel.of(MmCrossEntropy(), _inputs("MmCrossEntropy"))
    gm = _convert(fake, path)
    log_softmax = next(n for n in gm.graph.nodes
                       if n.target is torch.ops.aten.log_softmax.int)
    assert log_softmax.args[2] is BF16
    nll = next(n for n in gm.graph.nodes if n.target is torch.ops.aten.nll_loss.default)
    assert nll.args[0].meta["val"].dtype == torch.float32
    assert "cross_entropy" not in gm.code and "nll_loss_nd" not in gm.code
    assert not [n for n in gm.graph.nodes if pending_split(n) is not None]
    for p in amp_passes(amprewrite.Policy.autocast("cuda", BF16), BF16):
        assert not p(gm).modified, type(p).__name__


def test_normalize_without_example_inputs_runs_its_own_code() -> None:
    """No dtypes: ``F.normalize``'s own code (a torch Python function the CUDA composite table
    lists) is traced symbolically, so its norm upcasts and its division promotes as under
    autocast. The CPU preset, whose autocast never splits it, keeps it whole."""
    gm = amprewrite.convert(MmNormalize(), policy=amprewrite.Policy.autocast("cuda", BF16),
                            capture="symbolic")
    assert "normalize" not in gm.code
    assert ".norm(" in gm.code and "clamp_min" in gm.code and "expand_as" in gm.code
    cpu = amprewrite.convert(MmNormalize(), policy=amprewrite.Policy.autocast("cpu", BF16),
                             capture="symbolic")
    assert "torch.nn.functional.normalize(" in cpu.code


def test_one_level_records_each_call_whole() -> None:
    """What a composite's kernel calls, not what those calls are made of (private torch API:
    checked on every supported release)."""
    gm = amprewrite.capture.export.capture_export(
        MmCrossEntropy(), _inputs("MmCrossEntropy"), None, regime=None)
    node = next(n for n in gm.graph.nodes if n.target is torch.ops.aten.cross_entropy_loss.default)
    sub = one_level(node)
    assert sub is not None
    assert _targets(sub) == ["aten.log_softmax.int", "aten.nll_loss_nd.default"]
    nll_nd = next(n for n in sub.graph.nodes if n.target is torch.ops.aten.nll_loss_nd.default)
    assert _targets(one_level(nll_nd)) == ["aten.nll_loss.default"]  # type: ignore[arg-type]
