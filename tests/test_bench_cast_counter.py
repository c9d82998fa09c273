"""The speed benchmark's cast counter: what its "cast kernels" and "weight casts" columns count."""

from __future__ import annotations

import os
import sys

import torch
import torch.nn as nn

import amprewrite

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))

from _models import LaunchBound  # noqa: E402
from _timing import count_casts  # noqa: E402


def test_counts_casts_and_weight_casts() -> None:
    w, x = torch.randn(4, 4), torch.randn(4, 4)
    count = count_casts(lambda: (w.to(torch.bfloat16), x.to(torch.bfloat16),
                                 w.to(torch.float32)), [w])  # the last one converts nothing
    assert (count.kernels, count.weight_kernels) == (2, 1)
    assert count.nbytes == 2 * (16 * 4 + 16 * 2)


def test_o2_refresh_is_one_kernel_reading_every_weight() -> None:
    """The step casts nothing (it marks the copies stale); the next forward rewrites every
    copy in one kernel, and the forwards after it none."""
    torch.manual_seed(0)
    model, x = LaunchBound(width=4, depth=3), torch.randn(2, 4)
    gm = amprewrite.convert(model, (x,), opt_level="O2", dtype=torch.bfloat16)
    opt = torch.optim.SGD(gm.parameters(), lr=0.1)
    amprewrite.MasterWeights(gm, opt)
    gm(x).float().sum().backward()
    linears = [p for m in model.modules() if isinstance(m, nn.Linear) for p in m.parameters()]
    assert count_casts(opt.step, list(model.parameters())).kernels == 0
    after_step = count_casts(lambda: gm(x), list(model.parameters()))
    again = count_casts(lambda: gm(x), list(model.parameters()))
    # one kernel for every weight (3 weights + 3 biases), besides the input's and output's
    # casts; then the input's and output's casts only, as O3
    assert (after_step.kernels, after_step.weight_kernels) == (3, len(linears))
    assert (again.kernels, again.weight_kernels) == (2, 0)
    copies = sum(p.numel() for p in linears)
    assert after_step.nbytes - again.nbytes == copies * (4 + 2)  # fp32 read, bf16 written
