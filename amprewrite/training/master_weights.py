"""fp32 master weights for ``opt_level="O2"``, bound to the optimizers that update them.

:class:`MasterWeights` binds an O2 module's fp32 master weights (its parameters, shared with
the user's model) to the optimizer(s) that update them, and refreshes the low-precision
copies the graph computes with after every optimizer step::

    gm = amprewrite.convert(model, (x,), opt_level="O2", dtype=torch.float16)
    opt = torch.optim.AdamW(gm.parameters(), lr=1e-3)      # the fp32 masters
    masters = amprewrite.MasterWeights(gm, opt)
    scaler = torch.amp.GradScaler("cuda")
    for x, y in data:
        loss = loss_fn(gm(x), y)
        scaler.scale(loss).backward()      # fp16 grads of the copies reach the masters in fp32
        scaler.unscale_(opt)               # optional: clip fp32 master gradients
        torch.nn.utils.clip_grad_norm_(gm.parameters(), 1.0)
        scaler.step(opt)                   # fp32 update; the copies are refreshed after it
        scaler.update()
        opt.zero_grad()

Loss scaling stays ``torch.amp.GradScaler``'s job; :mod:`.scaler_monitor` watches it.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch.nn as nn
from torch.optim import Optimizer

from ..passes.opt_levels import opt_level_of
from ..runtime.low_copies import LOW_COPIES_ATTR, LowPrecisionCopies
from .optimizers import held_tensors, list_names, optimizer_list

__all__ = ["MasterWeights"]


# ---------------------------------------------------------------------------------------------
class MasterWeights:
    """The fp32 master weights of an ``opt_level="O2"`` module, bound to their optimizer(s).

    The masters are the module's parameters (``gm.parameters()``, the same tensors as the
    model's): the optimizer holds them, updates them in fp32, and its state and
    ``gm.state_dict()`` are fp32 as well. The graph computes with low-precision copies. After
    each optimizer step (a step that ``GradScaler`` skips changes nothing) the copies of the
    trained masters are recomputed, all in one multi-tensor copy at the next forward. Changes
    made elsewhere are followed where a counter sees them (``load_state_dict``, ``p.mul_``
    under ``no_grad``, new storage, a replaced parameter); a write through ``.data``
    (``p.data.mul_``) moves no counter and needs :meth:`refresh` (or
    ``amprewrite.clear_weight_cache(gm)``). A module sharded with FSDP2 (``fully_shard``,
    before binding) refills its parameters in place before every forward without moving a
    counter: the binding then refreshes the copies before each forward itself, and drops
    them after it, as FSDP2 frees the gathered parameters (so the copies of one block exist
    while its forward and backward need them, not between steps; those a checkpointed
    block's recomputation makes in the backward are dropped at the optimizer step).

    Works with any ``torch.optim`` optimizer (fused ones included), with several optimizers
    (pass a list), with ``GradScaler`` (``unscale_`` and clipping see fp32 master gradients)
    and with gradient accumulation (autograd sums micro-batch gradients in fp32 in the
    masters' ``.grad``).

    Args:
        gm: a module from ``amprewrite.convert(..., opt_level="O2")``.
        optimizers: the optimizer, or a list of them, that together hold every trainable
            master weight of ``gm``.

    Raises:
        ValueError: ``gm`` is not an O2 module, or the optimizers miss some of its trainable
            parameters (a step would leave them, and their low-precision copies, unchanged).
        TypeError: ``optimizers`` is not an optimizer or a list of them.
    """

    def __init__(self, gm: nn.Module, optimizers: Optimizer | Sequence[Optimizer]) -> None:
        level = opt_level_of(gm)
        store = getattr(gm, LOW_COPIES_ATTR, None)
        if level is None or level.level != "O2" or not isinstance(store, LowPrecisionCopies):
            got = f"opt_level={level.level!r}" if level is not None else \
                f"a {type(gm).__name__} that amprewrite did not convert"
            raise ValueError(
                f"amprewrite.MasterWeights: gm must come from amprewrite.convert(..., "
                f"opt_level='O2'), got {got}. O0/O1 modules train fp32 parameters directly "
                "and O3 modules have no masters: use the optimizer alone.")
        self._optimizers = optimizer_list(optimizers, "amprewrite.MasterWeights")
        held = {id(p) for p in held_tensors(self._optimizers)}
        missing = [name for name, p in gm.named_parameters()
                   if p.requires_grad and id(p) not in held]
        if missing:
            raise ValueError(
                f"amprewrite.MasterWeights: the optimizer(s) do not hold {len(missing)} of the "
                f"module's trainable fp32 master weights ({list_names(missing)}); their "
                "updates and low-precision copies would silently stay unchanged. Build the "
                "optimizer(s) over gm.parameters() (the fp32 masters, the same tensors as "
                "model.parameters()), or set requires_grad=False on weights you freeze.")
        self._gm = gm
        self._store = store
        self._handles = [opt.register_step_post_hook(self._after_step)
                         for opt in self._optimizers]
        self._sharded = _is_fsdp2(gm)
        if self._sharded:
            # NB: after FSDP2's own pre-forward hook (registered first, prepended), so the
            # copies are made from the all-gathered parameters; returns None: the inputs
            # stay as they are. And dropped after the forward: FSDP2 frees the gathered
            # parameters then, and full-size copies kept until the next forward would undo
            # what sharding saves (a block's copies live as long as its backward needs them).
            self._handles.append(gm.register_forward_pre_hook(lambda module, args: store.refresh()))
            self._handles.append(gm.register_forward_hook(
                lambda module, args, output: store.release()))
        store.bindings += 1
        self._closed = False

    def _after_step(self, optimizer: Optimizer, args: Any, kwargs: Any) -> None:
        if self._sharded:
            # NB: also those a recomputation made in the backward (activation checkpointing
            # stops its recomputing forward early, by an exception, before forward hooks run)
            self._store.release()
        else:
            self._store.mark_stepped()

    def refresh(self) -> None:
        """Recompute every low-precision copy from its fp32 master now."""
        self._store.refresh()

    def close(self) -> None:
        """Unbind: remove the step hooks (a grad-mode forward then needs a new binding)."""
        if not self._closed:
            for handle in self._handles:
                handle.remove()
            self._store.bindings -= 1
            self._closed = True

    def __repr__(self) -> str:
        n = sum(1 for _ in self._gm.parameters())
        return (f"MasterWeights({n} fp32 masters, {len(self._optimizers)} optimizer(s), "
                f"{self._store.nbytes()} bytes of low-precision copies)")


def _is_fsdp2(module: nn.Module) -> bool:
    """Whether ``module``'s parameters are sharded by FSDP2's ``fully_shard``: of the module
    itself, or of a wrapper around it (``fully_shard(checkpoint_wrapper(gm))``), whose
    parameters are then DTensors between forwards."""
    try:
        from torch.distributed.fsdp import FSDPModule
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch built without distributed support
        return False
    return isinstance(module, FSDPModule) or any(
        isinstance(p, DTensor) for p in module.parameters())
