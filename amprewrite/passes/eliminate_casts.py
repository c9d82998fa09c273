"""EliminateCastsPass: remove casts that cannot change a bit or an alias.

Invariants (what this pass may and may not do):

1. **Identity**: a cast to the dtype its input already has is removed. ``x.to(x.dtype)``
   returns ``x`` itself anyway; a real copy (``aten._to_copy``) is removed only when nothing
   writes in place into it, its input, or a view of either (that would turn a copy into an
   alias).
2. **Duplicates**: casts of one value to one dtype are merged into one, for weights always and
   for activations only when ``policy.share_activation_casts`` (sharing sums the gradients of
   the consumers in low precision; the autocast presets keep autocast's one-cast-per-use).
   Not when either cast or the value is written in place, nor across the model's own
   ``no_grad`` regions (a cast made there has no gradient for a consumer outside).
3. **Lossless chains**: ``a → b → c`` where the middle dtype ``b`` holds every value of ``a``
   (fp16→fp32→fp16, bf16→fp32→fp16, fp32→fp64→fp32): replaced by ``a`` itself when
   ``c == a``, else by one cast ``a → c`` (it rounds once, as the chain does). Exact in forward
   and backward. Chains through an integer or bool dtype truncate and are never touched.
4. **Narrowing round trips** (fp32→bf16→fp32) round the value: kept, unless
   ``policy.fold_rounding_casts``; folded ones are counted in the report.
5. **Dead casts**, with no users, are removed.
6. Guarded casts (dtype unknown until run time) are only merged or removed when dead, never
   reasoned about.
7. **Idempotent**: the rules run to a fixed point, so a second run changes nothing.

Every removal is counted by rule in ``gm.meta["amprewrite"].eliminated`` (a
:class:`CastReport`).

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

from ..capture.facts import GRAD_KEY
from ..graph.meta import META_KEY
from ..graph.queries import attr_at, cast_source, mutated
from ..policy.policy import Policy
from ..runtime.functions import guarded_cast

__all__ = ["EliminateCastsPass", "CastReport", "cast_report"]

_WIDTH = {torch.float16: 16, torch.bfloat16: 16, torch.float32: 32, torch.float64: 64}


@dataclasses.dataclass
class CastReport:
    """Counts kept in ``gm.meta["amprewrite"]`` for ``explain()``: the casts removed, by
    rule. NB: the casts kept are counted on the graph itself when it is explained, as every
    other cast count is: steps after the passes (the compile backend's) add and merge casts."""

    eliminated: Counter = dataclasses.field(default_factory=Counter)


def _dtype(node: Any) -> torch.dtype | None:
    if not isinstance(node, fx.Node):
        return None
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor):
        return val.dtype
    if node.op == "get_attr":
        obj = attr_at(node.graph.owning_module, str(node.target), None)
        return obj.dtype if isinstance(obj, torch.Tensor) else None
    return None


def _is_copy(node: fx.Node) -> bool:
    """A cast that always returns new memory, even to its input's own dtype."""
    return node.op == "call_function" and node.target is torch.ops.aten._to_copy.default


def _float_width(dtype: torch.dtype | None) -> int | None:
    return _WIDTH.get(dtype) if dtype is not None else None


class EliminateCastsPass(PassBase):
    """Remove the casts that cannot change a bit or an alias (see the module docstring).

    Each removal is counted by rule in ``gm.meta["amprewrite"].eliminated``; a second run
    finds nothing and returns ``modified=False``.
    """

    def __init__(self, policy: Policy) -> None:
        super().__init__()
        self.policy = policy

    def call(self, gm: fx.GraphModule) -> PassResult:
        report = cast_report(gm)
        before = sum(report.eliminated.values())
        changed = True
        while changed:  # each rule may expose work for another; stops: every step removes
            # a node or shortens a chain of casts
            changed = self._dead(gm, report) | self._identity(gm, report) | \
                self._chains(gm, report) | self._duplicates(gm, report)
        modified = sum(report.eliminated.values()) != before
        if modified:
            gm.graph.lint()
            gm.recompile()
        return PassResult(gm, modified)

    def _dead(self, gm: fx.GraphModule, report: CastReport) -> bool:
        changed = False
        for node in reversed(list(gm.graph.nodes)):
            if not node.users and cast_source(node) is not None:
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
            # `x.to(x.dtype)` already returns x itself; only a real copy can become an alias.
            if _is_copy(node) and mutated(node, value):
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
            wa, wb, wc = _float_width(a), _float_width(b), _float_width(c)
            if wa is None or wb is None or wc is None:
                continue  # integer, bool or unknown dtypes: a cast there truncates; keep it
            # A write into the middle value, or into either end, would be lost or shared.
            if mutated(node, middle, a_node):
                continue
            # fp32 and fp64 hold every fp16 and bf16 value, and fp64 every fp32 one, so
            # a → b is exact and a → b → c rounds once, as a → c does.
            lossless = b == a or (wb >= max(wa, wc) and b in (torch.float32, torch.float64))
            if lossless:
                rule = "lossless chain"
            elif a == c and self.policy.fold_rounding_casts:
                rule = "rounding round trip"
            else:
                continue
            if a == c:
                node.replace_all_uses_with(a_node)
                gm.graph.erase_node(node)
            elif node.op == "call_method" and node.target in ("cast", "get"):
                node.args = (node.args[0], a_node, c)
            else:
                node.args = (a_node,) + tuple(node.args[1:])
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
                   node.target is guarded_cast, node.meta.get(GRAD_KEY))
            first = seen.get(key)
            # A write into either cast, or into the value between them, tells them apart.
            if first is None or mutated(node, first, value):
                seen.setdefault(key, node)
                continue
            node.replace_all_uses_with(first)
            gm.graph.erase_node(node)
            report.eliminated["duplicate"] += 1
            changed = True
        return changed


def cast_report(gm: fx.GraphModule) -> CastReport:
    """``gm``'s :class:`CastReport`, made on first use."""
    meta = gm.meta if hasattr(gm, "meta") else gm.__dict__.setdefault("meta", {})
    report = meta.get(META_KEY)
    if not isinstance(report, CastReport):
        report = meta[META_KEY] = CastReport()
    return report
