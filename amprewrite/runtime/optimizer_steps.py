"""A count of optimizer steps, process-wide: how kept weight copies notice fused optimizers.

Fused optimizers (``AdamW(fused=True)``, ``SGD(fused=True)``; transformers' ``Trainer``
defaults to ``adamw_torch_fused``) write the parameters without moving their version
counters (torch 2.13, CPU: ``_fused_adamw_`` leaves ``p._version`` as it was), so a
low-precision copy checked by version alone would outlive the step. Every ``torch.optim``
optimizer runs the global step hooks, fused or not: one counts the steps, and a cache that
keeps copies across calls (:func:`amprewrite.cache_weights`) drops them when the count moved.

The hook is registered on first use (the first ``cache_weights`` region), not on import: a
process that never keeps copies across calls runs no hook at all. NB: a *pre*-step hook, so
that :class:`amprewrite.MasterWeights`, which refreshes O2's copies in its own post-step
hook, can record the count that includes its step and spare the next forward a second
refresh.
"""

from __future__ import annotations

from typing import Any

from torch.optim.optimizer import register_optimizer_step_pre_hook

__all__ = ["steps_taken", "count_steps"]

_count = [0]
_registered = [False]


def _count_step(optimizer: Any, args: Any, kwargs: Any) -> None:
    _count[0] += 1


def count_steps() -> None:
    """Start counting optimizer steps (once per process)."""
    if not _registered[0]:
        register_optimizer_step_pre_hook(_count_step)
        _registered[0] = True


def steps_taken() -> int:
    """Optimizer steps started since :func:`count_steps` was first called."""
    return _count[0]
