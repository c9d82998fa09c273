"""``convert``'s options, checked once and passed along as one frozen value.

``amprewrite.convert`` takes its options as keyword arguments; :meth:`ConvertOptions.checked`
validates them together (each error names the argument, what was passed and what is expected)
and resolves what they leave open (the low dtype from the model's device). Everything after
(the capture, the passes, a capture made later at a call) reads this one object.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.nn as nn

from .module.cache import ON_CHANGE
from .hardware import model_device, warn_if_slow
from .passes.calibrate import CalibrationInput, check_calibrate
from .passes.opt_levels import check_opt_level
from .policy.policy import Policy, check_low_dtype, default_low_dtype

__all__ = ["ConvertOptions", "CAPTURES", "resolve_dtype"]

CAPTURES = ("auto", "symbolic", "export")


def resolve_dtype(model: nn.Module, policy: Policy, dtype: torch.dtype | None) -> torch.dtype:
    """``dtype`` argument > the policy's dtype > fp16 for a model on CUDA, bf16 otherwise."""
    if dtype is not None:
        return check_low_dtype(dtype, "amprewrite.convert")
    if policy.dtype is not None:
        return policy.dtype
    first = next(iter(model.parameters()), None)
    return default_low_dtype(first.device.type if first is not None else "cpu")


@dataclasses.dataclass(frozen=True)
class ConvertOptions:
    """What ``convert`` was asked for (its docstring explains each)."""

    policy: Policy
    low: torch.dtype
    """The low dtype: ``dtype``, else the policy's, else by the model's device."""
    capture: str
    opt_level: str
    calibration: tuple[CalibrationInput, ...] | None
    on_change: str

    @classmethod
    def checked(cls, model: nn.Module, example_inputs: Any, example_kwargs: Any, *,
                policy: Policy | None, dtype: torch.dtype | None, capture: str,
                opt_level: str, calibrate: Any, on_change: str) -> ConvertOptions:
        """The options of a ``convert`` call, or the ``TypeError`` / ``ValueError`` that
        names the first one that is wrong."""
        if not isinstance(model, nn.Module):
            raise TypeError(f"amprewrite.convert expects a torch.nn.Module, got "
                            f"{type(model).__name__}; wrap functions in an nn.Module first.")
        if example_inputs is not None and not isinstance(example_inputs, tuple):
            raise TypeError(
                f"amprewrite.convert: example_inputs must be a tuple of positional arguments, "
                f"got {type(example_inputs).__name__}; for one input write example_inputs=(x,).")
        if example_kwargs is not None and not isinstance(example_kwargs, dict):
            raise TypeError(f"amprewrite.convert: example_kwargs must be a dict, got "
                            f"{type(example_kwargs).__name__}")
        if capture not in CAPTURES:
            raise ValueError(f"amprewrite.convert: capture={capture!r} is unknown; expected one "
                             f"of {', '.join(map(repr, CAPTURES))}")
        if policy is None:
            policy = Policy()
        if not isinstance(policy, Policy):
            raise TypeError(f"amprewrite.convert: policy must be an amprewrite.Policy, got "
                            f"{type(policy).__name__}")
        check_opt_level(opt_level, policy, dtype)
        calibration = check_calibrate(calibrate, model, opt_level)
        low = resolve_dtype(model, policy, dtype)
        if on_change not in ON_CHANGE:
            raise ValueError(f"amprewrite.convert: on_change={on_change!r} is unknown; expected "
                             f"{' or '.join(map(repr, ON_CHANGE))}")
        if policy.fp8_rules is not None and low is not torch.bfloat16:
            raise ValueError(f"amprewrite.convert: dtype={low} was given with Policy.fp8(...), "
                             "whose fp8 matmuls write bf16 and whose other ops run in bf16. Drop "
                             "dtype=...")
        if opt_level != "O0":
            warn_if_slow(model_device(model, example_inputs, example_kwargs), low)
        return cls(policy, low, capture, opt_level,
                   None if calibration is None else tuple(calibration), on_change)
