"""The demo's side-by-side measurement: the converted model against ``torch.autocast`` on
the same input, in one process (forward time, peak memory of a training step, error against
fp32)."""

from __future__ import annotations

import copy
import statistics
import time
from typing import Any, Callable

import torch
import torch.nn as nn

__all__ = ["side_by_side", "error_vs_fp32", "measurement_lines"]

_ROUNDS = 7


def _forward_ms(fns: dict[str, Callable[[], Any]]) -> dict[str, float]:
    """Median forward time of each function, timed interleaved (one round runs each once)."""
    samples: dict[str, list[float]] = {k: [] for k in fns}
    for fn in fns.values():
        fn()  # warm up
    for _ in range(_ROUNDS):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            samples[name].append((time.perf_counter() - start) * 1e3)
    return {k: statistics.median(v) for k, v in samples.items()}


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
    """Forward time (ms, median of interleaved runs), peak bytes of one training step
    (:func:`amprewrite.compare_memory`'s accounting) and error vs fp32, for both."""
    from ..training.memory import compare_memory, memory_report

    device = next((p.device.type for p in model.parameters()), "cpu")

    def autocast_forward() -> Any:
        with torch.autocast(device, dtype=dtype):
            return model(*inputs)

    times = _forward_ms({"converted": call, "autocast": autocast_forward})
    ours = memory_report(gm, inputs, loss_fn=loss_fn).total
    theirs = compare_memory(copy.deepcopy(model), inputs, ("autocast",), dtype=dtype,
                            optimizer_factory=None, loss_fn=loss_fn)["autocast"].total
    return {"forward_ms": times, "step_bytes": {"converted": ours, "autocast": theirs},
            "max_abs_error": error_vs_fp32(model, inputs, call, dtype)}


def measurement_lines(m: dict[str, Any]) -> list[str]:
    t, b, e = m["forward_ms"], m["step_bytes"], m["max_abs_error"]
    kib = {k: v / 1024 for k, v in b.items()}
    return [f"vs torch.autocast, same input: forward {t['converted']:.2f} ms vs "
            f"{t['autocast']:.2f} ms ({t['converted'] / t['autocast']:.2f}x); training step "
            f"{kib['converted']:.0f} KiB vs {kib['autocast']:.0f} KiB "
            f"({b['converted'] / b['autocast']:.2f}x)",
            f"max |logits - fp32 logits|: {e['converted']:.3g} (torch.autocast "
            f"{e['autocast']:.3g})"]
