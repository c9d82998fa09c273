"""The demo's side-by-side measurement: the converted model against ``torch.autocast`` on
the same input, in one process (forward time, memory of a training step, error against
fp32).

Speed is stated with its certainty: forwards are timed in rounds that interleave the two (so
that a busy moment of the machine slows both), and the verdict is the median round's ratio
with the spread of the rounds (:func:`amprewrite.summary.speed_spread`), or "too noisy to
tell" when the rounds disagree, or "the machine is too busy to tell" when a round ran
several times slower than the rest.

On a device without fast kernels for the low dtype (a CPU without avx512_bf16 or AMX:
:func:`amprewrite.hardware.slow_reason`), the rounds time the fp32 model too, and a line
says that fp32 is the one to keep there: both mixed-precision forwards run emulated matmuls,
and comparing them with each other alone would hide that (the demo's Llama: 24.5 ms in
fp32, 227 ms converted, on an AVX2 CPU).
"""

from __future__ import annotations

import copy
import statistics
import time
from typing import Any, Callable

import torch
import torch.nn as nn

from ..hardware import describe, slow_reason
from ..summary import (BUSY, BUSY_FACTOR, short_dtype, speed_sentence, speed_spread,
                       speed_words)

__all__ = ["side_by_side", "error_vs_fp32", "measurement_lines", "speed_words"]

_MIN_ROUNDS, _MAX_ROUNDS, _BUDGET_S = 5, 12, 1.2
"""Rounds: at least 5 (a spread needs several), then more until 1.2 s are spent, at most 12:
the demo stays a few seconds long on a small machine."""
_MAX_CALLS = 50
"""Calls of each model per round, at most (tiny models are called this often)."""


def _forward_rounds(fns: dict[str, Callable[[], Any]], sync: Callable[[], Any] = lambda: None,
                    budget_s: float = _BUDGET_S) -> list[tuple[float, ...]]:
    """Per round, the ms of each of ``fns`` in their order (``(converted ms, autocast ms)``,
    then fp32's where timed): a round calls each in turn (the order reverses between rounds)
    for about ``budget_s / _MAX_ROUNDS`` seconds, at least once each, and each one's round
    time is its fastest call. NB: the fastest call, because on a shared machine other jobs
    only ever add time; the rounds, each timing all, show how far that holds. Time-boxed per
    round, so a machine that slows down mid-way stretches the whole to at most
    ``_MIN_ROUNDS`` calls of each past the budget."""
    def timed(fn: Callable[[], Any]) -> float:
        begin = time.perf_counter()
        fn()
        sync()
        return time.perf_counter() - begin

    names = tuple(fns)
    for _ in range(2):  # warm up: first calls fill caches and pick kernels
        for name in names:
            timed(fns[name])
    share = budget_s / _MAX_ROUNDS
    rounds: list[tuple[float, ...]] = []
    start = time.perf_counter()
    while len(rounds) < _MIN_ROUNDS or (len(rounds) < _MAX_ROUNDS
                                        and time.perf_counter() - start < budget_s):
        order = names if len(rounds) % 2 == 0 else names[::-1]
        best = dict.fromkeys(names, float("inf"))
        begin, calls = time.perf_counter(), 0
        while calls == 0 or (calls < _MAX_CALLS and time.perf_counter() - begin < share):
            for name in order:
                best[name] = min(best[name], timed(fns[name]))
            calls += 1
        rounds.append(tuple(best[name] * 1e3 for name in names))
    return rounds


def error_vs_fp32(model: nn.Module, inputs: tuple, call: Callable[[], Any],
                  dtype: torch.dtype) -> dict[str, float]:
    """Largest |output - fp32 output| of the converted model and of ``torch.autocast``."""
    with torch.no_grad():
        fp32 = model(*inputs)
        with torch.autocast(fp32.device.type, dtype=dtype):
            autocast = model(*inputs)
        ours = call()
    return {"converted": (ours.float() - fp32).abs().max().item(),
            "autocast": (autocast.float() - fp32).abs().max().item()}


def side_by_side(model: nn.Module, gm: nn.Module, inputs: tuple, call: Callable[[], Any],
                 loss_fn: Callable[[Any], torch.Tensor], dtype: torch.dtype) -> dict[str, Any]:
    """Forward time against ``torch.autocast`` over interleaved rounds (``forward_rounds``:
    ``[converted ms, autocast ms]`` per round; ``forward_ms``: the median of each; ``speed``:
    the median round's ratio, autocast's time over ours, above 1 = faster, as in the README's
    tables), bytes one training step holds (:func:`amprewrite.compare_memory`'s accounting)
    and error vs fp32, for both. Where ``dtype`` has no fast kernels on the model's device,
    the rounds time the fp32 model as well (``forward_ms["fp32"]``), and ``slow_low_dtype``
    names the device and the dtype (:func:`amprewrite.hardware.slow_reason` decides)."""
    from ..training.memory import compare_memory, memory_report

    device = next((p.device.type for p in model.parameters()), "cpu")
    # Asynchronous devices return before the kernels ran: wait for them inside each timing.
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)

    def autocast_forward() -> Any:
        with torch.autocast(device, dtype=dtype):
            return model(*inputs)

    fns = {"converted": call, "autocast": autocast_forward}
    slow = None
    if slow_reason(device, dtype) is not None:
        fns["fp32"] = lambda: model(*inputs)
        slow = {"hardware": describe(device), "low_dtype": short_dtype(dtype)}
    rounds = _forward_rounds(fns, sync)
    pairs = [(r[0], r[1]) for r in rounds]
    ours = memory_report(gm, inputs, loss_fn=loss_fn).total
    theirs = compare_memory(copy.deepcopy(model), inputs, ("autocast",), dtype=dtype,
                            optimizer_factory=None, loss_fn=loss_fn)["autocast"].total
    return {"forward_ms": {name: statistics.median(r[i] for r in rounds)
                           for i, name in enumerate(fns)},
            "forward_rounds": [list(r) for r in pairs],
            "speed": speed_spread(pairs).ratio, "rounds": len(rounds),
            "step_bytes": {"converted": ours, "autocast": theirs},
            "max_abs_error": error_vs_fp32(model, inputs, call, dtype),
            **({"slow_low_dtype": slow, "fp32_rounds": [r[2] for r in rounds]}
               if slow is not None else {})}


def measurement_lines(m: dict[str, Any]) -> list[str]:
    """The demo's lines: speed with its spread (:func:`amprewrite.summary.speed_sentence`),
    then fp32's time where the low dtype has no fast kernels here (:func:`fp32_line`), the
    memory of a training step and the error, against ``torch.autocast``."""
    t, b, e = m["forward_ms"], m["step_bytes"], m["max_abs_error"]
    rounds = [(r[0], r[1]) for r in m["forward_rounds"]]
    spread = speed_spread(rounds)
    lines = [f"vs torch.autocast, same input: forward {t['converted']:.2f} ms vs "
             f"{t['autocast']:.2f} ms (medians of {len(rounds)} interleaved rounds): "
             f"{speed_sentence(spread)}"]
    if "fp32" in t:
        fp32 = m.get("fp32_rounds") or [t["fp32"]]
        busy = spread.busy or max(fp32) > BUSY_FACTOR * statistics.median(fp32)
        lines.append(fp32_line(t, m.get("slow_low_dtype"), busy))
    lines += [f"memory of one training step (weights, gradients, saved activations): "
              f"{_kib(b['converted'])} vs {_kib(b['autocast'])} with torch.autocast "
              f"({b['converted'] / b['autocast']:.2f}x)",
              f"max |logits - fp32 logits|: {e['converted']:.3g} (torch.autocast "
              f"{e['autocast']:.3g})"]
    return lines


def fp32_line(forward_ms: dict[str, float], slow: dict[str, str] | None,
              busy: bool = False) -> str:
    """One plain line: the fp32 model's forward beside the two mixed-precision ones, and
    which to keep on this machine (``slow``: ``side_by_side``'s ``slow_low_dtype``); no
    advice when the rounds say the machine is too busy to time (``busy``)."""
    fp32, ours, theirs = forward_ms["fp32"], forward_ms["converted"], forward_ms["autocast"]
    times = (f"fp32 forward {fp32:.2f} ms, converted {ours:.2f} ms, torch.autocast "
             f"{theirs:.2f} ms")
    low, hardware = (slow or {}).get("low_dtype", "the low dtype"), \
        (slow or {}).get("hardware", "this device")
    if busy:
        return (f"{times}: {hardware} has no fast {low} kernels, but {BUSY} which is "
                "faster here")
    if min(ours, theirs) <= fp32:
        return f"{times}: {low} is not slower than fp32 here, despite no fast {low} kernels"
    return (f"{times}: {hardware} has no fast {low} kernels, so fp32 runs "
            f"{min(ours, theirs) / fp32:.1f}x faster here; keep the model in fp32 on this "
            "machine (opt_level='O0')")


def _kib(n: float) -> str:
    return f"{n / 1024:,.0f} KiB" if n < 1 << 30 else f"{n / (1 << 30):.2f} GiB"
