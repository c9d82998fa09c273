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


def test_share_of_o3_gain_column() -> None:
    """``(X vs ac - 1) / (O3 vs ac - 1)``, and no share where O3's gain is within noise."""
    from _speed_report import share_of_o3_gain, speed_table
    from _speed_types import Row

    def row(o3: float) -> Row:
        ratios = {"preset": 1.10, "O2": 1.35, "O3": o3}
        return Row("m", "s", "inference", 5, {"autocast": 1.0, **ratios}, ratios,
                   dict(ratios), {}, {}, "yes", {})

    assert share_of_o3_gain(row(1.50), "O2") == pytest.approx(0.70)
    assert share_of_o3_gain(row(1.50), "preset") == pytest.approx(0.20)
    assert share_of_o3_gain(row(1.05), "O2") is None
    table = speed_table([row(1.50), row(1.05)], ["autocast", "preset", "O2", "O3"])
    assert "share of O3's gain pre/O2" in table
    assert "20% / 70%" in table and "- / -" in table
