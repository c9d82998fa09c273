"""DropNoOpsPass: ops a captured graph runs every call that give back what is already there.

``torch.export`` records what the model's Python did, and two common idioms leave ops whose
result is already at hand, each an eager dispatch per forward for nothing:

* a slice over a whole dimension (``mask[:, None, :]``, ``x[..., :]``) is a view equal to its
  input: ``slice(x, 2, 0, 9223372036854775807)``;
* a tensor written as a literal in the model's code (``torch.tensor([])``, the empty start of
  Hugging Face's key/value cache) is a graph constant that every forward copies
  (``lift_fresh_copy``) and detaches (``detach_``) before reading it. Where the copy is only
  read (no op writes to it or returns a view of it, and the graph does not return it), the
  constant itself gives the same values.

Before::

    slice_1 = torch.ops.aten.slice.Tensor(unsqueeze_8, 2, 0, 9223372036854775807)
    unsqueeze_9 = torch.unsqueeze(slice_1, 3)
    lift_fresh_copy = torch.ops.aten.lift_fresh_copy.default(attn_lifted_tensor_0)
    detach_ = torch.ops.aten.detach_.default(lift_fresh_copy)
    cat = torch.cat([detach_, transpose], -2)

After::

    unsqueeze_9 = torch.unsqueeze(unsqueeze_8, 3)
    cat = torch.cat([attn_lifted_tensor_0, transpose], -2)

Values and gradients are unchanged: the dropped ops make no new values (a full view, a copy
of a constant that needs no gradient). A node whose result the graph returns is kept, so the
caller never receives the graph's own constant or an input in place of a fresh tensor.
"""

from __future__ import annotations

import sys

import torch
import torch.fx as fx
from torch.fx.passes.infra.pass_base import PassBase, PassResult

from ..graph.queries import slice_args

__all__ = ["DropNoOpsPass"]

_aten = torch.ops.aten


def _returned(node: fx.Node) -> bool:
    return any(user.op == "output" for user in node.users)


def _full_slice(node: fx.Node) -> fx.Node | None:
    """The input of ``node`` when it is a slice over the whole of its dimension."""
    args = slice_args(node)
    if args is None or _returned(node):
        return None
    base, dim, start, end, step = args
    if not isinstance(base, fx.Node) or step != 1 or start != 0 or not isinstance(end, int):
        return None
    val = base.meta.get("val")
    size = val.shape[dim] if isinstance(val, torch.Tensor) and isinstance(dim, int) else None
    return base if end >= sys.maxsize or (isinstance(size, int) and end >= size) else None


def _only_read(node: fx.Node) -> bool:
    """Whether every use of ``node`` reads it: an op that neither writes its inputs nor
    returns a view of them, and not the graph's output."""
    for user in node.users:
        target = user.target
        if user.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
            return False
        schema = target._schema
        if schema.is_mutable or any(r.alias_info is not None for r in schema.returns):
            return False
    return True


def _constant_read(node: fx.Node) -> fx.Node | None:
    """The constant that ``node``, a fresh copy of it (detached or not), can be replaced by."""
    if node.target is _aten.detach_.default:
        copy = node.args[0]
        if not (isinstance(copy, fx.Node) and len(copy.users) == 1
                and copy.target is _aten.lift_fresh_copy.default):
            return None
    elif node.target is _aten.lift_fresh_copy.default:
        if any(u.target is _aten.detach_.default for u in node.users):
            return None  # replaced through its detach_
        copy = node
    else:
        return None
    constant = copy.args[0]
    val = constant.meta.get("val") if isinstance(constant, fx.Node) else None
    if constant.op != "get_attr" or (isinstance(val, torch.Tensor) and val.requires_grad):
        return None
    return constant if _only_read(node) else None


class DropNoOpsPass(PassBase):
    """Replace full slices and read-only fresh copies of constants by what they give back."""

    def call(self, gm: fx.GraphModule) -> PassResult:
        modified = False
        for node in list(gm.graph.nodes):
            if node.op != "call_function":
                continue
            same = _full_slice(node) or _constant_read(node)
            if same is None:
                continue
            node.replace_all_uses_with(same)
            # NB: erased by hand: dead-code elimination keeps detach_, an in-place op.
            while node is not same and not node.users:
                source = node.args[0]
                gm.graph.erase_node(node)
                node = source
            modified = True
        if modified:
            gm.recompile()
        return PassResult(gm, modified)
