"""Factories for ``python -m amprewrite explain|audit examples.factories:NAME``.

A factory takes no arguments and returns ``(model, example_inputs)``; run the commands from
the repository root so that ``examples`` is importable.

    python -m amprewrite explain examples.factories:mlp
    python -m amprewrite audit examples.factories:gpt2 --policy autocast-cpu
    python -m amprewrite explain examples.factories:branchy --capture compile
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


def mlp() -> tuple[nn.Module, tuple[torch.Tensor]]:
    """Linear → GELU → Linear → LayerNorm → log_softmax."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16), nn.LayerNorm(16),
                          nn.LogSoftmax(dim=-1))
    return model, (torch.randn(4, 16),)


class Branchy(nn.Module):
    """Python control flow on a tensor value: torch.export cannot capture it as one graph,
    the torch.compile backend (``--capture compile``) converts each piece."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(16, 16)
        self.out = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.inp(x))
        if h.mean() > 0.1:
            h = h * 2
        return F.softmax(self.out(h), dim=-1)


def branchy() -> tuple[nn.Module, tuple[torch.Tensor]]:
    torch.manual_seed(0)
    return Branchy(), (torch.randn(4, 16),)


def gpt2() -> tuple[nn.Module, tuple[torch.Tensor]]:
    """A 2-layer GPT-2 with random weights (needs ``transformers``; nothing is downloaded)."""
    from transformers import GPT2Config, GPT2Model

    config = GPT2Config(vocab_size=128, n_embd=32, n_layer=2, n_head=2, n_positions=32,
                        use_cache=False, attn_implementation="eager", bos_token_id=0,
                        eos_token_id=0)
    torch.manual_seed(0)
    model = GPT2Model(config).eval()
    return model, (torch.randint(0, 128, (2, 12)),)
