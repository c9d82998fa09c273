"""``ScalerMonitor``: a per-step record of loss scaling, and warnings for what
``torch.amp.GradScaler`` leaves silent.

Loss scaling itself is GradScaler's job. The monitor records, per step, the loss scale, whether
the step was skipped and which parameters' gradients held inf/NaN, and the fraction of gradient
elements that are exactly zero (underflow); it warns when the scale collapses, when steps keep
being skipped, and when fp16 training runs without a (working) scaler.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any, Sequence

import torch
import torch.nn as nn
from torch.optim import Optimizer

from ..errors import user_stacklevel
from ..passes.opt_levels import opt_level_of
from .optimizers import held_tensors, list_names, optimizer_list, parameter_names

__all__ = ["ScalerMonitor", "StepRecord"]


@dataclasses.dataclass(frozen=True)
class StepRecord:
    """What happened at one optimizer step, as seen by :meth:`ScalerMonitor.update`."""

    step: int
    """0-based count of :meth:`ScalerMonitor.update` calls."""
    scale: float
    """The loss scale this step's gradients were computed with (1.0 without a scaler)."""
    skipped: bool
    """True when an optimizer did not step (GradScaler found inf/NaN in its gradients)."""
    nonfinite: tuple[str, ...]
    """Parameters whose gradient held inf or NaN (why the step was skipped)."""
    zero_fraction: float
    """Fraction of gradient elements that are exactly zero: values that underflowed (fp16
    without loss scaling) show up here."""
    next_scale: float
    """The scale after ``GradScaler.update()``: what the next step will use."""


class ScalerMonitor:
    """Per-step record of loss scaling, and warnings for what GradScaler leaves silent.

    Call :meth:`update` where the loop calls ``scaler.update()`` (it calls it); without a
    scaler, call it after ``optimizer.step()``. Checks made when it is created:

    * parameters that require grad held in fp16 by the optimizers, with an enabled scaler:
      ``ValueError`` naming them (GradScaler would raise "Attempting to unscale FP16
      gradients" at the first step);
    * fp16 training (an fp16-converted module, or fp16 parameters) without a scaler, or with
      a disabled one (``GradScaler()`` defaults to device ``"cuda"`` and disables itself
      without CUDA): a ``UserWarning``, since small gradients flush to zero in fp16.

    Args:
        module: the trained module (names the parameters; tells the compute dtype).
        optimizers: the optimizer, or a list of them, stepped through the scaler.
        scaler: the ``torch.amp.GradScaler``, or None when training without one.
        min_scale: warn when the scale falls below this (a collapsing scale means gradients
            overflow at every scale: some op produces inf/NaN by itself).
        max_skipped_in_a_row: warn when this many consecutive steps are skipped.
    """

    def __init__(self, module: nn.Module, optimizers: Optimizer | Sequence[Optimizer],
                 scaler: torch.amp.GradScaler | None = None, *, min_scale: float = 1.0,
                 max_skipped_in_a_row: int = 8) -> None:
        if not isinstance(module, nn.Module):
            raise TypeError(f"amprewrite.ScalerMonitor: module must be an nn.Module, got "
                            f"{type(module).__name__}")
        if scaler is not None and not isinstance(scaler, torch.amp.GradScaler):
            raise TypeError(f"amprewrite.ScalerMonitor: scaler must be a torch.amp.GradScaler "
                            f"or None, got {type(scaler).__name__}")
        if not min_scale > 0 or max_skipped_in_a_row < 1:
            raise ValueError(f"amprewrite.ScalerMonitor: min_scale={min_scale!r} must be > 0 "
                             f"and max_skipped_in_a_row={max_skipped_in_a_row!r} >= 1")
        self._optimizers = optimizer_list(optimizers, "amprewrite.ScalerMonitor")
        self._scaler = scaler
        self.min_scale = min_scale
        self.max_skipped_in_a_row = max_skipped_in_a_row
        self._names = parameter_names(module)
        self._params = held_tensors(self._optimizers)
        self._check_setup(module)
        self._steps = [0] * len(self._optimizers)
        self._seen = [0] * len(self._optimizers)
        self._handles = [opt.register_step_post_hook(self._counter(i))
                         for i, opt in enumerate(self._optimizers)]
        self.history: list[StepRecord] = []
        self._skipped_in_a_row = 0
        self._below = False

    # -- checks made up front ----------------------------------------------------------
    def _name(self, p: torch.Tensor, i: int) -> str:
        return self._names.get(id(p), f"<optimizer parameter {i}>")

    def _check_setup(self, module: nn.Module) -> None:
        enabled = self._scaler is not None and self._scaler.is_enabled()
        half = [self._name(p, i) for i, p in enumerate(self._params)
                if p.requires_grad and p.dtype == torch.float16]
        if half and enabled:
            raise ValueError(
                f"amprewrite.ScalerMonitor: GradScaler was given fp16 parameters that require "
                f"grad ({list_names(half)}); it unscales fp32 gradients only and would raise "
                "'Attempting to unscale FP16 gradients' at the first step. Keep fp32 "
                "parameters: convert with opt_level='O1', or 'O2' (fp32 master weights), "
                "instead of 'O3' or model.half().")
        level = opt_level_of(module)
        fp16 = bool(half) or (level is not None and level.dtype == torch.float16)
        if fp16 and not enabled:
            why = "no scaler" if self._scaler is None else \
                "a disabled GradScaler (GradScaler() means device='cuda'; on CPU pass 'cpu')"
            warnings.warn(
                f"amprewrite.ScalerMonitor: fp16 training with {why}: gradients below "
                "6e-8 flush to zero in fp16 and training stalls without an error. Use "
                "scaler = torch.amp.GradScaler(device_type) with scaler.scale(loss).backward(), "
                "or train in bf16.", UserWarning, stacklevel=user_stacklevel())

    def _counter(self, i: int) -> Any:
        def count(optimizer: Optimizer, args: Any, kwargs: Any) -> None:
            self._steps[i] += 1
        return count

    # -- per step ----------------------------------------------------------------------
    def update(self, new_scale: float | torch.Tensor | None = None) -> StepRecord:
        """Record this step, then ``scaler.update(new_scale)``. Call it once per step,
        after every ``scaler.step(optimizer)`` and before ``zero_grad``."""
        enabled = self._scaler is not None and self._scaler.is_enabled()
        scale = self._scaler.get_scale() if enabled else 1.0
        skipped = any(s == seen for s, seen in zip(self._steps, self._seen))
        self._seen = list(self._steps)
        nonfinite, zero_fraction = self._inspect_grads()
        if enabled:
            self._scaler.update(new_scale)  # type: ignore[union-attr]
        next_scale = self._scaler.get_scale() if enabled else 1.0  # type: ignore[union-attr]
        record = StepRecord(len(self.history), scale, skipped, nonfinite, zero_fraction,
                            next_scale)
        self.history.append(record)
        self._warn(record)
        return record

    def _inspect_grads(self) -> tuple[tuple[str, ...], float]:
        pairs = [(i, p.grad) for i, p in enumerate(self._params) if p.grad is not None]
        if not pairs:
            return (), 0.0
        with torch.no_grad():
            # One host sync for all statistics: per-gradient finiteness plus the zero count.
            finite = torch.stack([g.isfinite().all() for _, g in pairs]).to(torch.float64)
            zeros = torch.stack([(g == 0).sum() for _, g in pairs]).sum().to(torch.float64)
            stats = torch.cat([finite.cpu(), zeros.cpu().reshape(1)]).tolist()
        total = sum(g.numel() for _, g in pairs)
        bad = tuple(self._name(self._params[i], i)
                    for (i, _), ok in zip(pairs, stats[:-1]) if not ok)
        return bad, stats[-1] / total

    def _warn(self, record: StepRecord) -> None:
        self._skipped_in_a_row = self._skipped_in_a_row + 1 if record.skipped else 0
        culprits = f" Gradients with inf/NaN at step {record.step}: " \
                   f"{list_names(list(record.nonfinite))}." if record.nonfinite else ""
        if self._skipped_in_a_row == self.max_skipped_in_a_row:
            warnings.warn(
                f"amprewrite.ScalerMonitor: {self._skipped_in_a_row} steps in a row were "
                f"skipped (steps {record.step - self._skipped_in_a_row + 1}..{record.step}); "
                f"the loss scale is now {record.next_scale:g}.{culprits} Look for an op "
                "that overflows in low precision (amprewrite can keep it in fp32 with "
                "Policy().override(keep_fp32=[...])), or train in bf16.",
                UserWarning, stacklevel=user_stacklevel())
        below = record.next_scale < self.min_scale
        if below and not self._below:
            warnings.warn(
                f"amprewrite.ScalerMonitor: the loss scale collapsed to "
                f"{record.next_scale:g} (below min_scale={self.min_scale:g}) at step "
                f"{record.step}: gradients overflow even unscaled, so the inf/NaN comes from "
                f"the model, not from scaling.{culprits} Check the forward for fp16 overflow "
                "(e.g. -1e9 mask constants, large activations) or train in bf16.",
                UserWarning, stacklevel=user_stacklevel())
        self._below = below

    # -- reading -----------------------------------------------------------------------
    @property
    def skipped_steps(self) -> list[int]:
        return [r.step for r in self.history if r.skipped]

    def table(self, only_skipped: bool = False) -> str:
        """The history as a text table (every step, or the skipped ones)."""
        from tabulate import tabulate

        rows = [(r.step, f"{r.scale:g}", "skipped" if r.skipped else "",
                 list_names(list(r.nonfinite), 3), f"{100 * r.zero_fraction:.1f}%",
                 f"{r.next_scale:g}")
                for r in self.history if r.skipped or not only_skipped]
        return tabulate(rows, headers=["step", "scale", "step skipped", "inf/NaN grads",
                                       "zero grads", "next scale"])

    def close(self) -> None:
        """Remove the step hooks from the optimizers."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
