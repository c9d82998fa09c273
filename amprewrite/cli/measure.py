"""The demo's side-by-side measurement: the converted model against ``torch.autocast`` on
the same input, in one process (forward time, peak memory of a training step, error against
fp32).

Speed is stated with its certainty: forwards are timed in rounds that interleave the two (so
that a busy moment of the machine slows both), and the verdict is the median round's ratio
with the spread of the rounds (:func:`amprewrite.summary.speed_spread`), or "too noisy to
tell" when the rounds disagree.
"""

from __future__ import annotations

import copy
import statistics
import time
from typing import Any, Callable

import torch
import torch.nn as nn

from ..summary import speed_sentence, speed_spread, speed_words

__all__ = ["side_by_side", "error_vs_fp32", "measurement_lines", "speed_words"]

_MIN_ROUNDS, _MAX_ROUNDS, _BUDGET_S = 5, 12, 1.2
"""Rounds: at least 5 (a spread needs several), then more until 1.2 s are spent, at most 12:
the demo stays a few seconds long on a small machine."""
_MAX_CALLS = 50
"""Calls of each model per round, at most (tiny models are called this often)."""


def _forward_rounds(fns: dict[str, Callable[[], Any]], sync: Callable[[], Any] = lambda: None,
                    budget_s: float = _BUDGET_S) -> list[tuple[float, float]]:
    """``(converted ms, autocast ms)`` per round: a round calls both in turn (which goes
    first alternates between rounds) for about ``budget_s / _MAX_ROUNDS`` seconds, at least
    once each, and each side's round time is its fastest call. NB: the fastest call, because
    on a shared machine other jobs only ever add time; the rounds, each timing both, show how
    far that holds. Time-boxed per round, so a machine that slows down mid-way stretches
    the whole to at most ``_MIN_ROUNDS`` calls of each past the budget."""
    def timed(fn: Callable[[], Any]) -> float:
        begin = time.perf_counter()
        fn()
        sync()
        return time.perf_counter() - begin

    for _ in range(2):  # warm up: first calls fill caches and pick kernels
        timed(fns["converted"]), timed(fns["autocast"])
    share = budget_s / _MAX_ROUNDS
    rounds: list[tuple[float, float]] = []
    start = time.perf_counter()
    while len(rounds) < _MIN_ROUNDS or (len(rounds) < _MAX_ROUNDS
                                        and time.perf_counter() - start < budget_s):
        order = ("converted", "autocast") if len(rounds) % 2 == 0 else \
            ("autocast", "converted")
        best = {"converted": float("inf"), "autocast": float("inf")}
        begin, calls = time.perf_counter(), 0
        while calls == 0 or (calls < _MAX_CALLS and time.perf_counter() - begin < share):
            for name in order:
                best[name] = min(best[name], timed(fns[name]))
            calls += 1
        rounds.append((best["converted"] * 1e3, best["autocast"] * 1e3))
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
    tables), peak bytes of one training step (:func:`amprewrite.compare_memory`'s
    accounting) and error vs fp32, for both."""
    from ..training.memory import compare_memory, memory_report

    device = next((p.device.type for p in model.parameters()), "cpu")
    # Asynchronous devices return before the kernels ran: wait for them inside each timing.
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)

    def autocast_forward() -> Any:
        with torch.autocast(device, dtype=dtype):
            return model(*inputs)

    rounds = _forward_rounds({"converted": call, "autocast": autocast_forward}, sync)
    ours = memory_report(gm, inputs, loss_fn=loss_fn).total
    theirs = compare_memory(copy.deepcopy(model), inputs, ("autocast",), dtype=dtype,
                            optimizer_factory=None, loss_fn=loss_fn)["autocast"].total
    return {"forward_ms": {"converted": statistics.median(c for c, _ in rounds),
                           "autocast": statistics.median(a for _, a in rounds)},
            "forward_rounds": [list(r) for r in rounds],
            "speed": speed_spread(rounds).ratio, "rounds": len(rounds),
            "step_bytes": {"converted": ours, "autocast": theirs},
            "max_abs_error": error_vs_fp32(model, inputs, call, dtype)}


def measurement_lines(m: dict[str, Any]) -> list[str]:
    """The demo's lines: speed with its spread (:func:`amprewrite.summary.speed_sentence`),
    training-step memory and error, against ``torch.autocast``."""
    t, b, e = m["forward_ms"], m["step_bytes"], m["max_abs_error"]
    kib = {k: v / 1024 for k, v in b.items()}
    rounds = m["forward_rounds"]
    return [f"vs torch.autocast, same input: forward {t['converted']:.2f} ms vs "
            f"{t['autocast']:.2f} ms (medians of {len(rounds)} interleaved rounds): "
            f"{speed_sentence(speed_spread(rounds))}; training step "
            f"{kib['converted']:.0f} KiB vs {kib['autocast']:.0f} KiB "
            f"({b['converted'] / b['autocast']:.2f}x)",
            f"max |logits - fp32 logits|: {e['converted']:.3g} (torch.autocast "
            f"{e['autocast']:.3g})"]
