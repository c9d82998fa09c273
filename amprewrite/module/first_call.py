"""A converted module captured at its first call, from that call's inputs, as torch.compile does.

``convert(model, capture="export")`` without example inputs returns a module that holds no
graph yet: trainers (a Lightning precision plugin, a framework's set-up code) hand a model
over before any batch exists, while the export capture that real models need wants inputs.
The first call captures the model from its own inputs (:meth:`GraphCache.follow
<amprewrite.module.cache.GraphCache.follow>`); a later call whose inputs the graph does
not fit (another dtype, rank or fixed size) captures again for them, bounded and with a
warning (:meth:`GraphCache.refit <amprewrite.module.cache.GraphCache.refit>`).

Until then the module is a placeholder (:func:`placeholder_module`) that is already the
model for everything but computing: it holds the model's own submodules and root tensors, so
``parameters()`` (an optimizer built at set-up), ``state_dict()`` / ``load_state_dict()``
(a checkpoint restored before training), ``.to()`` and ``train()`` / ``eval()`` work, and
:class:`amprewrite.MasterWeights` binds an O2 module's optimizer. Its ``gm.code`` and
``explain(gm)`` say that it is not captured yet; calling its graph directly (``torch.compile``
of it before a first eager call) raises, saying so.
"""

from __future__ import annotations

import torch.fx as fx
import torch.nn as nn

from ..errors import AmpRewriteError
from ..runtime.low_copies import LOW_COPIES_ATTR, LowPrecisionCopies
from .modes import MODE_KEY

__all__ = ["placeholder_module", "NOT_CAPTURED_YET_KEY", "not_captured_yet"]

NOT_CAPTURED_YET_KEY = "amprewrite_not_captured_yet"
"""``gm.meta[NOT_CAPTURED_YET_KEY]``: set on the placeholder; what to do before the first call."""


def not_captured_yet(message: str) -> None:
    """The one op of the placeholder's graph."""
    raise AmpRewriteError(message)


def placeholder_module(model: nn.Module, meta: dict, o2: bool, shares: bool) -> fx.GraphModule:
    """The converted module before its first call (module docstring). ``meta``: what
    ``convert`` records on every converted module (policy, opt level); ``o2``: give it the
    store of low-precision copies now, so that ``MasterWeights`` can bind it before the first
    call (the captured graph then uses this store); ``shares``: its root parameters are the
    model's own dict (not for O3, whose capture holds low-precision copies of its own)."""
    name = type(model).__name__
    message = (f"this converted {name} is captured at its first call, from that call's "
               "inputs, and has not been called yet: call it once (gm(*inputs)), or convert "
               "with example_inputs=(...) to capture now.")
    graph = fx.Graph()
    graph.placeholder("*args")
    graph.placeholder("**kwargs")
    graph.output(graph.call_function(not_captured_yet, (message,)))
    gm = fx.GraphModule(nn.Module(), graph, class_name=name)
    gm._modules.update(model._modules)  # the model's own: parameters(), state_dict()
    if shares:  # the model's own dict, as a capture's root shares it
        # (.model_watch.share_root_parameters): FSDP2's fully_shard(gm) before the first call
        # swaps the parameters the capture reads through the model
        gm.__dict__["_parameters"] = model._parameters
    else:
        gm._parameters.update(model._parameters)
    gm._buffers.update(model._buffers)
    gm._non_persistent_buffers_set.update(model._non_persistent_buffers_set)
    gm.meta.update(meta)
    gm.meta[MODE_KEY] = model.training
    gm.meta[NOT_CAPTURED_YET_KEY] = message
    gm.training = model.training  # NB: not train(): it would set the model's own flags
    if o2:
        gm.__dict__[LOW_COPIES_ATTR] = LowPrecisionCopies()
    return gm

