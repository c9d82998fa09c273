"""The compile-time benchmark's code path on a one-layer model: each route times a first call,
both compute the same (the preset against torch.autocast, with the eager backend), and the
printout names the machine and has one row per model and backend. Structure only, no timings."""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))

from bench_compile_time import ROUTES, TINY, _run_tiny, _Tiny, first_call, main  # noqa: E402

pytestmark = pytest.mark.usefixtures("fresh_dynamo", "one_thread")


@pytest.mark.parametrize("train", [False, True], ids=["inference", "train"])
def test_each_route_times_a_first_call(train: bool) -> None:
    for route in ROUTES:
        assert first_call(TINY, route, "eager", train) > 0, route


def test_the_routes_compute_the_same() -> None:
    outputs = []
    for make in ROUTES.values():
        torch._dynamo.reset()
        torch.manual_seed(0)  # the same weights for both routes
        outputs.append(_run_tiny(make(_Tiny(), "eager"), False))
    ours, theirs = outputs
    assert ours.dtype == theirs.dtype == torch.bfloat16
    assert torch.equal(ours, theirs)


def test_main_prints_the_machine_and_a_row_per_model(capsys: pytest.CaptureFixture[str]) -> None:
    rows = main(["--only", "tiny", "--backend", "eager"])
    assert [(r.model, r.backend) for r in rows] == [("tiny", "eager")]
    assert set(rows[0].seconds) == set(ROUTES) and rows[0].ratio > 0
    lines = capsys.readouterr().out.splitlines()
    assert torch.__version__ in lines[0]
    assert f"capability {torch.backends.cpu.get_cpu_capability()}" in lines[0]
    assert "1 threads" in lines[0]
    assert all(route in lines[1] for route in ROUTES)
    assert lines[2].split()[:2] == ["tiny", "eager"] and lines[2].endswith("x")
    assert lines[3].startswith("eager: highest ratio tiny")
