"""Measurement: exact cast counts with a dispatch mode (:mod:`amprewrite.cast_count`),
side-by-side timing, CUDA memory, and the run's time budget.

Cast counts do not depend on the machine's noise; times do, so variants are timed
interleaved in one process (each round runs every variant once, in a rotating order) and
compared by their medians. On CUDA every clock read follows ``torch.cuda.synchronize()``.
"""

from __future__ import annotations

import collections
import dataclasses
import gc
import statistics
import time
from typing import Any, Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from amprewrite.cast_count import CastCount, CastCounter, count_casts  # noqa: F401 (re-exported)

__all__ = ["Budget", "CastCount", "CastCounter", "OpCounter", "Samples", "count_casts",
           "count_ops", "describe_error", "interleaved_samples", "median", "paired_ratio",
           "recover", "step_memory_mb", "sync"]


class OpCounter(TorchDispatchMode):
    """Counts the ATen ops a run dispatches, by overload, below autocast and autograd (an op
    whose inputs autocast casts counts once, and each of those casts as an op of its own):
    ``calls`` so far, and ``ops[overload]``."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0
        self.ops: collections.Counter[Any] = collections.Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.calls += 1
        self.ops[func] += 1
        return func(*args, **(kwargs or {}))


def count_ops(fn: Callable[[], Any]) -> collections.Counter[Any]:
    """The ATen ops of one call of ``fn`` (overload -> calls), from an :class:`OpCounter`."""
    counter = OpCounter()
    with counter:
        fn()
    return counter.ops


def sync(device: str) -> None:
    """Wait for the device's queued kernels, so that a clock read after it sees them done."""
    if device == "cuda":
        torch.cuda.synchronize()


def describe_error(exc: BaseException, limit: int = 200) -> str:
    """One line for a table or a log: the exception's type and the start of its message."""
    text = str(exc).strip().splitlines()
    line = f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__
    return line if len(line) <= limit else line[:limit - 3] + "..."


def recover(device: str) -> None:
    """After a failed call: free what its frames held, so the next variant has the memory
    (a CUDA out-of-memory error leaves the caching allocator full)."""
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


@dataclasses.dataclass
class Samples:
    """Seconds per call of each function, one sample per completed round, and the functions
    that raised (name -> error), which were dropped from the rounds."""

    seconds: dict[str, list[float]]
    failed: dict[str, str]
    rounds: int


def _estimate(fn: Callable[[], Any], device: str, warmup: int) -> float:
    for _ in range(warmup):
        fn()
    sync(device)
    start = time.perf_counter()
    fn()
    sync(device)
    return max(time.perf_counter() - start, 1e-6)


def _sample(fn: Callable[[], Any], k: int, device: str) -> float:
    sync(device)
    start = time.perf_counter()
    for _ in range(k):
        fn()
    sync(device)
    return (time.perf_counter() - start) / k


def interleaved_samples(fns: dict[str, Callable[[], Any]], rounds: int, device: str,
                        deadline: float | None = None, min_rounds: int = 3,
                        min_sample_s: float = 0.004, warmup: int = 3) -> Samples:
    """Time each function side by side: one sample of every function per round.

    Samples of one round were taken within moments of each other, so on a machine whose load
    changes, ratios taken round by round (:func:`paired_ratio`) are steadier than ratios of
    whole-run medians. Each round runs the functions in a rotated order, so that none always
    runs right after the same neighbour.

    Each sample runs a function ``inner`` times back to back, with ``inner`` chosen so that
    a sample lasts at least ``min_sample_s`` (timer and scheduler noise swamp shorter ones).
    Rounds stop early once ``deadline`` (a ``time.perf_counter()`` value) has passed and
    ``min_rounds`` are done. A function that raises is reported in ``failed`` and the others
    go on without it.
    """
    failed: dict[str, str] = {}
    inner: dict[str, int] = {}
    for name, fn in fns.items():
        try:
            inner[name] = max(1, int(min_sample_s / _estimate(fn, device, warmup)))
        except Exception as exc:  # report it in the table; the other variants go on
            failed[name] = describe_error(exc)
            recover(device)
    names = list(inner)
    seconds: dict[str, list[float]] = {n: [] for n in names}
    done = 0
    gc_was_enabled = gc.isenabled()
    # A collection inside one sample would charge its pause to whichever variant ran then.
    gc.disable()
    try:
        for r in range(rounds if names else 0):
            if deadline is not None and done >= min_rounds and time.perf_counter() > deadline:
                break
            for name in names[r % len(names):] + names[:r % len(names)]:
                if name in failed:
                    continue
                try:
                    seconds[name].append(_sample(fns[name], inner[name], device))
                except Exception as exc:
                    failed[name] = describe_error(exc)
                    recover(device)
            done += 1
    finally:
        if gc_was_enabled:
            gc.enable()
    return Samples({n: s for n, s in seconds.items() if n not in failed}, failed, done)


def step_memory_mb(fn: Callable[[], Any], device: str) -> tuple[float, float] | None:
    """CUDA memory of one call of ``fn``: ``(peak, peak - held before the call)`` in MB
    (1e6 bytes) of tensors allocated through the caching allocator; None off CUDA."""
    if device != "cuda":
        return None
    sync(device)
    held = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    sync(device)
    peak = torch.cuda.max_memory_allocated()
    return peak / 1e6, (peak - held) / 1e6


def median(samples: list[float]) -> float:
    return statistics.median(samples)


def paired_ratio(reference: list[float], other: list[float]) -> float:
    """Median over rounds of ``reference / other`` (above 1: ``other`` is faster)."""
    return statistics.median(r / o for r, o in zip(reference, other))


class Budget:
    """A wall-clock budget for the whole run, shared out equally among the units of work
    (model shapes) left.

    ``start`` is a ``time.perf_counter()`` value taken when the process started, so that
    imports and set-up count too. Without ``total_s`` there is no limit.
    """

    def __init__(self, total_s: float | None, start: float, units: int) -> None:
        self.total_s = total_s
        self.start = start
        self.units_left = units
        # Kept free at the end for printing and writing the tables.
        self.reserve_s = 0.0 if total_s is None else max(2.0, 0.02 * total_s)

    def remaining(self) -> float:
        if self.total_s is None:
            return float("inf")
        return self.start + self.total_s - time.perf_counter()

    def exhausted(self) -> bool:
        return self.remaining() <= self.reserve_s

    def next_deadline(self) -> float | None:
        """The ``perf_counter`` time by which the next unit should end: now plus an equal
        share of the time left (None without a budget)."""
        if self.total_s is None:
            return None
        spare = max(self.remaining() - self.reserve_s, 0.0)
        return time.perf_counter() + spare / max(self.units_left, 1)
