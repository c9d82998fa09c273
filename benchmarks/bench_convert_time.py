"""Conversion time of every model of both zoos, in eval and train mode.

    python benchmarks/bench_convert_time.py [--only llama,t5,tv_resnet]

Prints one line per model and mode (seconds of ``amprewrite.convert`` with the default
policy and the zoo's example inputs) and the slowest, with torch's version and this CPU's
capability: conversion time is part of the supported range's promise (every zoo model
converts in under 10 s on a 2-core machine, on every supported torch). The zoos are the
HuggingFace one (``tests/models/_hf_zoo.py``) and the ecosystem one (``_ecosystem_zoo.py``:
torchvision, timm, diffusers, multimodal); a model whose library does not import is listed as
skipped.
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import time
import warnings

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "tests" / "models"))
sys.path.insert(0, str(ROOT))

import amprewrite  # noqa: E402
from _ecosystem_zoo import ZOO as ECOSYSTEM_ZOO  # noqa: E402
from _zoo_entry import ZooEntry  # noqa: E402


def zoo() -> list[ZooEntry]:
    """The HuggingFace zoo (when transformers imports), then the ecosystem zoo's models whose
    library imports; one line on stderr for each model left out."""
    entries: list[ZooEntry] = []
    try:
        from _hf_zoo import ZOO as HF_ZOO
        entries += HF_ZOO
    except ImportError as exc:
        print(f"HuggingFace zoo skipped: {exc}", file=sys.stderr)
    for entry in ECOSYSTEM_ZOO:
        if (why := entry.missing()) is None:
            entries.append(entry)
        else:
            print(f"{entry.name} skipped: {why}", file=sys.stderr)
    return entries


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="", help="comma-separated architecture names")
    names = {n for n in parser.parse_args().only.split(",") if n}
    warnings.simplefilter("ignore")
    print(f"torch {torch.__version__}, cpu: {torch.backends.cpu.get_cpu_capability()}, "
          f"threads: {torch.get_num_threads()}")
    times = []
    for arch in zoo():
        if names and arch.name not in names:
            continue
        model = arch.build()
        args, kwargs = arch.example()
        for mode in ("eval", "train"):
            model.train(mode == "train")
            start = time.perf_counter()
            try:
                amprewrite.convert(model, tuple(args), example_kwargs=kwargs or None)
                failed = ""
            except Exception as exc:  # noqa: BLE001  (a failure is a row; the others go on)
                failed = f"  failed: {type(exc).__name__}: {str(exc).strip().splitlines()[0]}"
            seconds = time.perf_counter() - start
            times.append((seconds, arch.name, mode))
            print(f"{arch.name:22s} {mode:5s} {seconds:6.1f} s{failed}", flush=True)
    seconds, name, mode = max(times)
    print(f"slowest: {name} ({mode}) {seconds:.1f} s of {len(times)} conversions")


if __name__ == "__main__":
    main()
