"""CUDA autocast's op sequence, without a GPU: ``Policy.autocast("cuda", d)`` runs, forward and
backward, the same ATen ops on the same dtypes in the same order as ``torch.autocast("cuda",
dtype=d)``, model by model of the parity zoo, on fake CUDA tensors (see ``_op_sequence``).

On one device, the same op sequence computes the same bits: this is the CUDA parity of
``test_parity_zoo.py`` checked where no GPU is.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn as nn
from _op_sequence import (
    CUDA_BUILD_ONLY,
    FakeCudaModel,
    autocast_sequence,
    converted_sequence,
    sequence_diff,
)
from _zoo import ZOO, Composites, ZooCase

import amprewrite
from amprewrite import OpCategory

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
PATHS = ("export", "symbolic_static", "symbolic_guarded")


class CompositesWithoutGru(Composites):
    """The zoo's composites without ``gru_cell``, whose CUDA kernel
    (``_thnn_fused_gru_cell``) has no fake implementation: autocast cannot run it on fake
    CUDA tensors."""

    def forward(self, x: torch.Tensor, h: torch.Tensor) -> tuple[torch.Tensor, ...]:
        a = torch.einsum("bi,ij->bj", x, self.w)
        b = torch.tensordot(x, self.w, dims=([1], [0]))
        c = torch.inner(x, self.w)
        hy, cy = torch.lstm_cell(x, (h, h), self.w_ih, self.w_hh, self.b_ih, self.b_hh)
        return a + b + c, hy, cy


def _without_gru() -> nn.Module:
    torch.manual_seed(0)
    return CompositesWithoutGru()


def _on_fake_cuda(case: ZooCase) -> ZooCase:
    if case.name != "composites":
        return case
    return ZooCase("composites", _without_gru, case.make_inputs, case.train)


CASES = [_on_fake_cuda(c) for c in ZOO]

KNOWN_GAPS = {
    ("embedding_loss", "symbolic_guarded"):
        "without example inputs the C++ composite cross_entropy_loss cannot be split (its "
        "pieces depend on the input's dtype: log_softmax(x, 1, dtype=x.dtype)), so it runs "
        "whole in fp32 where CUDA autocast rounds the log-probabilities to the input's dtype",
}


def _convert(fake: FakeCudaModel, low: torch.dtype, path: str,
             policy: amprewrite.Policy | None = None) -> nn.Module:
    policy = policy or amprewrite.Policy.autocast("cuda", low)
    if path == "symbolic_guarded":
        return amprewrite.convert(fake.model, policy=policy, capture="symbolic")
    return amprewrite.convert(fake.model, fake.inputs, policy=policy,
                              capture=path.split("_")[0])


def _cases() -> list[Any]:
    out = []
    for case in CASES:
        for dtype in DTYPES:
            for path in PATHS:
                gap = KNOWN_GAPS.get((case.name, path))
                marks = [pytest.mark.xfail(strict=True, reason=gap)] if gap else []
                out.append(pytest.param(case, dtype, path, marks=marks,
                                        id=f"{case.name}-{dtype}-{path}"))
    return out


@CUDA_BUILD_ONLY
@pytest.mark.parametrize("case,dtype,path", _cases())
def test_cuda_preset_runs_cuda_autocast_op_sequence(case: ZooCase, dtype: str, path: str) -> None:
    low = DTYPES[dtype]
    fake = FakeCudaModel.of(case.make_model().train(case.train), case.make_inputs())
    want = autocast_sequence(fake, low)
    got = converted_sequence(fake, _convert(fake, low, path))
    assert sum(c.phase == "backward" for c in want) > 0, "the oracle recorded no backward"
    diff = sequence_diff(got, want)
    assert not diff, f"{case.name} ({dtype}, {path}): the op sequence differs from " \
                     f"torch.autocast('cuda'):\n{diff}"


@CUDA_BUILD_ONLY
def test_sequence_diff_names_the_op_a_policy_changes() -> None:
    """The oracle is not blind: one op moved to fp32 shows as that op, with its dtypes."""
    case = next(c for c in CASES if c.name == "mlp_residual")
    fake = FakeCudaModel.of(case.make_model(), case.make_inputs())
    want = autocast_sequence(fake, torch.bfloat16)
    policy = amprewrite.Policy.autocast("cuda", torch.bfloat16).override(
        ops={"gelu": OpCategory.FP32})
    diff = sequence_diff(converted_sequence(fake, _convert(fake, torch.bfloat16, "export",
                                                           policy)), want)
    assert "-for gelu.default(bf16) -> bf16" in diff.splitlines()
    assert "+for gelu.default(f32) -> f32" in diff.splitlines()
    assert "-bac gelu_backward.default(bf16, bf16) -> bf16" in diff.splitlines()
