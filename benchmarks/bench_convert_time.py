"""Conversion time of every HuggingFace zoo architecture, in eval and train mode.

    python benchmarks/bench_convert_time.py [--only llama,t5]

Prints one line per architecture and mode (seconds of ``amprewrite.convert`` with the
default policy and the zoo's example inputs) and the slowest, with torch's version and this
CPU's capability: conversion time is part of the supported range's promise (every zoo model
converts in under 10 s on a 2-core machine, on every supported torch).
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
from _hf_zoo import ZOO  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="", help="comma-separated architecture names")
    names = {n for n in parser.parse_args().only.split(",") if n}
    warnings.simplefilter("ignore")
    print(f"torch {torch.__version__}, cpu: {torch.backends.cpu.get_cpu_capability()}, "
          f"threads: {torch.get_num_threads()}")
    times = []
    for arch in ZOO:
        if names and arch.name not in names:
            continue
        model = arch.build()
        args, kwargs = arch.example()
        for mode in ("eval", "train"):
            model.train(mode == "train")
            start = time.perf_counter()
            amprewrite.convert(model, tuple(args), example_kwargs=kwargs or None)
            seconds = time.perf_counter() - start
            times.append((seconds, arch.name, mode))
            print(f"{arch.name:14s} {mode:5s} {seconds:6.1f} s", flush=True)
    seconds, name, mode = max(times)
    print(f"slowest: {name} ({mode}) {seconds:.1f} s of {len(times)} conversions")


if __name__ == "__main__":
    main()
