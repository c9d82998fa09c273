"""Measurement: exact cast counts with a dispatch mode, and side-by-side timing.

Cast counts do not depend on the machine's noise; times do, so variants are timed
interleaved in one process (each round runs every variant once, in a rotating order) and
compared by their medians.
"""

from __future__ import annotations

import dataclasses
import gc
import statistics
import time
from typing import Any, Callable, Iterable

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["CastCount", "CastCounter", "count_casts", "interleaved_samples", "median",
           "paired_ratio"]

_aten = torch.ops.aten


@dataclasses.dataclass
class CastCount:
    """Cast kernels seen in one run; ``nbytes`` is bytes read plus bytes written."""

    kernels: int = 0
    weight_kernels: int = 0
    nbytes: int = 0


class CastCounter(TorchDispatchMode):
    """Counts dtype-converting kernels (``_to_copy``, ``copy_`` across dtypes) at the ATen
    level, below autocast and autograd, so that every variant is counted the same way.

    A cast whose source shares storage with one of ``weights`` counts as a weight cast.
    """

    def __init__(self, weights: Iterable[torch.Tensor]) -> None:
        super().__init__()
        self.weight_storages = {w.untyped_storage().data_ptr() for w in weights}
        self.count = CastCount()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        src = dst = None
        if func in (_aten._to_copy.default, _aten.to.dtype, _aten.to.dtype_layout):
            src, dst = args[0], out
        elif func is _aten.copy_.default:
            src, dst = args[1], args[0]
        if isinstance(src, torch.Tensor) and isinstance(dst, torch.Tensor) and \
                src.dtype != dst.dtype:
            self.count.kernels += 1
            self.count.nbytes += src.numel() * src.element_size() + \
                dst.numel() * dst.element_size()
            if src.untyped_storage().data_ptr() in self.weight_storages:
                self.count.weight_kernels += 1
        return out


def count_casts(fn: Callable[[], Any], weights: Iterable[torch.Tensor]) -> CastCount:
    """Run ``fn`` once under a :class:`CastCounter` and return what it counted."""
    counter = CastCounter(weights)
    with counter:
        fn()
    return counter.count


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def interleaved_samples(fns: dict[str, Callable[[], Any]], rounds: int, device: str,
                        min_sample_s: float = 0.004, warmup: int = 3
                        ) -> dict[str, list[float]]:
    """Seconds per call of each function, one sample per round, timed side by side.

    Samples of one round were taken within moments of each other, so on a machine whose load
    changes, ratios taken round by round (:func:`paired_ratio`) are steadier than ratios of
    whole-run medians.

    Each sample runs a function ``inner`` times back to back, with ``inner`` chosen so that
    a sample lasts at least ``min_sample_s`` (timer and scheduler noise swamp shorter ones).
    """
    names = list(fns)
    estimate = {}
    for name in names:
        for _ in range(warmup):
            fns[name]()
        _sync(device)
        start = time.perf_counter()
        fns[name]()
        _sync(device)
        estimate[name] = max(time.perf_counter() - start, 1e-6)
    inner = {n: max(1, int(min_sample_s / estimate[n])) for n in names}
    samples: dict[str, list[float]] = {n: [] for n in names}
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        for r in range(rounds):
            order = names[r % len(names):] + names[:r % len(names)]
            for name in order:
                fn, k = fns[name], inner[name]
                _sync(device)
                start = time.perf_counter()
                for _ in range(k):
                    fn()
                _sync(device)
                samples[name].append((time.perf_counter() - start) / k)
    finally:
        if gc_was_enabled:
            gc.enable()
    return samples


def median(samples: list[float]) -> float:
    return statistics.median(samples)


def paired_ratio(reference: list[float], other: list[float]) -> float:
    """Median over rounds of ``reference / other`` (above 1: ``other`` is faster)."""
    return statistics.median(r / o for r, o in zip(reference, other))
