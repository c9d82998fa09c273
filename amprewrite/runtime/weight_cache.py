"""Weight casts: autograd-tracked in training, computed once in inference.

Every cast of a parameter or buffer in a converted graph is a call of
``WeightCastCache.cast`` where the weight is used (``_amp_weight_cache.cast(l_weight,
torch.bfloat16)`` in the graph). When autograd needs the cast (grad mode on and the weight
requires grad) it is a plain cast (``weight.bfloat16()``: ``weight.to(dtype)`` without
parsing its overloads), so gradients flow to the fp32 master weight. Otherwise
(``torch.no_grad``, ``torch.inference_mode``, frozen weights) the low-precision copy is made
once and reused until the weight changes, then refreshed:

* an in-place update (optimizer step, ``load_state_dict``, ``p.copy_`` under ``no_grad``)
  bumps ``weight._version``;
* a replaced tensor (``module.weight = nn.Parameter(...)``) is a different object;
* new storage behind the same object (``p.data = t``, ``module.to(...)``) has another
  ``data_ptr()``.

A forward in inference therefore casts no weights. The cache lookups of all the weights of a
forward are made together, by its weight read (:meth:`WeightCastCache.lookup_many`, called by
:mod:`.weight_table`), which hands each cast the copy it would return: ``cast`` of a weight
already in ``dtype`` returns it. The generated code therefore calls a cast of a weight read that
way as the dtype's method (``l_weight.bfloat16()``, :mod:`amprewrite.graph.codegen`), which
does the same: returns the handed copy, or casts with autograd. In inference the lookup also
keeps what it handed over; the next one, for the same unchanged weights, hands the same
copies after three list comparisons instead of a check per weight (:class:`_Handed`: 87
against 55 µs for the 100 weights of the launch-bound benchmark model).

NB: ``p.data.copy_(t)`` writes through a tensor whose version counter is not ``p``'s, so no
check short of reading the values can see it (torch.autocast's cache has the same blind spot).
Call :func:`clear_weight_cache` after such writes.

The cache belongs to one GraphModule: it is released with it, a copy of the module
(``copy.deepcopy``, pickling) starts with an empty one, and :func:`clear_weight_cache` drops
it on demand.
"""

from __future__ import annotations

import weakref
from typing import Any, NamedTuple

import torch
import torch.nn as nn
from torch.fx.experimental.proxy_tensor import get_proxy_mode

from .functions import cast_to

__all__ = ["WeightCastCache", "CACHE_ATTR", "clear_weight_cache"]

CACHE_ATTR = "_amp_weight_cache"


class _Entry(NamedTuple):
    weight: weakref.ref
    version: int
    data_ptr: int
    copy: torch.Tensor


def _tracing(weight: torch.Tensor) -> bool:
    """Whether ``weight`` is seen by a tracer or compiler rather than run eagerly.

    A cached copy made while tracing would be a fake or proxy tensor stored past the trace,
    and a compiler should see the plain cast (it can hoist or fold it itself). NB: a copy
    cached by an earlier eager forward is served to a tracer as a constant.
    """
    if isinstance(weight, torch._subclasses.FakeTensor) or torch._is_functional_tensor(weight):
        return True
    return get_proxy_mode() is not None


class _Handed(NamedTuple):
    """The copies one inference lookup handed over, and the state of the weights they were
    handed for: while that state holds, the next lookup of the same weights hands the same
    copies without checking each weight on its own."""

    ids: list[int]
    versions: list[int]
    data_ptrs: list[int]
    copies: list[torch.Tensor]
    """The list the lookup returned, returned again: callers read it, never modify it."""


class WeightCastCache:
    """Low-precision copies of weights, keyed by (tensor identity, dtype)."""

    def __init__(self) -> None:
        self._entries: dict[tuple[int, torch.dtype], _Entry] = {}
        self._handed: dict[torch.dtype, _Handed] = {}
        """What the last inference lookup of each dtype handed over; dropped with any entry
        (a weight died: its id may go to another tensor) and by :meth:`clear`."""

    def cast(self, weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """``weight`` in ``dtype``: tracked by autograd when a gradient is needed, else the
        cached copy (made or refreshed here when missing or stale)."""
        # Runs once per weight cast per forward: the common paths are a few cheap checks. A
        # weight already in ``dtype`` is the copy :meth:`lookup_many` handed the forward.
        if weight.dtype is dtype:
            return weight
        if (weight.requires_grad and torch.is_grad_enabled()) or torch.compiler.is_compiling():
            return cast_to(weight, dtype)
        key = (id(weight), dtype)
        entry = self._entries.get(key)
        if entry is not None and entry.weight() is weight and \
                entry.data_ptr == weight.data_ptr() and entry.version == weight._version:
            return entry.copy
        return self._refresh(weight, dtype, key)

    def lookup_many(self, weights: list[torch.Tensor], dtype: torch.dtype
                    ) -> list[torch.Tensor]:
        """What the forward's weight read hands over for casts of ``weights`` to ``dtype``:
        the cached copy of each weight that needs no gradient in this call, and the weight
        itself where autograd records the cast, which :meth:`cast` then makes where the
        weight is used.

        Why there: autograd runs a node's backward in the order the forward made it, latest
        first. A cast made at the start of the forward would run its backward last, so every
        low-precision weight gradient would wait, alive, for the end of backward before
        reaching ``.grad``: more memory held, and nothing for DDP to all-reduce while the
        backward still computes. Made where the weight is used, as ``torch.autocast`` makes
        it, the cast's backward runs right after its consumer's."""
        # Runs once per forward for all weights: checks that hold for every weight (tracing,
        # compiling, grad mode) are made once, and cache hits are inlined.
        if not weights or torch.compiler.is_compiling() or _tracing(weights[0]):
            return weights  # a compiler or tracer sees plain casts, where the weights are used
        grad = torch.is_grad_enabled()
        if not grad:
            handed = self._handed.get(dtype)
            # The same weights as last time (none died since, or the record would be gone,
            # so equal ids are the same tensors), none updated in place or given new
            # storage: the same copies, checked list by list (a third of the per-weight
            # checks below).
            if handed is not None and handed.ids == list(map(id, weights)) and \
                    handed.versions == [w._version for w in weights] and \
                    handed.data_ptrs == [w.data_ptr() for w in weights]:
                return handed.copies
        entries = self._entries
        out = list(weights)
        for i, w in enumerate(weights):
            if w.dtype is dtype or (grad and w.requires_grad):
                continue
            entry = entries.get((id(w), dtype))
            if entry is not None and entry.weight() is w and entry.version == w._version \
                    and entry.data_ptr == w.data_ptr():
                out[i] = entry.copy
            else:
                out[i] = self.cast(w, dtype)
        if not grad:
            self._remember(weights, dtype, out)
        return out

    def _remember(self, weights: list[torch.Tensor], dtype: torch.dtype,
                  copies: list[torch.Tensor]) -> None:
        """Keep what an inference lookup handed over, if every item is a cached copy (not a
        weight already in ``dtype``, nor an inference tensor's uncached cast: the record
        must hold no weight alive and rest on version counters)."""
        entries = self._entries
        if all(e is not None and e.copy is c for e, c in
               zip((entries.get((id(w), dtype)) for w in weights), copies)):
            self._handed[dtype] = _Handed(list(map(id, weights)), [w._version for w in weights],
                                          [w.data_ptr() for w in weights], copies)
        else:
            self._handed.pop(dtype, None)

    def _refresh(self, weight: torch.Tensor, dtype: torch.dtype,
                 key: tuple[int, torch.dtype]) -> torch.Tensor:
        if _tracing(weight) or weight.is_inference():
            # NB: inference tensors have no version counter, so a cached copy could not
            # notice in-place updates; they are cast every time instead.
            return weight.to(dtype)
        # NB: made outside inference mode, so that a later grad-mode forward through frozen
        # weights may save the copy for backward.
        with torch.inference_mode(False), torch.no_grad():
            copy = weight.detach().to(dtype)
        # The callback drops the copy as soon as its weight dies (a replaced parameter), so
        # stale copies do not pile up; it holds the cache weakly to avoid a reference cycle.
        self._entries[key] = _Entry(weakref.ref(weight, _dropper(self, key)), weight._version,
                                    weight.data_ptr(), copy)
        return copy

    def clear(self) -> int:
        """Drop every cached copy; returns how many there were."""
        n = len(self._entries)
        self._entries.clear()
        self._handed.clear()
        return n

    def __len__(self) -> int:
        return len(self._entries)

    def nbytes(self) -> int:
        """Bytes held by the cached copies."""
        return sum(e.copy.numel() * e.copy.element_size() for e in self._entries.values())

    # Copies of a module get an empty cache of their own, never shared tensors.
    def __deepcopy__(self, memo: dict) -> "WeightCastCache":
        return WeightCastCache()

    def __reduce__(self) -> Any:
        return (WeightCastCache, ())

    def __repr__(self) -> str:
        return f"WeightCastCache({len(self)} copies, {self.nbytes()} bytes)"


BATCHED_DEVICE_TYPES = frozenset({"cuda"})
"""Devices where :func:`cast_batch` packs many tensors into one cast: those where each cast is
a kernel launch."""


_BATCH_ELEMENTS = 1 << 24
"""Elements per flat group (64 MB of fp32): bounds the temporary a batched cast makes."""


def cast_batch(tensors: list[torch.Tensor], dtype: torch.dtype) -> list[torch.Tensor]:
    """``[t.to(dtype) for t in tensors]``, bit for bit, in a few kernels.

    Contiguous tensors of one device are concatenated into a flat buffer in groups of at most
    :data:`_BATCH_ELEMENTS`, cast once per group, and handed back as views of the result: two
    kernels per group instead of one per tensor (on a GPU, a launch is several microseconds of
    host time). Other tensors (channels-last, strided) take ``.to``, which keeps their layout,
    and so do tensors on devices without a launch cost (the CPU: there the extra copy into
    the flat buffer makes the batch slower, 6.9 against 2.0 ms for eight 1024^2 weights).
    """
    out: list[torch.Tensor | None] = [None] * len(tensors)
    groups: dict[torch.device, list[list[int]]] = {}
    sizes: dict[torch.device, int] = {}  # elements in each device's last group
    for i, t in enumerate(tensors):
        if t.device.type not in BATCHED_DEVICE_TYPES or not t.is_contiguous() or \
                t.numel() == 0:
            out[i] = t.to(dtype)
            continue
        device_groups = groups.setdefault(t.device, [[]])
        n = t.numel()
        if device_groups[-1] and sizes[t.device] + n > _BATCH_ELEMENTS:
            device_groups.append([])
            sizes[t.device] = 0
        device_groups[-1].append(i)
        sizes[t.device] = sizes.get(t.device, 0) + n
    for device_groups in groups.values():
        for group in device_groups:
            members = [tensors[i] for i in group]
            if len(members) == 1:
                out[group[0]] = members[0].to(dtype)
                continue
            flat = torch._C._nn.flatten_dense_tensors(members).to(dtype)
            for i, view in zip(group, torch._C._nn.unflatten_dense_tensors(flat, members)):
                out[i] = view
    return out  # type: ignore[return-value]


def _dropper(cache: WeightCastCache, key: tuple[int, torch.dtype]) -> Any:
    cache_ref = weakref.ref(cache)

    def drop(dead: weakref.ref) -> None:
        owner = cache_ref()
        if owner is None:
            return
        owner._handed.clear()  # its id may now go to another tensor, and its copy be freed
        entry = owner._entries.get(key)
        # The id may already belong to a new weight with an entry of its own: keep that one.
        if entry is not None and entry.weight is dead:
            del owner._entries[key]

    return drop


def clear_weight_cache(module: nn.Module) -> int:
    """Drop the low-precision weight copies a converted module keeps for inference.

    The next inference forward makes them again from the current weights. Use it to free
    their memory, or after writing weights in a way the cache cannot notice
    (``p.data.copy_(t)``). Returns the number of copies dropped (0 for a module that holds
    none).
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"amprewrite.clear_weight_cache expects the nn.Module returned by "
                        f"amprewrite.convert, got {type(module).__name__}")
    dropped = 0
    for sub in module.modules():
        cache = sub.__dict__.get(CACHE_ATTR)
        if isinstance(cache, WeightCastCache):
            dropped += cache.clear()
    return dropped
