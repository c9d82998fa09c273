"""Functions that converted graphs call at run time (they appear by name in ``gm.code``).

They are used only where the dtypes of a graph are unknown at conversion time (symbolic
capture without example inputs): the cast then checks its input when it runs, with exactly
autocast's eligibility rule (a floating tensor, not fp64, on the policy's device).
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

__all__ = ["guarded_cast", "guarded_promote", "guarded_match", "fp32_if_eligible",
           "RUNTIME_FUNCTIONS", "CAST_METHODS", "cast_to"]

CAST_METHODS = {torch.float32: "float", torch.float16: "half", torch.bfloat16: "bfloat16",
                torch.float64: "double"}
"""The Tensor method that casts to each floating dtype without arguments to parse.

``x.bfloat16()`` runs what ``x.to(torch.bfloat16)`` runs (``aten::to.dtype``: a copy made by
``_to_copy``, or ``x`` itself when already bf16; the same autograd node) but skips the
overload resolution of ``Tensor.to``: on CPU, torch 2.13, 2.6 against 4.2 µs for a weight that
requires grad, 1.8 against 3.1 µs without autograd (``benchmarks/bench_calls.py``). A forward
casts every weight in training, so that is 5-10% of a launch-bound forward."""

_CAST_FUNCTIONS = {dtype: getattr(torch.Tensor, name) for dtype, name in CAST_METHODS.items()}


def _eligible(x: Any, device_type: str | None) -> bool:
    return (isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != torch.float64
            and (device_type is None or x.device.type == device_type))


def cast_to(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x.to(dtype)``, through the dtype's own method where it has one (:data:`CAST_METHODS`)."""
    method = _CAST_FUNCTIONS.get(dtype)
    return method(x) if method is not None else x.to(dtype)


def guarded_cast(x: Any, dtype: torch.dtype, device_type: str | None = None) -> Any:
    """``x.to(dtype)`` if ``x`` is an eligible tensor of another dtype, else ``x`` itself."""
    if _eligible(x, device_type) and x.dtype != dtype:
        return cast_to(x, dtype)
    return x


def guarded_promote(xs: Sequence[Any], low: torch.dtype,
                    device_type: str | None = None) -> list[Any]:
    """Cast the eligible tensors of ``xs`` to their widest dtype (fp32 if any is wider than
    ``low``), as autocast's ``promote`` policy does; other values pass through."""
    eligible = [x for x in xs if _eligible(x, device_type)]
    target = low if all(x.dtype == low for x in eligible) else torch.float32
    return [cast_to(x, target) if _eligible(x, device_type) and x.dtype != target else x
            for x in xs]


def guarded_match(x: Any, destination: Any, device_type: str | None = None) -> Any:
    """``x`` in the dtype of ``destination`` (a floating tensor that an op such as
    ``masked_scatter`` writes ``x`` into) if ``x`` is an eligible tensor of another dtype, else
    ``x`` itself."""
    if isinstance(destination, torch.Tensor) and destination.is_floating_point() and \
            _eligible(x, device_type) and x.dtype != destination.dtype:
        return cast_to(x, destination.dtype)
    return x


def fp32_if_eligible(x: Any, device_type: str | None = None) -> torch.dtype | None:
    """The ``dtype=`` argument autocast's ``fp32_set_opt_dtype`` fills in: fp32 for an
    eligible first input, None (op unaltered) otherwise."""
    return torch.float32 if _eligible(x, device_type) else None


RUNTIME_FUNCTIONS = (guarded_cast, guarded_promote, guarded_match, fp32_if_eligible)
