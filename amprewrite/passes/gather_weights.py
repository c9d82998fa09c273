"""GatherWeightsPass: every parameter and buffer read of a forward, and every parameter cast,
in one call at its start.

Why: a converted graph reads each weight through a chain of ``nn.Module.__getattr__`` calls
(``getattr(self.layers, "3").attn.q_proj.weight``, about 1 µs a level) and casts it with a
Python call per weight; ``torch.autocast`` pays a C++ dispatch per cast instead. For a small
model run eagerly (GPU training of small and medium models, launch-bound) that Python is the
step time. After this pass one call reads every tensor through dict lookups and casts all
trainable parameters in one batch (one autograd node; on every device two kernels per group
of weights instead of one per weight), and ``gm.code`` still names each weight and its dtype.

Before::

    b_0_l_weight = getattr(self.b, "0").l.weight
    b_0_l_weight_bf16 = _amp_weight_cache.cast(b_0_l_weight, torch.bfloat16)
    b_0_n_weight = getattr(self.b, "0").n.weight

After::

    weights = _amp_weights.fetch(('b.0.l.weight', torch.bfloat16), ('b.0.n.weight',),
                                 cache = _amp_weight_cache)
    b_0_l_weight_bf16 = weights[0]
    b_0_n_weight = weights[1]

An entry is ``(name,)`` for a tensor read as it is stored, ``(name, dtype)`` for a parameter
cast (autograd-tracked in training, a cached copy in inference: see
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
from ..graph.queries import mutated
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
    """Replace the graph's tensor ``get_attr`` reads and parameter casts by one
    ``_amp_weights.fetch(...)`` call and an item per tensor (see the module docstring).

    The items keep the names and metadata of the nodes they replace, so decisions, ``explain``
    and the auditor keep referring to ``b_0_l_weight_bf16``. A graph that already has a fetch
    is left alone (idempotent); :func:`ungather_weights` undoes the pass.
    """

    def call(self, gm: fx.GraphModule) -> PassResult:
        graph = gm.graph
        if any(is_fetch(n) for n in graph.nodes):
            return PassResult(gm, False)
        reads = [n for n in graph.nodes if n.op == "get_attr"
                 and isinstance(_attr(gm, str(n.target)), torch.Tensor)]
        if not reads:
            return PassResult(gm, False)

        index: dict[tuple[Any, ...], int] = {}  # entry -> its position (one per tensor/dtype)
        replaced: list[tuple[fx.Node, int]] = []
        for read in reads:
            name = str(read.target)
            value = _attr(gm, name)
            gathered = [u for u in read.users if _parameter_cast(u, read)] \
                if isinstance(value, nn.Parameter) and not mutated(read) else []
            found = [((name,), read)] if any(u not in gathered for u in read.users) else []
            # NB: casts the graph kept apart for the model's no_grad regions are one entry
            # here: hoisted to the start, they all run in the caller's grad mode.
            found += [((name, c.args[2], LOW_COPY) if c.target == "get" else (name, c.args[2]), c)
                      for c in gathered]
            for entry, node in found:
                replaced.append((node, index.setdefault(entry, len(index))))
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
        previous = fetch
        for node, i in sorted(replaced, key=lambda pair: pair[1]):
            node.op, node.target = "call_function", operator.getitem
            node.args, node.kwargs = (fetch, i), {}
            previous.append(node)
            previous = node
        for read in reads:
            if read.op == "get_attr" and not read.users:
                graph.erase_node(read)
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
    obj: Any = gm
    for part in target.split("."):
        obj = getattr(obj, part, None)
    return obj


def _parameter_cast(node: fx.Node, read: fx.Node) -> bool:
    """``_amp_weight_cache.cast(read, dtype)`` or O2's ``_amp_low_copies.get(read, dtype)``."""
    info = cast_info(node)
    return (info is not None and info.weight and node.op == "call_method"
            and node.target in ("cast", "get") and len(node.args) == 3
            and node.args[1] is read)
