"""Which nodes of a graph are ops of the model: what ClassifyPass gives a Decision."""

from __future__ import annotations

import operator

import torch.fx as fx

from ..capture.facts import GRAD_MODE_FUNCTIONS
from ..capture.guards import is_input_guards
from ..graph.meta import cast_info, fp8_step, pending_split
from ..runtime.attention import multi_head_attention
from ..runtime.weight_table import is_fetch

__all__ = ["takes_decision"]

_CALLS = ("call_function", "call_method", "call_module")


def _cast_item(node: fx.Node) -> bool:
    """``cast[i]``: an output of a multi-output cast (guarded_promote) or of the gathered
    weight reads (``weights[i]``) is part of the cast, not an op of the model."""
    if is_fetch(node):
        return True
    return (node.op == "call_function" and node.target is operator.getitem
            and isinstance(node.args[0], fx.Node)
            and (cast_info(node.args[0]) is not None or is_fetch(node.args[0])))


def _is_export_guard(node: fx.Node) -> bool:
    """torch.export's input-shape check (``self._guards_fn(x)``), the grad-mode calls of an
    inlined ``no_grad`` region and a fused attention call (decided when it was made, its ops
    in a sub-graph: :mod:`amprewrite.passes.attention`): not ops of the model to classify,
    never cast."""
    return is_input_guards(node) or (node.op == "call_function" and (
        node.target in GRAD_MODE_FUNCTIONS or node.target is multi_head_attention))


def takes_decision(node: fx.Node) -> bool:
    """Whether ``node`` is an op of the model that ClassifyPass gives a Decision: not a cast
    or a part of one, not an fp8 step, not export's input guard or a grad-mode call, and not
    a composite waiting to be split (:class:`~amprewrite.graph.meta.PendingSplit`)."""
    return node.op in _CALLS and cast_info(node) is None and not _cast_item(node) \
        and fp8_step(node) is None and pending_split(node) is None \
        and not _is_export_guard(node)


