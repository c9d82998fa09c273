"""One canonical op name per FX node, whichever tracer made the graph.

``operator.matmul``, ``torch.matmul``, ``Tensor.matmul``/``__matmul__`` and ``aten.matmul``
all become ``"matmul"``; ``F.cross_entropy`` becomes ``"cross_entropy_loss"`` (the ATen name
autocast's CPU table uses). Op tables (:mod:`amprewrite.policy.tables`) are keyed by these names.
"""

from __future__ import annotations

import operator
from typing import Callable

import torch
import torch.nn as nn
from torch.fx import Node

__all__ = ["op_key", "callable_key", "overload_key", "is_inplace", "module_op_names"]

# Torch-level spellings whose ATen name differs.
_ALIASES: dict[str, str] = {
    "truediv": "div",
    "floordiv": "floor_divide",
    "cross_entropy": "cross_entropy_loss",
    "__matmul__": "matmul",
    "__rmatmul__": "matmul",
    "__pow__": "pow",
    "__rpow__": "pow",
    "_VariableFunctionsClass.linalg_vector_norm": "linalg_vector_norm",
    "linalg.vector_norm": "linalg_vector_norm",
    "linalg.matrix_norm": "linalg_matrix_norm",
    "linalg.multi_dot": "linalg_multi_dot",
    "linalg.vecdot": "linalg_vecdot",
}

# Leaf modules (kept as call_module nodes by the symbolic tracer) and the op they run.
_MODULE_OPS: tuple[tuple[type[nn.Module], str], ...] = (
    (nn.modules.batchnorm._BatchNorm, "batch_norm"),
    (nn.modules.instancenorm._InstanceNorm, "instance_norm"),
    (nn.modules.dropout._DropoutNd, "dropout"),
)


def module_op_names() -> tuple[tuple[type[nn.Module], str], ...]:
    """The module types the symbolic tracer keeps as leaves, with their op names."""
    return _MODULE_OPS


def callable_key(fn: Callable) -> str:
    """The canonical name of a call_function target.

    ATen ops and torch functions give their ATen name; other ``torch.library`` ops give
    ``"namespace::name"``; user Python functions give ``"module.qualname"`` (so a user function
    called ``linear`` never picks up the policy of ``aten.linear``).
    """
    # torch.library.custom_op returns a CustomOpDef wrapper; graphs hold its OpOverload.
    fn = getattr(fn, "_opoverload", fn)
    if isinstance(fn, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        namespace, name = fn._qualified_op_name.split("::") if isinstance(
            fn, torch._ops.OpOverloadPacket) else (fn.namespace, fn._opname)
        return _ALIASES.get(name, name) if namespace == "aten" else f"{namespace}::{name}"
    name = getattr(fn, "__name__", None) or type(fn).__name__
    module = getattr(fn, "__module__", None) or ""
    if module.startswith("torch.linalg") or module == "torch._C._linalg":
        name = name if name.startswith("linalg_") else "linalg_" + name
    elif not (module.startswith("torch") or module in ("_operator", "operator", "builtins")
              or module.startswith("amprewrite")):
        return f"{module}.{getattr(fn, '__qualname__', name)}"
    return _ALIASES.get(name, name)


def op_key(node: Node) -> str:
    """The canonical op name of ``node`` (``""`` for placeholders, outputs and get_attr)."""
    if node.op == "call_function":
        return callable_key(node.target)
    elif node.op == "call_method":
        name = str(node.target)
    elif node.op == "call_module":
        module = node.graph.owning_module.get_submodule(str(node.target))
        for module_type, op_name in _MODULE_OPS:
            if isinstance(module, module_type):
                return op_name
        return type(module).__name__
    else:
        return ""
    return _ALIASES.get(name, name)


def overload_key(node: Node) -> str | None:
    """``"packet.overload"`` for ATen OpOverload targets, else None."""
    if node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload):
        return f"{node.target._opname}.{node.target._overloadname}"
    return None


def is_inplace(node: Node) -> bool:
    """In-place ops (``add_``, ``x += y``, ``aten.relu_``) are never autocast: they keep the
    mutated tensor's dtype."""
    if node.op == "call_function" and node.target in (operator.iadd, operator.isub,
                                                        operator.imul, operator.itruediv):
        return True
    if node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload):
        return any(a.alias_info is not None and a.alias_info.is_write
                   for a in node.target._schema.arguments)
    if node.op in ("call_method", "call_function"):
        name = node.target if node.op == "call_method" else getattr(node.target, "__name__", "")
        return isinstance(name, str) and name.endswith("_") and not name.endswith("__")
    return False
