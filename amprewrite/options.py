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

from .errors import AmpRewriteError
from .module.cache import ON_CHANGE
from .hardware import model_device, warn_if_slow
from .passes.calibrate import CalibrationInput, check_calibrate
from .passes.opt_levels import check_opt_level
from .policy.policy import Policy, check_low_dtype, default_low_dtype

__all__ = ["ConvertOptions", "CAPTURES", "resolve_dtype", "check_meta_inputs"]

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

    @property
    def shares_modules(self) -> bool:
        """Whether the graphs run on the model's own modules and flags (every level but O3,
        which runs on a low-precision copy of its own): a leaf layer the symbolic capture
        keeps is the model's, and a submodule's ``training`` flag is state the capture read."""
        return self.opt_level != "O3"

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
        check_meta_inputs(model, example_inputs, example_kwargs)
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


def check_meta_inputs(model: nn.Module, example_inputs: tuple | None,
                      example_kwargs: dict[str, Any] | None) -> None:
    """Raise :class:`AmpRewriteError` where an example input is on the ``meta`` device and
    the model's tensors are not, or the other way round: a capture would fail deep inside a
    layer ("Input type (float) and bias type (c10::BFloat16) should be the same") with a
    hint about control flow that does not apply. A model all on ``meta`` with meta inputs
    converts (shapes and dtypes only)."""
    state = [*model.parameters(), *model.buffers()]
    on_meta = {t.is_meta for t in state}
    if len(on_meta) != 1:
        return  # no tensors, or a model partly on meta (materialized lazily): torch decides
    model_meta = on_meta.pop()
    leaves, _ = torch.utils._pytree.tree_flatten_with_path(
        {"example_inputs": example_inputs or (), "example_kwargs": example_kwargs or {}})
    for path, leaf in leaves:
        if not isinstance(leaf, torch.Tensor) or leaf.is_meta is model_meta:
            continue
        where = torch.utils._pytree.keystr(path)[2:].replace("']", "", 1)
        devices = sorted({str(t.device) for t in state})
        name = type(model).__name__
        what = (f"amprewrite.convert: {where} is a {leaf.dtype} tensor of shape "
                f"{tuple(leaf.shape)} on the {str(leaf.device)!r} device, but {name}'s "
                f"parameters and buffers are on {', '.join(devices)}. ")
        if leaf.is_meta:
            raise AmpRewriteError(
                what + "A meta tensor has a shape and a dtype but no values, and the capture "
                "runs the model's layers on the example inputs with its real weights. Pass "
                f"example inputs with values on the model's device ({devices[0]}), e.g. "
                f"torch.randn({', '.join(map(str, leaf.shape))}, device={devices[0]!r}) or a real "
                "batch; or move the whole model to meta (model.to('meta')) to convert for "
                "shapes and dtypes only.")
        raise AmpRewriteError(
            what + "The model holds no values (built under torch.device('meta') or "
            "accelerate's init_empty_weights), so it cannot run on real inputs. Load its "
            "weights first (model.to_empty(device='cpu') then model.load_state_dict(...)), "
            "or pass example inputs on the meta device (x.to('meta')) to convert for shapes "
            "and dtypes only.")
