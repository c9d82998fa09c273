"""Re-running one node on fake tensors, to keep ``meta["val"]`` right after a rewrite."""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.fx as fx
from torch._guards import detect_fake_mode
from torch.fx.node import map_aggregate

__all__ = ["fake_run", "val_of", "same_val"]


def val_of(x: Any) -> Any:
    return map_aggregate(x, lambda a: a.meta.get("val") if isinstance(a, fx.Node) else a)


def fake_run(gm: fx.GraphModule, node: fx.Node) -> Any:
    """The value ``node`` computes when run on its inputs' ``meta["val"]`` (fake tensors)."""
    args, kwargs = val_of(node.args), val_of(node.kwargs)
    flat = [v for v in torch.utils._pytree.tree_leaves((args, kwargs))]
    mode = detect_fake_mode(flat)
    ctx = mode if mode is not None else contextlib.nullcontext()
    with ctx:
        if node.op == "call_function":
            return node.target(*args, **kwargs)
        if node.op == "call_method":
            return getattr(args[0], node.target)(*args[1:], **kwargs)
        if node.op == "call_module":
            return gm.get_submodule(str(node.target))(*args, **kwargs)
    raise ValueError(f"fake_run: cannot run {node.format_node()}")


def same_val(a: Any, b: Any) -> bool:
    """Same dtypes and shapes, recursively (values of fake tensors are not compared)."""
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and a.device == b.device
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return len(a) == len(b) and all(same_val(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and not isinstance(a, torch.Tensor)
