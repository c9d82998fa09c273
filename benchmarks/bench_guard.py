"""The per-call check of a converted module (:meth:`amprewrite.module.cache.GraphCache.holds`):
its cost against the converted forward it guards, in µs, one torch thread.

For each model: the check alone (``guard.holds(gm)``: the mode, the registration stamp and
every attribute, submodule table and config the capture read), the capture lock each call
takes as a reader (:mod:`amprewrite.module.isolation`), the whole converted forward in
inference (``no_grad``, check and lock included), and their share of it. Models: the launch-bound
model (50 blocks ``x + Linear(LayerNorm(x))`` of width 8 at batch 2, where a forward is all
host overhead) and a tiny HF Llama of 24 layers (hidden size 16, about 320 submodules), both
converted with the autocast preset through the export capture.

    python benchmarks/bench_guard.py [--number 2000] [--repeat 7]
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import timeit
import warnings
from typing import Any, Callable

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from _models import LaunchBound  # noqa: E402
from _speed_report import machine  # noqa: E402

import amprewrite  # noqa: E402
from amprewrite.module.isolation import CAPTURE_LOCK  # noqa: E402
from amprewrite.module.cache import cache_of  # noqa: E402


def _read_lock() -> None:
    CAPTURE_LOCK.acquire_read()
    CAPTURE_LOCK.release_read()


def _llama() -> tuple[torch.nn.Module, tuple]:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32,
                         num_hidden_layers=24, num_attention_heads=2, num_key_value_heads=2,
                         use_cache=False)
    torch.manual_seed(0)
    return LlamaForCausalLM(config).eval(), (torch.randint(0, 64, (1, 8)),)


def _launch() -> tuple[torch.nn.Module, tuple]:
    return LaunchBound().eval(), (torch.randn(2, 8),)


MODELS: dict[str, Callable[[], tuple[torch.nn.Module, tuple]]] = {
    "Launch-bound 50x(LN+Linear) d8": _launch, "HF Llama 24 layers d16": _llama}


def _us(fn: Callable[[], Any], number: int, repeat: int) -> float:
    return min(timeit.repeat(fn, number=number, repeat=repeat)) / number * 1e6


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--number", type=int, default=2000)
    parser.add_argument("--repeat", type=int, default=7)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    print(machine("cpu"))
    print(f"torch {torch.__version__}, CPU capability {torch.backends.cpu.get_cpu_capability()}")
    print()
    print("| model | submodules | items checked | check µs | lock µs | forward µs "
          "| check / forward | lock / forward |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    policy = amprewrite.Policy.autocast("cpu", torch.bfloat16)
    for name, build in MODELS.items():
        model, inputs = build()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            gm = amprewrite.convert(model, inputs, policy=policy)
        guard = cache_of(gm)
        assert guard.holds(gm), "the check must hold right after conversion"
        with torch.no_grad():
            gm(*inputs)
            check = _us(lambda: guard.holds(gm), args.number, args.repeat)
            lock = _us(_read_lock, args.number, args.repeat)
            forward = _us(lambda: gm(*inputs), max(args.number // 20, 20), args.repeat)
        modules = sum(1 for _ in model.modules())
        print(f"| {name} | {modules} | {guard.snapshot.size} | {check:.2f} | {lock:.2f} | "
              f"{forward:.1f} | {check / forward:.1%} | {lock / forward:.1%} |")


if __name__ == "__main__":
    main()
