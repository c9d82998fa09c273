"""The demo's side-by-side measurement: the converted model against ``torch.autocast`` on
the same input, in one process (forward time, peak memory of a training step, error against
fp32)."""

from __future__ import annotations

import copy
import time
from typing import Any, Callable

import torch
import torch.nn as nn

from ..htmlreport.overview import speed_verdict

__all__ = ["side_by_side", "error_vs_fp32", "measurement_lines", "speed_words"]

_MIN_ROUNDS, _MAX_ROUNDS, _BUDGET_S = 20, 200, 1.0
"""Interleaved rounds: at least 20, then more until a second is spent (at most 200)."""


def _forward_ms(fns: dict[str, Callable[[], Any]]) -> tuple[dict[str, float], int]:
    """The best forward time (ms) of the converted model and of ``torch.autocast``, over
    interleaved rounds (each runs both, the order alternating), and the number of rounds.
    NB: the best of many runs, not the median: on a shared machine other jobs only ever add
    time, so the fastest run is the steadiest estimate of each, and rounds that interleave
    them expose both to the same load."""
    converted, autocast = fns["converted"], fns["autocast"]
    converted(), autocast()  # warm up
    best = {"converted": float("inf"), "autocast": float("inf")}
    start = time.perf_counter()
    rounds = 0
    while rounds < _MIN_ROUNDS or (rounds < _MAX_ROUNDS
                                   and time.perf_counter() - start < _BUDGET_S):
        for name in (("converted", "autocast") if rounds % 2 == 0 else
                     ("autocast", "converted")):
            begin = time.perf_counter()
            fns[name]()
            best[name] = min(best[name], (time.perf_counter() - begin) * 1e3)
        rounds += 1
    return best, rounds


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
    """Forward time (ms, best of interleaved runs) and speed (autocast's time over the
    converted one's: above 1 = faster, as in the README's tables), peak bytes of one training step
    (:func:`amprewrite.compare_memory`'s accounting) and error vs fp32, for both."""
    from ..training.memory import compare_memory, memory_report

    device = next((p.device.type for p in model.parameters()), "cpu")

    def autocast_forward() -> Any:
        with torch.autocast(device, dtype=dtype):
            return model(*inputs)

    times, rounds = _forward_ms({"converted": call, "autocast": autocast_forward})
    ours = memory_report(gm, inputs, loss_fn=loss_fn).total
    theirs = compare_memory(copy.deepcopy(model), inputs, ("autocast",), dtype=dtype,
                            optimizer_factory=None, loss_fn=loss_fn)["autocast"].total
    return {"forward_ms": times, "speed": times["autocast"] / times["converted"],
            "rounds": rounds,
            "step_bytes": {"converted": ours, "autocast": theirs},
            "max_abs_error": error_vs_fp32(model, inputs, call, dtype)}


def measurement_lines(m: dict[str, Any]) -> list[str]:
    t, b, e = m["forward_ms"], m["step_bytes"], m["max_abs_error"]
    kib = {k: v / 1024 for k, v in b.items()}
    return [f"vs torch.autocast, same input: forward {t['converted']:.2f} ms vs "
            f"{t['autocast']:.2f} ms (best of {m['rounds']} interleaved rounds): "
            f"{speed_words(m['speed'])}; training step {kib['converted']:.0f} KiB vs "
            f"{kib['autocast']:.0f} KiB ({b['converted'] / b['autocast']:.2f}x)",
            f"max |logits - fp32 logits|: {e['converted']:.3g} (torch.autocast "
            f"{e['autocast']:.3g})"]


def speed_words(speed: float) -> str:
    """``"1.52x torch.autocast's speed, faster"`` / ``"1.02x, as fast as torch.autocast"``: a
    speed ratio (above 1 = faster) in words, judged as the HTML report judges it
    (:func:`amprewrite.htmlreport.overview.speed_verdict`)."""
    verdict = speed_verdict(speed)
    if verdict == "as fast":
        return f"{speed:.2f}x, as fast as torch.autocast"
    return f"{speed:.2f}x torch.autocast's speed, {verdict}"
