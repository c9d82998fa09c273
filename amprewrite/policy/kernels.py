"""Ops that have no fp16/bf16 kernel on a device, as data.

Under a rule that lets an op run in whatever dtype arrives (PASSTHROUGH) or lowers it, an op
fed a low-precision tensor fails at run time if its device has no kernel for that dtype: the
FFTs on a CPU (pocketfft computes in fp32 and fp64 only) raise *Unsupported dtype BFloat16*.
``torch.autocast("cpu")`` lists them as fp32 ops; the CUDA rules, which the default policy
applies on every device, do not, since cuFFT takes fp16. ClassifyPass moves such an op to fp32
at conversion (rule ``"no bfloat16 kernel on cpu"`` in ``explain()``), so that no rule can
lower an op into a dtype its device cannot run. ``tests/test_portability.py`` checks on each
torch release that every op listed here does raise in the listed dtype.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Mapping

import torch

__all__ = ["MISSING_LOW_KERNELS", "has_low_kernel"]

_FFT = frozenset("""
    fft_fft fft_ifft fft_fft2 fft_ifft2 fft_fftn fft_ifftn fft_rfft fft_irfft fft_rfft2
    fft_irfft2 fft_rfftn fft_irfftn fft_hfft fft_ihfft _fft_r2c _fft_c2c _fft_c2r stft
""".split())

MISSING_LOW_KERNELS: Mapping[str, Mapping[torch.dtype, frozenset[str]]] = MappingProxyType({
    "cpu": MappingProxyType({torch.float16: _FFT, torch.bfloat16: _FFT}),
    # cuFFT computes in fp16 (power-of-two sizes) but not in bf16.
    "cuda": MappingProxyType({torch.bfloat16: _FFT}),
})


def has_low_kernel(op: str, device_type: str, dtype: torch.dtype) -> bool:
    """Whether ``op`` (a canonical op key) can compute in ``dtype`` on ``device_type``."""
    return op not in MISSING_LOW_KERNELS.get(device_type, {}).get(dtype, frozenset())
