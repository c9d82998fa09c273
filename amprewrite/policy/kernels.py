"""What a device's kernels take in low precision, as data: ops that have no fp16/bf16 kernel,
and normalisation ops whose kernel takes fp16/bf16 input with fp32 parameters.

Under a rule that lets an op run in whatever dtype arrives (PASSTHROUGH) or lowers it, an op
fed a low-precision tensor fails at run time if its device has no kernel for that dtype: the
FFTs on a CPU (pocketfft computes in fp32 and fp64 only) raise *Unsupported dtype BFloat16*.
``torch.autocast("cpu")`` lists them as fp32 ops; the CUDA rules, which the default policy
applies on every device, do not, since cuFFT takes fp16. ClassifyPass moves such an op to fp32
at conversion (rule ``"no bfloat16 kernel on cpu"`` in ``explain()``), so that no rule can
lower an op into a dtype its device cannot run. ``tests/test_portability.py`` checks on each
torch release that every op listed here does raise in the listed dtype.

Under ``opt_level="O2"`` a normalisation op keeps fp32 master parameters and fp32 running
statistics. Where its kernel takes fp16/bf16 input with such parameters (and accumulates in
fp32, returning the input's dtype), it runs on the low-precision activation as it arrives, with
no cast around it: Apex's ``keep_batchnorm_fp32``. ``MIXED_INPUT_NORMS`` lists those ops per
device; anywhere else O2 computes the norm in fp32 with casts around it.
``tests/test_portability.py`` checks on each torch release that every CPU entry takes both low
dtypes, forward and backward.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Mapping

import torch

__all__ = ["MISSING_LOW_KERNELS", "MIXED_INPUT_NORMS", "has_low_kernel", "takes_mixed_input"]

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


_BATCH_NORMS = frozenset("""
    batch_norm native_batch_norm _native_batch_norm_legit _native_batch_norm_legit_functional
    _native_batch_norm_legit_no_training
""".split())

MIXED_INPUT_NORMS: Mapping[str, frozenset[str]] = MappingProxyType({
    # ATen's CPU kernels take a mixed-type input (``is_mixed_type`` in batch_norm_kernel.cpp,
    # layer_norm_kernel.cpp and group_norm_kernel.cpp), verified on torch 2.11, 2.13 and 2.14.
    # NB: not rms_norm: with mixed dtypes it leaves the fused kernel for a slow composite
    # ("Cannot dispatch to fused implementation").
    "cpu": _BATCH_NORMS | {"layer_norm", "native_layer_norm", "group_norm",
                           "native_group_norm", "instance_norm"},
    # CUDA's batch norm (``is_mixed_type`` in native/cuda/Normalization.cu; cuDNN takes fp16
    # input with fp32 weight) is what Apex's O2 relied on. Its layer and group norm kernels
    # are not listed: no source at hand shows them taking mixed dtypes, and no GPU checked.
    "cuda": _BATCH_NORMS,
})


def takes_mixed_input(op: str, device_type: str | None) -> bool:
    """Whether the norm ``op`` (a canonical op key) takes fp16/bf16 input with fp32
    parameters on ``device_type`` (False where the device is unknown)."""
    return device_type is not None and op in MIXED_INPUT_NORMS.get(device_type, frozenset())
