"""Which buffers of a captured module are saved: the same as in the model.

``fx.GraphModule(root, graph)`` copies every tensor the graph reads onto a fresh module and
registers each buffer as persistent. A model's non-persistent buffers (Hugging Face's rotary
``inv_freq``, a causal-mask cache) and the literals ``torch.export`` lifts out of its code
(``lifted_tensor_0``) then appear in the converted module's ``state_dict``: loading the
model's own ``state_dict`` into it fails with missing keys, and what it saves does not load
into the model. This step marks them non-persistent again.
"""

from __future__ import annotations

import torch.fx as fx
import torch.nn as nn

__all__ = ["match_persistence"]


def _persistent_buffers(model: nn.Module) -> set[str]:
    return {f"{prefix}.{name}" if prefix else name
            for prefix, module in model.named_modules(remove_duplicate=False)
            for name in module._buffers
            if name not in module._non_persistent_buffers_set}


def match_persistence(gm: fx.GraphModule, model: nn.Module) -> fx.GraphModule:
    """Mark every buffer of ``gm`` that is not a persistent buffer of ``model`` (same
    qualified name) non-persistent; idempotent."""
    saved = _persistent_buffers(model)
    for prefix, module in gm.named_modules(remove_duplicate=False):
        for name in module._buffers:
            if (f"{prefix}.{name}" if prefix else name) not in saved:
                module._non_persistent_buffers_set.add(name)
    return gm
