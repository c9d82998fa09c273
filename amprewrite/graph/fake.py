"""Re-running one node on fake tensors, to keep ``meta["val"]`` right after a rewrite."""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.fx as fx
from torch._guards import detect_fake_mode
from torch.fx.experimental.symbolic_shapes import statically_known_true
from torch.fx.node import map_aggregate

from .queries import attr_at

__all__ = ["fake_run", "fake_state", "graph_fake_mode", "same_val", "concrete_meta"]


def fake_state(module: torch.nn.Module, mode: Any) -> contextlib.AbstractContextManager:
    """Swap ``module``'s parameters and buffers for fake copies while it runs on fake tensors.

    NB: a fake run must not touch the real tensors. With real buffers, a BatchNorm in
    training mode would count ``num_batches_tracked`` up on the user's model at conversion.
    """
    if mode is None:
        return contextlib.nullcontext()
    state = {name: mode.from_tensor(t) for name, t in
             [*module.named_parameters(remove_duplicate=False),
              *module.named_buffers(remove_duplicate=False)]}
    return torch.nn.utils.stateless._reparametrize_module(module, state, tie_weights=True)


def fake_run(gm: fx.GraphModule, node: fx.Node) -> Any:
    """The value ``node`` computes when run on its inputs' ``meta["val"]`` (fake tensors).

    A ``get_attr`` input without a value is the attribute itself: the branch GraphModules of a
    ``torch.cond``, which the higher-order op calls on the fake tensors."""
    def value(a: Any) -> Any:
        if isinstance(a, fx.Node) and a.op == "get_attr" and a.meta.get("val") is None:
            return attr_at(gm, str(a.target))
        return a.meta.get("val") if isinstance(a, fx.Node) else a

    args, kwargs = map_aggregate(node.args, value), map_aggregate(node.kwargs, value)
    flat = [v for v in torch.utils._pytree.tree_leaves((args, kwargs))]
    # NB: an op without tensor inputs (arange, zeros) must still make a fake tensor: a real
    # one in meta["val"] would meet fake ones downstream. Such ops run in the graph's mode.
    mode = detect_fake_mode(flat) or graph_fake_mode(gm)
    ctx = mode if mode is not None else contextlib.nullcontext()
    try:
        with ctx:
            if node.op == "call_function":
                return node.target(*args, **kwargs)
            if node.op == "call_method":
                return getattr(args[0], node.target)(*args[1:], **kwargs)
            if node.op == "call_module":
                module = gm.get_submodule(str(node.target))
                with fake_state(module, mode):
                    return module(*args, **kwargs)
    except Exception:
        # NB: some meta kernels reject symbolic sizes (aten.addbmm in torch 2.13, aten.lstm),
        # which export's dynamic shapes produce. Casts change dtypes, never shapes: learn the
        # output dtypes from concrete-size meta tensors, keep the recorded shapes.
        recorded = node.meta.get("val")
        if node.op == "call_module" or not _tensors(recorded):
            raise
        meta_args, meta_kwargs = map_aggregate((args, kwargs), concrete_meta)
        out = (node.target(*meta_args, **meta_kwargs) if node.op == "call_function"
               else getattr(meta_args[0], node.target)(*meta_args[1:], **meta_kwargs))
        with ctx:
            if isinstance(recorded, torch.Tensor):
                return recorded.to(out.dtype)
            return type(recorded)(r.to(o.dtype) for r, o in zip(recorded, out))
    raise ValueError(f"fake_run: cannot run {node.format_node()}")


def _tensors(val: Any) -> bool:
    """A tensor, or a tuple or list of tensors (a multi-output op's value)."""
    return isinstance(val, torch.Tensor) or (
        isinstance(val, (tuple, list)) and bool(val)
        and all(isinstance(v, torch.Tensor) for v in val))


def graph_fake_mode(gm: fx.GraphModule) -> Any:
    """The fake mode of the graph's placeholder values, or None."""
    vals = [n.meta.get("val") for n in gm.graph.find_nodes(op="placeholder")]
    return detect_fake_mode(torch.utils._pytree.tree_leaves(vals))


def concrete_meta(x: Any) -> Any:
    """A meta tensor like ``x`` with its size hints as concrete sizes (a symbolic size given
    as an argument: its hint)."""
    if isinstance(x, torch.SymInt):
        return x.node.hint
    if not isinstance(x, torch.Tensor):
        return x
    shape = [s if isinstance(s, int) else s.node.hint for s in x.shape]
    return torch.empty(shape, dtype=x.dtype, device="meta")


def same_val(a: Any, b: Any) -> bool:
    """Same dtypes and shapes, recursively (values of fake tensors are not compared). NB: a
    size that depends on data (``x[mask]``) is a new symbol in every fake run: equal only
    where provably so, never a guard (which raises on such a size)."""
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.dtype == b.dtype and a.device == b.device and a.dim() == b.dim() and \
            all(statically_known_true(x == y) for x, y in zip(a.shape, b.shape))
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return len(a) == len(b) and all(same_val(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and not isinstance(a, torch.Tensor)
