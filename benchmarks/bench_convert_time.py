"""Conversion time of every zoo model against a static ``torch.export`` of the same model.

    python benchmarks/bench_convert_time.py [--zoo hf|vision|all] [--only llama,tv_swin]
                                            [--repeat 2]

For each model and mode (eval, train), side by side in one process: the seconds of a plain
static ``torch.export.export(model, args, kwargs, strict=False)`` (fp32, the example's
shapes), then of ``amprewrite.convert`` with the default policy, and their ratio. Models of
the HuggingFace zoo and vision models of torchvision and timm (skipped where those libraries
are missing; the ecosystem zoo of ``tests/models`` when it is there, else the models below
that were slowest to convert).
Prints torch's version, this CPU's capability and the slowest conversion by seconds and by
ratio: conversion time is part of the supported range's promise (at most 10 s and at most
3x a static export, on every zoo model, on every supported torch).
"""

from __future__ import annotations

import argparse
import importlib.util
import pathlib
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

Case = tuple[str, Callable[[], nn.Module], Callable[[], tuple[tuple, dict]]]
"""A model's name, a builder (fresh model, eval mode) and its example ``(args, kwargs)``."""


def _hf_cases() -> Iterator[Case]:
    if importlib.util.find_spec("transformers") is None:
        return
    from _hf_zoo import ZOO

    for arch in ZOO:
        yield arch.name, arch.build, lambda arch=arch: arch.example()


def _images(size: int) -> Callable[[], tuple[tuple, dict]]:
    return lambda: ((torch.randn(2, 3, size, size, generator=torch.Generator().manual_seed(0)),),
                    {})


def _tv_swin() -> nn.Module:
    from torchvision.models.swin_transformer import SwinTransformer

    return SwinTransformer(patch_size=[2, 2], embed_dim=16, depths=[1, 1], num_heads=[2, 2],
                           window_size=[4, 4], stochastic_depth_prob=0.0, num_classes=4)


def _tv_googlenet() -> nn.Module:
    from torchvision.models.googlenet import GoogLeNet

    return GoogLeNet(num_classes=4, aux_logits=False, init_weights=True, dropout=0.0)


def _tv_lraspp() -> nn.Module:
    import torchvision

    return torchvision.models.segmentation.lraspp_mobilenet_v3_large(
        weights=None, weights_backbone=None, num_classes=4)


def _timm_sequencer2d() -> nn.Module:
    from timm.models.sequencer import Sequencer2d

    return Sequencer2d(num_classes=4, img_size=32, layers=(1, 1), patch_sizes=(4, 2),
                       embed_dims=(16, 32), hidden_sizes=(8, 16), mlp_ratios=(2.0, 2.0))


def _timm_ghostnetv2() -> nn.Module:
    from timm.models.ghostnet import _create_ghostnet

    return _create_ghostnet("ghostnetv2_100", width=0.25, version="v2", drop_rate=0.0,
                            num_classes=4)


def _timm_efficientformerv2() -> nn.Module:
    from timm.models.efficientformer_v2 import EfficientFormerV2

    return EfficientFormerV2(depths=(1, 1, 1, 1), embed_dims=(8, 16, 24, 32), num_vit=1,
                             mlp_ratios=2, distillation=False, img_size=64, num_classes=4)


# The vision models that were slowest to convert (torch.export with every dimension dynamic),
# in the ecosystem zoo's configurations; used where that zoo is not in tests/models.
_VISION: tuple[tuple[str, str, Callable[[], nn.Module], int], ...] = (
    ("tv_swin", "torchvision", _tv_swin, 32),
    ("tv_googlenet", "torchvision", _tv_googlenet, 32),
    ("tv_lraspp", "torchvision", _tv_lraspp, 64),
    ("timm_sequencer2d", "timm", _timm_sequencer2d, 32),
    ("timm_ghostnetv2", "timm", _timm_ghostnetv2, 64),
    ("timm_efficientformerv2", "timm", _timm_efficientformerv2, 64),
)


def _vision_cases() -> Iterator[Case]:
    try:
        from _ecosystem_zoo import ZOO as ECOSYSTEM  # type: ignore[import-not-found]
    except ImportError:
        ECOSYSTEM = None
    if ECOSYSTEM is not None:
        for entry in ECOSYSTEM:
            if importlib.util.find_spec(entry.library) is not None:
                yield entry.name, entry.build, entry.example
        return
    for name, library, build, size in _VISION:
        if importlib.util.find_spec(library) is not None:
            yield name, build, _images(size)


def _seconds(fn: Callable[[], Any], repeat: int) -> float:
    """The best of ``repeat`` runs: on a shared machine other jobs only add time."""
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--zoo", choices=("hf", "vision", "all"), default="all")
    parser.add_argument("--only", default="", help="comma-separated model names")
    parser.add_argument("--repeat", type=int, default=1,
                        help="best of this many runs of each export and conversion")
    options = parser.parse_args()
    names = {n for n in options.only.split(",") if n}
    warnings.simplefilter("ignore")
    print(f"torch {torch.__version__}, cpu: {torch.backends.cpu.get_cpu_capability()}, "
          f"threads: {torch.get_num_threads()}")
    cases = [*(_hf_cases() if options.zoo != "vision" else ()),
             *(_vision_cases() if options.zoo != "hf" else ())]
    rows = []
    for name, build, example in cases:
        if names and name not in names:
            continue
        torch.manual_seed(0)
        model = build().eval()
        args, kwargs = example()
        for mode in ("eval", "train"):
            model.train(mode == "train")
            # NB: a plain export can fail where convert does not: OPT's LayerDrop in train
            # mode on torch 2.11 (a random draw export cannot decide; convert decides it)
            try:
                static = _seconds(lambda: torch.export.export(
                    model, tuple(args), kwargs or None, strict=False), options.repeat)
            except Exception:
                static = float("nan")
            seconds = _seconds(lambda: amprewrite.convert(model, tuple(args),
                                                          example_kwargs=kwargs or None),
                               options.repeat)
            rows.append((seconds, seconds / static if static == static else 0.0, name, mode))
            print(f"{name:24s} {mode:5s} {seconds:6.1f} s  static export {static:5.1f} s  "
                  f"{seconds / static:4.1f}x", flush=True)
    if rows:
        by_time, by_ratio = max(rows), max(rows, key=lambda r: r[1])
        print(f"slowest: {by_time[2]} ({by_time[3]}) {by_time[0]:.1f} s; highest ratio: "
              f"{by_ratio[2]} ({by_ratio[3]}) {by_ratio[1]:.1f}x; {len(rows)} conversions")


if __name__ == "__main__":
    main()
