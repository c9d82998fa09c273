"""The process-wide torch state that conversion must leave exactly as it found it.

Capture runs model code under ``torch.autocast`` and inside the model's own ``no_grad``
regions, and passes run graphs on fake tensors; an error raised half-way through any of them
must not leave the user's process with grad mode off or autocast on. Nor may a capture draw
from the user's random stream (torch.export's first use draws from it): a module captured at
its first call, inside a training step, must drop out the same units as eager does.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

__all__ = ["preserved_global_state"]

_AUTOCAST_DEVICES = ("cpu", "cuda")


@contextlib.contextmanager
def preserved_global_state() -> Iterator[None]:
    """Restore grad mode, the default dtype, every autocast setting and the random state on
    exit, errors included."""
    grad = torch.is_grad_enabled()
    default_dtype = torch.get_default_dtype()
    autocast = {d: (torch.is_autocast_enabled(d), torch.get_autocast_dtype(d))
                for d in _AUTOCAST_DEVICES}
    cache = torch.is_autocast_cache_enabled()
    rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    try:
        yield
    finally:
        torch.set_rng_state(rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)
        torch.set_grad_enabled(grad)
        torch.set_default_dtype(default_dtype)
        for device, (enabled, dtype) in autocast.items():
            torch.set_autocast_enabled(device, enabled)
            torch.set_autocast_dtype(device, dtype)
        torch.set_autocast_cache_enabled(cache)
