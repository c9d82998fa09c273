"""FitConstantsPass: fp32's extreme values, read off an fp32 tensor at capture, fitted to the
low dtype that the op now computes in.

Attention code masks scores with ``torch.finfo(scores.dtype).min``. A capture that ran the
model in fp32 (the symbolic tracer, a ``torch.compile`` graph; ``torch.export`` runs in the
AMP regime and records the low dtype's value) records fp32's minimum, -3.4e38, as a literal.
Once the scores are bf16 or fp16 that literal does not fit: ``masked_fill`` raises ``value
cannot be converted to type c10::BFloat16 without overflow``, and compiled code silently gives
inf and then NaN. Under ``torch.autocast`` the same line reads the low dtype and gets its own
minimum. This pass gives the graph that value: a float argument equal to fp32's max, min or
-max, of an op whose output is in the low dtype, becomes the low dtype's own.

Before (scores in bf16)::

    masked_fill = scores.masked_fill(mask, -3.4028234663852886e+38)

After::

    masked_fill = scores.masked_fill(mask, -3.3895313892515355e+38)

Only those exact values move: they can come from nothing but ``torch.finfo(torch.float32)``,
and no bf16 or fp16 tensor holds them. Nodes without a recorded output dtype are left alone.
The pass runs only on graphs marked ``gm.meta[TRACED_IN_FP32]``: in a graph traced in the AMP
regime such a literal is one the model wrote as such, and converting keeps it (autocast would
fail on it too; ``amprewrite.lint`` flags it).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx
from torch.fx.passes.infra.pass_base import PassBase, PassResult

from ..capture.facts import TRACED_IN_FP32

__all__ = ["FitConstantsPass"]


_FP32 = torch.finfo(torch.float32)
_LOW = (torch.float16, torch.bfloat16)


def _fitted(value: Any, low: torch.dtype) -> Any:
    """The low dtype's counterpart of fp32's extreme ``value``; anything else unchanged."""
    if type(value) is not float:
        return value
    finfo = torch.finfo(low)
    if value == _FP32.max:
        return finfo.max
    if value in (_FP32.min, -_FP32.max):
        return finfo.min
    return value


class FitConstantsPass(PassBase):
    """Replace fp32-extreme float arguments of ops that compute in fp16/bf16."""

    def call(self, gm: fx.GraphModule) -> PassResult:
        modified = False
        if not gm.meta.get(TRACED_IN_FP32):
            return PassResult(gm, modified)
        for node in gm.graph.nodes:
            val = node.meta.get("val")
            if node.op not in ("call_function", "call_method") or \
                    not isinstance(val, torch.Tensor) or val.dtype not in _LOW:
                continue
            args = tuple(_fitted(a, val.dtype) for a in node.args)
            kwargs = {k: _fitted(v, val.dtype) for k, v in node.kwargs.items()}
            # NB: compared by identity: an argument may be a tensor, whose == is elementwise.
            if any(a is not b for a, b in zip(args, node.args)) or \
                    any(kwargs[k] is not v for k, v in node.kwargs.items()):
                node.args, node.kwargs = args, kwargs
                modified = True
        return PassResult(gm, modified)
