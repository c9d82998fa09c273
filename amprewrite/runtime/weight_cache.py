"""Weight casts: autograd-tracked in training, made into kept copies otherwise.

Every cast of a parameter or buffer in a converted graph is a call of
``WeightCastCache.cast`` where the weight is used (``_amp_weight_cache.cast(l_weight,
torch.bfloat16)`` in the graph). When autograd needs the cast (grad mode on and the weight
requires grad) it is a plain cast (``weight.bfloat16()``: ``weight.to(dtype)`` without
parsing its overloads), so gradients flow to the fp32 master weight. Otherwise
(``torch.no_grad``, ``torch.inference_mode``, frozen weights) the forward's weight read
(:meth:`WeightCastCache.lookup_many`, called by :mod:`.weight_table`) hands each cast a
low-precision copy kept between calls, which the cast returns as it is (``cast`` of a weight
already in ``dtype`` returns it; the generated code calls it as the dtype's method,
``l_weight.bfloat16()``, :mod:`amprewrite.graph.codegen`, which does the same).

Whether a kept copy may be reused as it is depends on what could have changed the weight
since the last call:

* By default every call rewrites the copies from the weights, in place, all of them by one
  ``torch._foreach_copy_`` (no allocation, no cast per weight): whatever changed the weights
  (a fused optimizer, ``p.data.mul_``, ``p.data.copy_``, an in-place all-gather), the forward
  reads their current values. The copies are written through their ``.data``, so their own
  version counters stay put: a graph that saved a copy for backward (frozen weights in grad
  mode) sees a rewrite only when the weights' values changed behind autograd's back, exactly
  as a graph that saved the fp32 weight itself would.
* Inside :func:`amprewrite.cache_weights` (:mod:`.kept_copies`) a copy is reused while its
  weight is the same tensor (``module.weight = nn.Parameter(...)`` makes another), with the
  same storage (``p.data = t``, ``module.to(...)``) and version (an in-place update:
  ``load_state_dict``, a foreach or single-tensor optimizer, ``p.mul_`` under ``no_grad``),
  and no ``torch.optim`` optimizer has started a step since it was made (fused optimizers
  move no version counter: :mod:`.optimizer_steps`). NB: ``p.data.copy_(t)`` writes through a
  tensor whose version counter is not ``p``'s, so no check short of reading the values sees
  it: call :func:`amprewrite.clear_weight_cache` after such writes.

While the same weights are unchanged, the lookup hands the same copies after three list
comparisons instead of a check per weight (:class:`_Handed`: 87 against 55 µs for the 100
weights of the launch-bound benchmark model).

The cache belongs to one GraphModule: it is released with it, a copy of the module
(``copy.deepcopy``, pickling) starts with an empty one, and :func:`amprewrite.clear_weight_cache`
drops it on demand.
"""

from __future__ import annotations

import weakref
from typing import Any, NamedTuple

import torch

from .functions import cast_to
from .optimizer_steps import steps_taken
from .tracing import tracing

__all__ = ["WeightCastCache", "CACHE_ATTR", "rewrite_copies"]

CACHE_ATTR = "_amp_weight_cache"


class _Entry(NamedTuple):
    weight: weakref.ref
    version: int
    data_ptr: int
    copy: torch.Tensor
    alias: torch.Tensor
    """``copy.data``: what a rewrite writes through (module docstring)."""
    storage: Any
    """The weight's storage when the copy was made, held so that its address cannot go to
    the storage that replaces it (``p.data = t``, ``model.half().float()``): a new storage at
    the old address, with a version counter that happens to match, would look unchanged."""


class _Handed(NamedTuple):
    """The copies one inference lookup handed over, and the state of the weights they were
    handed for: while that state holds, the next lookup of the same weights hands the same
    copies without checking each weight on its own."""

    ids: list[int]
    versions: list[int]
    data_ptrs: list[int]
    copies: list[torch.Tensor]
    """The list the lookup returned, returned again: callers read it, never modify it."""
    aliases: list[torch.Tensor]
    """Each copy's ``.data``, for the rewrite of every call outside ``cache_weights``."""


class WeightCastCache:
    """Low-precision copies of weights, keyed by (tensor identity, dtype)."""

    def __init__(self) -> None:
        self._entries: dict[tuple[int, torch.dtype], _Entry] = {}
        self._handed: dict[torch.dtype, _Handed] = {}
        """What the last inference lookup of each dtype handed over; dropped with any entry
        (a weight died: its id may go to another tensor) and by :meth:`clear`."""
        self.kept = 0
        """How many :func:`amprewrite.cache_weights` regions are open over this cache: while
        any is, copies are reused across calls while the checks hold; else every call
        rewrites them (module docstring)."""
        self.steps = -1
        """The optimizer step count (:func:`.optimizer_steps.steps_taken`) the copies were
        last checked against; -1 makes the next kept lookup drop them."""

    def cast(self, weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """``weight`` in ``dtype``: tracked by autograd when a gradient is needed; else, inside
        ``cache_weights``, the kept copy (made or refreshed here when missing or stale), and
        outside it a cast made now."""
        # Runs once per weight cast per forward: the common paths are a few cheap checks. A
        # weight already in ``dtype`` is the copy :meth:`lookup_many` handed the forward.
        if weight.dtype is dtype:
            return weight
        if (weight.requires_grad and torch.is_grad_enabled()) or torch.compiler.is_compiling() \
                or not self.kept:
            # NB: outside cache_weights a cast that the weight read did not hand a copy (a
            # buffer's, or a graph without a weight read) is made per call: always current.
            return cast_to(weight, dtype)
        self._check_steps()
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
        if not weights or tracing(weights[0]):
            return weights  # a compiler or tracer sees plain casts, where the weights are used
        grad = torch.is_grad_enabled()
        kept = self.kept
        if kept:
            self._check_steps()
        if not grad:
            handed = self._handed.get(dtype)
            # The same weights as last time (none died since, or the record would be gone,
            # so equal ids are the same tensors), none updated in place or given new
            # storage: the same copies, checked list by list (a third of the per-weight
            # checks below).
            if handed is not None and handed.ids == list(map(id, weights)) and \
                    handed.versions == [w._version for w in weights] and \
                    handed.data_ptrs == [w.data_ptr() for w in weights]:
                if not kept:
                    rewrite_copies(handed.aliases, weights)
                return handed.copies
        entries = self._entries
        out = list(weights)
        aliases: list[torch.Tensor] = []
        sources: list[torch.Tensor] = []
        for i, w in enumerate(weights):
            if w.dtype is dtype or (grad and w.requires_grad):
                continue
            key = (id(w), dtype)
            entry = entries.get(key)
            if entry is not None and entry.weight() is w and entry.version == w._version \
                    and entry.data_ptr == w.data_ptr():
                out[i] = entry.copy
                if not kept:
                    aliases.append(entry.alias)
                    sources.append(w)
            else:
                out[i] = self._refresh(w, dtype, key)
        if aliases:
            rewrite_copies(aliases, sources)
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
                                          [w.data_ptr() for w in weights], copies,
                                          [c.data for c in copies])
        else:
            self._handed.pop(dtype, None)

    def _refresh(self, weight: torch.Tensor, dtype: torch.dtype,
                 key: tuple[int, torch.dtype]) -> torch.Tensor:
        if tracing(weight) or weight.is_inference():
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
                                    weight.data_ptr(), copy, copy.data,
                                    weight.untyped_storage())
        return copy

    def _check_steps(self) -> None:
        """Inside ``cache_weights``: drop every copy if an optimizer started a step since the
        last check (a fused one moves no version counter, :mod:`.optimizer_steps`)."""
        steps = steps_taken()
        if self.steps != steps:
            self.clear()
            self.steps = steps

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


def rewrite_copies(targets: list[torch.Tensor], sources: list[torch.Tensor]) -> None:
    """Copy each source into its target, all in one ``torch._foreach_copy_``. Targets that
    are copies' ``.data`` aliases give the copies the sources' current values without moving
    their version counters (module docstring).

    NB: the grad mode is switched directly (as in :mod:`.low_copies`): entering and leaving
    ``torch.no_grad()`` costs as much as the batched copy of a small model's weights. It must
    be off, or a copy from a weight that requires grad would record an autograd node."""
    grad = torch.is_grad_enabled()
    torch._C._set_grad_enabled(False)
    try:
        torch._foreach_copy_(targets, sources)
    finally:
        torch._C._set_grad_enabled(grad)


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
