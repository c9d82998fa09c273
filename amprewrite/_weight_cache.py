"""Weight casts: autograd-tracked in training, computed once in inference.

Every cast of a parameter or buffer in a converted graph is a call of
``WeightCastCache.cast`` (``_amp_weight_cache.cast(l_weight, torch.bfloat16)`` in
``gm.code``). When autograd needs the cast (grad mode on and the weight requires grad) it is a
plain ``weight.to(dtype)``, so gradients flow to the fp32 master weight. Otherwise
(``torch.no_grad``, ``torch.inference_mode``, frozen weights) the low-precision copy is made
once and reused until the weight changes: an in-place update bumps ``weight._version``; a
replaced tensor is a different object. A forward in inference therefore casts no weights.

The cache belongs to one GraphModule: it is released with it, and
``amprewrite.clear_weight_cache(gm)`` drops it on demand.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

__all__ = ["WeightCastCache", "CACHE_ATTR"]

CACHE_ATTR = "_amp_weight_cache"


class WeightCastCache:
    """Low-precision copies of weights, keyed by (tensor identity, dtype)."""

    def __init__(self) -> None:
        self._entries: dict[tuple[int, torch.dtype], tuple[weakref.ref, int, torch.Tensor]] = {}

    def cast(self, weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        if weight.dtype == dtype:
            return weight
        if weight.requires_grad and torch.is_grad_enabled():
            return weight.to(dtype)
        key = (id(weight), dtype)
        entry = self._entries.get(key)
        if entry is not None and entry[0]() is weight and entry[1] == weight._version:
            return entry[2]
        # NB: made outside inference mode, so that a later grad-mode forward through frozen
        # weights may save the copy for backward.
        with torch.inference_mode(False), torch.no_grad():
            copy = weight.detach().to(dtype)
        self._entries[key] = (weakref.ref(weight), weight._version, copy)
        return copy

    def clear(self) -> None:
        self._entries.clear()

    def __len__(self) -> int:
        return len(self._entries)

    def nbytes(self) -> int:
        return sum(c.numel() * c.element_size() for _, _, c in self._entries.values())

    # Copies of a module get an empty cache of their own, never shared tensors.
    def __deepcopy__(self, memo: dict) -> "WeightCastCache":
        return WeightCastCache()

    def __reduce__(self) -> Any:
        return (WeightCastCache, ())
