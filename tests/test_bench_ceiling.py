"""The ceiling benchmark's measure: the time a call spends in the shared compute kernels,
and nothing else counted as such."""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))

from bench_ceiling import COMPUTE_KERNELS, _profiled  # noqa: E402


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
