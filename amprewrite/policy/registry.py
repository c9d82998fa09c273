"""Process-wide registration of user functions and custom ops (Apex's register_*_function).

A registered Python function is also made a leaf of the symbolic tracer, so it appears as one
``call_function`` node that the policy can classify instead of being traced into.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Callable, Mapping

import torch

from .opkey import callable_key
from .tables import OpCategory

__all__ = ["register_op", "registered", "registered_functions"]

_REGISTRY: dict[str, OpCategory] = {}
_FUNCTIONS: dict[str, Callable] = {}
_ALLOWED = (OpCategory.LOWER, OpCategory.FP32, OpCategory.PROMOTE, OpCategory.PASSTHROUGH,
            OpCategory.MATCH_SELF)


def register_op(fn: Callable, category: OpCategory) -> Callable:
    """Classify a user function or ``torch.library`` custom op for every policy.

    ``category`` is one of LOWER, FP32, PROMOTE, PASSTHROUGH or MATCH_SELF. Returns ``fn``
    so it can be used as a decorator factory's target. Policy op overrides still win over
    registrations.
    """

    if category not in _ALLOWED:
        raise ValueError(f"register_op({fn!r}, {category!r}): category must be one of "
                         f"{', '.join('OpCategory.' + c.name for c in _ALLOWED)}")
    if not callable(fn):
        raise TypeError(f"register_op expects a function or a torch.library op, got {fn!r}")
    # torch.library.custom_op returns a CustomOpDef; graphs hold its OpOverload, and the
    # symbolic tracer must not try to wrap it as a Python function.
    fn = getattr(fn, "_opoverload", fn)
    key = callable_key(fn)
    if _REGISTRY.get(key, category) is not category:
        raise ValueError(
            f"register_op({key}, OpCategory.{category.name}): {key} is already registered as "
            f"OpCategory.{_REGISTRY[key].name}; call amprewrite.unregister_op({key}) first, or "
            "override it for one conversion with Policy().override(ops={...}).")
    _REGISTRY[key] = category
    if not isinstance(fn, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        _FUNCTIONS[key] = fn
    return fn


def registered() -> Mapping[str, OpCategory]:
    return MappingProxyType(_REGISTRY)


def registered_functions() -> tuple[Callable, ...]:
    return tuple(_FUNCTIONS.values())


def unregister_op(fn: Callable) -> None:
    """Remove a registration made with :func:`register_op` (no-op if absent)."""

    key = callable_key(getattr(fn, "_opoverload", fn))
    _REGISTRY.pop(key, None)
    _FUNCTIONS.pop(key, None)
