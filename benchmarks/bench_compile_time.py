"""First-call time of ``amprewrite.compile`` against ``torch.compile`` under ``torch.autocast``.

    python benchmarks/bench_compile_time.py [--only fasterrcnn,llama]
                                            [--backend inductor|eager|both] [--train] [--repeat 1]

For each model, side by side in one process: the seconds of the first call (Dynamo's capture,
the backend's compilation and the run) of ``amprewrite.compile(model, policy=
Policy.autocast("cpu", torch.bfloat16))`` and of ``torch.compile(model)`` called under
``torch.autocast("cpu", dtype=torch.bfloat16)``, and their ratio. Models: torchvision's six
detectors in the configurations of ``tests/test_detection_zoo.py`` (skipped where torchvision's
ops do not load) and two transformers of the HuggingFace zoo (tiny Llama and GPT-2).

Both routes compile with the same backend, each model on both by default: Inductor
(``amprewrite.compile(...)`` against ``torch.compile(model)``, what users run) and the eager
backend (``amprewrite.compile(..., eager=True)`` against ``torch.compile(backend="eager")``,
which times Dynamo's capture and the rewrite alone: the share of the time that is ours). Each first call runs with empty compile caches
(``torch._inductor.utils.fresh_cache``: a new cache directory and cleared in-memory caches)
after ``torch._dynamo.reset()``, so neither route reuses the other's kernels. Before the
measurements a tiny model is compiled both ways (imports, the C++ compiler's first start) and
each model is traced once by both routes with the eager backend (what Dynamo and amprewrite
do once per process on meeting a library's code: reading its source, resolving its
functions); which route goes first alternates from model to model. Inference (eval mode,
under ``no_grad``) by default; ``--train`` times a training forward and its backward
(Inductor compiles the backward graph at the first backward). ``--repeat n`` reports each
route's best of n first calls (on a shared machine other jobs only add time), the routes
taking turns.
Prints the CPU, its capability, torch's version and threads, the seconds of each route and
their ratio, and the highest ratio per backend (the target: at most 1.5x).
``--only tiny`` runs a one-layer model alone (the smoke test's setting).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import logging
import os
import pathlib
import platform
import sys
import time
import warnings
from typing import Any, Callable, Iterator

import torch
import torch.nn as nn

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "tests" / "models"))
sys.path.insert(0, str(ROOT))

import amprewrite  # noqa: E402
from amprewrite import Policy  # noqa: E402

PRESET = Policy.autocast("cpu", torch.bfloat16)
DETECTORS = ("fasterrcnn", "retinanet", "fcos", "ssdlite", "maskrcnn", "keypointrcnn")
TRANSFORMERS = ("llama", "gpt2_labels")

Case = tuple[str, Callable[[], nn.Module], Callable[[nn.Module, bool], Any]]
"""A model's name, a builder (a fresh seeded model) and ``run(model_or_compiled, train)``:
one call as its users make it, with the backward of a training loss when ``train``."""


def _detector_cases() -> list[Case]:
    from test_detection_zoo import _batch, _detector, _torchvision_missing

    if _torchvision_missing() is not None:
        print(f"skipping the detectors: {_torchvision_missing()}")
        return []

    def case(name: str) -> Case:
        def run(model: Callable[..., Any], train: bool) -> Any:
            images, targets = _batch(name)
            torch.manual_seed(2)  # the transform draws a size, the samplers draw boxes
            if not train:
                return model(images)
            losses = model(images, targets)
            sum(losses.values()).backward()
            return losses

        return name, lambda: _detector(name), run

    return [case(name) for name in DETECTORS]


def _transformer_cases() -> list[Case]:
    if importlib.util.find_spec("transformers") is None:
        print("skipping the transformers: transformers is not installed")
        return []
    from _hf_zoo import arch

    def case(name: str) -> Case:
        entry = arch(name)

        def run(model: Callable[..., Any], train: bool) -> Any:
            args, kwargs = entry.example()
            out = model(*args, **kwargs)
            if train:
                entry.loss(out).backward()
            return out

        return name, entry.build, run

    return [case(name) for name in TRANSFORMERS]


def _amprewrite(model: nn.Module, backend: str) -> Callable[..., Any]:
    return amprewrite.compile(model, policy=PRESET, eager=backend == "eager")


def _torch(model: nn.Module, backend: str) -> Callable[..., Any]:
    compiled = torch.compile(model, backend=backend)

    def call(*args: Any, **kwargs: Any) -> Any:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return compiled(*args, **kwargs)

    return call


ROUTES = {"amprewrite.compile": _amprewrite, "torch.compile+autocast": _torch}


def first_call(case: Case, route: str, backend: str, train: bool) -> float:
    """Seconds of the first call of a fresh model through ``route``, with empty caches."""
    from torch._inductor.utils import fresh_cache

    _, build, run = case
    model = build().train(train)
    torch._dynamo.reset()
    with fresh_cache():
        start = time.perf_counter()
        compiled = ROUTES[route](model, backend)
        with torch.set_grad_enabled(train):
            run(compiled, train)
        return time.perf_counter() - start


class _Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x).softmax(-1)


def _run_tiny(model: Callable[..., Any], train: bool) -> Any:
    out = model(torch.randn(2, 8, generator=torch.Generator().manual_seed(0)))
    if train:
        out.float().sum().backward()
    return out


TINY: Case = ("tiny", _Tiny, _run_tiny)


def _warm_up(cases: list[Case], backends: list[str], train: bool) -> None:
    for route in ROUTES:
        for backend in backends:
            first_call(TINY, route, backend, train)
        for case in cases:
            first_call(case, route, "eager", train)


@dataclasses.dataclass(frozen=True)
class Row:
    """One model's first calls on one backend: seconds per route (best of the repeats)."""

    model: str
    backend: str
    seconds: dict[str, float]

    @property
    def ratio(self) -> float:
        ours, theirs = (self.seconds[r] for r in ROUTES)
        return ours / theirs


def measure(cases: list[Case], backends: list[str], train: bool,
            repeat: int) -> Iterator[Row]:
    """Each case's first call on each backend by both routes, taking turns; which route goes
    first alternates from model to model."""
    routes = list(ROUTES)
    for i, case in enumerate(cases):
        order = routes if i % 2 == 0 else routes[::-1]
        for backend in backends:
            seconds = dict.fromkeys(routes, float("inf"))
            for _ in range(repeat):
                for route in order:
                    seconds[route] = min(seconds[route],
                                         first_call(case, route, backend, train))
            yield Row(case[0], backend, seconds)


def machine() -> str:
    """This CPU, its capability, torch's version and threads, and the load on the machine."""
    name = platform.processor() or "cpu"
    try:
        with open("/proc/cpuinfo") as f:
            name = next((line.split(":", 1)[1].strip() for line in f
                         if line.startswith("model name")), name)
    except OSError:
        pass
    load = f", 1-minute load average {os.getloadavg()[0]:.1f}" if hasattr(os, "getloadavg") \
        else ""
    return (f"{name}, {os.cpu_count()} cores, capability "
            f"{torch.backends.cpu.get_cpu_capability()}; torch {torch.__version__}, "
            f"{torch.get_num_threads()} threads{load}")


def format_row(row: Row) -> str:
    ours, theirs = (row.seconds[r] for r in ROUTES)
    return (f"{row.model:14s} {row.backend:9s} {ours:18.1f} s {theirs:22.1f} s  "
            f"{row.ratio:4.2f}x")


def main(argv: list[str] | None = None) -> list[Row]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="", help="comma-separated model names")
    parser.add_argument("--backend", choices=("inductor", "eager", "both"), default="both")
    parser.add_argument("--train", action="store_true",
                        help="time a training forward and backward instead of inference")
    parser.add_argument("--repeat", type=int, default=1,
                        help="best of this many first calls of each route")
    options = parser.parse_args(argv)
    names = {n for n in options.only.split(",") if n}
    backends = ["inductor", "eager"] if options.backend == "both" else [options.backend]
    warnings.simplefilter("ignore")
    logging.getLogger("torch._dynamo").setLevel(logging.ERROR)  # graph-break warnings
    print(f"{machine()}; "
          f"{'train forward + backward' if options.train else 'inference'}", flush=True)
    candidates = [TINY] if names == {TINY[0]} else [*_detector_cases(), *_transformer_cases()]
    cases = [c for c in candidates if not names or c[0] in names]
    _warm_up(cases, backends, options.train)
    routes = list(ROUTES)
    print(f"{'model':14s} {'backend':9s} {routes[0]:>20s} {routes[1]:>24s}  ratio", flush=True)
    rows = []
    for row in measure(cases, backends, options.train, options.repeat):
        rows.append(row)
        print(format_row(row), flush=True)
    for backend in backends:
        mine = [r for r in rows if r.backend == backend]
        if mine:
            worst = max(mine, key=lambda r: r.ratio)
            print(f"{backend}: highest ratio {worst.model} {worst.ratio:.2f}x; "
                  f"{len(mine)} models")
    return rows


if __name__ == "__main__":
    main()
