"""The zoo benchmark's rows: per phase autocast's time and each variant's ratio, or the error
that stopped the architecture."""

from __future__ import annotations

import dataclasses
import os
import sys

import pytest
import torch

pytest.importorskip("transformers")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))

from bench_zoo import measure  # noqa: E402
from _hf_zoo import arch  # noqa: E402  (bench_zoo puts tests/models on the path)


def test_a_row_has_autocasts_time_and_both_ratios_per_phase() -> None:
    row = measure(arch("distilbert"), "cpu", torch.bfloat16, rounds=1)
    name, family, *cells, error = row
    assert (name, family, error) == ("distilbert", "encoder", "")
    assert len(cells) == 6 and all(float(c) > 0 for c in cells)


def test_a_failing_architecture_fills_its_row_with_the_error() -> None:
    def broken() -> None:
        raise RuntimeError("no config here")

    entry = dataclasses.replace(arch("distilbert"), config=broken)
    row = measure(entry, "cpu", torch.bfloat16, rounds=1)
    assert row[2:-1] == ["-"] * 6 and row[-1] == "RuntimeError: no config here"
