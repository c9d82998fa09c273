"""What the optimizers of a training loop hold: shared checks and names for the training
helpers."""

from __future__ import annotations

from typing import Any, Iterable

import torch
import torch.nn as nn
from torch.optim import Optimizer

__all__ = ["optimizer_list", "held_tensors", "parameter_names", "list_names"]


def optimizer_list(optimizers: Any, where: str) -> list[Optimizer]:
    items = [optimizers] if isinstance(optimizers, Optimizer) else optimizers
    if not isinstance(items, (list, tuple)) or not items or \
            not all(isinstance(o, Optimizer) for o in items):
        raise TypeError(f"{where}: expected a torch.optim.Optimizer or a non-empty list of "
                        f"them, got {type(optimizers).__name__}")
    return list(items)


def held_tensors(optimizers: Iterable[Optimizer]) -> list[torch.Tensor]:
    return [p for opt in optimizers for group in opt.param_groups for p in group["params"]]


def parameter_names(module: nn.Module | None) -> dict[int, str]:
    if module is None:
        return {}
    return {id(p): name for name, p in module.named_parameters()}


def list_names(names: list[str], limit: int = 5) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")
