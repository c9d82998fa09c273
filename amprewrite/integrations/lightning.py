"""PyTorch Lightning precision plugins that train with amprewrite's converted modules.

    trainer = lightning.Trainer(plugins=[AmpPrecision(policy=amprewrite.Policy())])
    fabric = lightning.Fabric(plugins=[AmpFabricPrecision(policy=amprewrite.Policy())])

:class:`AmpPrecision` is ``Trainer``'s: at set-up it converts each direct child of the
LightningModule that holds parameters (what ``training_step`` calls: ``self.net(x)``), in
place, with ``capture="export"`` and no example inputs, so that each is captured at its
first call from the batch it is given (:mod:`amprewrite.module.first_call`; no batch
exists at set-up). The LightningModule's state dict keeps its keys, so checkpoints save and
resume as without the plugin. Nothing is wrapped in ``torch.autocast``: the casts are in the
graphs. fp16 steps go through a ``torch.amp.GradScaler`` (unscaled before clipping,
skipped on inf/NaN), as Lightning's ``"16-mixed"`` does; ``opt_level="O2"`` binds each
converted child's fp32 masters to the optimizers that hold them
(:class:`amprewrite.MasterWeights`) before the first step. Validation and testing run the
eval-mode graph (Lightning switches the module to ``eval()``).

:class:`AmpFabricPrecision` is Fabric's: ``fabric.setup(model, ...)`` converts the model
itself the same way (O1; an O2 model needs its optimizer bound before the first forward,
which Fabric's plugin never sees: convert it yourself and bind ``MasterWeights``).

Needs the ``lightning`` extra.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Any, Callable

import torch
import torch.nn as nn

try:
    from lightning.fabric.plugins.precision.amp import MixedPrecision as _FabricMixedPrecision
    from lightning.pytorch.plugins.precision.amp import MixedPrecision as _MixedPrecision
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError("amprewrite.integrations.lightning needs PyTorch Lightning: "
                      "pip install 'amprewrite[lightning]'") from exc

from ..capture.converted import is_converted
from ..convert import convert
from ..policy.policy import Policy, default_low_dtype
from ..training.master_weights import MasterWeights
from ..training.optimizers import held_tensors

__all__ = ["AmpPrecision", "AmpFabricPrecision"]


def _settings(policy: Policy | None, dtype: torch.dtype | None, device: str | None
              ) -> tuple[Policy, torch.dtype, str]:
    if policy is not None and not isinstance(policy, Policy):
        raise TypeError(f"amprewrite's Lightning plugin: policy must be an amprewrite.Policy, "
                        f"got {type(policy).__name__}")
    policy = policy if policy is not None else Policy()
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    low = dtype or policy.dtype or default_low_dtype(device)
    if low not in (torch.float16, torch.bfloat16):
        raise ValueError(f"amprewrite's Lightning plugin: dtype={low} is not a low-precision "
                         "dtype; expected torch.float16 or torch.bfloat16")
    return policy, low, device


def _precision_name(low: torch.dtype) -> str:
    return "16-mixed" if low is torch.float16 else "bf16-mixed"


class AmpPrecision(_MixedPrecision):
    """``Trainer(plugins=[AmpPrecision(policy=...)])`` (module docstring).

    Args:
        policy: the :class:`amprewrite.Policy` (default ``Policy()``: CUDA AMP rules).
        opt_level: ``"O1"`` (default) or ``"O2"`` (fp32 master weights, low-precision
            copies), as in :func:`amprewrite.convert`.
        dtype: the low dtype; default the policy's, else fp16 on CUDA and bf16 on CPU.
        device: where the ``GradScaler`` of fp16 runs; default CUDA when available.
        scaler: a ``torch.amp.GradScaler`` of your own (fp16 only).
    """

    def __init__(self, policy: Policy | None = None, *, opt_level: str = "O1",
                 dtype: torch.dtype | None = None, device: str | None = None,
                 scaler: torch.amp.GradScaler | None = None) -> None:
        if opt_level != "O1" and policy is not None and policy != Policy():
            raise ValueError(
                f"amprewrite's Lightning plugin: a policy was given with opt_level="
                f"{opt_level!r}; the per-op policy is what opt_level='O1' applies. Drop "
                "policy=..., or use opt_level='O1'.")
        policy, low, device = _settings(policy, dtype, device)
        super().__init__(_precision_name(low), device, scaler)
        self.policy, self.low, self.opt_level = policy, low, opt_level
        self._bound = False

    def convert_module(self, module: nn.Module) -> nn.Module:
        """Convert each direct child of ``module`` that holds parameters, in place, to be
        captured at its first call."""
        for name, child in list(module.named_children()):
            if is_converted(child) or next(child.parameters(), None) is None:
                continue
            # NB: the dtype the precision name was chosen for (an explicit dtype= wins over
            # the policy's, as in convert); O2 takes no policy (checked in __init__).
            policy = self.policy if self.opt_level == "O1" else None
            setattr(module, name, convert(child, capture="export", policy=policy,
                                          dtype=self.low, opt_level=self.opt_level))
        return module

    def forward_context(self) -> AbstractContextManager:
        return nullcontext()  # the casts are in the converted graphs

    def optimizer_step(self, optimizer: Any, model: Any, closure: Callable[[], Any],
                       **kwargs: Any) -> Any:
        if self.opt_level == "O2" and not self._bound:
            self._bind_masters(model)
        return super().optimizer_step(optimizer, model=model, closure=closure, **kwargs)

    def _bind_masters(self, model: nn.Module) -> None:
        """Bind each converted O2 child to the optimizers that hold its masters (before the
        step's closure runs the first forward)."""
        optimizers = [getattr(o, "optimizer", o) for o in model.trainer.optimizers]
        for child in model.children():
            if not is_converted(child):
                continue
            mine = {id(p) for p in child.parameters()}
            holding = [o for o in optimizers if any(id(p) in mine for p in held_tensors([o]))]
            if holding:
                MasterWeights(child, holding)
        self._bound = True


class AmpFabricPrecision(_FabricMixedPrecision):
    """``Fabric(plugins=[AmpFabricPrecision(policy=...)])`` (module docstring): O1, the
    model converted at ``fabric.setup`` and captured at its first call."""

    def __init__(self, policy: Policy | None = None, *, dtype: torch.dtype | None = None,
                 device: str | None = None,
                 scaler: torch.amp.GradScaler | None = None) -> None:
        policy, low, device = _settings(policy, dtype, device)
        super().__init__(_precision_name(low), device, scaler)
        self.policy, self.low = policy, low

    def convert_module(self, module: nn.Module) -> nn.Module:
        if is_converted(module):
            return module
        return convert(module, capture="export", policy=self.policy, dtype=self.low)

    def forward_context(self) -> AbstractContextManager:
        return nullcontext()
