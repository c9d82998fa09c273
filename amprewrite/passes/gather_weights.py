"""GatherWeightsPass: every parameter and buffer read of a forward, and every parameter cast,
in one call at its start.

Why: a converted graph reads each weight through a chain of ``nn.Module.__getattr__`` calls
(``getattr(self.layers, "3").attn.q_proj.weight``, about 1 µs a level) and looks up each
cached weight cast in its own call; ``torch.autocast`` pays a C++ dispatch per cast instead.
For a small model run eagerly (GPU training of small and medium models, launch-bound) that
Python is the step time. After this pass one call reads every tensor through dict lookups and
looks up the cached casts of all parameters at once (in inference each ``cast`` then returns
the copy it is handed). The casts themselves stay where the weights are used: one that
autograd records must be made there, so that its backward runs right after its consumer's
(:meth:`amprewrite.runtime.weight_cache.WeightCastCache.lookup_many`).

Before::

    b_0_l_weight = getattr(self.b, "0").l.weight
    b_0_l_weight_bf16 = _amp_weight_cache.cast(b_0_l_weight, torch.bfloat16)
    b_0_n_weight = getattr(self.b, "0").n.weight
    ...
    linear = torch.ops.aten.linear.default(n_bf16, b_0_l_weight_bf16)

After::

    weights = _amp_weights.fetch(('b.0.l.weight', torch.bfloat16), ('b.0.n.weight',),
                                 cache = _amp_weight_cache)
    b_0_l_weight = weights[0]
    b_0_n_weight = weights[1]
    ...
    b_0_l_weight_bf16 = _amp_weight_cache.cast(b_0_l_weight, torch.bfloat16)
    linear = torch.ops.aten.linear.default(n_bf16, b_0_l_weight_bf16)

(torch.fx's code of the graph; a converted module's code reads the items as one statement,
``(b_0_l_weight, b_0_n_weight, ...) = self._amp_weights.fetch(cache=...)``, one name a
line, and the cast as ``b_0_l_weight.bfloat16()``: :mod:`amprewrite.graph.layout`.)

An entry is ``(name,)`` for a tensor read as it is stored, ``(name, dtype)`` for a parameter
the forward casts to ``dtype`` (autograd-tracked in training, a cached copy in inference: see
:mod:`amprewrite.runtime.weight_cache`) and ``(name, dtype, 'low copy')`` for an O2
parameter's stored low-precision copy (:mod:`amprewrite.runtime.low_copies`); the table that
reads them is :mod:`amprewrite.runtime.weight_table`.

NB: only *parameters* have their casts gathered. A buffer can be written in place during the
forward (a static KV cache, BatchNorm's running statistics): its cast stays where the graph
had it, reading the buffer's value at that point.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn
from torch.fx.passes.infra.pass_base import PassBase, PassResult

from ..graph.meta import cast_info
from ..graph.queries import attr_at, mutated
from ..runtime.low_copies import LOW_COPIES_ATTR
from ..runtime.weight_cache import CACHE_ATTR
from ..runtime.weight_table import (
    LOW_COPY,
    WEIGHTS_ATTR,
    WeightTable,
    is_fetch,
    owner_node,
)

__all__ = ["GatherWeightsPass", "gather_weights"]


# ---------------------------------------------------------------------------------------------
class GatherWeightsPass(PassBase):
    """Replace the graph's tensor ``get_attr`` reads and O2 low copies by one
    ``_amp_weights.fetch(...)`` call and an item per entry; move each parameter cast to just
    before its first consumer (see the module docstring).

    Nodes keep their names and metadata (an item is the node it replaces, a cast stays itself),
    so decisions, ``explain`` and the auditor keep referring to ``b_0_l_weight_bf16``. A graph
    that already has a fetch is left alone (idempotent); :func:`ungather_weights` undoes the
    pass.
    """

    def call(self, gm: fx.GraphModule) -> PassResult:
        graph = gm.graph
        if any(is_fetch(n) for n in graph.nodes):
            return PassResult(gm, False)
        reads = [n for n in graph.nodes if n.op == "get_attr"
                 and isinstance(_attr(gm, str(n.target)), torch.Tensor)]
        if not reads:
            return PassResult(gm, False)

        order = {node: i for i, node in enumerate(graph.nodes)}
        index: dict[tuple[Any, ...], int] = {}  # entry -> its position (one per tensor/dtype)
        replaced: list[tuple[fx.Node, int]] = []  # nodes that become items, with their entry
        casts: list[tuple[fx.Node, int]] = []  # parameter casts, with the entry they read
        for read in reads:
            name = str(read.target)
            value = _attr(gm, name)
            gathered = [u for u in read.users if _parameter_cast(u, read)] \
                if isinstance(value, nn.Parameter) and not mutated(read) else []
            found = [((name,), read)] if any(u not in gathered for u in read.users) else []
            found += [((name, c.args[2], LOW_COPY), c) for c in gathered if c.target == "get"]
            for entry, node in found:
                replaced.append((node, index.setdefault(entry, len(index))))
            # NB: an O2 low copy's node becomes its item; a parameter cast stays a node of its
            # own, reading an item that stands for the parameter (``read`` itself, where it is
            # not already a plain read's item).
            read_casts = [(c, index.setdefault((name, c.args[2]), len(index)))
                          for c in gathered if c.target == "cast"]
            if read_casts and not found:
                replaced.append((read, read_casts[0][1]))
            casts += read_casts
        entries = tuple(index)
        table = WeightTable(gm, entries)
        setattr(gm, WEIGHTS_ATTR, table)
        anchor = [n for n in graph.nodes if n.op == "placeholder"]
        with graph.inserting_after(anchor[-1]) if anchor else \
                graph.inserting_before(next(iter(graph.nodes))):
            # NB: create_node: the table is a plain attribute, which get_attr warns on.
            holder = graph.create_node("get_attr", WEIGHTS_ATTR)
        owners, last = {}, holder
        for key, attr, length in (("cache", CACHE_ATTR, 2), ("store", LOW_COPIES_ATTR, 3)):
            if any(len(e) == length for e in entries):
                owners[key] = owner_node(graph, attr, gm, None)
                last.append(owners[key])  # moved next to the table: the fetch reads both
                last = owners[key]
        with graph.inserting_after(last):
            fetch = graph.create_node("call_method", "fetch", (holder, *entries), owners,
                                      name="weights")
        # Each replaced node becomes its item in place (FX never reuses an erased node's name,
        # and decisions refer to these names), moved to just after the fetch.
        items = {i: node for node, i in replaced}
        for cast, i in casts:
            if i not in items:  # a second dtype of one parameter, or a read with a plain use
                read = cast.args[1]
                items[i] = graph.create_node("call_function", operator.getitem, (fetch, i),
                                             name=read.name)
                items[i].meta.update(read.meta)
                replaced.append((items[i], i))
        previous = fetch
        for node, i in sorted(replaced, key=lambda pair: pair[1]):
            node.op, node.target = "call_function", operator.getitem
            node.args, node.kwargs = (fetch, i), {}
            previous.append(node)
            previous = node
        # Each cast reads its item where its first consumer runs (the cast's backward then
        # runs right after the consumer's: see WeightCastCache.lookup_many). A cast already
        # before its first consumer stays there: InsertCastsPass ordered the casts of one op
        # as autocast makes them.
        for cast, i in casts:
            cast.args = (cast.args[0], items[i], cast.args[2])
            first = min(cast.users, key=order.__getitem__, default=None)
            if first is not None and order[cast] > order[first]:
                first.prepend(cast)
        for node in [*reads, *(node for node, _ in replaced)]:
            if not node.users and node.op in ("get_attr", "call_function"):
                graph.erase_node(node)  # a read all of whose casts read another item
        graph.lint()
        gm.recompile()
        return PassResult(gm, True)


def gather_weights(gm: fx.GraphModule) -> fx.GraphModule:
    """Run :class:`GatherWeightsPass` and drop the cast-cache reads it left unused."""
    GatherWeightsPass()(gm)
    for node in list(gm.graph.nodes):
        if node.op == "get_attr" and node.target in (CACHE_ATTR, LOW_COPIES_ATTR) \
                and not node.users:
            gm.graph.erase_node(node)
    gm.recompile()
    return gm


def _attr(gm: nn.Module, target: str) -> Any:
    return attr_at(gm, target, None)


def _parameter_cast(node: fx.Node, read: fx.Node) -> bool:
    """``_amp_weight_cache.cast(read, dtype)`` or O2's ``_amp_low_copies.get(read, dtype)``."""
    info = cast_info(node)
    return (info is not None and info.weight and node.op == "call_method"
            and node.target in ("cast", "get") and len(node.args) == 3
            and node.args[1] is read)
