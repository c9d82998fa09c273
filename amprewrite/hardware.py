"""Does this device have a fast path for the low dtype? A check, a description and a warning.

Apex users' first pitfall is a device that runs fp16 or bf16 *slower* than fp32: the kernels
exist, so nothing fails, and the step just takes longer. What we know:

========  =====  ==================================================================
device    dtype  fast path when
========  =====  ==================================================================
CPU       bf16   ``avx512_bf16`` or AMX tiles (an AVX2-only EPYC ran a 1024^3 bf16
                 matmul at 1.0 GFLOP/s against fp32's 77)
CPU       fp16   AMX-FP16 (without it fp16 matmuls are emulated, as slow as bf16's)
CUDA      fp16   compute capability >= 7.0 (tensor cores, Volta)
CUDA      bf16   compute capability >= 8.0 (Ampere)
========  =====  ==================================================================

The probes are the ``torch.cpu._is_*_supported`` functions and
``torch.cuda.get_device_capability``, looked up at call time so tests can monkeypatch them.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.nn as nn

from .errors import user_stacklevel

__all__ = ["describe", "model_device", "slow_reason", "warn_if_slow"]

_CUDA_MIN = {torch.float16: ((7, 0), "Volta"), torch.bfloat16: ((8, 0), "Ampere")}
_WARNED: set[tuple[str, torch.dtype]] = set()
"""(device description, dtype) pairs already warned about: one warning per process each."""


def _cpu_flag(name: str) -> bool:
    probe = getattr(torch.cpu, name, None)  # private probes: absent in some torch builds
    return bool(probe()) if probe is not None else False


def _cpu_features() -> list[str]:
    flags = {"avx512_bf16": "_is_avx512_bf16_supported", "amx": "_is_amx_tile_supported",
             "amx_fp16": "_is_amx_fp16_supported"}
    return [flag for flag, probe in flags.items() if _cpu_flag(probe)]


def model_device(model: nn.Module, args: tuple | None,
                 kwargs: dict[str, Any] | None) -> torch.device:
    """Where the model computes: its first floating parameter's device, else its first
    tensor input's, else the CPU."""
    for p in model.parameters():
        if p.is_floating_point():
            return p.device
    for leaf in torch.utils._pytree.tree_leaves((args or (), kwargs or {})):
        if isinstance(leaf, torch.Tensor):
            return leaf.device
    return torch.device("cpu")


def describe(device: torch.device | str) -> str:
    """One line naming the device and what it can do, e.g. ``cpu: AVX2 (no avx512_bf16, no
    AMX)`` or ``cuda:0: NVIDIA H100 80GB HBM3, compute capability 9.0``."""
    device = torch.device(device)
    if device.type == "cpu":
        features = _cpu_features()
        extra = ", ".join(features) if features else "no avx512_bf16, no AMX"
        return f"cpu: {torch.backends.cpu.get_cpu_capability()} ({extra})"
    if device.type == "cuda" and torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability(device)
        name = torch.cuda.get_device_name(device)
        return f"{device}: {name}, compute capability {major}.{minor}"
    return str(device)


def slow_reason(device: torch.device | str, dtype: torch.dtype) -> str | None:
    """Why ``dtype`` has no fast path on ``device`` (and what to do), or None if it has one
    or we do not know."""
    device = torch.device(device)
    if device.type == "cpu":
        features = _cpu_features()
        fast = ("avx512_bf16" in features or "amx" in features) if dtype == torch.bfloat16 \
            else "amx_fp16" in features
        if fast:
            return None
        needs, where = ("avx512_bf16 or AMX", "a CPU with native bf16 (Sapphire Rapids / "
                        "Zen 4 and newer)") if dtype == torch.bfloat16 else \
            ("AMX-FP16", "dtype=torch.bfloat16 on a CPU with native bf16")
        return (f"this CPU ({torch.backends.cpu.get_cpu_capability()}, see "
                f"torch.backends.cpu.get_cpu_capability()) has no {needs}, so "
                f"{_short(dtype)} matmuls run in emulation, tens of times slower than fp32. "
                f"Keep the model in fp32 on this machine (opt_level='O0'), or use {where}, "
                "or a GPU")
    if device.type == "cuda" and torch.cuda.is_available():
        (need, arch) = _CUDA_MIN.get(dtype, ((0, 0), ""))
        have = torch.cuda.get_device_capability(device)
        if tuple(have) >= need:
            return None
        other = "use dtype=torch.float16 (fast from 7.0)" if dtype == torch.bfloat16 and \
            tuple(have) >= (7, 0) else "keep the model in fp32 (opt_level='O0')"
        return (f"{torch.cuda.get_device_name(device)} has compute capability "
                f"{have[0]}.{have[1]} (torch.cuda.get_device_capability()); {_short(dtype)} "
                f"needs {need[0]}.{need[1]} ({arch}) for tensor-core kernels, so it will not be "
                f"faster than fp32: {other}")
    return None


def warn_if_slow(device: torch.device | str, dtype: torch.dtype) -> None:
    """Warn once per process and (device, dtype) when ``dtype`` has no fast path there, at
    the user's line (``convert``, ``amprewrite.compile``'s first call)."""
    reason = slow_reason(device, dtype)
    key = (describe(device), dtype)
    if reason is None or key in _WARNED:
        return
    _WARNED.add(key)
    warnings.warn(f"amprewrite.convert: {_short(dtype)} on {torch.device(device)}: {reason}.",
                  stacklevel=user_stacklevel())


def _short(dtype: torch.dtype) -> str:
    return {torch.float16: "fp16", torch.bfloat16: "bf16"}.get(dtype, str(dtype))
