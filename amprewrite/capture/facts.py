"""What capture records on a graph for the passes: the model's own autocast and grad-mode
regions, and whether the graph was traced in fp32.

Capture front ends (:mod:`.symbolic`, :mod:`.export`, the Dynamo backend) write these keys;
the passes read them. They live apart from both so that neither imports the other.
"""

from __future__ import annotations

import dataclasses

import torch

__all__ = ["REGION_KEY", "GRAD_KEY", "CHECKPOINT_KEY", "Region", "GRAD_MODE_FUNCTIONS", "TRACED_IN_FP32",
           "LIFTED_CONSTANTS"]

REGION_KEY = "amprewrite_autocast"
"""``node.meta[REGION_KEY]``: the innermost ``torch.autocast`` region of the model's own code
that contains the node (a :class:`Region`); absent outside any region."""


GRAD_KEY = "amprewrite_grad_enabled"
"""``node.meta[GRAD_KEY]``: the grad mode (bool) of the innermost ``torch.no_grad()`` /
``torch.enable_grad()`` region of the model's own code that contains the node; absent outside
any region. Casts are never shared across such regions: a cast made under ``no_grad`` has no
gradient for consumers outside."""


CHECKPOINT_KEY = "amprewrite_checkpoint"
"""``node.meta[CHECKPOINT_KEY]``: the index of the activation checkpoint (a Dynamo
``tag_activation_checkpoint`` body, inlined for the passes) that contains the node; absent
outside any."""


@dataclasses.dataclass(frozen=True)
class Region:
    device_type: str
    dtype: torch.dtype | None
    enabled: bool


GRAD_MODE_FUNCTIONS = (torch.is_grad_enabled, torch._C._set_grad_enabled)
"""The calls an inlined grad region adds; they compute no tensor and are never cast."""


TRACED_IN_FP32 = "amprewrite_traced_in_fp32"
"""``gm.meta`` key: the capture ran the model's Python in fp32, not in the AMP regime."""


LIFTED_CONSTANTS = "amprewrite_lifted_constants"
"""``gm.meta`` key: the attributes (``get_attr`` targets) that hold tensors the capture lifted
out of the model's code (``torch.tensor([...])`` in a forward): values of the code, not state
of the model, though ``torch.export`` registers them as buffers of the graph's module."""
