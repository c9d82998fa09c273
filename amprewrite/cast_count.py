"""Exact cast counts: a dispatch mode that counts the dtype conversions a run makes.

A count does not depend on the machine's noise, so it compares two ways of running a model
(``torch.autocast`` and a converted graph) exactly, on any device: the summaries of
``explain``/``audit``/``demo`` and the benchmarks use it.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Iterable

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["CastCount", "CastCounter", "count_casts"]

_aten = torch.ops.aten


@dataclasses.dataclass
class CastCount:
    """Cast kernels seen in one run; ``nbytes`` is bytes read plus bytes written."""

    kernels: int = 0
    weight_kernels: int = 0
    nbytes: int = 0


class CastCounter(TorchDispatchMode):
    """Counts dtype-converting kernels (``_to_copy``, ``copy_`` and ``_foreach_copy_`` across
    dtypes) at the ATen level, below autocast and autograd, so that every variant is counted
    the same way.

    A cast whose source shares storage with one of ``weights`` counts as a weight cast.
    """

    def __init__(self, weights: Iterable[torch.Tensor] = ()) -> None:
        super().__init__()
        self.weight_storages = {w.untyped_storage().data_ptr() for w in weights}
        self.count = CastCount()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        pairs: list[tuple[Any, Any]] = []
        if func in (_aten._to_copy.default, _aten.to.dtype, _aten.to.dtype_layout):
            pairs = [(args[0], out)]
        elif func is _aten.copy_.default:
            pairs = [(args[1], args[0])]
        elif func is _aten._foreach_copy_.default:
            pairs = list(zip(args[1], args[0]))
        converted = [(src, dst) for src, dst in pairs
                     if isinstance(src, torch.Tensor) and isinstance(dst, torch.Tensor)
                     and src.dtype != dst.dtype]
        if converted:
            # NB: a _foreach_copy_ is one multi-tensor kernel on a GPU: one cast kernel,
            # with a weight cast for each weight it reads.
            self.count.kernels += 1
        for src, dst in converted:
            self.count.nbytes += src.numel() * src.element_size() + \
                dst.numel() * dst.element_size()
            if src.untyped_storage().data_ptr() in self.weight_storages:
                self.count.weight_kernels += 1
        return out


def count_casts(fn: Callable[[], Any], weights: Iterable[torch.Tensor] = ()) -> CastCount:
    """Run ``fn`` once under a :class:`CastCounter` and return what it counted."""
    counter = CastCounter(weights)
    with counter:
        fn()
    return counter.count
