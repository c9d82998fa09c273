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

__all__ = ["INPUTS_KEY", "InputSpec", "record_inputs", "input_mismatch", "changed_dims",
           "input_names", "scalar_changes", "captured_size", "other_arguments"]

INPUTS_KEY = "amprewrite_inputs"
"""``gm.meta[INPUTS_KEY]``: the :class:`InputSpec` of each tensor the module was captured for."""


_SCALARS = (bool, int, float, str)
"""Python values torch.export bakes into the graph (``temperature == 1.0`` in its check)."""


@dataclasses.dataclass(frozen=True)
class InputSpec:
    name: str
    """The argument as the model's ``forward`` names it (``x``, ``past[0]``, ``batch['ids']``)."""
    dtype: torch.dtype | None
    """None for a Python scalar (:attr:`value`)."""
    shape: tuple[int | None, ...] | None
    """Sizes the capture fixed; None for a dynamic dimension; None for all when the capture
    fixes none (the symbolic tracer's graph takes any size)."""
    value: Any = None
    """A Python scalar argument's value, which the graph holds as a constant."""

    def describe(self) -> str:
        if self.dtype is None:
            return repr(self.value)
        if self.shape is None:
            return _dtype_name(self.dtype)
        dims = ", ".join("any" if s is None else str(s) for s in self.shape)
        return f"{_dtype_name(self.dtype)} of shape ({dims})"


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def input_names(model: nn.Module, args: tuple, kwargs: dict[str, Any]) -> dict[str, Any]:
    """The call's arguments by the names the model's ``forward`` gives them (``args[i]`` and
    the keywords where they do not bind)."""
    try:
        return dict(inspect.signature(model.forward).bind(*args, **kwargs).arguments)
    except (TypeError, ValueError):
        return {**{f"args[{i}]": a for i, a in enumerate(args)}, **kwargs}


def _named_leaves(model: nn.Module, args: tuple, kwargs: dict[str, Any]
                  ) -> list[tuple[str, Any]]:
    """Every tensor and Python scalar of a call, named as in :class:`InputSpec`, in the
    order torch.export flattens them (its placeholders'): the positional arguments, then the
    keywords in the order the call gives them (not the forward's)."""
    named = []
    for name, value in input_names(model, args, kwargs).items():
        leaves, _ = pytree.tree_flatten_with_path(value)
        for path, leaf in leaves:
            if isinstance(leaf, (torch.Tensor, *_SCALARS)):
                named.append((name + pytree.keystr(path), leaf))
    # NB: sorted is stable: positional leaves keep their order, a keyword's leaves theirs
    return sorted(named, key=lambda item: _call_position(item, kwargs))


def _call_position(item: tuple[str, Any], kwargs: dict[str, Any]) -> int:
    """-1 for a positional argument's leaf, else the index of its keyword in the call."""
    name = item[0]
    for i, key in enumerate(kwargs):
        if name == key or name.startswith((f"{key}[", f"{key}.")) or f"[{key!r}]" in name:
            return i
    return -1


def _named_tensors(model: nn.Module, args: tuple, kwargs: dict[str, Any]
                   ) -> list[tuple[str, torch.Tensor]]:
    return [(n, v) for n, v in _named_leaves(model, args, kwargs) if isinstance(v, torch.Tensor)]


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
    leaves = _named_leaves(model, args, kwargs or {})
    named = [(n, v) for n, v in leaves if isinstance(v, torch.Tensor)]
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
    if sizes_fixed:  # torch.export specialises on Python scalars; the symbolic tracer reads
        # them at each call
        specs += [InputSpec(n, None, None, v) for n, v in leaves if isinstance(v, _SCALARS)]
    gm.meta[INPUTS_KEY] = tuple(specs)


def _mismatch(spec: InputSpec, got: Any) -> bool:
    if spec.dtype is None:  # a scalar: NB type too, since True == 1 == 1.0
        return type(got) is not type(spec.value) or got != spec.value
    if not isinstance(got, torch.Tensor) or got.dtype != spec.dtype:
        return True
    if spec.shape is None:
        return False
    return len(got.shape) != len(spec.shape) or any(
        s is not None and s != g for s, g in zip(spec.shape, got.shape))


def _to_float64(spec: InputSpec, got: Any) -> bool:
    """Whether a call passes float64 where the capture had a lower floating dtype."""
    return isinstance(got, torch.Tensor) and got.dtype == torch.float64 and \
        spec.dtype is not None and spec.dtype.is_floating_point and spec.dtype != torch.float64


def _called_with(spec: InputSpec, got: Any) -> str:
    if not isinstance(got, torch.Tensor):
        return repr(got)
    shape = None if spec.shape is None else tuple(got.shape)
    return InputSpec(spec.name, got.dtype, shape).describe()


def input_mismatch(gm: nn.Module, model_name: str, args: tuple, kwargs: dict[str, Any],
                   named_by: nn.Module | None = None) -> str | None:
    """A message naming the arguments of a failed call that differ from the capture's, or
    None if they all fit (then the failure has another cause). ``named_by``: the module
    whose ``forward`` names the call's arguments, where ``gm`` is another graph of it (whose
    generated forward names them as its capture did)."""
    specs = getattr(gm, "meta", {}).get(INPUTS_KEY)
    if not specs:
        return None
    named = _named_or_none(gm if named_by is None else named_by, args, kwargs)
    if named is None:
        return None  # NB: never raise here: the caller is handling the model's own error
    lines = [f"  {spec.name}: captured for {spec.describe()}, called with "
             f"{_called_with(spec, named[spec.name])}"
             for spec in specs if spec.name in named and _mismatch(spec, named[spec.name])]
    lines += [f"  {name}: {what}" for name, what in _other_arguments(specs, named)]
    if not lines:
        return None
    wider = [spec.name for spec in specs
             if spec.name in named and _to_float64(spec, named[spec.name])]
    if wider:  # NB: not indented: cache.refit reads the indented lines as what changed
        lines.append(
            f"float64 is never cast by torch.autocast, so the model itself raises where "
            f"{', '.join(wider)} meets an fp32 weight (eagerly and under autocast), while the "
            f"graph would round it to the low dtype: pass {wider[0]}.float(), or convert with "
            "float64 example inputs if the model is meant to compute in float64.")
    return (f"the converted {model_name} was called with inputs its capture does not fit:\n"
            + "\n".join(lines) + "\n"
            "A converted module follows new sizes by capturing again with the dimension "
            "dynamic, and new Python scalars and arguments by capturing for them; other dtypes "
            "or ranks than the example inputs' are not followed. Call it with inputs of the "
            "example's dtypes and ranks, or convert again with example inputs like the ones "
            "you will pass. amprewrite.compile(model) follows any input.")


def _named_or_none(gm: nn.Module, args: tuple, kwargs: dict[str, Any]) -> dict[str, Any] | None:
    try:
        return dict(_named_leaves(gm, args, kwargs))
    except Exception:
        return None


def changed_dims(gm: nn.Module, args: tuple, kwargs: dict[str, Any],
                 named_by: nn.Module | None = None) -> set[tuple[str, int]] | None:
    """The ``(input name, dimension)`` pairs where a call's tensors differ in size from the
    ones ``gm`` fixed, all else (dtypes, ranks, scalars) fitting; None where something other
    than a size differs (a new capture for those inputs, not a dynamic dimension).
    ``named_by``: as for :func:`input_mismatch`."""
    specs = getattr(gm, "meta", {}).get(INPUTS_KEY)
    named = _named_or_none(gm if named_by is None else named_by, args, kwargs)
    if not specs or named is None:
        return None
    dims: set[tuple[str, int]] = set()
    for spec in specs:
        got = named.get(spec.name)
        if got is None:
            continue
        if spec.dtype is None or spec.shape is None or not isinstance(got, torch.Tensor):
            if _mismatch(spec, got):
                return None
            continue
        if got.dtype != spec.dtype or got.dim() != len(spec.shape):
            return None
        dims.update((spec.name, d) for d, (s, g) in enumerate(zip(spec.shape, got.shape))
                    if s is not None and s != g)
    return dims


def _other_arguments(specs: tuple[InputSpec, ...], named: dict[str, Any]
                     ) -> list[tuple[str, str]]:
    """Arguments the capture had that the call lacks, and the reverse."""
    captured = {spec.name for spec in specs}
    out = [(spec.name, f"captured with {spec.describe()}, called without it")
           for spec in specs if spec.name not in named]
    out += [(name, f"not captured, called with {_called_with(InputSpec(name, None, None), v)}"
             if not isinstance(v, torch.Tensor) else
             f"not captured, called with {_dtype_name(v.dtype)} of shape {tuple(v.shape)}")
            for name, v in named.items() if name not in captured]
    return out


def other_arguments(gm: nn.Module, args: tuple, kwargs: dict[str, Any],
                    named_by: nn.Module | None = None) -> bool:
    """Whether a call passes arguments ``gm`` was not captured with, or lacks some it was.
    ``named_by``: as for :func:`input_mismatch`."""
    specs = getattr(gm, "meta", {}).get(INPUTS_KEY)
    named = _named_or_none(gm if named_by is None else named_by, args, kwargs)
    return bool(specs) and named is not None and bool(_other_arguments(specs, named))


def scalar_changes(gm: nn.Module, args: tuple, kwargs: dict[str, Any],
                   named_by: nn.Module | None = None) -> list[str]:
    """The Python scalar arguments of a call that differ from the values ``gm`` holds.
    ``named_by``: as for :func:`input_mismatch`."""
    specs = getattr(gm, "meta", {}).get(INPUTS_KEY) or ()
    named = _named_or_none(gm if named_by is None else named_by, args, kwargs) or {}
    return [spec.name for spec in specs
            if spec.dtype is None and spec.name in named and _mismatch(spec, named[spec.name])]


def captured_size(gm: nn.Module, name: str, dim: int) -> int | None:
    """The size ``gm`` fixed in dimension ``dim`` of its input ``name``; None where it takes
    any size there (or has no such input)."""
    for spec in getattr(gm, "meta", {}).get(INPUTS_KEY) or ():
        if spec.name == name and spec.dtype is not None and spec.shape is not None:
            return spec.shape[dim] if dim < len(spec.shape) else None
    return None
