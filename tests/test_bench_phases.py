"""The phase benchmark's arithmetic: per-part means over steps, ratios to autocast per part and
for the whole step."""

from __future__ import annotations

import os
import sys
from typing import Callable

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))

from bench_phases import _rounds, _table  # noqa: E402


def _fixed(forward: float, backward: float, step: float) -> Callable[[list[float]], None]:
    """A stepper whose parts take the given seconds."""
    def run(into: list[float]) -> None:
        into[0] += forward
        into[1] += backward
        into[2] += step
    return run


def test_parts_are_averaged_and_compared_to_autocast_part_by_part() -> None:
    samples = _rounds({"autocast": _fixed(2e-3, 4e-3, 1e-3), "O2": _fixed(1e-3, 4e-3, 2e-3)},
                      rounds=3, steps=4)
    assert samples["O2"] == [[1e-3, 4e-3, 2e-3]] * 3  # the mean of 4 steps, each round
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]]
            for line in _table(samples).splitlines()[2:]}
    assert rows["autocast"] == ["2.000", "4.000", "1.000", "7.000"]
    assert rows["O2"] == ["1.000 (2.00x)", "4.000 (1.00x)", "2.000 (0.50x)", "7.000 (1.00x)"]
