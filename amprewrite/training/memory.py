"""Memory of one training step, measured, not estimated: what mixed precision buys.

:func:`memory_report` runs one step (forward, loss, backward, ``optimizer.step()``) and adds up
the tensors each part holds, each storage once, at its full ``nbytes``. Batch 16 through
``Linear(64, 64) → ReLU → Linear(64, 8)`` (no biases), O1 in bf16, AdamW::

    >>> print(amprewrite.memory_report(gm, (x,), optimizer=opt).table(per_module=False))
                                       bytes
    -------------------------------  -------  --------
    weights                           18,432  18.0 KiB
    low-precision copies                   0       0 B
    weight casts saved for backward    1,024   1.0 KiB
    gradients                         18,432  18.0 KiB
    optimizer state                   36,872  36.0 KiB
    saved activations                  4,096   4.0 KiB
    total                             78,856  77.0 KiB
    stored weights that autograd saved (counted above, not again): 0 B

*Weights*: parameters and buffers. *Low-precision copies*: an O2 module's stored copies of its
fp32 masters, an O3 module's own low-precision tensors (it holds no fp32 ones), an O1 module's
cached casts of frozen weights and buffers. *Weight casts*: casts of trained parameters made
per forward (O1, ``torch.autocast``) and saved for backward. *Saved activations*: every other
tensor autograd saves in the forward and the loss (``saved_tensors_hooks``); stored weights it
saves (an fp32 matmul's weight, an O2 copy) are shown apart, outside the total. The total bounds
what the rows hold at once (backward frees activations as it goes); kernels' temporaries are
not counted. Per module, saved bytes go to the innermost module running: forward hooks on an
eager model; in a GraphModule, the FX node whose line of ``forward`` runs (``gm._lineno_map``),
by its ``nn_module_stack``. ``.grad``, parameters, buffers and optimizer state are put back.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import sys
from collections import defaultdict
from typing import Any, Callable, Iterable, Iterator

import torch
import torch.fx as fx
import torch.nn as nn
from torch.utils._pytree import tree_leaves

from ..module.calling import generated_code
from ..convert import convert
from ..passes.opt_levels import opt_level_of
from ..policy.policy import default_low_dtype
from ..runtime.low_copies import LOW_COPIES_ATTR, LowPrecisionCopies
from ..runtime.weight_cache import CACHE_ATTR
from .master_weights import MasterWeights

__all__ = ["MemoryReport", "MemoryComparison", "memory_report", "compare_memory"]

_ROWS = (("weights", "weights"), ("low_precision_copies", "low-precision copies"),
         ("weight_casts", "weight casts saved for backward"), ("gradients", "gradients"),
         ("optimizer_state", "optimizer state"), ("activations", "saved activations"))
_UNITS = (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10))
# Autograd nodes between a saved view of a weight cast and the cast (``w_bf16.t()``: matmul).
_VIEWS = frozenset({"TBackward0", "TransposeBackward0", "PermuteBackward0", "ViewBackward0",
                    "UnsafeViewBackward0", "ExpandBackward0", "AliasBackward0"})


def _human(n: int) -> str:
    return next((f"{n / size:,.1f} {unit}" for unit, size in _UNITS if n >= size), f"{n} B")


def _storages(tensors: Iterable[Any]) -> dict[int, int]:
    """``data_ptr -> nbytes`` of the storages behind ``tensors``, each once."""
    return {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
            for t in tensors if isinstance(t, torch.Tensor)}


def _is_weight_cast(t: torch.Tensor, trained: set[int]) -> bool:
    """Whether ``t`` is (a view of) a cast of trained parameters."""
    fn = t.grad_fn
    while fn is not None and type(fn).__name__ in _VIEWS:
        fn = fn.next_functions[0][0]
    nexts = [f for f, _ in fn.next_functions if f is not None] if fn is not None else []
    return type(fn).__name__ == "ToCopyBackward0" and bool(nexts) and \
        all(id(getattr(f, "variable", None)) in trained for f in nexts)


@dataclasses.dataclass
class MemoryReport:
    """Bytes one training step holds (module docstring); ``total`` sums all but
    ``saved_weights``; ``per_module``: bytes saved for backward (activations and weight
    casts) by module name, ``"(loss)"`` for ``loss_fn``."""

    weights: int
    low_precision_copies: int
    weight_casts: int
    gradients: int
    optimizer_state: int
    activations: int
    saved_weights: int
    per_module: dict[str, int]

    @property
    def total(self) -> int:
        return sum(getattr(self, field) for field, _ in _ROWS)

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "total": self.total}

    def table(self, per_module: bool = True) -> str:
        """The rows in bytes, then (``per_module``) the bytes saved by each module."""
        from tabulate import tabulate

        rows = [(name, f"{getattr(self, f):,}", _human(getattr(self, f))) for f, name in _ROWS]
        rows.append(("total", f"{self.total:,}", _human(self.total)))
        out = [tabulate(rows, headers=["", "bytes", ""], colalign=("left", "right", "right"),
                        disable_numparse=True),
               "stored weights that autograd saved (counted above, not again): "
               + _human(self.saved_weights)]
        if per_module and self.per_module:
            out.append("\n" + tabulate([(k, f"{v:,}") for k, v in self.per_module.items()],
                                       headers=["module", "saved for backward"],
                                       colalign=("left", "right"), disable_numparse=True))
        return "\n".join(out)

    __str__ = table


class MemoryComparison(dict):
    """Variant name -> :class:`MemoryReport`; ``table()`` shows them side by side, each cell
    with its ratio to the first variant's (``"fp32"`` by default)."""

    def table(self) -> str:
        from tabulate import tabulate

        unit, size = next(((u, s) for u, s in _UNITS
                           if max(r.total for r in self.values()) >= 10 * s), ("B", 1))
        base, rows = next(iter(self.values())), []
        for field, name in (*_ROWS, ("total", "total")):
            values = [(getattr(r, field), getattr(base, field)) for r in self.values()]
            rows.append([name, *(f"{v / size:,.1f}" + (f" ({v / b:.2f}×)" if i and b else "")
                                 for i, (v, b) in enumerate(values))])
        return tabulate(rows, headers=[unit, *self], disable_numparse=True,
                        colalign=("left", *["right"] * len(self)))

    __str__ = table


def _owner(module: nn.Module, handles: list[Any]) -> Callable[[], str | None]:
    """The innermost module running ('' for the root), None outside ``module``'s forward.
    Eager: forward hooks. GraphModule: the FX node whose line of ``forward`` runs."""
    if not isinstance(module, fx.GraphModule):
        names, stack = {id(m): name for name, m in module.named_modules()}, []

        def leave(m: nn.Module, args: Any, out: Any) -> None:  # None: keeps the output
            if stack:
                stack.pop()

        for m in module.modules():
            handles += [m.register_forward_pre_hook(lambda m, a: stack.append(names[id(m)])),
                        m.register_forward_hook(leave, always_call=True)]
        return lambda: stack[-1] if stack else None
    code, nodes = generated_code(module), list(module.graph.nodes)
    lines = getattr(module, "_lineno_map", None) or {}
    start = getattr(module, "_prologue_start", 0)

    def owner() -> str | None:
        frame = sys._getframe(2)
        while frame is not None and frame.f_code is not code:
            frame = frame.f_back
        if frame is None:
            return None
        index = lines.get(frame.f_lineno - start)
        node = nodes[index] if index is not None else None
        if node is not None and node.op == "call_module":
            return str(node.target)
        stack = list((node.meta.get("nn_module_stack") or {}).values()) if node else [("",)]
        return str(stack[-1][0] if isinstance(stack[-1], tuple) else stack[-1]) if stack else ""
    return owner


@contextlib.contextmanager
def _one_step(module: nn.Module, optimizer: torch.optim.Optimizer | None,
              leaves: list[torch.Tensor]) -> Iterator[None]:
    """Run the block's step on no ``.grad`` and a fresh optimizer state, an unbound O2 module
    bound for this step only; put parameters, buffers, ``.grad`` and the state back after."""
    params, buffers = [*module.parameters()], [*module.buffers()]
    grads, state = [(t, t.grad) for t in leaves], getattr(optimizer, "state", None)
    kept = buffers + (params if optimizer is not None else [])  # a step changes params
    values = [(t, t.detach().clone()) for t in kept]
    store, binding, bound = getattr(module, LOW_COPIES_ATTR, None), None, False
    try:
        for t in leaves:
            t.grad = None
        if optimizer is not None:
            optimizer.state = defaultdict(dict)
        if isinstance(store, LowPrecisionCopies) and store.bindings == 0:  # an unbound O2
            if optimizer is not None:
                binding = MasterWeights(module, optimizer)
            else:  # no step: the copies cannot go stale
                store.bindings, bound = 1, True
        yield
    finally:
        with torch.no_grad():
            for t, value in values:
                t.copy_(value)
        for p, g in grads:
            p.grad = g
        if optimizer is not None:
            optimizer.state = state
        if binding is not None:
            binding.close()
        if bound:
            store.bindings = 0


def _copy_storages(module: nn.Module) -> dict[int, int]:
    """The storages of the module's low-precision weight copies (see the module docstring)."""
    store, level = getattr(module, LOW_COPIES_ATTR, None), opt_level_of(module)
    copies = [c for _, c in store.copies()] if isinstance(store, LowPrecisionCopies) else []
    copies += [e.copy for e in getattr(getattr(module, CACHE_ATTR, None), "_entries",
                                       {}).values()]  # an O1 module's cached casts
    if level is not None and level.level == "O3":
        copies += [t for t in [*module.parameters(), *module.buffers()] if t.dtype == level.dtype]
    return _storages(copies)


def _measure(module: nn.Module, inputs: tuple, kwargs: dict | None,
             optimizer: torch.optim.Optimizer | None, loss_fn: Callable[[Any], Any] | None,
             autocast: torch.dtype | None = None) -> MemoryReport:
    params, buffers = [*module.parameters()], [*module.buffers()]
    trained = {id(p) for p in params if p.requires_grad}
    saved: dict[int, tuple[int, str, bool]] = {}  # data_ptr -> (nbytes, module, weight cast)

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in saved:
            where = owner()
            saved[storage.data_ptr()] = (storage.nbytes(), "(loss)" if where is None else
                                         where or "(top level)", _is_weight_cast(t, trained))
        return t

    leaves = [t for t in tree_leaves((params, inputs, kwargs))
              if isinstance(t, torch.Tensor) and t.requires_grad and t.is_leaf]
    device = next((t.device.type for t in tree_leaves((params, inputs))
                   if isinstance(t, torch.Tensor)), "cpu")
    handles: list[Any] = []
    try:
        with _one_step(module, optimizer, leaves):
            owner = _owner(module, handles)
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), torch.autocast(
                    device, autocast or torch.bfloat16, enabled=autocast is not None):
                out = module(*inputs, **(kwargs or {}))
                loss = loss_fn(out) if loss_fn is not None else next(
                    t for t in tree_leaves(out) if isinstance(t, torch.Tensor)).float().sum()
            copy_bytes = _copy_storages(module)
            weight_bytes = {k: v for k, v in _storages(params + buffers).items()
                            if k not in copy_bytes}
            loss.backward()
            gradients = sum(_storages(p.grad for p in params).values())
            if optimizer is not None:
                optimizer.step()
            held = tree_leaves(list(getattr(optimizer, "state", {}).values()))
    finally:
        for h in handles:
            h.remove()
    sums, per_module = defaultdict(int), defaultdict(int)
    for ptr, (nbytes, where, cast) in saved.items():
        kind = "saved_weights" if ptr in weight_bytes or ptr in copy_bytes else \
            "weight_casts" if cast else "activations"
        sums[kind] += nbytes
        per_module[where] += nbytes if kind != "saved_weights" else 0
    return MemoryReport(sum(weight_bytes.values()), sum(copy_bytes.values()),
                        sums["weight_casts"], gradients, sum(_storages(held).values()),
                        sums["activations"], sums["saved_weights"],
                        {k: v for k, v in per_module.items() if v})


def memory_report(model_or_gm: nn.Module, example_inputs: Any, *,
                  example_kwargs: dict[str, Any] | None = None,
                  optimizer: torch.optim.Optimizer | None = None,
                  loss_fn: Callable[[Any], torch.Tensor] | None = None) -> MemoryReport:
    """Measure one training step of ``model_or_gm`` (an eager model or ``convert``'s result)
    on ``example_inputs`` (a tuple, or one tensor) and ``example_kwargs``.

    ``optimizer`` is stepped once (without closure) to measure its state; an O2 module not yet
    bound to one is bound for the step. ``loss_fn(output)`` is backpropagated (default: the
    sum of the first tensor output, in fp32). Nothing is left changed (module docstring).
    """
    inputs = example_inputs if isinstance(example_inputs, tuple) else (example_inputs,)
    return _measure(model_or_gm, inputs, example_kwargs, optimizer, loss_fn)


def compare_memory(model: nn.Module, example_inputs: Any,
                   opt_levels: Iterable[str] = ("fp32", "autocast", "O1", "O2", "O3"), *,
                   example_kwargs: dict[str, Any] | None = None,
                   optimizer_factory: Callable[..., torch.optim.Optimizer] | None = (
                       lambda params: torch.optim.AdamW(params, lr=1e-3)),
                   loss_fn: Callable[[Any], torch.Tensor] | None = None,
                   dtype: torch.dtype | None = None) -> MemoryComparison:
    """:func:`memory_report` of each variant, each built on a deep copy of ``model``.

    ``"fp32"``: the eager model; ``"autocast"``: it under ``torch.autocast(device, dtype)``
    (forward and loss); ``"O0"``–``"O3"``: ``amprewrite.convert(copy, example_inputs,
    opt_level=..., dtype=dtype)``; ``dtype`` defaults to fp16 for a model on CUDA, else bf16.
    ``optimizer_factory(parameters)`` makes each variant's optimizer (default AdamW; None: no
    optimizer). ``print(result)`` shows the table.
    """

    inputs = example_inputs if isinstance(example_inputs, tuple) else (example_inputs,)
    device = next((p.device.type for p in model.parameters()), "cpu")
    low = dtype or default_low_dtype(device)
    result = MemoryComparison()
    for level in opt_levels:
        if level not in ("fp32", "autocast", "O0", "O1", "O2", "O3"):
            raise ValueError(f"compare_memory: unknown variant {level!r} (fp32, autocast, O0-O3)")
        module = copy.deepcopy(model)
        if level.startswith("O"):
            module = convert(module, inputs, example_kwargs=example_kwargs, opt_level=level,
                             dtype=None if level == "O0" else low)
        opt = optimizer_factory(module.parameters()) if optimizer_factory else None
        result[level] = _measure(module, inputs, example_kwargs, opt, loss_fn,
                                 low if level == "autocast" else None)
    return result
