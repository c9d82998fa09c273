"""``nn.MultiheadAttention`` as eager autocast runs it: its fused kernel where eager takes it
(eval mode, nothing needing a gradient: :mod:`amprewrite.capture.attention`), its captured
composite ops otherwise. A converted graph calls :func:`multi_head_attention` by name."""

from __future__ import annotations

import torch
import torch.nn as nn

from .functions import cast_to

__all__ = ["multi_head_attention"]


def multi_head_attention(composite: nn.Module, composite_inputs: tuple, query: torch.Tensor,
                         in_proj_weight: torch.Tensor, in_proj_bias: torch.Tensor,
                         out_proj_weight: torch.Tensor, out_proj_bias: torch.Tensor,
                         embed_dim: int, num_heads: int, need_weights: bool,
                         average_attn_weights: bool, query_dtype: torch.dtype,
                         low: torch.dtype) -> torch.Tensor:
    """The attention output of a self-attention ``nn.MultiheadAttention`` call.

    ``composite`` (a sub-graph of the converted module, in its training mode) computes the
    captured ops from ``composite_inputs``; the projections' weights come cast to ``low``,
    and ``query_dtype`` is the dtype of the module's weights, which eager's fast path wants
    the query in. The fused kernel runs where ``nn.MultiheadAttention.forward`` would take it:
    the checks it makes at run time, in its order (the module's configuration was checked at
    conversion), with CPU autocast's casts of the kernel's inputs to ``low``.
    """
    weights = (in_proj_weight, in_proj_bias, out_proj_weight, out_proj_bias)
    fast = (not composite.training and torch.backends.mha.get_fastpath_enabled()
            and query.dtype == query_dtype and not torch.is_autocast_enabled()
            and not torch.overrides.has_torch_function((query, *weights))
            and not (torch.is_grad_enabled()
                     and any(t.requires_grad for t in (query, *weights))))
    if not fast:
        return composite(*composite_inputs)
    x = cast_to(query, low)
    return torch._native_multi_head_attention(
        x, x, x, embed_dim, num_heads, *weights, None, need_weights, average_attn_weights,
        None)[0]
