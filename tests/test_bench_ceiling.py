"""The ceiling benchmark's measures: the time a call spends in the shared compute kernels, and
nothing else counted as such; the ATen ops the preset runs beyond autocast's."""

from __future__ import annotations

import os
import sys

import torch

import amprewrite

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))

from bench_ceiling import COMPUTE_KERNELS, _profiled, op_counts  # noqa: E402


def test_matmuls_count_as_kernels_and_elementwise_ops_do_not() -> None:
    a = torch.randn(128, 128)

    def matmuls_and_adds() -> torch.Tensor:
        return (a @ a).add(1).mul(2) @ a

    def adds_only() -> torch.Tensor:
        return a.add(1).mul(2).sub(3)

    with_mm = _profiled(matmuls_and_adds, "cpu", calls=5)
    assert 0 < with_mm.kernels < with_mm.wall
    without = _profiled(adds_only, "cpu", calls=5)
    assert without.kernels == 0 and without.wall > 0


def test_the_kernels_are_the_ops_a_linear_and_its_backward_bottom_out_in() -> None:
    # If torch renamed them, the benchmark would quietly count nothing.
    x = torch.randn(4, 8, requires_grad=True)
    layer = torch.nn.Linear(8, 8)
    with torch.profiler.profile() as prof:
        layer(x).sum().backward()
    names = {e.key for e in prof.key_averages()}
    assert {"aten::addmm", "aten::mm"} <= names
    assert {"aten::addmm", "aten::mm"} <= set(COMPUTE_KERNELS)


def test_op_counts_show_the_ops_the_preset_runs_beyond_autocasts() -> None:
    torch.manual_seed(0)
    layer, x = torch.nn.Linear(8, 8), torch.randn(2, 8)

    def autocast() -> torch.Tensor:
        with torch.autocast("cpu", torch.bfloat16):
            return layer(x)

    gm = amprewrite.convert(layer, (x,), policy=amprewrite.Policy.autocast("cpu", torch.bfloat16))
    with torch.no_grad():
        gm(x)  # makes the kept weight copies
        # autocast: x, weight and bias cast, t, addmm; the preset: x cast, one batched copy
        # of the weights into their kept copies (_foreach_copy_, so that any write to the
        # weights is followed), t, addmm
        assert op_counts(autocast, lambda: gm(x)) == "5 / 4 (+1)"
        with amprewrite.cache_weights(gm):  # copies reused while the weights are unchanged
            gm(x)
            assert op_counts(autocast, lambda: gm(x)) == "5 / 3 (+0)"
    assert op_counts(autocast, lambda: (autocast(), x.relu())) == "5 / 6 (+1)"
    # a cast more is not an op the preset adds: casts are counted apart
    assert op_counts(autocast, lambda: (autocast(), x.to(torch.bfloat16))) == "5 / 6 (+0)"
