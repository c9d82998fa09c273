"""How long a converted module's low-precision weight copies may be reused: the user's side.

An O1 module keeps low-precision copies of the weights it lowers where a call needs no
gradient for them. (O2's stored copies follow their masters' counters by their own rule,
:mod:`.low_copies`, inside this region or not.) By default every O1 call rewrites them from the
current weights (:mod:`.weight_cache`), because some writes change a weight without any sign a
cheap check of the weight can read: writes through ``p.data`` (EMA and weight-loading
code), FSDP2's in-place all-gather, fused optimizer steps (these a global step hook does see,
:mod:`.optimizer_steps`). :func:`cache_weights` is the caller's promise that
no such write happens inside its region, which lets the module reuse the copies while they
are provably current, saving the rewrite (about 1 µs per weight on a CPU: 10-13% of the
launch-bound benchmark forward, BENCHMARKS.md cpu-launch-copies).
:func:`clear_weight_cache` is the way out after a write the promise did not cover.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch.nn as nn

from .low_copies import LOW_COPIES_ATTR, LowPrecisionCopies
from .optimizer_steps import count_steps
from .weight_cache import CACHE_ATTR, WeightCastCache

__all__ = ["cache_weights", "clear_weight_cache"]


def _holders(module: nn.Module, caller: str) -> list[WeightCastCache | LowPrecisionCopies]:
    """The weight caches and O2 copy stores of ``module`` and its submodules."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"amprewrite.{caller} expects the nn.Module returned by "
                        f"amprewrite.convert, got {type(module).__name__}")
    found: list[WeightCastCache | LowPrecisionCopies] = []
    for sub in module.modules():
        for attr, kind in ((CACHE_ATTR, WeightCastCache), (LOW_COPIES_ATTR, LowPrecisionCopies)):
            holder = sub.__dict__.get(attr)
            if isinstance(holder, kind):
                found.append(holder)
    return found


@contextlib.contextmanager
def cache_weights(module: nn.Module) -> Iterator[None]:
    """Reuse a converted module's low-precision weight copies across calls inside this region.

    Outside it every call rewrites the copies from the current weights, so the module always
    computes with them. Inside it a copy is reused while its weight is the same tensor, with
    the same storage and version counter, and no ``torch.optim`` optimizer has started a step
    since the copy was made: replaced parameters, ``module.to(...)``, ``load_state_dict``,
    in-place updates (``p.mul_`` under ``no_grad``) and every optimizer step (fused ones
    included) are followed. Writes that move no version counter are not: ``p.data.copy_``,
    ``p.data.mul_`` (EMA written with ``.data``), FSDP2's all-gather. Call
    :func:`clear_weight_cache` after them, or leave them outside the region::

        with amprewrite.cache_weights(gm), torch.inference_mode():
            for batch in requests:
                serve(gm(batch))

    Regions nest; leaving the last one returns the module to rewriting its copies on every
    call. A module with no copies to keep (``opt_level`` O0 or O3) runs as before, and so does
    an O2 module, whose stored copies always follow this rule (but for the optimizer steps'
    rewrite of the copies of trained masters only).

    Raises:
        TypeError: ``module`` is not an ``nn.Module``.
    """
    # NB: O2's stored copies are left out: they are rewritten only when their masters were
    # written in a way a counter sees (:mod:`.low_copies`), inside this region or not.
    holders = [h for h in _holders(module, "cache_weights") if isinstance(h, WeightCastCache)]
    count_steps()
    for holder in holders:
        if holder.kept == 0:
            holder.steps = -1  # copies from before the region were not checked for steps
        holder.kept += 1
    try:
        yield
    finally:
        for holder in holders:
            holder.kept -= 1


def clear_weight_cache(module: nn.Module) -> int:
    """Drop the low-precision weight copies a converted module keeps (O1), and recompute
    the stored copies of an O2 module from its fp32 masters.

    The next call makes them again from the current weights. Use it to free the memory of O1
    copies, or inside :func:`cache_weights` after writing weights in a way it does not follow
    (``p.data.copy_(t)``). Returns the number of O1 copies dropped (0 for a module that holds
    none).

    Raises:
        TypeError: ``module`` is not an ``nn.Module``.
    """
    dropped = 0
    for holder in _holders(module, "clear_weight_cache"):
        if isinstance(holder, WeightCastCache):
            dropped += holder.clear()
        else:
            holder.refresh()
    return dropped
