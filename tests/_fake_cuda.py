"""Helpers for the conformance tests: one-op modules built from PyTorch's autocast test
lists, and CUDA autocast on fake CUDA tensors (no GPU needed).

``cuda_autocast`` sets the autocast thread-local state directly, because
``torch.autocast("cuda")`` disables itself on a machine without CUDA; under a
``FakeTensorMode`` the real ``AutocastCUDA`` kernels then run on fake tensors with
``device="cuda"`` and give autocast-CUDA's output dtypes.

NB: never create a fake CUDA tensor with ``requires_grad=True``: building its AccumulateGrad
node asks for a CUDA device guard and aborts the process (it cannot be caught).
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable

import torch
import torch.nn as nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._pytree import tree_flatten, tree_unflatten

from amprewrite.capture.export import autocast_regime

__all__ = ["cuda_autocast", "fake_cuda", "OneOp", "one_op_module", "resolve_op", "tensors_of"]


def cuda_autocast(dtype: torch.dtype) -> contextlib.AbstractContextManager[None]:
    """CUDA autocast with ``dtype`` on a machine without a GPU (what ``torch.autocast`` does
    on enter and exit, minus its CUDA availability check)."""
    return autocast_regime("cuda", dtype)


def fake_cuda(mode: FakeTensorMode, value: Any) -> Any:
    """Fake CUDA copies of every tensor in ``value`` (same dtypes and shapes, no grad)."""
    def convert(x: Any) -> Any:
        if not isinstance(x, torch.Tensor):
            return x
        with mode:
            return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="cuda")
    flat, spec = tree_flatten(value)
    return tree_unflatten([convert(x) for x in flat], spec)


def resolve_op(name: str, module: Any, first: Any) -> Callable[..., Any]:
    """The callable an autocast test list entry names: ``module.name`` if it exists (module
    None means a Tensor method), else the Tensor method on the first argument."""
    if module is not None and hasattr(module, name):
        return getattr(module, name)
    if isinstance(first, torch.Tensor) and hasattr(torch.Tensor, name):
        return _Method(name)
    raise AttributeError(f"{name} is neither {module}.{name} nor a Tensor method")


class _Method:
    """``self.name(*rest)`` looked up on the first argument, so that tracers see a method
    call on a tensor (or proxy), as user code writes it."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __call__(self, first: Any, *rest: Any, **kwargs: Any) -> Any:
        return getattr(first, self.name)(*rest, **kwargs)


def tensors_of(args: Any) -> list[torch.Tensor]:
    return [x for x in tree_flatten(args)[0] if isinstance(x, torch.Tensor)]


class OneOp(nn.Module):
    """Calls one op; tensor arguments are the forward's inputs, everything else is fixed."""

    def __init__(self, op: Callable[..., Any], args: Any, kwargs: dict[str, Any]) -> None:
        super().__init__()
        self.op, self.kwargs = op, kwargs
        flat, self.spec = tree_flatten(args)
        self.slots = [i for i, x in enumerate(flat) if isinstance(x, torch.Tensor)]
        self.constants = [None if isinstance(x, torch.Tensor) else x for x in flat]

    def call(self, tensors: list[Any]) -> Any:
        flat = list(self.constants)
        for slot, t in zip(self.slots, tensors):
            flat[slot] = t
        return self.op(*tree_unflatten(flat, self.spec), **self.kwargs)


_FORWARDS: dict[int, type[OneOp]] = {}


def one_op_module(op: Callable[..., Any], args: Any, kwargs: dict[str, Any] | None = None) -> OneOp:
    """A :class:`OneOp` whose forward takes one named parameter per tensor argument.

    NB: the symbolic tracer makes one placeholder per named parameter; ``*args`` would be a
    single proxy that cannot be unpacked, so a class is made per arity.
    """
    module = OneOp(op, args, kwargs or {})
    n = len(module.slots)
    if n not in _FORWARDS:
        names = ", ".join(f"t{i}" for i in range(n))
        namespace: dict[str, Any] = {}
        exec(f"def forward(self, {names}):\n    return self.call([{names}])\n", namespace)
        _FORWARDS[n] = type(f"OneOp{n}", (OneOp,), {"forward": namespace["forward"]})
    module.__class__ = _FORWARDS[n]
    return module
