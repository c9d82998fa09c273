"""Symbolic capture: model → GraphModule whose weights are ``get_attr`` nodes, no inputs needed.

A ``torch.fx.Tracer`` that traces *through* torch.nn layers (``nn.Linear`` becomes
``F.linear(x, self.weight, self.bias)``), except layers whose forward depends on
``self.training`` (BatchNorm, InstanceNorm, Dropout), which stay ``call_module`` leaves so that
``gm.train()`` / ``gm.eval()`` keep working. ``with torch.autocast(...)`` regions that the model
opens are recorded on the nodes they contain (plain symbolic_trace drops them). The other
front end, ``torch.export`` in the AMP regime, is :mod:`amprewrite.capture.export`.

The GraphModule shares the model's parameters and buffers (the same tensor objects: fp32
master weights) and never modifies the model. :func:`propagate_meta` gives its nodes dtypes
when example inputs are known.
"""

from __future__ import annotations

import contextlib
import copy
import operator
from typing import Any, Iterator

import torch
import torch.fx as fx
import torch.nn as nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

from ..errors import AmpRewriteError
from ..graph.fake import fake_state
from ..graph.queries import attr_at
from ..policy.opkey import module_op_names
from ..policy.registry import registered_functions
from ..runtime.attention import multi_head_attention
from ..runtime.fp8 import FP8_FUNCTIONS
from ..runtime.functions import RUNTIME_FUNCTIONS
from ..runtime.low_copies import LOW_COPIES_ATTR
from ..runtime.weight_cache import CACHE_ATTR, WeightCastCache
from ..runtime.weight_table import WEIGHTS_ATTR, WeightTable
from .facts import REGION_KEY, Region

__all__ = ["capture_symbolic", "propagate_meta", "unshare_leaf_modules"]


# ---------------------------------------------------------------------------------------------
# symbolic
class _AmpTracer(fx.Tracer):
    def __init__(self) -> None:
        super().__init__(autowrap_functions=RUNTIME_FUNCTIONS + FP8_FUNCTIONS
                         + (multi_head_attention,) + registered_functions())
        self.regions: list[Region] = []
        self.leaf_types = tuple(t for t, _ in module_op_names())

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        return isinstance(m, self.leaf_types)

    def create_node(self, *args: Any, **kwargs: Any) -> fx.Node:
        node = super().create_node(*args, **kwargs)
        if self.regions:
            node.meta[REGION_KEY] = self.regions[-1]
        return node

    def trace(self, root: Any, concrete_args: Any = None) -> fx.Graph:
        with _patched(_trace_patches(self)):
            return super().trace(root, concrete_args)


_MISSING = object()


@contextlib.contextmanager
def _patched(patches: list[tuple[Any, str, Any]]) -> Iterator[None]:
    """Set ``owner.name = value`` for each patch during the block; put back (or delete) after."""
    saved = [(owner, name, owner.__dict__.get(name, _MISSING)) for owner, name, _ in patches]
    for owner, name, value in patches:
        setattr(owner, name, value)
    try:
        yield
    finally:
        for owner, name, value in saved:
            if value is _MISSING:
                delattr(owner, name)
            else:
                setattr(owner, name, value)


def _trace_patches(tracer: _AmpTracer) -> list[tuple[Any, str, Any]]:
    """What the tracer changes while it traces, as ``(owner, attribute, value)``."""
    autocast_cls = torch.amp.autocast_mode.autocast
    cast = WeightCastCache.cast

    # Record regions instead of entering them: the model's autocast calls run at trace
    # time and would otherwise vanish from the graph.
    def _enter(ac: Any) -> Any:
        tracer.regions.append(Region(ac.device, ac.fast_dtype if ac._enabled else None,
                                     bool(ac._enabled)))
        return ac

    def _exit(ac: Any, *exc: Any) -> bool:
        tracer.regions.pop()
        return False

    # A converted module traced again: its weight casts stay single graph nodes.
    def _cast(cache: WeightCastCache, weight: Any, dtype: torch.dtype) -> Any:
        if not isinstance(weight, fx.Proxy):
            return cast(cache, weight, dtype)
        # The converted module may sit inside the traced one: fetch its own cache.
        path = next((f"{q}.{CACHE_ATTR}" if q else CACHE_ATTR)
                    for q, m in tracer.root.named_modules()
                    if getattr(m, CACHE_ATTR, None) is cache)
        cache_proxy = tracer.create_proxy("get_attr", path, (), {})
        return tracer.create_proxy("call_method", "cast", (cache_proxy, weight, dtype), {})

    # ... and its gathered weight reads become get_attr and cast nodes again.
    def _fetch(table: WeightTable, *entries: tuple, cache: Any = None,
               store: Any = None) -> tuple:
        prefix = next(q for q, m in tracer.root.named_modules()
                      if m.__dict__.get(WEIGHTS_ATTR) is table)
        out = []
        for entry in entries or table.entries:  # the converted code names none: the table's
            path = f"{prefix}.{entry[0]}" if prefix else entry[0]
            read = tracer.create_proxy("get_attr", path, (), {})
            if len(entry) < 3:  # a plain read, or a parameter its cast node reads (_cast)
                out.append(read)
                continue
            # The inner module's O2 store: a plain attribute, read by path.
            holder = tracer.create_proxy(
                "get_attr", f"{prefix}.{LOW_COPIES_ATTR}" if prefix else LOW_COPIES_ATTR, (), {})
            out.append(tracer.create_proxy("call_method", "get", (holder, read, entry[1]), {}))
        return tuple(out)

    # NB: fx.Proxy has no in-place operators, so `h += x` would be traced as `h = h + x`:
    # out of place, it promotes a low-precision h to fp32 where the model keeps h's dtype.
    return [(autocast_cls, "__enter__", _enter), (autocast_cls, "__exit__", _exit),
            (WeightCastCache, "cast", _cast), (WeightTable, "fetch", _fetch)] + \
        [(fx.Proxy, name, _inplace_operator(fn)) for name, fn in _INPLACE_OPERATORS.items()]


_INPLACE_OPERATORS = {"__iadd__": operator.iadd, "__isub__": operator.isub,
                      "__imul__": operator.imul, "__itruediv__": operator.itruediv}


def _inplace_operator(fn: Any) -> Any:
    def record(self: fx.Proxy, other: Any) -> fx.Proxy:
        return self.tracer.create_proxy("call_function", fn, (self, other), {})
    return record


def capture_symbolic(model: nn.Module, share_leaves: bool = False) -> fx.GraphModule:
    """Trace ``model`` through its nn layers. Raises AmpRewriteError naming the construct the
    tracer could not follow, and pointing at ``example_inputs`` (torch.export) instead.
    ``share_leaves``: the layers kept whole are the model's own (they run with its flags and
    hooks at each call: a converted module whose submodules are the model's); else copies."""
    if "forward" in model.__dict__:
        raise AmpRewriteError(
            f"{type(model).__name__} has a forward set on the instance (model.forward = ...), "
            "which the symbolic tracer does not follow: it traces the class's forward, and the "
            "converted module would compute something else than model(x). Pass "
            "example_inputs=(...) to capture with torch.export, which calls the model as "
            "eager does, or set the forward on the class.")
    tracer = _AmpTracer()
    try:
        graph = tracer.trace(model)
    except Exception as exc:  # the tracer raises many types; all mean "not traceable"
        raise AmpRewriteError(
            f"symbolic tracing of {type(model).__name__} failed: {type(exc).__name__}: {exc}\n"
            "The symbolic tracer cannot follow data-dependent control flow or Python on tensor "
            "values. Pass example_inputs=(...) to capture with torch.export instead, or use "
            "amprewrite.compile(model) for models with graph breaks."
        ) from exc
    gm = fx.GraphModule(model, graph, class_name=type(model).__name__)
    if not share_leaves:
        unshare_leaf_modules(gm)
    return gm


def unshare_leaf_modules(gm: fx.GraphModule) -> None:
    """Give the GraphModule its own leaf-module objects (same parameter and buffer tensors)
    so that ``gm.eval()`` does not flip the training flag of the user's model."""
    for node in gm.graph.nodes:
        if node.op != "call_module":
            continue
        parent_name, _, attr = str(node.target).rpartition(".")
        parent = gm.get_submodule(parent_name)
        original = getattr(parent, attr)
        clone = copy.copy(original)
        for field in ("_parameters", "_buffers", "_modules", "_non_persistent_buffers_set"):
            setattr(clone, field, copy.copy(getattr(original, field)))
        # Drop hook dicts shared with the original (copy.copy shares them).
        for field, value in vars(original).items():
            if field.endswith("_hooks") and isinstance(value, dict):
                setattr(clone, field, copy.copy(value))
        setattr(parent, attr, clone)
    # Intermediate modules GraphModule created are fresh; the root's flag follows the model's.
    gm.train(gm.training)


# ---------------------------------------------------------------------------------------------
# dtype knowledge for symbolic graphs
def propagate_meta(gm: fx.GraphModule, args: tuple, kwargs: dict[str, Any] | None) -> None:
    """Fill ``meta["val"]`` of every node by running the graph on fake copies of the inputs."""
    if kwargs:
        placeholders = [n.target for n in gm.graph.nodes if n.op == "placeholder"]
        args = tuple(args) + tuple(kwargs[p] for p in placeholders[len(args):] if p in kwargs)
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    fake_args = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args]
    try:
        with fake_state(gm, mode):
            FakeTensorProp(gm, mode).propagate_dont_convert_inputs(*fake_args)
    except Exception:
        # NB: some models run only under autocast (``torch.dot(f16, f32)`` is an error
        # unless autocast's promote casts first). Nodes from the failing one on keep no
        # ``val``; InsertCastsPass fills them in once the casts are in place, and raises
        # if the node still cannot run.
        pass
    for node in gm.graph.nodes:
        if node.op == "get_attr" and "val" not in node.meta:
            value = _attr(gm, str(node.target))
            if isinstance(value, torch.Tensor):
                node.meta["val"] = mode.from_tensor(value)


def _attr(module: nn.Module, target: str) -> Any:
    return attr_at(module, target)
