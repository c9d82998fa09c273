"""A compiled converted module's call with and without its class's model-attribute fallback.

A converted module's class has a ``__getattr__`` that reads, after its own tensors and
children, an attribute the model got after conversion (:mod:`amprewrite.module.model_view`).
Dynamo traces a module's attribute reads, and a class ``__getattr__`` other than
``nn.Module``'s could make it trace that function for every child read. This measures
``torch.compile(gm)`` side by side, in one process: the converted module as it is, and a
second conversion of the same model whose class has the fallback removed; first call
(compile) and steady-state call under ``no_grad``, one torch thread, each variant compiled
twice (first once each), the best of each kept; and the number of guards Dynamo checks at
each call (``torch._dynamo.explain``), which is exact where the times are noisy. Models: the launch-bound
model (50 blocks, export capture: the graph reads no child) and 20 blocks of
Linear + BatchNorm1d + Dropout in eval mode (symbolic capture, which calls the model's own
batch-norm and dropout layers, 40 child reads per call).

    python benchmarks/bench_compiled_call.py [--number 200] [--repeat 7] [--backend inductor]
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import time
import timeit
import warnings
from typing import Any

import torch
import torch.nn as nn

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from _models import LaunchBound  # noqa: E402
from _speed_report import machine  # noqa: E402

import amprewrite  # noqa: E402

PRESET = amprewrite.Policy.autocast("cpu", torch.bfloat16)


def _leaves() -> nn.Module:
    return nn.Sequential(*[m for _ in range(20)
                           for m in (nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Dropout(0.1))])


def _variants(model: nn.Module, capture: str, x: torch.Tensor) -> dict[str, nn.Module]:
    inputs = (x,) if capture == "export" else None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with_fallback = amprewrite.convert(model, inputs, policy=PRESET, capture=capture)
        without = amprewrite.convert(model, inputs, policy=PRESET, capture=capture)
    del type(without).__getattr__  # its class is its own (torch.fx makes one per module)
    return {"with the fallback": with_fallback, "without": without}


def _time(gm: nn.Module, x: torch.Tensor, backend: str, number: int, repeat: int
          ) -> tuple[float, float]:
    torch._dynamo.reset()
    compiled = torch.compile(gm, backend=backend)
    with torch.no_grad():
        start = time.perf_counter()
        compiled(x)
        first = time.perf_counter() - start
        for _ in range(20):
            compiled(x)
        best = min(timeit.repeat(lambda: compiled(x), number=number, repeat=repeat))
    return first, best / number * 1e6


def _guards(gm: nn.Module, x: torch.Tensor) -> int:
    """How many guards Dynamo puts on the compiled call (an exact count)."""
    torch._dynamo.reset()
    with torch.no_grad():
        return len(torch._dynamo.explain(gm)(x).out_guards)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--number", type=int, default=200)
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--backend", default="inductor")
    options = parser.parse_args(argv)
    torch.set_num_threads(1)
    print(machine("cpu"))
    print(f"torch {torch.__version__}, CPU capability "
          f"{torch.backends.cpu.get_cpu_capability()}, backend {options.backend}\n")
    torch.manual_seed(0)
    cases: list[tuple[str, nn.Module, str, torch.Tensor]] = [
        ("Launch-bound 50x(LN+Linear) d8, export", LaunchBound(), "export", torch.randn(2, 8)),
        ("20x(Linear+BN+Dropout) d8, symbolic", _leaves().eval(), "symbolic",
         torch.randn(2, 8))]
    rows: list[list[Any]] = []
    for name, model, capture, x in cases:
        variants = _variants(model, capture, x)
        runs: dict[str, list[tuple[float, float]]] = {label: [] for label in variants}
        for order in (list(variants), list(reversed(variants))):  # each first once
            for label in order:
                runs[label].append(_time(variants[label], x, options.backend,
                                         options.number, options.repeat))
        (f_with, c_with), (f_without, c_without) = (
            (min(f for f, _ in r), min(c for _, c in r)) for r in runs.values())
        g_with, g_without = (_guards(gm, x) for gm in variants.values())
        rows.append([name, g_with, g_without, f"{f_with:.1f}", f"{f_without:.1f}",
                     f"{c_with:.1f}", f"{c_without:.1f}", f"{c_with / c_without:.2f}"])
    print("| model | guards, with | guards, without | first call s, with | first call s, "
          "without | call µs, with | call µs, without | call ratio |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for row in rows:
        print("| " + " | ".join(map(str, row)) + " |")


if __name__ == "__main__":
    main()
