"""Composite ops one level at a time, as autocast meets them on its way down.

An ATen op with a ``CompositeImplicitAutograd`` kernel (``inner``, ``cross_entropy_loss``,
``einsum``, ``nll_loss_nd``) is made of other ops. Autocast wraps only the ops it lists: an
unlisted composite falls through to its kernel, whose calls go through autocast one by one;
the first listed op on each path is cast, and what that op calls runs with autocast off. So
under CUDA autocast ``torch.inner(x, w)`` meets ``tensordot`` (a promote op) and runs in fp32,
although it ends in an ``mm``; ``F.cross_entropy`` runs ``log_softmax(x, 1, dtype=x.dtype)``
in the input's dtype and then ``nll_loss`` in fp32, although its backend kernels
(``_log_softmax``, ``nll_loss_forward``) are listed nowhere.

:func:`one_level` traces what a composite calls, each call recorded whole::

    aten.inner(x, w)              →  aten.tensordot(x, w, [-1], [-1])
    aten.cross_entropy_loss(x, t) →  aten.log_softmax.int(x, 1, torch.bfloat16)
                                     aten.nll_loss_nd(log_softmax, t, None, 1, -100)
    F.normalize(h, dim=-1)        →  aten.linalg_vector_norm, aten.clamp_min, aten.expand_as,
                                     aten.div.Tensor

(a torch-level call becomes the ATen ops it reaches, its Python flattened: autocast sees no
Python). Without dtypes, :func:`python_body` traces a torch Python function's own code
symbolically (``F.normalize`` → ``h.norm(...)``, ``clamp_min``, ``expand_as``, ``/``).

NB: :func:`one_level` uses private torch API (``OpOverload._op_dk``, pre-dispatch ``make_fx``,
``DisableTorchFunction``), isolated in :func:`_trace_call`; ``tests/test_portability.py``
checks it on each supported release.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import types
from typing import Any, Callable

import torch
import torch.fx as fx
from torch._guards import detect_fake_mode
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.proxy import GraphAppendingTracer

from ..policy.opkey import op_key
from .fake import concrete_meta

__all__ = ["is_composite", "has_composite_kernel", "one_level", "python_body"]

_CIA = torch._C.DispatchKey.CompositeImplicitAutograd


def is_composite(node: fx.Node) -> bool:
    """Whether the op behind ``node`` is made of other ops: an ATen op with a
    CompositeImplicitAutograd kernel, or a Python function of torch (``F.normalize``,
    ``torch.functional.norm``), which reaches ATen only through the ops it calls."""
    if isinstance(node.target, torch._ops.OpOverload):
        return has_composite_kernel(node.target)
    if _torch_python_function(node):
        return True
    packet = getattr(torch.ops.aten, op_key(node), None)
    if not isinstance(packet, torch._ops.OpOverloadPacket):
        return False
    for name in packet.overloads():
        try:
            if has_composite_kernel(getattr(packet, name)):
                return True
        except RuntimeError:  # a TorchScript-only overload (aten::add.t): not dispatchable
            continue
    return False


def has_composite_kernel(op: torch._ops.OpOverload) -> bool:
    """A C++ composite kernel: what autocast falls through to. NB: not
    ``op.has_kernel_for_dispatch_key``, which also counts Python decompositions registered
    for tracing (``native_batch_norm`` has one), which autocast never runs."""
    return torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), _CIA)


def _torch_python_function(node: fx.Node) -> bool:
    return node.op == "call_function" and inspect.isfunction(node.target) and \
        (getattr(node.target, "__module__", None) or "").startswith("torch.")


def one_level(node: fx.Node, concrete: bool = False, symbolic: bool = False,
              one_dtype: bool = False) -> fx.GraphModule | None:
    """What ``node``'s op calls, one level down, as an ATen graph traced on the node's fake
    inputs (``meta["val"]``); None if it cannot be traced.

    ``concrete``: trace on meta tensors of the size hints instead (the graph is then
    specialised to those sizes: only fit for inspection). ``symbolic``: trace those meta
    tensors with symbolic sizes, so that the graph reads every size it uses off its inputs
    (``sym_size`` nodes) instead of holding the example's; its values belong to another
    shape environment than the node's graph, so whoever inlines it runs its nodes again.
    ``one_dtype``: trace on floating inputs promoted to one dtype, for an op whose pieces
    reject the mixed dtypes that autocast would cast at a listed piece (``einsum`` of a bf16
    activation and an fp32 table reaches ``bmm``); the graph's values hold the promoted dtype,
    so whoever inlines it runs its nodes again, as autocast would."""
    inputs = node.all_input_nodes
    vals = [a.meta["val"] for a in inputs]
    mode: Any = detect_fake_mode(vals)
    if mode is None:
        return None
    if one_dtype:
        floating = [v.dtype for v in vals if v.is_floating_point()]
        wide = functools.reduce(torch.promote_types, floating) if floating else None
        with mode:
            vals = [v.to(wide) if v.is_floating_point() else v for v in vals]
    tracing = "symbolic" if symbolic else "real"
    if concrete or symbolic:
        vals = [concrete_meta(v) for v in vals]
        mode = contextlib.nullcontext()

    def call(*xs: Any) -> Any:
        env = dict(zip(inputs, xs))
        args = fx.node.map_arg(node.args, lambda n: env[n])
        kwargs = fx.node.map_arg(node.kwargs, lambda n: env[n])
        if node.op == "call_method":
            return getattr(args[0], str(node.target))(*args[1:], **kwargs)
        return _trace_call(node.target, args, kwargs)

    try:
        with mode:
            return make_fx(call, tracing_mode=tracing, pre_dispatch=True)(*vals)
    except Exception:  # an op make_fx cannot follow: the caller keeps the node whole
        return None


def _trace_call(target: Callable[..., Any], args: Any, kwargs: Any) -> Any:
    """Call ``target`` under a pre-dispatch trace. An ATen op runs its composite kernel
    directly, so the trace records the ops the kernel calls (pre-dispatch tracing records
    every op whole: the op itself, called normally, would be one node). NB: torch function
    handling is off for the call itself: ``_op_dk`` would hand the op to the tracer's torch
    function mode, which records it whole again."""
    if isinstance(target, torch._ops.OpOverload):
        with torch._C.DisableTorchFunction():
            return target._op_dk(_CIA, *args, **kwargs)
    return target(*args, **kwargs)


# A torch Python function starts by handing itself to __torch_function__ when an argument has
# one, as a Proxy does: the symbolic tracer records it whole. Its body, run with these checks
# answering no, calls Tensor methods and torch functions on the proxies, which record them.
_NO_OVERRIDES = {name: (lambda *args: False) for name in
                 ("has_torch_function", "has_torch_function_unary", "has_torch_function_variadic")}


def python_body(node: fx.Node) -> fx.Graph | None:
    """The code of the torch Python function ``node`` calls (``F.normalize``), traced
    symbolically on its arguments: a graph with one placeholder per input node, in
    ``node.all_input_nodes`` order; None if ``node`` calls no such function or its code
    cannot be traced without values (control flow on a tensor)."""
    if not _torch_python_function(node):
        return None
    fn: Any = node.target
    body = types.FunctionType(fn.__code__, {**fn.__globals__, **_NO_OVERRIDES}, fn.__name__,
                              fn.__defaults__, fn.__closure__)
    body.__kwdefaults__ = fn.__kwdefaults__
    graph = fx.Graph()
    tracer = GraphAppendingTracer(graph)
    proxies = {a: fx.Proxy(graph.placeholder(a.name), tracer) for a in node.all_input_nodes}
    try:
        out = body(*fx.node.map_arg(node.args, lambda n: proxies[n]),
                   **fx.node.map_arg(node.kwargs, lambda n: proxies[n]))
        graph.output(tracer.create_arg(out))
    except Exception:  # the code needs values (control flow, a tensor's size): keep it whole
        return None
    return graph
