"""Which binding of torch's Python API runs the same ATen op as a graph's ``OpOverload``.

A captured graph calls ``torch.ops.aten.layer_norm.default(...)``: an ``OpOverload``, whose
call parses its arguments against the JIT schema and costs 1.5-3 µs more than
``torch.layer_norm(...)``, the generated binding eager code calls (measured on CPU, torch 2.13:
6.1 against 3.2 µs; ``add`` 2.9 against 1.6). In a launch-bound model (many small ops: eager
GPU training of small and medium models) that is a fifth of the forward. The code generator
(:mod:`.codegen`) calls, in place of each, :func:`binding_for`'s answer: ``torch.<name>`` or
``torch._C._nn.<name>``, else the Tensor method (``x.view(...)``, ``x.expand(...)``,
``x.add_(y)``, ``x.size(0)`` for ``aten::sym_size``: ops eager code calls only as methods).

**Same op, proven per signature.** A binding chooses an overload from its arguments' types,
so a candidate is accepted only when, run on the node's example values (fake tensors), it
dispatches exactly the ATen ops the ``OpOverload`` dispatches, with the same arguments
(composite ops included: their decompositions are compared), and returns the same structure
(a list and a tuple count as one where the graph only indexes the result: ``aten::split``
gives a list, ``Tensor.split`` a tuple). The proof is cached by op and argument types.
``aten::slice`` is generated as indexing (``x[..., 0:4]``, see :class:`Index`), so are
``aten::index.Tensor`` (``x[:, idx]``) and ``aten::alias`` (``x[...]``, see
:class:`Subscript`), and ``aten::__and__`` and the other dunder ops as operators (``a & b``,
not ``a.__and__(b)``), each where the proof holds. Nodes
without example values (symbolic capture without inputs), ops that write an argument other
than their first and ops of other namespaces keep their ``OpOverload``; an in-place op
(``add_``) is proven on copies of the example values.
"""

from __future__ import annotations

import contextlib
import importlib
import operator
from typing import Any, Callable

import torch
import torch.fx as fx
from torch.fx.node import map_aggregate
from torch.utils._python_dispatch import TorchDispatchMode

from .queries import slice_args

__all__ = ["binding_for", "Method", "Index", "Subscript"]

# NB: not Tensor methods: a method descriptor rejects the proxies a tracer passes (the
# symbolic tracer re-capturing a converted module), where these functions dispatch them.
_NAMESPACES: tuple[Any, ...] = (torch._C._VariableFunctions, torch._C._nn)
_METHOD_NAMES = {"sym_size": "size", "sym_numel": "numel", "sym_stride": "stride",
                 "sym_storage_offset": "storage_offset"}
"""ATen ops whose Tensor method has another name."""
_PROVEN: dict[tuple[Any, ...], Callable[..., Any] | None] = {}
"""(op, argument signature) -> the binding proven to run it, or None (none does)."""


class Method(str):
    """A Tensor method binding, by name: the call is generated as ``x.view(...)``.

    NB: as a method call of the node's first argument, never as the function
    ``torch.Tensor.view``: a method descriptor rejects the proxies a tracer passes (the
    symbolic tracer re-capturing a converted module), where a method call on a proxy records.
    """

    def __call__(self, tensor: Any, *args: Any, **kwargs: Any) -> Any:
        return getattr(tensor, self)(*args, **kwargs)


class Index:
    """The binding of ``aten::slice``: eager code slices by indexing, generated as
    ``x[(slice(None, None, None), slice(0, 4, None))]`` (``x[:, 0:4]``) or, counted from the
    end, ``x[(Ellipsis, slice(0, 4, None))]`` (``x[..., 0:4]``).

    Indexing names the dimension by position, so it dispatches ``slice`` with the dimension
    wrapped (``-1`` of a 4-d tensor as ``3``): the proof runs the ``OpOverload`` with the
    same wrapped dimension, which is what ``aten::slice`` does with a negative one. Of the
    two forms, the proof takes the one whose ``:`` fall on dimensions of known size (with
    symbolic sizes a tracer cannot see that ``:`` takes all, and slices again)."""

    def __init__(self, from_end: bool) -> None:
        self.from_end = from_end

    def __call__(self, tensor: Any, dim: int = 0, *bounds: Any) -> Any:
        return tensor[self.index(dim % tensor.dim(), tensor.dim(), *bounds)]

    def index(self, dim: int, ndim: int, start: Any = None, end: Any = None, step: Any = 1
              ) -> tuple[Any, ...]:
        """The index of a slice of dimension ``dim`` (not negative) of ``ndim``."""
        cut = slice(start, end, None if step == 1 else step)
        if self.from_end:
            return (Ellipsis, cut) + (slice(None),) * (ndim - 1 - dim)
        return (slice(None),) * dim + (cut,)

    @staticmethod
    def wrapped(node: fx.Node) -> tuple[Any, ...] | None:
        """The node's arguments as indexing passes them: the dimension wrapped, the bounds'
        defaults written out (:func:`slice_args`). None if they cannot be."""
        args = slice_args(node)
        val = node.args[0].meta.get("val") if isinstance(node.args[0], fx.Node) else None
        if args is None or not isinstance(val, torch.Tensor) or val.dim() == 0 or \
                not isinstance(args[1], int):
            return None
        x, dim, *bounds = args
        return (x, dim % val.dim(), *bounds)


INDEXES = (Index(from_end=False), Index(from_end=True))


class Subscript:
    """The binding of ``aten::index.Tensor`` and ``aten::alias``: eager code indexes, and
    ``x[:, idx]`` (or ``x[..., idx]``, the index reaching the last dimension) dispatches
    ``aten::index.Tensor(x, [None, idx])``, ``x[...]`` dispatches ``aten::alias(x)``.
    Generated as ``operator.getitem(x, index)``, laid out as indexing (:mod:`.layout`).

    Of the forms, the proof takes one that dispatches exactly the op (with symbolic sizes,
    a ``:`` may slice first: ``...`` does not)."""

    def __init__(self, from_end: bool) -> None:
        self.from_end = from_end

    def __call__(self, tensor: Any, indices: Any = None) -> Any:
        index = self.index(indices, tensor.dim())
        if index is None:
            raise TypeError("no indexing form")
        return tensor[index]

    def index(self, indices: Any, ndim: int) -> Any:
        """The index of ``aten::index.Tensor``'s ``indices`` (``None`` for ``aten::alias``),
        None where this form has none."""
        if indices is None:
            return Ellipsis
        if not isinstance(indices, (list, tuple)) or not indices:
            return None
        skipped = next(k for k, i in enumerate([*indices, 0]) if i is not None)
        tensors = tuple(indices[skipped:])
        if not tensors or any(i is None for i in tensors):
            return None
        if self.from_end:
            if skipped == 0 or len(indices) != ndim:
                return None
            return (Ellipsis, *tensors)
        parts = (slice(None),) * skipped + tensors
        return parts[0] if len(parts) == 1 else parts

    @staticmethod
    def indices(node: fx.Node) -> Any:
        """The node's indices (None for ``aten::alias``)."""
        return node.args[1] if node.target is torch.ops.aten.index.Tensor else None


SUBSCRIPTS = (Subscript(from_end=False), Subscript(from_end=True))
_SUBSCRIPTED = (torch.ops.aten.index.Tensor, torch.ops.aten.alias.default)
_OPERATORS = torch.fx.graph.magic_methods
"""The operators torch.fx writes as such (``a & b``), by their ``operator`` name."""


def binding_for(node: fx.Node, mode: Any) -> Callable[..., Any] | None:
    op = node.target
    if node.op != "call_function" or not isinstance(op, torch._ops.OpOverload) or \
            op.namespace != "aten" or op._schema.is_mutable and not _in_place(op):
        return None
    values = [_value(a) for a in (*node.args, *node.kwargs.values())]
    if any(v is _UNKNOWN for v in values):
        return None
    key: tuple[Any, ...] = (op, tuple(map(_signature, values)), tuple(node.kwargs))
    if op is torch.ops.aten.slice.Tensor:
        # Which indexing form is proven depends on the dimension and on which sizes are
        # known (:class:`Index`), not only on the argument types.
        wrapped = Index.wrapped(node)
        key += (None,) if wrapped is None else (
            wrapped[1], tuple(isinstance(s, int) for s in values[0].shape))
    elif op in _SUBSCRIPTED and isinstance(values[0], torch.Tensor):
        key += (tuple(isinstance(s, int) for s in values[0].shape),)
    if key not in _PROVEN:
        with mode if mode is not None else contextlib.nullcontext():
            _PROVEN[key] = _prove(op, node)
    return _PROVEN[key]


class _Unknown:
    pass


_UNKNOWN = _Unknown()


def _value(arg: Any) -> Any:
    """The example value of an argument; ``_UNKNOWN`` if a node has none."""
    def one(a: Any) -> Any:
        if isinstance(a, fx.Node):
            val = a.meta.get("val")
            return _UNKNOWN if val is None else val
        return a
    out = map_aggregate(arg, one)
    leaves = torch.utils._pytree.tree_leaves(out)
    return _UNKNOWN if any(v is _UNKNOWN for v in leaves) else out


def _signature(value: Any) -> Any:
    """What a binding's overload choice can depend on: types, tensors' dtype and rank."""
    if isinstance(value, torch.Tensor):
        return ("tensor", value.dtype, value.dim(), value.device.type)
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, tuple(_signature(v) for v in value))
    return type(value).__name__


class _Dispatched(TorchDispatchMode):
    """Records the ATen ops a call dispatches."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[Any] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.ops.prim.device.default:  # a fake tensor's device query, not an op
            return func(*args, **kwargs)
        self.ops.append((func, torch.utils._pytree.tree_map(_described, (args, kwargs))))
        return func(*args, **kwargs)


def _described(value: Any) -> Any:
    """An argument as the proof compares it: a tensor by its metadata, anything else as is."""
    if isinstance(value, torch.Tensor):
        return ("tensor", value.dtype, tuple(value.shape), value.stride(), value.device.type)
    return value


def _in_place(op: torch._ops.OpOverload) -> bool:
    """An in-place op that writes its first argument only (``add_``, ``masked_fill_``): eager
    code calls it as a Tensor method, proven on copies of the example values."""
    arguments = op._schema.arguments
    return op._schema.name.endswith("_") and bool(arguments) and \
        arguments[0].alias_info is not None and arguments[0].alias_info.is_write and \
        not any(a.alias_info is not None and a.alias_info.is_write for a in arguments[1:])


def _run(fn: Callable[..., Any], node: fx.Node, node_args: tuple | None = None
         ) -> tuple[list[Any], Any]:
    args, kwargs = map_aggregate((node.args if node_args is None else node_args, node.kwargs),
                                 _value)
    if isinstance(node.target, torch._ops.OpOverload) and node.target._schema.is_mutable:
        # NB: on copies: the proof must not write the graph's example values
        args, kwargs = torch.utils._pytree.tree_map(
            lambda v: v.clone() if isinstance(v, torch.Tensor) else v, (args, kwargs))
    with _Dispatched() as seen:
        out = fn(*args, **kwargs)
    if isinstance(out, list) and all(u.target is operator.getitem for u in node.users):
        # ``aten::split`` returns a list, ``torch.split`` a tuple: the same to a graph that
        # only indexes the result.
        out = tuple(out)
    return seen.ops, torch.utils._pytree.tree_structure(out)


def _nameable(binding: Any) -> bool:
    """Whether the name generated code gives ``binding`` is ``binding``: ``torch.__and__``
    has none, and ``torch.chain_matmul`` names the Python wrapper of
    ``torch._C._VariableFunctions.chain_matmul``, whose arguments differ."""
    try:
        name = torch.fx.node._get_qualified_name(binding)
        module, _, attr = name.rpartition(".")
        return getattr(importlib.import_module(module), attr, None) is binding
    except Exception:
        return False


def _prove(op: torch._ops.OpOverload, node: fx.Node) -> Callable[..., Any] | None:
    if op is torch.ops.aten.slice.Tensor:
        return _prove_index(op, node)
    name = op._schema.name.split("::", 1)[1]
    candidates: list[Callable[..., Any]] = [] if op._schema.is_mutable else [
        getattr(ns, name) for ns in _NAMESPACES
        if hasattr(ns, name) and _nameable(getattr(ns, name))]
    if op in _SUBSCRIPTED and node.args and isinstance(node.args[0], fx.Node):
        candidates = [*SUBSCRIPTS, *candidates]
    # ``aten::__and__`` and the other dunder ops: the operator (``a & b``), as eager code
    # writes them, before the method ``a.__and__(b)``.
    operator_name = next((n for n in (name[2:-2], name[2:-2] + "_") if name.startswith("__")
                          and name.endswith("__") and n in _OPERATORS
                          and hasattr(operator, n)), None)
    if operator_name is not None and not op._schema.is_mutable:
        candidates.insert(0, getattr(operator, operator_name))
    # Ops that eager code calls as Tensor methods only (view, expand, contiguous, add_, ...),
    # some under another name (``aten::sym_size`` is ``x.size(dim)``).
    method = _METHOD_NAMES.get(name, name)
    if hasattr(torch.Tensor, method) and node.args and isinstance(node.args[0], fx.Node):
        candidates.append(Method(method))
    if not candidates:
        return None
    try:
        expected = _run(op, node)
    except Exception:  # cannot be run on its example values: keep the OpOverload
        return None
    for binding in candidates:
        try:
            if _run(binding, node) == expected:
                return binding
        except Exception:  # wrong arguments for this binding: try the next
            continue
    return None


def _prove_index(op: torch._ops.OpOverload, node: fx.Node) -> Index | None:
    wrapped = Index.wrapped(node)
    if wrapped is None:
        return None
    try:
        expected = _run(op, node, wrapped)
    except Exception:  # cannot be run on its example values: keep the OpOverload
        return None
    for binding in INDEXES:
        try:
            if _run(binding, node, wrapped) == expected:
                return binding
        except Exception:
            continue
    return None
