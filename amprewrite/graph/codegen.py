"""Generated code that calls ATen ops through torch's Python bindings, not ``torch.ops``.

A captured graph calls ``torch.ops.aten.layer_norm.default(...)``: an ``OpOverload``, whose
call parses its arguments against the JIT schema and costs 1.5-3 µs more than
``torch.layer_norm(...)``, the generated binding eager code calls (measured on CPU, torch 2.13:
6.1 against 3.2 µs; ``add`` 2.9 against 1.6). In a launch-bound model (many small ops: eager
GPU training of small and medium models) that is a fifth of the forward.

:func:`recompile_with_bindings` regenerates ``gm.forward`` with each such call replaced by
the binding that runs the *same* ATen op: ``torch.<name>`` or ``torch._C._nn.<name>``, else
the Tensor method (``x.view(...)``, ``x.expand(...)``: ops eager code calls only as methods).
The graph keeps its ``OpOverload`` targets (every pass, ``explain`` and ``lint`` read those);
only the generated code changes, so a later ``gm.recompile()`` gives the plain code back,
equal in results.

Before::

    layer_norm = torch.ops.aten.layer_norm.default(add, [8], w, b, 1e-05, False)
    add = torch.ops.aten.add.Tensor(view, layer_norm)

After::

    layer_norm = torch.layer_norm(add, [8], w, b, 1e-05, False)
    add = torch.add(view, layer_norm)

**Same op, proven per signature.** A binding chooses an overload from its arguments' types,
so a candidate is accepted only when, run on the node's example values (fake tensors), it
dispatches exactly the ATen ops the ``OpOverload`` dispatches, with the same arguments
(composite ops included: their decompositions are compared), and returns the same structure
(a list and a tuple count as one where the graph only indexes the result: ``aten::split``
gives a list, ``Tensor.split`` a tuple). The proof is cached by op and argument types.
``aten::slice`` is generated as indexing (``x[..., 0:4]``, see :class:`_Index`). Nodes
without example values (symbolic capture without inputs), mutating ops and ops of other
namespaces keep their ``OpOverload``.

**Casts.** A cast node ``x.to(torch.bfloat16)`` is generated as ``x.bfloat16()``: the same
op, without the overload resolution of ``Tensor.to`` (:data:`CAST_METHODS`). So is a
parameter cast, ``_amp_weight_cache.cast(w, torch.bfloat16)``, where the forward's weight
read already handed over the cached copy (:mod:`amprewrite.runtime.weight_table`): the
method returns a tensor already in its dtype as it is, and a parameter that needs a
gradient is cast where it is used, with autograd, as the cache's ``cast`` would.

**Arguments.** An exported module's forward starts by flattening its arguments against the
input spec, ``x, = fx_pytree.tree_flatten_spec(([x], {}), self._in_spec)``, which for
positional tensor arguments binds each name to itself (3.5 µs per call). That line is left
out where it is such an identity (:class:`_DirectArgumentsCodeGen`).
"""

from __future__ import annotations

import contextlib
import importlib
import operator
from typing import Any, Callable

import torch
import torch.fx as fx
from torch.fx.graph import _PyTreeCodeGen
from torch.fx.node import map_aggregate
from torch.utils._python_dispatch import TorchDispatchMode

from ..runtime.functions import CAST_METHODS
from ..runtime.weight_cache import CACHE_ATTR
from ..runtime.weight_table import handed_cast_dtype
from .fake import graph_fake_mode
from .queries import slice_args

__all__ = ["recompile_with_bindings"]

# NB: not Tensor methods: a method descriptor rejects the proxies a tracer passes (the
# symbolic tracer re-capturing a converted module), where these functions dispatch them.
_NAMESPACES: tuple[Any, ...] = (torch._C._VariableFunctions, torch._C._nn)
_PROVEN: dict[tuple[Any, ...], Callable[..., Any] | None] = {}
"""(op, argument signature) -> the binding proven to run it, or None (none does)."""


class _Method(str):
    """A Tensor method binding, by name: the call is generated as ``x.view(...)``.

    NB: as a method call of the node's first argument, never as the function
    ``torch.Tensor.view``: a method descriptor rejects the proxies a tracer passes (the
    symbolic tracer re-capturing a converted module), where a method call on a proxy records.
    """

    def __call__(self, tensor: Any, *args: Any, **kwargs: Any) -> Any:
        return getattr(tensor, self)(*args, **kwargs)


class _Index:
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


_INDEXES = (_Index(from_end=False), _Index(from_end=True))


def recompile_with_bindings(gm: fx.GraphModule) -> fx.GraphModule:
    """Regenerate ``gm``'s code with proven bindings in place of ``torch.ops.aten`` calls."""
    swapped: list[tuple[fx.Node, str, Any, tuple, dict]] = []
    mode = graph_fake_mode(gm)
    for node in gm.graph.nodes:
        cast = _cast_method(node)
        if cast is not None:
            swapped.append((node, node.op, node.target, node.args, node.kwargs))
            node.op, node.target, node.args = "call_method", cast[0], (cast[1],)
            continue
        binding = _binding_for(node, mode)
        if binding is not None:
            swapped.append((node, node.op, node.target, node.args, node.kwargs))
            if isinstance(binding, _Method):
                node.op, node.target = "call_method", str(binding)
            elif isinstance(binding, _Index):
                x, dim, *bounds = _Index.wrapped(node)  # type: ignore[misc]
                index = binding.index(dim, x.meta["val"].dim(), *bounds)
                node.target, node.args = operator.getitem, (x, index)
            else:
                node.target = binding
    codegen = gm.graph._codegen
    if type(codegen) is _PyTreeCodeGen:
        gm.graph._codegen = _DirectArgumentsCodeGen(codegen.pytree_info)
    try:
        gm.recompile()
    finally:
        gm.graph._codegen = codegen
        for node, op, target, args, kwargs in swapped:  # the graph keeps its OpOverloads
            node.op, node.target, node.args, node.kwargs = op, target, args, kwargs
    return gm


class _DirectArgumentsCodeGen(_PyTreeCodeGen):
    """An exported forward's code without the flattening of its arguments where that binds
    each placeholder to the argument of the same name: positional arguments that are each one
    tensor (a leaf of the input spec), no keyword arguments."""

    def gen_var_bindings(self, fn_args: list[str], free_vars: list[str],
                         expanded_def: bool) -> str:
        names = [v.split(":")[0].split("#")[0].strip() for v in free_vars]  # no annotations
        if list(fn_args) == names and _positional_leaves(self.pytree_info.in_spec, len(names)):
            return ""
        return super().gen_var_bindings(fn_args, free_vars, expanded_def)


def _positional_leaves(spec: Any, n: int) -> bool:
    """Whether the input spec ``spec`` is ``(args, {})`` with ``n`` positional arguments that
    are each a leaf."""
    if spec.type is not tuple or spec.num_children != 2:
        return False
    args, kwargs = spec.child(0), spec.child(1)
    return args.type is tuple and kwargs.type is dict and kwargs.num_children == 0 and \
        args.num_children == n and all(args.child(i).is_leaf() for i in range(n))


def _cast_method(node: fx.Node) -> tuple[str, fx.Node] | None:
    """The dtype's own method and its input, for a cast node generated as that method call:
    a cast of a tensor to a dtype, ``x.to(dtype)`` or ``aten.to.dtype(x, dtype)`` (what
    ``x.to(dtype)`` and ``x.bfloat16()`` both dispatch), and a parameter cast
    ``_amp_weight_cache.cast(w, dtype)`` of a weight that the forward's read hands over as
    the cached copy where the cast needs no gradient (``w.bfloat16()`` then returns that
    copy, and casts with autograd where it is needed)."""
    if node.kwargs or len(node.args) < 2 or not isinstance(node.args[-1], torch.dtype):
        return None
    if (node.op == "call_method" and node.target == "to"
            or node.op == "call_function" and node.target is torch.ops.aten.to.dtype) and \
            len(node.args) == 2 and isinstance(node.args[0], fx.Node) and \
            isinstance(node.args[0].meta.get("val"), torch.Tensor):
        # NB: only for a known tensor: symbolic capture records ``.to(dtype)`` of any object
        # that has one (a user's batch class), which need not have ``.bfloat16()``.
        x, dtype = node.args
    elif node.op == "call_method" and node.target == "cast" and len(node.args) == 3 and \
            getattr(node.args[0], "target", None) == CACHE_ATTR and \
            handed_cast_dtype(node.args[1]) is node.args[2]:
        _, x, dtype = node.args
    else:
        return None
    method = CAST_METHODS.get(dtype)
    return None if method is None else (method, x)


def _binding_for(node: fx.Node, mode: Any) -> Callable[..., Any] | None:
    op = node.target
    if node.op != "call_function" or not isinstance(op, torch._ops.OpOverload) or \
            op.namespace != "aten" or op._schema.is_mutable:
        return None
    values = [_value(a) for a in (*node.args, *node.kwargs.values())]
    if any(v is _UNKNOWN for v in values):
        return None
    key: tuple[Any, ...] = (op, tuple(map(_signature, values)), tuple(node.kwargs))
    if op is torch.ops.aten.slice.Tensor:
        # Which indexing form is proven depends on the dimension and on which sizes are
        # known (:class:`_Index`), not only on the argument types.
        wrapped = _Index.wrapped(node)
        key += (None,) if wrapped is None else (
            wrapped[1], tuple(isinstance(s, int) for s in values[0].shape))
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


def _run(fn: Callable[..., Any], node: fx.Node, node_args: tuple | None = None
         ) -> tuple[list[Any], Any]:
    args, kwargs = map_aggregate((node.args if node_args is None else node_args, node.kwargs),
                                 _value)
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
    candidates: list[Callable[..., Any]] = [
        getattr(ns, name) for ns in _NAMESPACES
        if hasattr(ns, name) and _nameable(getattr(ns, name))]
    # Ops that eager code calls as Tensor methods only (view, expand, contiguous, ...).
    if hasattr(torch.Tensor, name) and node.args and isinstance(node.args[0], fx.Node):
        candidates.append(_Method(name))
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


def _prove_index(op: torch._ops.OpOverload, node: fx.Node) -> _Index | None:
    wrapped = _Index.wrapped(node)
    if wrapped is None:
        return None
    try:
        expected = _run(op, node, wrapped)
    except Exception:  # cannot be run on its example values: keep the OpOverload
        return None
    for binding in _INDEXES:
        try:
            if _run(binding, node, wrapped) == expected:
                return binding
        except Exception:
            continue
    return None
