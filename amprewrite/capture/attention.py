"""Where a captured ``nn.MultiheadAttention`` call would take its fused fast path in eager.

``nn.MultiheadAttention.forward`` runs one fused kernel, ``torch._native_multi_head_attention``,
instead of its composite ops when the module is in eval mode, its configuration allows it
(self-attention, ``batch_first``, an even number of heads, no masks, ...) and nothing needs a
gradient: under ``torch.no_grad()``. Its check of the autocast state,
``torch.is_autocast_enabled()`` without a device, reads CUDA's only, so under
``torch.autocast("cpu")`` eager takes the fused kernel too (CPU autocast lowers it to bf16),
which rounds otherwise than the composite ops. ``torch.export`` never records it (any torch
function mode blocks the fast path): the captured graph holds the composite ops, which is what
eager computes with gradients.

:class:`AttentionCalls` records, while the model is exported, each call whose module and
arguments allow the fast path, from the arguments of the ``F.multi_head_attention_forward``
call the composite path makes (a torch function: the mode sees it). The pass of
:mod:`amprewrite.passes.attention` then lets the converted module choose as eager does.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["ATTENTION_KEY", "AttentionCall", "AttentionCalls", "has_attention"]

ATTENTION_KEY = "amprewrite_attention_calls"
"""``gm.meta[ATTENTION_KEY]``: the :class:`AttentionCall` of each ``nn.MultiheadAttention``
call of the capture that could take the fused fast path, by module path."""


@dataclasses.dataclass(frozen=True)
class AttentionCall:
    """One ``nn.MultiheadAttention`` call that eager may run as its fused kernel."""

    path: str
    """The module's qualified name (``encoder.layers.0.self_attention``)."""
    embed_dim: int
    num_heads: int
    need_weights: bool
    average_attn_weights: bool


_SIGNATURE = inspect.signature(F.multi_head_attention_forward)


def has_attention(model: nn.Module) -> bool:
    return any(isinstance(m, nn.MultiheadAttention) for m in model.modules())


class AttentionCalls(torch.overrides.TorchFunctionMode):
    """Records the fast-path-eligible ``nn.MultiheadAttention`` calls of ``model`` (once each:
    a module called twice is left out, as its calls cannot be told apart in the graph)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.modules = [(path, m) for path, m in model.named_modules()
                        if isinstance(m, nn.MultiheadAttention)]
        self.calls: dict[str, AttentionCall | None] = {}

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is F.multi_head_attention_forward:
            self._record(_SIGNATURE.bind(*args, **kwargs).arguments)
        return func(*args, **kwargs)

    def _record(self, call: dict[str, Any]) -> None:
        weight = call.get("in_proj_weight")
        found = next(((p, m) for p, m in self.modules if m.in_proj_weight is weight), None)
        if found is None:
            return
        path, module = found
        fast = _module_allows(module) and call["query"] is call["key"] is call["value"] \
            and call["query"].dim() == 3 and call.get("key_padding_mask") is None \
            and call.get("attn_mask") is None and not call.get("is_causal", False)
        seen = path in self.calls
        self.calls[path] = None if seen or not fast else AttentionCall(
            path, module.embed_dim, module.num_heads, bool(call.get("need_weights", True)),
            bool(call.get("average_attn_weights", True)))

    def recorded(self) -> tuple[AttentionCall, ...]:
        return tuple(c for c in self.calls.values() if c is not None)


def _module_allows(m: nn.MultiheadAttention) -> bool:
    """The conditions of the fast path that the module's configuration decides."""
    return (not m.training and m.batch_first and m.num_heads % 2 == 0
            and m._qkv_same_embed_dim and m.in_proj_bias is not None
            and m.bias_k is None and m.bias_v is None and not m.add_zero_attn)
