"""EliminateCastsPass: remove casts that cannot change a bit or an alias.

Invariants (what this pass may and may not do):

1. **Identity**: a cast to the dtype its input already has is removed, unless it is a copy
   (``_to_copy``) whose result or input is mutated in place (that would turn a copy into an
   alias).
2. **Duplicates**: casts of one value to one dtype are merged into one, for weights always and
   for activations only when ``policy.share_activation_casts`` (sharing sums the gradients of
   the consumers in low precision; the autocast presets keep autocast's one-cast-per-use).
3. **Lossless chains**: ``a → b → c`` where the middle dtype ``b`` holds every value of ``a``
   (fp16→fp32→fp16, bf16→fp32→fp16): the chain is replaced by ``a`` itself when ``c == a``, or
   by one cast ``a → c``. Exact in forward and backward.
4. **Narrowing round trips** (fp32→bf16→fp32) round the value: kept, unless
   ``policy.fold_rounding_casts``; folded ones are counted in the report.
5. **Dead casts**, with no users, are removed.
6. Guarded casts (dtype unknown) are only merged or removed when dead, never reasoned about.

Before::

    x_f32 = x.to(torch.float32)          # x is already fp32
    h_f16 = h.to(torch.float16); h_f16_1 = h.to(torch.float16)

After::

    h_f16 = h.to(torch.float16)          # x used directly; one shared cast of h
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from typing import Any

import torch
import torch.fx as fx
from torch.fx.passes.infra.pass_base import PassBase, PassResult

from ._meta import META_KEY, CastInfo, cast_info
from ._opkey import is_inplace
from ._runtime import guarded_cast
from ._weight_cache import CACHE_ATTR
from .policy import Policy

__all__ = ["EliminateCastsPass", "cast_source", "CastReport"]

_WIDTH = {torch.float16: 16, torch.bfloat16: 16, torch.float32: 32, torch.float64: 64}
_METHOD_CASTS = {"float": torch.float32, "half": torch.float16, "bfloat16": torch.bfloat16,
                 "double": torch.float64}


@dataclasses.dataclass
class CastReport:
    """Counts kept in ``gm.meta["amprewrite"]`` for ``explain()``."""

    inserted: int = 0
    guarded: int = 0
    eliminated: Counter = dataclasses.field(default_factory=Counter)


def cast_source(node: fx.Node) -> tuple[fx.Node, torch.dtype] | None:
    """``(input, dtype)`` if ``node`` is a pure dtype conversion, else None.

    Recognises our casts and the user's: ``x.to(dtype)``, ``x.float()``/``half()``/
    ``bfloat16()``, ``aten._to_copy(x, dtype=...)``, ``aten.to.dtype(x, dtype)``.
    """
    if node.op == "call_method" and node.target == "cast" and len(node.args) == 3:
        return node.args[1], node.args[2]
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


def _dtype(node: Any) -> torch.dtype | None:
    if not isinstance(node, fx.Node):
        return None
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor):
        return val.dtype
    if node.op == "get_attr":
        obj = node.graph.owning_module
        for part in str(node.target).split("."):
            obj = getattr(obj, part, None)
        return obj.dtype if isinstance(obj, torch.Tensor) else None
    return None


def _mutated(node: fx.Node) -> bool:
    return any(is_inplace(u) and u.args and u.args[0] is node for u in node.users)


class EliminateCastsPass(PassBase):
    def __init__(self, policy: Policy) -> None:
        super().__init__()
        self.policy = policy

    def call(self, gm: fx.GraphModule) -> PassResult:
        report = _report(gm)
        before = sum(report.eliminated.values())
        changed = True
        while changed:  # each rule may expose work for another; stops: every step removes a node
            changed = self._dead(gm, report) | self._identity(gm, report) | \
                self._chains(gm, report) | self._duplicates(gm, report)
        modified = sum(report.eliminated.values()) != before
        return PassResult(gm, modified)

    def _dead(self, gm: fx.GraphModule, report: CastReport) -> bool:
        changed = False
        for node in reversed(list(gm.graph.nodes)):
            if not node.users and cast_source(node) is not None and node.op != "output":
                gm.graph.erase_node(node)
                report.eliminated["dead"] += 1
                changed = True
        return changed

    def _identity(self, gm: fx.GraphModule, report: CastReport) -> bool:
        changed = False
        for node in list(gm.graph.nodes):
            src = cast_source(node)
            if src is None or node.target is guarded_cast:
                continue
            value, dtype = src
            if _dtype(value) != dtype or _dtype(node) not in (None, dtype):
                continue
            is_copy = node.op == "call_function" and node.target is torch.ops.aten._to_copy.default
            if is_copy and (_mutated(node) or _mutated(value)):
                continue
            node.replace_all_uses_with(value)
            gm.graph.erase_node(node)
            report.eliminated["identity"] += 1
            changed = True
        return changed

    def _chains(self, gm: fx.GraphModule, report: CastReport) -> bool:
        changed = False
        for node in list(gm.graph.nodes):
            outer = cast_source(node)
            if outer is None or node.target is guarded_cast:
                continue
            middle, c = outer
            inner = cast_source(middle) if isinstance(middle, fx.Node) else None
            if inner is None or middle.target is guarded_cast:
                continue
            a_node, b = inner
            a = _dtype(a_node)
            if a is None or _mutated(node) or _mutated(a_node):
                continue
            lossless = _WIDTH.get(b, 0) >= max(_WIDTH.get(a, 99), _WIDTH.get(c, 99)) and (
                b == torch.float32 or b == a or b == torch.float64)
            if not lossless:
                if a == c and self.policy.fold_rounding_casts:
                    rule = "rounding round trip (folded by policy)"
                else:
                    continue
            else:
                rule = "lossless chain"
            if a == c:
                node.replace_all_uses_with(a_node)
            else:
                node.args = (node.args[0], a_node, c) if node.target == "cast" else \
                    (a_node,) + tuple(node.args[1:])
            if a == c:
                gm.graph.erase_node(node)
            report.eliminated[rule] += 1
            changed = True
        return changed

    def _duplicates(self, gm: fx.GraphModule, report: CastReport) -> bool:
        seen: dict[tuple[Any, torch.dtype, bool], fx.Node] = {}
        changed = False
        for node in list(gm.graph.nodes):
            src = cast_source(node)
            if src is None:
                continue
            value, dtype = src
            weight = isinstance(value, fx.Node) and value.op == "get_attr"
            if not (weight or self.policy.share_activation_casts):
                continue
            key = (("get_attr", value.target) if weight else value, dtype,
                   node.target is guarded_cast)
            first = seen.get(key)
            if first is None or _mutated(node) or _mutated(first):
                seen.setdefault(key, node)
                continue
            node.replace_all_uses_with(first)
            gm.graph.erase_node(node)
            report.eliminated["duplicate"] += 1
            changed = True
        return changed


def _report(gm: fx.GraphModule) -> CastReport:
    meta = gm.meta if hasattr(gm, "meta") else gm.__dict__.setdefault("meta", {})
    report = meta.get(META_KEY)
    if not isinstance(report, CastReport):
        report = meta[META_KEY] = CastReport()
    return report



