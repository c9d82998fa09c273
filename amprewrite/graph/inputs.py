"""What a converted module was captured for, and what to say when a call does not fit.

A graph captured from example inputs holds for inputs like them: the same dtypes (an integer
tensor where a float one was traced takes other paths through the model's Python) and, for
torch.export, the same sizes except in its dynamic dimensions. A call that does not fit fails
somewhere inside: *Boolean value of Tensor with more than one value is ambiguous*, or
*Guard failed: x.size()[1] == 8*. When a call fails, :func:`input_mismatch` compares its
arguments with the ones recorded at conversion (:func:`record_inputs`) and, if they differ,
says which argument, what the capture expects, what came, and how to convert for it. The check
runs only on the failure path: a call that works pays nothing for it.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn
import torch.utils._pytree as pytree

__all__ = ["INPUTS_KEY", "InputSpec", "record_inputs", "input_mismatch"]

INPUTS_KEY = "amprewrite_inputs"
"""``gm.meta[INPUTS_KEY]``: the :class:`InputSpec` of each tensor the module was captured for."""


@dataclasses.dataclass(frozen=True)
class InputSpec:
    name: str
    """The argument as the model's ``forward`` names it (``x``, ``past[0]``, ``batch['ids']``)."""
    dtype: torch.dtype
    shape: tuple[int | None, ...] | None
    """Sizes the capture fixed; None for a dynamic dimension; None for all when the capture
    fixes none (the symbolic tracer's graph takes any size)."""

    def describe(self) -> str:
        if self.shape is None:
            return _dtype_name(self.dtype)
        dims = ", ".join("any" if s is None else str(s) for s in self.shape)
        return f"{_dtype_name(self.dtype)} of shape ({dims})"


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _named_tensors(model: nn.Module, args: tuple, kwargs: dict[str, Any]
                   ) -> list[tuple[str, torch.Tensor]]:
    try:
        bound = inspect.signature(model.forward).bind(*args, **kwargs).arguments
    except (TypeError, ValueError):
        bound = {**{f"args[{i}]": a for i, a in enumerate(args)}, **kwargs}
    named = []
    for name, value in bound.items():
        leaves, _ = pytree.tree_flatten_with_path(value)
        for path, leaf in leaves:
            if isinstance(leaf, torch.Tensor):
                named.append((name + pytree.keystr(path), leaf))
    return named


def _fixed_size(size: int | torch.SymInt) -> int | None:
    """A traced size as a number, or None for a dynamic one (a SymInt that export may also
    have specialised to a number: then it is fixed)."""
    if isinstance(size, torch.SymInt):
        return size.node.maybe_as_int()
    return int(size)


def record_inputs(gm: fx.GraphModule, model: nn.Module, args: tuple,
                  kwargs: dict[str, Any] | None, *, sizes_fixed: bool) -> None:
    """Record on ``gm`` the tensors it was captured for. ``sizes_fixed``: the capture checks
    sizes (torch.export); a placeholder's symbolic size marks a dynamic dimension."""
    named = _named_tensors(model, args, kwargs or {})
    traced = [n.meta.get("val") for n in gm.graph.nodes if n.op == "placeholder"]
    traced = [v for v in traced if isinstance(v, torch.Tensor)]
    aligned = len(traced) == len(named)
    specs = []
    for i, (name, tensor) in enumerate(named):
        shape = None
        if sizes_fixed:
            sizes = traced[i].shape if aligned else tensor.shape
            shape = tuple(map(_fixed_size, sizes))
        specs.append(InputSpec(name, tensor.dtype, shape))
    gm.meta[INPUTS_KEY] = tuple(specs)


def _mismatch(spec: InputSpec, got: torch.Tensor) -> bool:
    if got.dtype != spec.dtype:
        return True
    if spec.shape is None:
        return False
    return len(got.shape) != len(spec.shape) or any(
        s is not None and s != g for s, g in zip(spec.shape, got.shape))


def _called_with(spec: InputSpec, got: torch.Tensor) -> str:
    shape = None if spec.shape is None else tuple(got.shape)
    return InputSpec(spec.name, got.dtype, shape).describe()


def input_mismatch(gm: nn.Module, model_name: str, args: tuple, kwargs: dict[str, Any]
                   ) -> str | None:
    """A message naming the arguments of a failed call that differ from the capture's, or
    None if they all fit (then the failure has another cause)."""
    specs = getattr(gm, "meta", {}).get(INPUTS_KEY)
    if not specs:
        return None
    try:
        named = dict(_named_tensors(gm, args, kwargs))
    except Exception:
        return None  # NB: never raise here: the caller is handling the model's own error
    lines = [f"  {spec.name}: captured for {spec.describe()}, called with "
             f"{_called_with(spec, named[spec.name])}"
             for spec in specs if spec.name in named and _mismatch(spec, named[spec.name])]
    if not lines:
        return None
    return (f"the converted {model_name} was called with inputs its capture does not fit:\n"
            + "\n".join(lines) + "\n"
            "A converted module runs the graph captured from convert()'s example inputs. Call it "
            "with inputs of those dtypes and sizes, or convert again with example inputs like the "
            "ones you will pass. Positional example inputs make the dimensions the model lets "
            "vary dynamic, except those of floating tensors of 4 or more dimensions (images, "
            "video), whose sizes, batch included, are kept; keyword example inputs keep their "
            "sizes. amprewrite.compile(model) follows any size.")
