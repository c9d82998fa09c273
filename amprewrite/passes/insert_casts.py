"""InsertCastsPass: make every precision decision an explicit node of the graph.

Walks the graph in topological order. For each classified op it casts the eligible inputs
(floating, not fp64, on the policy's device) that do not already have the dtype the op needs,
sets ``dtype=torch.float32`` on ops that upcast internally, and re-propagates
``meta["val"]`` downstream of every change so later decisions see the new dtypes.

Before::

    linear = torch._C._nn.linear(x, l_weight, l_bias)
    softmax = torch.nn.functional.softmax(linear, dim = -1, _stacklevel = 3, dtype = None)

After (default policy, bf16)::

    x_bf16 = x.to(torch.bfloat16)
    l_weight_bf16 = _amp_weight_cache.cast(l_weight, torch.bfloat16)
    l_bias_bf16 = _amp_weight_cache.cast(l_bias, torch.bfloat16)
    linear = torch._C._nn.linear(x_bf16, l_weight_bf16, l_bias_bf16)
    softmax = torch.nn.functional.softmax(linear, dim = -1, _stacklevel = 3, dtype = torch.float32)

Weights get one shared cast per (weight, dtype) (autocast caches them too). Activations get
one shared cast per (value, dtype) when ``policy.share_activation_casts``, else one per use,
as autocast does. Without dtype knowledge (symbolic capture, no example inputs) activation
casts are ``guarded_cast(x, dtype)`` calls that check their input at run time.
"""

from __future__ import annotations

import dataclasses
import inspect
import itertools
import operator
from typing import Any, Callable

import torch
import torch.fx as fx
from torch.fx.passes.infra.pass_base import PassBase, PassResult

from ..capture.facts import GRAD_KEY, GRAD_MODE_FUNCTIONS
from ..capture.guards import is_input_guards
from ..errors import AmpRewriteError
from ..graph.fake import fake_run, same_val
from ..graph.meta import META_KEY, CastInfo, Decision, cast_info, decision, pending_split
from ..graph.queries import attr_at, cast_source
from ..policy.opkey import op_key, overload_key
from ..policy.policy import Policy
from ..policy.tables import OpCategory
from ..runtime.attention import multi_head_attention
from ..runtime.functions import fp32_if_eligible, guarded_cast, guarded_match, guarded_promote
from ..runtime.weight_cache import CACHE_ATTR, WeightCastCache
from ..runtime.weight_table import gathered_cast_dtype, is_fetch, read_name
from .propagation import mirrored_autocast_at, run_failure, traced_dtype_may_differ

__all__ = ["InsertCastsPass"]

_SHORT = {torch.float16: "f16", torch.bfloat16: "bf16", torch.float32: "f32"}
# Positional index of `dtype` in torch-level builtins / Tensor methods (self counted).
_DTYPE_POSITION = {"softmax": 2, "log_softmax": 2, "cumsum": 2, "cumprod": 2, "sum": 3,
                   "prod": 3, "norm": 4}
_NORM_APPEND = {
    "norm.Scalar": ("ScalarOpt_dtype", 2),
    "norm.ScalarOpt_dim": ("ScalarOpt_dim_dtype", 4),
}


class InsertCastsPass(PassBase):
    """Insert explicit casts for the decisions ClassifyPass recorded."""

    def __init__(self, policy: Policy, dtype: torch.dtype) -> None:
        super().__init__()
        self.policy = policy
        self.dtype = dtype

    # -- driver --------------------------------------------------------------------------
    def call(self, gm: fx.GraphModule) -> PassResult:
        graph = gm.graph
        self.gm = gm
        # Static when the inputs' dtypes are known; nodes whose val the capture could not
        # compute (ops valid only once cast) get it as the walk below reaches them.
        self.static = all("val" in n.meta for n in graph.nodes if n.op == "placeholder") \
            and any("val" in n.meta for n in graph.nodes)
        self.shared: dict[tuple[Any, torch.dtype, Any], fx.Node] = {}
        for node in graph.nodes:  # reuse casts an earlier run made
            info = cast_info(node)
            if info is not None and not info.guarded:
                key = (_share_key(self._cast_input(node)), info.dtype, node.meta.get(GRAD_KEY))
                self.shared[key] = node
        self.changed: set[fx.Node] = set()
        modified = False
        for node in list(graph.nodes):
            rec = decision(node)
            if rec is not None and rec.category is not OpCategory.PASSTHROUGH:
                modified |= self._rewrite(node, rec)
            if self.static and node.op.startswith("call") and cast_info(node) is None \
                    and not _stateful(node):
                self._repropagate(node)
        return PassResult(gm, modified)

    def _repropagate(self, node: fx.Node) -> None:
        """Recompute ``node``'s ``meta["val"]`` from its inputs' (now final) values.

        Not only nodes downstream of a new cast are recomputed: an export traced in the AMP
        regime (:mod:`amprewrite.capture.export`) records the dtypes *autocast* gives each
        op, and the policy may differ from autocast's lists (the default policy's CUDA rules
        on a CPU model), so a recorded dtype is only a first guess wherever autocast decided
        it (:func:`.propagation.traced_dtype_may_differ`).
        """
        inputs = node.all_input_nodes
        missing = node.meta.get("val") is None
        needed = missing or node in self.changed or any(i in self.changed for i in inputs)
        if not needed and not traced_dtype_may_differ(node) and \
                not any(cast_info(i) is not None for i in inputs):
            return  # its inputs are as traced, and autocast did not decide its dtype
        try:
            new = self._run(node)
        except Exception as exc:
            if not needed:
                return  # an op fake tensors cannot run (no meta kernel): keep its record
            if not missing:
                raise AmpRewriteError(
                    run_failure(node, exc, self.policy, self.dtype)) from exc
            raise AmpRewriteError(
                f"the example inputs do not run through node {node.format_node()}, even with "
                f"the policy's casts in place: {type(exc).__name__}: {exc}. Check that the "
                "example inputs are valid for the model (shapes, dtypes, devices).") from exc
        if not same_val(new, node.meta.get("val")):
            self.changed.add(node)
        node.meta["val"] = new

    def _run(self, node: fx.Node) -> Any:
        """``node``'s value on its inputs' values. A composite waiting to be split runs as
        autocast runs it, where the policy mirrors autocast: its pieces cast their inputs, so
        the op whole may meet dtypes it refuses (``einsum`` of bf16 and fp32 reaches ``bmm``)."""
        try:
            return fake_run(self.gm, node)
        except Exception:
            autocast = mirrored_autocast_at(self.policy, node)
            if pending_split(node) is None or autocast is None:
                raise
            with autocast:
                return fake_run(self.gm, node)

    # -- per category --------------------------------------------------------------------
    def _rewrite(self, node: fx.Node, rec: Decision) -> bool:
        category = rec.category
        if category in (OpCategory.LOWER, OpCategory.FP32):
            return self._cast_all(node, rec, lambda _: rec.compute_dtype)
        if category is OpCategory.PROMOTE:
            return self._promote(node, rec)
        if category is OpCategory.MATCH_SELF:
            return self._match_self(node, rec)
        if category is OpCategory.FP32_DTYPE_ARG:
            return self._set_dtype_arg(node, rec)
        if category is OpCategory.FP32_APPEND_DTYPE:
            return self._append_dtype(node, rec)
        if category is OpCategory.BANNED:
            self._check_banned(node, rec)
        return False

    def _cast_all(self, node: fx.Node, rec: Decision,
                  target: Callable[[fx.Node], torch.dtype | None]) -> bool:
        casts: list[str] = []
        # Autocast casts the arguments of an op last one first (the C++ arguments of its
        # wrapper, which GCC-built PyTorch evaluates right to left; a list's elements in
        # order): the same order gives the same autograd graph, so gradients that meet are
        # summed in the same order.
        made: dict[tuple[int, int], fx.Node] = {}
        arguments = [*node.args, *node.kwargs.values()]
        for i in reversed(range(len(arguments))):
            for j, arg in enumerate(_nodes_in(arguments[i])):
                dtype = target(arg)
                if dtype is not None and self._needs_cast(arg, dtype):
                    made[i, j] = self._cast(arg, dtype, node)
        casts.extend(made[key].name for key in sorted(made))

        def replacing(i: int) -> Callable[[fx.Node], fx.Node]:
            count = itertools.count()
            return lambda arg: made.get((i, next(count)), arg)

        node.args = tuple(fx.node.map_arg(a, replacing(i)) for i, a in enumerate(node.args))
        node.kwargs = {k: fx.node.map_arg(v, replacing(len(node.args) + i))
                       for i, (k, v) in enumerate(node.kwargs.items())}
        if casts:
            self.changed.add(node)
            node.meta[META_KEY] = dataclasses.replace(
                rec, casts=rec.casts + tuple(casts), guarded=rec.guarded or not self.static)
        return bool(casts)

    def _promote(self, node: fx.Node, rec: Decision) -> bool:
        if not self.static:
            return self._promote_guarded(node, rec)
        low = rec.compute_dtype or self.dtype
        eligible = [a for a in node.all_input_nodes if self._eligible(a)]
        if not eligible:
            return False
        widest = low if all(_dtype(a) == low for a in eligible) else torch.float32
        if widest != rec.compute_dtype:
            node.meta[META_KEY] = rec = dataclasses.replace(rec, compute_dtype=widest)
        return self._cast_all(node, rec, lambda a: widest)

    def _promote_guarded(self, node: fx.Node, rec: Decision) -> bool:
        inputs = [a for a in node.all_input_nodes if not self._is_weight(a)
                  and cast_info(a) is None]
        # Items of a guarded_promote (ours, or in a re-traced converted module, where they
        # carry no CastInfo) are promoted already.
        if not inputs or any(_promoted_item(a) for a in node.all_input_nodes):
            return False
        graph = node.graph
        low = rec.compute_dtype or self.dtype
        with graph.inserting_before(node):
            promoted = graph.call_function(guarded_promote,
                                           (list(inputs), low, self.policy.device_type))
            promoted.meta[META_KEY] = CastInfo(low, guarded=True, weight=False)
            items = {}
            for i, a in enumerate(inputs):
                items[a] = graph.call_function(operator.getitem, (promoted, i))
        node.args = fx.node.map_arg(node.args, lambda a: items.get(a, a))
        node.kwargs = fx.node.map_arg(node.kwargs, lambda a: items.get(a, a))
        node.meta[META_KEY] = dataclasses.replace(rec, casts=(promoted.name,), guarded=True)
        return True

    def _match_self(self, node: fx.Node, rec: Decision) -> bool:
        """Cast the floating sources of a destination-writing op (``masked_scatter``,
        ``index_put``...) to the destination's dtype, its first input's."""
        destination = node.args[0] if node.args else None
        if not isinstance(destination, fx.Node):
            return False
        if not self.static:
            return self._match_guarded(node, rec, destination)
        val = destination.meta.get("val")
        if not (isinstance(val, torch.Tensor) and val.is_floating_point()):
            return False  # an integer destination: torch's own rules apply
        if val.dtype != rec.compute_dtype:
            node.meta[META_KEY] = rec = dataclasses.replace(rec, compute_dtype=val.dtype)
        return self._cast_all(node, rec, lambda a: None if a is destination else val.dtype)

    def _match_guarded(self, node: fx.Node, rec: Decision, destination: fx.Node) -> bool:
        sources = [a for a in node.all_input_nodes if a is not destination
                   and not _matched(a)]
        if not sources:
            return False
        graph = node.graph
        matched = {}
        with graph.inserting_before(node):
            for a in sources:
                matched[a] = graph.call_function(guarded_match,
                                                 (a, destination, self.policy.device_type))
                matched[a].meta[META_KEY] = CastInfo(self.dtype, guarded=True, weight=False)
        node.args = fx.node.map_arg(node.args, lambda a: matched.get(a, a))
        node.kwargs = fx.node.map_arg(node.kwargs, lambda a: matched.get(a, a))
        node.meta[META_KEY] = dataclasses.replace(
            rec, casts=tuple(m.name for m in matched.values()), guarded=True)
        return True

    def _set_dtype_arg(self, node: fx.Node, rec: Decision) -> bool:
        first = node.args[0] if node.args else next(iter(node.kwargs.values()), None)
        position = _dtype_position(node)
        given = node.kwargs.get("dtype")
        if given is None and position is not None and len(node.args) > position:
            given = node.args[position]
        if given is not None or not isinstance(first, fx.Node):
            return False
        if self.static:
            if not self._eligible(first):
                return False
            value: Any = torch.float32
        else:
            with node.graph.inserting_before(node):
                value = node.graph.call_function(fp32_if_eligible,
                                                 (first, self.policy.device_type))
        if position is not None and len(node.args) > position:
            args = list(node.args)
            args[position] = value
            node.args = tuple(args)
        else:
            node.kwargs = {**node.kwargs, "dtype": value}
        node.meta[META_KEY] = dataclasses.replace(rec, guarded=not self.static)
        self.changed.add(node)
        return True

    def _append_dtype(self, node: fx.Node, rec: Decision) -> bool:
        """aten ``norm.Scalar`` / ``norm.ScalarOpt_dim`` → the overload that takes a dtype."""

        target = _NORM_APPEND.get(overload_key(node) or "")
        if target is None:  # torch-level norm: it has a dtype argument
            return self._set_dtype_arg(node, rec)
        first = node.args[0]
        if self.static and not self._eligible(first):
            return False
        overload, n_args = target
        args = list(node.args)
        if len(args) < 2:
            args.append(2)
        if overload == "ScalarOpt_dim_dtype" and len(args) < 4:
            args.append(node.kwargs.get("keepdim", False))
        node.target = getattr(torch.ops.aten.norm, overload)
        node.args = tuple(args[:n_args])
        node.kwargs = {"dtype": torch.float32}
        self.changed.add(node)
        return True

    def _check_banned(self, node: fx.Node, rec: Decision) -> None:
        first = node.args[0] if node.args else None
        if self.static and isinstance(first, fx.Node) and not self._eligible(first):
            return
        raise AmpRewriteError(
            f"{rec.op} is unsafe in low precision and the policy bans it ({rec.rule}): "
            f"node {node.format_node()}. Many models put a sigmoid right before "
            "binary_cross_entropy; combine them with binary_cross_entropy_with_logits "
            "(BCEWithLogitsLoss), which is safe. Or convert with the default Policy(), which "
            f"runs {rec.op} in fp32, or override it: Policy.autocast(...).override("
            f"ops={{{rec.op!r}: OpCategory.FP32}})."
        )

    # -- eligibility and cast nodes ------------------------------------------------------
    def _is_weight(self, node: fx.Node) -> bool:
        return read_name(node) is not None

    def _weight_value(self, node: fx.Node) -> Any:
        return attr_at(self.gm, str(read_name(node)))

    def _eligible(self, node: fx.Node) -> bool:
        if self._is_weight(node):
            val = self._weight_value(node)
        else:
            val = node.meta.get("val")
        return (isinstance(val, torch.Tensor) and val.is_floating_point()
                and val.dtype != torch.float64
                and (self.policy.device_type is None
                     or val.device.type == self.policy.device_type))

    def _needs_cast(self, node: fx.Node, dtype: torch.dtype) -> bool:
        if self.static or self._is_weight(node):
            return self._eligible(node) and _dtype(node, self) != dtype
        # Dtypes unknown: a value that is already a conversion to `dtype` (ours, or one a
        # re-traced converted module contains) needs no second cast.
        source = cast_source(node)
        if source is None:
            return gathered_cast_dtype(node) != dtype
        return source[1] != dtype

    def _cast_input(self, cast: fx.Node) -> fx.Node:
        return cast.args[1] if cast.args and cast.args[0].op == "get_attr" and \
            cast.args[0].target == CACHE_ATTR else cast.args[0]

    def _cast(self, value: fx.Node, dtype: torch.dtype, consumer: fx.Node) -> fx.Node:
        weight = self._is_weight(value)
        share = weight or self.policy.share_activation_casts
        key = (_share_key(value), dtype, consumer.meta.get(GRAD_KEY))
        if share and key in self.shared:
            return self.shared[key]
        graph = consumer.graph
        name = f"{value.name}_{_SHORT.get(dtype, str(dtype).split('.')[-1])}"
        with graph.inserting_before(consumer):
            if weight:
                cache = self._cache_node(graph)
                cast = graph.create_node("call_method", "cast", (cache, value, dtype), name=name)
            elif self.static:
                cast = graph.create_node("call_method", "to", (value, dtype), name=name)
            else:
                cast = graph.create_node("call_function", guarded_cast,
                                         (value, dtype, self.policy.device_type), name=name)
        cast.meta[META_KEY] = CastInfo(dtype, guarded=not self.static and not weight,
                                       weight=weight)
        for meta_key in ("nn_module_stack", "stack_trace", GRAD_KEY):
            if meta_key in consumer.meta:
                cast.meta[meta_key] = consumer.meta[meta_key]
        if self.static:
            source = value.meta.get("val")
            if weight and source is None:
                source = self._weight_value(value)
            cast.meta["val"] = _fake_cast(source, dtype, consumer)
        if share:
            self.shared[key] = cast
        return cast

    def _cache_node(self, graph: fx.Graph) -> fx.Node:
        if not isinstance(getattr(self.gm, CACHE_ATTR, None), WeightCastCache):
            setattr(self.gm, CACHE_ATTR, WeightCastCache())
        for node in graph.nodes:
            if node.op == "get_attr" and node.target == CACHE_ATTR:
                return node
        first = next(n for n in graph.nodes if n.op != "placeholder")
        with graph.inserting_before(first):
            # NB: create_node, not graph.get_attr: the cache is a plain attribute, not a
            # parameter, buffer or submodule, which get_attr would warn about.
            return graph.create_node("get_attr", CACHE_ATTR)


def _stateful(node: fx.Node) -> bool:
    """Calls not to re-run on fake tensors: the grad-mode calls of an inlined ``no_grad``
    region (they would flip the converting process's grad mode), torch.export's input-shape
    guard, the gathered weight reads (their values are the weights', recorded already) and
    a fused attention call (its sub-graph's ops were converted before it was made)."""
    if node.op == "call_function" and node.target is operator.getitem and \
            isinstance(node.args[0], fx.Node) and is_fetch(node.args[0]):
        return True
    return (node.op == "call_function" and (node.target in GRAD_MODE_FUNCTIONS
                                            or node.target is multi_head_attention)) or \
        is_input_guards(node) or is_fetch(node)


def _nodes_in(argument: Any) -> list[fx.Node]:
    """The nodes of one argument, in order (several for a list of tensors)."""
    found: list[fx.Node] = []
    fx.node.map_arg(argument, found.append)
    return found


def _matched(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target is guarded_match


def _promoted_item(node: fx.Node) -> bool:
    """Whether ``node`` is ``guarded_promote(...)[i]`` (or the promote call itself)."""
    if node.op == "call_function" and node.target is operator.getitem:
        node = node.args[0] if isinstance(node.args[0], fx.Node) else node
    return node.op == "call_function" and node.target is guarded_promote


def _share_key(value: fx.Node) -> Any:
    # A weight may be fetched by several get_attr nodes; its cast is shared by attribute name.
    name = read_name(value)
    return ("get_attr", name) if name is not None else value


def _dtype(node: fx.Node, owner: InsertCastsPass | None = None) -> torch.dtype | None:
    if owner is not None and owner._is_weight(node):
        return owner._weight_value(node).dtype
    val = node.meta.get("val")
    return val.dtype if isinstance(val, torch.Tensor) else None


def _fake_cast(source: Any, dtype: torch.dtype, consumer: fx.Node) -> Any:
    from torch._guards import detect_fake_mode

    if not isinstance(source, torch.Tensor):
        return None
    mode = detect_fake_mode([source]) or detect_fake_mode(
        [a.meta.get("val") for a in consumer.all_input_nodes])
    if mode is not None and not isinstance(source, torch._subclasses.FakeTensor):
        source = mode.from_tensor(source)
    return source.to(dtype)


def _dtype_position(node: fx.Node) -> int | None:
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        for i, arg in enumerate(target._schema.arguments):
            if arg.name == "dtype":
                return None if arg.kwarg_only else i
        return None
    if node.op == "call_function" and inspect.isfunction(target):
        params = list(inspect.signature(target).parameters.values())
        for i, p in enumerate(params):
            if p.name == "dtype":
                return i if p.kind in (p.POSITIONAL_OR_KEYWORD, p.POSITIONAL_ONLY) else None
        return None

    return _DTYPE_POSITION.get(op_key(node))
