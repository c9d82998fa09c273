"""DecomposeCompositesPass: split unlisted composite ops the way autocast sees them.

Autocast wraps an op only if it is listed; an unlisted op with a ``CompositeImplicitAutograd``
kernel (``einsum``, ``tensordot``, ``inner``, ``bilinear``, ``gru_cell``, …) falls through and
runs its decomposition, whose ops go through autocast one by one. So under CPU autocast
``torch.einsum("bij,bjk->bik", a, b)`` computes its ``bmm`` in bf16, while ``einsum`` itself
is not on the CPU list. A graph node for the whole op would run it in fp32.

This pass replaces such a node by its decomposition (traced with ``make_fx`` on the node's
fake inputs) when, and only when, the decomposition reaches an op the policy lists; the other
passes then treat the pieces as autocast does. Composites whose pieces are all unlisted stay
whole, so ``gm.code`` keeps its readable torch-level calls.

Before (``Policy.autocast("cpu")``)::

    einsum = torch.functional.einsum('bij,bjk->bik', a, b)

After::

    permute = torch.ops.aten.permute.default(unsqueeze, [0, 1, 3, 2]) ...
    bmm = torch.ops.aten.bmm.default(view, view_1)
    view_3 = torch.ops.aten.view.default(permute_4, [2, 3, 5])

NB: it needs dtypes and shapes (``meta["val"]``). Without example inputs (guarded casts) the
composite stays whole and runs in the dtype that reaches it.
"""

from __future__ import annotations

import contextlib
import inspect
import operator
import warnings
from typing import Any

import torch
import torch.fx as fx
from torch._guards import detect_fake_mode
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.passes.infra.pass_base import PassBase, PassResult

from ..capture.facts import REGION_KEY
from ..graph.meta import PIECES_KEY
from ..policy.opkey import is_inplace, op_key, overload_key
from ..policy.policy import Policy
from ..policy.tables import OpCategory

__all__ = ["DecomposeCompositesPass"]

_KEPT_META = ("nn_module_stack", "stack_trace", "source_fn_stack", REGION_KEY)


class DecomposeCompositesPass(PassBase):
    """Inline the decomposition of unlisted composite ops that reach a listed op."""

    def __init__(self, policy: Policy) -> None:
        super().__init__()
        self.policy = policy

    def call(self, gm: fx.GraphModule) -> PassResult:
        modified = False
        # NB: a trace costs tens of milliseconds (make_fx), and a vision model holds a hundred
        # batch norms: calls like one whose decomposition reached no listed op are not traced
        # again. Like: the same op and non-tensor arguments, tensors of the same dtype, rank,
        # device and autograd flag (the sizes differ; decompositions of one op that reach a
        # listed op at some sizes only are not known to exist).
        whole: dict[tuple, frozenset[str]] = {}  # signature -> the pieces' op names
        for node in list(gm.graph.nodes):
            if not self._candidate(node):
                continue
            like = _signature(node)
            if like in whole:
                node.meta[PIECES_KEY] = whole[like]
                continue
            sub = _trace(node)
            if sub is None:
                self._warn_if_reaches_listed(node)
                continue
            if not any(self._listed(n) for n in sub.graph.nodes):
                whole[like] = node.meta[PIECES_KEY] = frozenset(
                    op_key(n) for n in sub.graph.nodes if n.op == "call_function")
                continue
            modified |= _inline(gm, node, sub)
        if modified:
            gm.graph.lint()
            gm.recompile()
        return PassResult(gm, modified)

    def _candidate(self, node: fx.Node) -> bool:
        if node.op not in ("call_function", "call_method") or is_inplace(node):
            return False
        if not isinstance(node.meta.get("val"), torch.Tensor) and not _tensor_tuple(node):
            return False
        if any(not isinstance(a.meta.get("val"), torch.Tensor) for a in node.all_input_nodes):
            return False
        key = op_key(node)
        policy = self.policy
        region = node.meta.get(REGION_KEY)
        if region is not None and not region.enabled:
            return False  # the model's own enabled=False region: nothing is autocast
        if policy.table_rule(key, overload_key(node)) is not None or \
                policy.op_override(key) is not None:
            return False
        return _is_composite(node, key)

    def _warn_if_reaches_listed(self, node: fx.Node) -> None:
        """A node that cannot be traced on its own fake inputs (an ATen kernel that rejects
        symbolic sizes, as ``aten.lstm`` does under export's dynamic shapes): trace it on
        concrete sizes only to tell the user when it stays whole where autocast would not."""
        sub = _trace(node, concrete=True)
        listed = sorted({op_key(n) for n in sub.graph.nodes if self._listed(n)}) if sub else []
        if listed:
            warnings.warn(
                f"amprewrite: {node.format_node()} could not be split into its ATen pieces "
                f"(its kernel rejects symbolic sizes), so it runs whole in the dtype that "
                f"reaches it; torch.autocast would run its {', '.join(listed)} per the "
                f"policy. Results may differ from torch.autocast for this op.", stacklevel=2)

    def _listed(self, node: fx.Node) -> bool:
        if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
            return False
        rule = self.policy.table_rule(op_key(node), overload_key(node))
        return rule is not None and rule[0] is not OpCategory.PASSTHROUGH


def _signature(node: fx.Node) -> tuple:
    """``node``'s op and arguments, each tensor as its dtype, rank, device and autograd flag."""
    def like(a: Any) -> Any:
        val = a.meta.get("val") if isinstance(a, fx.Node) else a
        if isinstance(val, torch.Tensor):
            return ("tensor", val.dtype, val.dim(), val.device.type, val.requires_grad)
        return ("node",) if isinstance(a, fx.Node) else a

    return (node.op, node.target, repr(fx.node.map_aggregate(node.args, like)),
            repr(fx.node.map_aggregate(node.kwargs, like)), node.meta.get(REGION_KEY))


def _tensor_tuple(node: fx.Node) -> bool:
    val = node.meta.get("val")
    return isinstance(val, (tuple, list)) and all(isinstance(v, torch.Tensor) for v in val)


def _is_composite(node: fx.Node, key: str) -> bool:
    """Whether the op behind ``node`` is made of other ops: an ATen op with a
    CompositeImplicitAutograd kernel, or a Python function of torch (``F.normalize``,
    ``torch.functional.norm``), which reaches ATen only through the ops it calls."""
    cia = torch._C.DispatchKey.CompositeImplicitAutograd
    if isinstance(node.target, torch._ops.OpOverload):
        return node.target.has_kernel_for_dispatch_key(cia)
    if node.op == "call_function" and inspect.isfunction(node.target) and \
            (getattr(node.target, "__module__", None) or "").startswith("torch."):
        return True
    packet = getattr(torch.ops.aten, key, None)
    if not isinstance(packet, torch._ops.OpOverloadPacket):
        return False
    for name in packet.overloads():
        try:
            if getattr(packet, name).has_kernel_for_dispatch_key(cia):
                return True
        except RuntimeError:  # a TorchScript-only overload (aten::add.t): not dispatchable
            continue
    return False


def _trace(node: fx.Node, concrete: bool = False) -> fx.GraphModule | None:
    """The node's op as an ATen graph of its decomposition, or None if it cannot be traced.

    ``concrete``: trace on meta tensors of the size hints instead of the fake inputs (the
    graph is then specialised to those sizes: only fit for inspection)."""
    inputs = node.all_input_nodes
    vals = [a.meta["val"] for a in inputs]
    mode = detect_fake_mode(vals)
    if mode is None:
        return None
    if concrete:
        vals = [torch.empty([s if isinstance(s, int) else s.node.hint for s in v.shape],
                            dtype=v.dtype, device="meta") for v in vals]
        mode = contextlib.nullcontext()  # type: ignore[assignment]

    def run(*xs: Any) -> Any:
        env = dict(zip(inputs, xs))
        args = fx.node.map_arg(node.args, lambda n: env[n])
        kwargs = fx.node.map_arg(node.kwargs, lambda n: env[n])
        if node.op == "call_method":
            return getattr(args[0], str(node.target))(*args[1:], **kwargs)
        return node.target(*args, **kwargs)

    try:
        with mode:
            return make_fx(run, tracing_mode="real")(*vals)
    except Exception:  # an op make_fx cannot follow: keep the node whole, as before
        return None


def _inline(gm: fx.GraphModule, node: fx.Node, sub: fx.GraphModule) -> bool:
    graph = gm.graph
    output = next(n for n in sub.graph.nodes if n.op == "output")
    results = output.args[0]
    multi = isinstance(results, (tuple, list))
    if multi and not all(u.op == "call_function" and u.target is operator.getitem
                         for u in node.users):
        return False  # a tuple used whole: keep the node rather than rebuild the tuple
    env: dict[fx.Node, Any] = dict(zip([n for n in sub.graph.nodes if n.op == "placeholder"],
                                       node.all_input_nodes))
    kept = {k: node.meta[k] for k in _KEPT_META if k in node.meta}
    with graph.inserting_before(node):
        for sub_node in sub.graph.nodes:
            if sub_node.op in ("placeholder", "output"):
                continue
            if sub_node.op == "get_attr":  # a constant the decomposition made
                name = f"_decomposed_{node.name}_{sub_node.target}"
                setattr(gm, name, getattr(sub, str(sub_node.target)))
                new = graph.create_node("get_attr", name)
            else:
                new = graph.node_copy(sub_node, lambda n: env[n])
            new.meta = {**kept, **{k: v for k, v in sub_node.meta.items()
                                   if k in ("val", "tensor_meta")}}
            env[sub_node] = new
    mapped = fx.node.map_arg(results, lambda n: env[n])
    if multi:
        for user in list(node.users):
            user.replace_all_uses_with(mapped[user.args[1]])
            graph.erase_node(user)
    else:
        node.replace_all_uses_with(mapped)
    graph.erase_node(node)
    return True
