"""Per-tensor statistics for the auditor, computed on the tensor's device without host syncs.

For one floating tensor: largest finite |x|, smallest nonzero |x|, and counts of inf/NaN,
zeros, values that overflow fp16, values below fp16's smallest normal and mask sentinels
(``±finfo(dtype).max``, the value ``finfo(dtype).min`` masks write: counted apart, left out
of the largest |x| and of the overflow count), plus a histogram of binary exponents. All of it is read off the magnitude bits (the float viewed as an
integer with the sign bit cleared, which orders like |x|) with integer arithmetic: on CPU
that is several times faster than float compares, and every result is a 0-d or small tensor.
"""

from __future__ import annotations

import torch

__all__ = ["output_stats", "has_nan", "exponent_histogram", "release_scratch", "STAT_DTYPE"]

_INF = float("inf")
STAT_DTYPE = torch.float64
"""Statistics dtype: counts stay exact up to 2**53 elements."""
_ACC = STAT_DTYPE

# Integer views of the floating formats: |x| as an integer (sign bit cleared) orders like |x|,
# and its top bits are the biased exponent (fp32 and bf16 share fp32's 8-bit exponent).
# Per format: (int dtype, mantissa bits, abs mask, +inf, largest value <= 65504).
_INT_VIEW = {torch.float32: (torch.int32, 23, 0x7FFFFFFF, 0x7F800000, 0x477FE000),
             torch.bfloat16: (torch.int16, 7, 0x7FFF, 0x7F80, 0x477F)}
_BIAS = 127
_SENTINEL = {torch.float32: 0x7F7FFFFF, torch.bfloat16: 0x7F7F, torch.float16: 0x477FE000}
"""|finfo(dtype).max| as magnitude bits of the view the statistics read (fp16 is read as
fp32): the mask value of ``masked_fill(mask, torch.finfo(dtype).min)``."""


def exponent_histogram(bits: torch.Tensor, shift: int,
                       scratch: torch.Tensor | None = None) -> torch.Tensor:
    """Counts of the biased exponents (0..255) of the integer magnitudes ``bits``."""
    if scratch is None:
        scratch = torch.empty_like(bits)
    exponent = torch.bitwise_right_shift(bits, shift, out=scratch).flatten()
    if exponent.device.type == "cpu":
        return torch.bincount(exponent, minlength=256)
    # bincount sizes its output from exponent.max(): a host sync on accelerators.
    hist = torch.zeros(256, dtype=torch.int64, device=exponent.device)
    return hist.index_add_(0, exponent.long(), torch.ones_like(exponent, dtype=torch.int64))


def output_stats(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(max_abs, min_nz, nonfinite, zero, over, small, mask, has_nan) of one floating tensor
    as a float64 vector, and its exponent histogram (summed into the gradient histogram).
    ``mask`` counts sentinels (``±finfo(t.dtype).max``); ``max_abs`` and ``over`` leave
    them out.

    Everything is computed on the magnitude bits with integer arithmetic (on CPU several
    times faster than float compares): one exponent histogram gives the non-finite, small
    and bf16 overflow counts; shifted/masked integer min and max give the extremes.
    NB: dtypes other than fp32/bf16/fp16 are measured after conversion to fp32.
    """
    x = t if t.dtype in _INT_VIEW else t.float()
    int_dtype, shift, mask, inf_bits, max16_bits = _INT_VIEW[x.dtype]
    sign = 31 if int_dtype == torch.int32 else 15
    # NB: every elementwise step writes into one of two buffers reused across calls (stream
    # order keeps that safe on accelerators): a fresh temporary per step cost more than the
    # arithmetic itself on large fp32 tensors.
    bits, tmp = _scratch(x.shape, int_dtype, x.device)
    torch.bitwise_and(x.view(int_dtype), mask, out=bits)
    hist = exponent_histogram(bits, shift, tmp)
    counts = hist.to(_ACC) @ _selector(hist.device)  # (non-finite, < 2**-14, >= 2**16)
    count = torch.count_nonzero
    if t.dtype == torch.float16:
        # values that became inf in fp16
        over = t.numel() - count(torch.bitwise_xor(bits, inf_bits, out=tmp))
    elif int_dtype == torch.int32:
        # (max16 - bits) >> 31 is -1 exactly where bits > max16; inf/NaN are not finite.
        torch.sub(max16_bits, bits, out=tmp).bitwise_right_shift_(sign)
        over = count(tmp).to(_ACC) - counts[0]
    else:
        over = counts[2]  # bf16 has no value between 65504 and 2**16
    sentinel = _SENTINEL.get(t.dtype)
    if sentinel is None:
        mask_count = torch.zeros((), dtype=_ACC, device=x.device)
        pivot = inf_bits
    else:
        mask_count = (t.numel() - count(torch.bitwise_xor(bits, sentinel, out=tmp))).to(_ACC)
        pivot = sentinel
        if t.dtype != torch.float16:  # fp16's sentinel is 65504 itself, not above it
            over = over - mask_count
    # (bits - pivot) & mask puts the patterns below the pivot (+inf, or the sentinel) above
    # all others (order kept), so its max is the largest finite non-sentinel value shifted;
    # (bits - 1) & mask sends 0 to the top for the min. NaN patterns are those above +inf's.
    has_nan = bits.amax() > inf_bits
    finite_max = torch.sub(bits, pivot, out=tmp).bitwise_and_(mask).amax()
    nonzero_min = torch.sub(bits, 1, out=tmp).bitwise_and_(mask).amin()
    extremes = torch.stack([finite_max, nonzero_min]).to(torch.int32)
    extremes = extremes + _offsets(extremes.device, mask - pivot + 1)
    if int_dtype == torch.int16:
        extremes = extremes << 16
    values = extremes.view(torch.float32).to(_ACC)
    # Marks: no finite value -> max -1; no nonzero value (wrapped to -0.0, or inf/NaN) -> inf.
    is_min, marks = _marks(values.device)
    bad = torch.where(is_min, ~(values > 0), ~(values >= 0))
    values = torch.where(bad, marks, values)
    zero = t.numel() - count(bits)
    return torch.cat([values, counts[:1], torch.stack([zero.to(_ACC), over.to(_ACC)]),
                      counts[1:2], mask_count.reshape(1), has_nan.to(_ACC).reshape(1)]), hist


def has_nan(t: torch.Tensor) -> torch.Tensor:
    """0-d bool: whether floating ``t`` holds a NaN (one integer max, no float compare)."""
    if t.numel() == 0:  # amax of nothing is an error; an empty tensor holds no NaN
        return torch.zeros((), dtype=torch.bool, device=t.device)
    x = t if t.dtype in _INT_VIEW else t.float()
    int_dtype, _, mask, inf_bits, _ = _INT_VIEW[x.dtype]
    return (x.view(int_dtype) & mask).amax() > inf_bits


_SCRATCH: dict[tuple[torch.Size, torch.dtype, torch.device], tuple[torch.Tensor, torch.Tensor]] = {}
_SCRATCH_LIMIT = 8


def _scratch(shape: torch.Size, dtype: torch.dtype,
             device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Two reusable integer buffers of ``shape`` (a few shapes kept, oldest dropped first)."""
    key = (shape, dtype, device)
    pair = _SCRATCH.pop(key, None)
    if pair is None:
        pair = (torch.empty(shape, dtype=dtype, device=device),
                torch.empty(shape, dtype=dtype, device=device))
        if len(_SCRATCH) >= _SCRATCH_LIMIT:
            _SCRATCH.pop(next(iter(_SCRATCH)))
    _SCRATCH[key] = pair  # most recently used last
    return pair


def release_scratch() -> None:
    """Drop the statistics' scratch buffers (called when an audit ends)."""
    _SCRATCH.clear()


# Constants per device, built there with fill kernels on views: copying a host tensor to an
# accelerator is a host sync, and so is indexed assignment (``t[i] = v`` copies a host scalar).
_SELECT: dict[torch.device, torch.Tensor] = {}
_OFFSETS: dict[tuple[torch.device, int], torch.Tensor] = {}
_MARKS: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}


def _selector(device: torch.device) -> torch.Tensor:
    """(256, 3) 0/1 matrix: exponent histogram -> (non-finite, below fp16's smallest normal
    2**-14 (zeros included), at least 2**16 and finite)."""
    sel = _SELECT.get(device)
    if sel is None:
        sel = _SELECT[device] = torch.zeros(256, 3, dtype=_ACC, device=device)
        sel[255:, 0].fill_(1)
        sel[:_BIAS - 14, 1].fill_(1)
        sel[_BIAS + 16:255, 2].fill_(1)
    return sel


def _offsets(device: torch.device, rotation: int) -> torch.Tensor:
    off = _OFFSETS.get((device, rotation))
    if off is None:
        off = _OFFSETS[(device, rotation)] = torch.ones(2, dtype=torch.int32, device=device)
        off[:1].fill_(-rotation)
    return off


def _marks(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    pair = _MARKS.get(device)
    if pair is None:
        is_min = torch.arange(2, device=device) == 1
        marks = torch.full((2,), _INF, dtype=_ACC, device=device)
        marks[:1].fill_(-1.0)
        pair = _MARKS[device] = (is_min, marks)
    return pair
