"""The model of ``python -m amprewrite demo``: a HuggingFace Llama, as users train it.

One decoder layer with tiny sizes and random weights, built from a ``LlamaConfig`` (nothing is
downloaded), so that its rewritten graph fits in a terminal's scrollback and still has every
kind of op a policy sorts: matmuls and linears (low precision), softmax and the RMSNorm's
``pow``/``rsqrt`` and ``mean`` (fp32), rotary embeddings computed under the model's own
``torch.no_grad()`` and ``torch.autocast(enabled=False)``, SiLU and residual adds
(passthrough), an embedding lookup on integer ids (never cast), and model code that reads
dtypes off its tensors (``hidden_states.to(input_dtype)``, ``torch.finfo(dtype).min``).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from ..errors import AmpRewriteError

__all__ = ["LlamaLogits", "demo_factory"]


class LlamaLogits(nn.Module):
    """Token ids ``(batch, length)`` → next-token logits, the way a training loop calls a
    causal LM (no KV cache)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=ids, use_cache=False).logits


def demo_factory() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """``(model, example_inputs)``, seeded: the same weights and ids on every run."""
    try:
        import transformers
    except ImportError as exc:
        raise AmpRewriteError(
            "the demo converts a HuggingFace Llama and needs transformers: "
            "pip install -e \".[demo]\" (or pip install transformers)") from exc
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32,
        attn_implementation="eager")
    torch.manual_seed(0)
    model = LlamaLogits(transformers.LlamaForCausalLM(config)).train()
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    return model, (ids,)
