"""Questions several stages ask of a graph: is this node a pure dtype conversion, is this
memory written in place, which modules enclose this node?

Both are conservative where they cannot know: an op that *may* return a view of its input
counts as an alias, so a cast next to it is kept rather than removed.
"""

from __future__ import annotations

import operator
import re
import sys
from typing import Any

import torch
import torch.fx as fx

from ..policy.opkey import is_inplace
from ..runtime.functions import CAST_METHODS, guarded_cast

__all__ = ["attr_at", "cast_source", "input_dtypes", "mutated", "module_paths", "slice_args",
           "lifted_weight", "lifted_weight_name"]

_METHOD_CASTS = {name: dtype for dtype, name in CAST_METHODS.items()}


_RAISE: Any = object()


def attr_at(root: Any, qualname: str, default: Any = _RAISE) -> Any:
    """What the dotted ``qualname`` names under ``root`` (a ``get_attr`` node's target under
    its GraphModule), walked with ``getattr`` as ``torch.fx`` resolves it; ``default`` where a
    part is missing if one is given, else the ``AttributeError``."""
    obj = root
    for part in qualname.split("."):
        obj = getattr(obj, part) if default is _RAISE else getattr(obj, part, default)
    return obj


def cast_source(node: fx.Node) -> tuple[fx.Node, torch.dtype] | None:
    """``(input, dtype)`` if ``node`` is a pure dtype conversion, else None.

    Recognises our casts and the user's: ``x.to(dtype)``, ``x.float()``/``half()``/
    ``bfloat16()``, ``aten._to_copy(x, dtype=...)``, ``aten.to.dtype(x, dtype)``.
    """
    if node.op == "call_method" and node.target in ("cast", "get") and len(node.args) == 3 \
            and isinstance(node.args[0], fx.Node) and node.args[0].op == "get_attr":
        return node.args[1], node.args[2]  # a weight cast, or an O2 low-precision copy
    if node.op == "call_method" and node.target == "to" and len(node.args) == 2 \
            and isinstance(node.args[1], torch.dtype) and not node.kwargs:
        return node.args[0], node.args[1]
    if node.op == "call_method" and node.target in _METHOD_CASTS and len(node.args) == 1:
        return node.args[0], _METHOD_CASTS[node.target]
    if node.op == "call_function":
        if node.target is torch.ops.aten._to_copy.default and set(node.kwargs) == {"dtype"}:
            return node.args[0], node.kwargs["dtype"]
        if node.target is torch.ops.aten.to.dtype and len(node.args) == 2 and not node.kwargs:
            return node.args[0], node.args[1]
        if node.target is guarded_cast:
            return node.args[0], node.args[1]
    return None


_SHORT = {torch.float16: "f16", torch.bfloat16: "bf16", torch.float32: "f32",
          torch.float64: "f64"}


def input_dtypes(node: fx.Node) -> str:
    """``"x: bf16[2, 8], mask: bool[2, 8]"``: ``node``'s tensor inputs as ``meta["val"]``
    records them, for error messages."""
    parts = []
    for a in node.all_input_nodes:
        val = a.meta.get("val")
        if isinstance(val, torch.Tensor):
            dtype = _SHORT.get(val.dtype, str(val.dtype).removeprefix("torch."))
            parts.append(f"{a.name}: {dtype}{list(val.shape)}")
    return ", ".join(parts) or "no tensor inputs"


# Torch-level calls (symbolic capture) whose result may share memory with their first input.
# Over-approximated on purpose: a false "alias" only keeps a cast that could have gone.
_VIEW_METHODS = frozenset({
    "view", "view_as", "reshape", "reshape_as", "transpose", "permute", "expand", "expand_as",
    "narrow", "select", "split", "chunk", "unbind", "unsqueeze", "squeeze", "flatten",
    "unflatten", "t", "T", "mT", "detach", "as_strided", "contiguous", "to", "type_as",
    "movedim", "swapaxes", "diagonal", "real", "imag", "unfold", "tensor_split", "split_with_sizes",
    "getitem", "float", "half", "bfloat16", "double", "type", "data",
})


def slice_args(node: fx.Node) -> tuple[Any, Any, Any, Any, Any] | None:
    """``(input, dim, start, end, step)`` of an ``aten::slice`` node, the defaults written
    out as the op reads them (``None`` bounds: 0 and ``sys.maxsize``); None for other nodes
    and for keyword arguments."""
    if node.target is not torch.ops.aten.slice.Tensor or node.kwargs:
        return None
    base, dim, start, end, step = (*node.args, *(0, None, None, 1)[len(node.args) - 1:])
    return (base, dim, 0 if start is None else start, sys.maxsize if end is None else end,
            step)


def _is_view(node: fx.Node) -> bool:
    """Whether ``node``'s result may alias one of its tensor inputs."""
    if node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload):
        # In-place ops return their (written) input too: that result aliases it as well.
        return any(r.alias_info is not None for r in node.target._schema.returns)
    if node.op == "call_function" and node.target is operator.getitem:
        return True
    if node.op in ("call_method", "call_function"):
        name = node.target if node.op == "call_method" else getattr(node.target, "__name__", "")
        return name in _VIEW_METHODS
    return False


def _writes(user: fx.Node, node: fx.Node) -> bool:
    """Whether ``user`` writes into ``node`` in place (``x.add_(y)``, ``x[i] = y``, ``out=``)."""
    if user.op == "call_function" and user.target is operator.setitem:
        return bool(user.args) and user.args[0] is node
    if user.kwargs.get("out") is node:
        return True
    if user.op == "call_function" and isinstance(user.target, torch._ops.OpOverload):
        for i, arg in enumerate(user.target._schema.arguments):
            if arg.alias_info is not None and arg.alias_info.is_write:
                value = user.args[i] if i < len(user.args) else user.kwargs.get(arg.name)
                if value is node:
                    return True
        return False
    return is_inplace(user) and bool(user.args) and user.args[0] is node


def _aliases(node: fx.Node) -> set[fx.Node]:
    """``node`` and every node that may share its memory: views of it, and what it is a view
    of (transitively, both ways)."""
    seen = {node}
    todo = [node]
    while todo:
        n = todo.pop()
        related = [u for u in n.users if _is_view(u)]
        if _is_view(n):
            related += [a for a in n.all_input_nodes]
        for m in related:
            if m not in seen:
                seen.add(m)
                todo.append(m)
    return seen


def mutated(*nodes: fx.Node) -> bool:
    """Whether any in-place op of the graph writes into memory of one of ``nodes``."""
    for node in nodes:
        if not isinstance(node, fx.Node):
            continue
        for alias in _aliases(node):
            if any(_writes(u, alias) for u in alias.users):
                return True
    return False


_DYNAMO_ROOT = re.compile(r"^L\['[^']*'\]\.?")


def module_paths(node: fx.Node) -> list[str]:
    """Qualified names of the modules enclosing ``node``, outermost first."""
    stack = node.meta.get("nn_module_stack") or {}
    paths = []
    for key, value in stack.items():
        path = value[0] if isinstance(value, tuple) else key
        # Dynamo (and torch.export in some versions) prefixes paths with the root's local
        # name: "L['self'].encoder.layer", or "L['fn'].0" for a compiled nn.Sequential.
        path = _DYNAMO_ROOT.sub("", str(path))
        if path:
            paths.append(path)
    if node.op == "call_module":
        paths.append(str(node.target))
    return paths


_LIFTED_WORDS = frozenset({"", "l", "g", "self", "fn", "modules", "parameters", "buffers"})
"""The words of Dynamo's placeholder names that are not the qualified name's
(``l_self_modules_blocks_modules_0_modules_qkv_parameters_weight_``)."""


def lifted_weight(node: Any) -> bool:
    """Whether ``node`` is a placeholder that Dynamo lifted from a module's parameters or
    buffers (the weights of a ``torch.compile`` graph arrive as inputs, not ``get_attr``)."""
    if not isinstance(node, fx.Node) or node.op != "placeholder":
        return False
    kind = node.type
    return isinstance(kind, type) and issubclass(kind, torch.nn.Parameter) or \
        "_buffers_" in str(node.target)


def lifted_weight_name(node: fx.Node, model: torch.nn.Module) -> str | None:
    """The qualified name in ``model`` of the tensor a lifted placeholder is (its name's
    words against each parameter's and buffer's), None where not exactly one matches."""
    words = _words(str(node.target))
    found = [q for q, _ in (*model.named_parameters(remove_duplicate=False),
                            *model.named_buffers(remove_duplicate=False)) if _words(q) == words]
    return found[0] if len(set(found)) == 1 else None


def _words(name: str) -> tuple[str, ...]:
    return tuple(w for w in re.split(r"[._]+", name.lower()) if w not in _LIFTED_WORDS)
