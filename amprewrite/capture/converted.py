"""Capture of a module amprewrite already converted: its graph, not a new trace.

``convert(convert(model, ...), ...)`` and the opt levels start from a converted GraphModule.
Its graph is copied (each node's meta with it: decisions, regions, dtypes) and the gathered
weight reads are spelled out again, one ``get_attr`` and one cast node per weight, as the
passes expect them.
"""

from __future__ import annotations

import copy

import torch.fx as fx
import torch.nn as nn

from ..runtime.weight_cache import CACHE_ATTR, WeightCastCache
from ..runtime.weight_table import ungather_weights
from ..graph.codegen import plain_codegen
from ..graph.meta import CONVERTED_KEY
from .symbolic import unshare_leaf_modules

__all__ = ["CONVERTED_KEY", "MODEL_KEY", "is_converted", "capture_converted"]


MODEL_KEY = "amprewrite_model"
"""``gm.meta[MODEL_KEY]``: the class name of the model ``convert`` was given (summaries)."""


def is_converted(model: nn.Module) -> bool:
    return isinstance(model, fx.GraphModule) and CONVERTED_KEY in getattr(model, "meta", {})


def capture_converted(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of a converted module's graph, sharing its parameters and buffers.

    NB: not traced again: the model's own autocast regions live only in node meta (the
    converted code enters no autocast region), so a re-trace would see the ops of an
    ``enabled=False`` region as ordinary ops and cast them. ``Graph`` deep copies keep each
    node's meta (a shallow copy), so decisions, regions and dtypes carry over.
    """

    graph = copy.deepcopy(gm.graph)
    plain_codegen(graph)  # the passes recompile with torch.fx's generator; finish sets ours
    new = fx.GraphModule(gm, graph, class_name=type(gm).__name__)
    ungather_weights(new, gm)  # the passes work on one get_attr and one cast node per weight
    if hasattr(new, CACHE_ATTR):
        setattr(new, CACHE_ATTR, WeightCastCache())  # copies of weights are per module
    new.meta.update({k: v for k, v in gm.meta.items() if k != CONVERTED_KEY})
    unshare_leaf_modules(new)
    new.train(gm.training)
    return new
