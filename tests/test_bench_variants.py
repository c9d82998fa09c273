"""The speed benchmark's phases: what its inference phase runs under, and which phases a run
measures."""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))

from _variants import inference  # noqa: E402
from bench_speed import _parser  # noqa: E402


def test_the_inference_phase_runs_under_no_grad_or_inference_mode() -> None:
    layer, x = torch.nn.Linear(4, 4), torch.randn(2, 4)
    out = inference(lambda: layer(x))()
    assert not out.requires_grad and not out.is_inference()
    out = inference(lambda: layer(x), inference_mode=True)()
    assert out.is_inference()


def test_phases_are_chosen_on_the_command_line() -> None:
    args = _parser().parse_args(["--phases", "inference", "--inference-mode"])
    assert args.phases == ["inference"] and args.inference_mode
    assert _parser().parse_args([]).phases == ["inference", "train step"]
    with pytest.raises(SystemExit):
        _parser().parse_args(["--phases", "backward"])
