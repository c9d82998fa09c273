"""What an fp8 graph calls at run time: amax, scale, quantize, the scaled matmul, and the
autograd node that runs a linear layer's backward matmuls in fp8.

Each function is one line of ``gm.code`` (see :mod:`amprewrite.passes.fp8`), and each works
on the tensors' device without reading a value back to the host: the amax is a 0-dim
tensor, the scale is computed from it on the device, and ``torch._scaled_mm`` takes it as a
tensor. The scale is the *dequantisation* scale (``amax / finfo(fp8).max``, what
``torch._scaled_mm``'s ``scale_a``/``scale_b`` multiply by): a tensor is stored as
``x / scale`` clamped to the fp8 range, so its largest value lands on ±448 (e4m3) or ±57344
(e5m2).

Autograd: the fp8 tensors are constants to autograd (amax and quantize read ``x.detach()``),
so ``torch._scaled_mm``, which has no derivative, never meets a tensor that requires grad.
The gradient reaches the high-precision input and the fp32 master weight through
:func:`fp8_linear_grad`, an identity in the forward whose backward is the two matmuls of
torchao's float8 training recipe, in fp8 with the output gradient in e5m2::

    grad_x = fp8(grad_out, e5m2) @ fp8(w, e4m3)
    grad_w = fp8(grad_out, e5m2).t() @ fp8(x, e4m3)

Every scaled matmul follows CUDA's rules on every device (:func:`scaled_mm_2d`): operand
layouts, and the shared dimension and the output columns padded to multiples of 16
(``pad_to``, shown in ``gm.code``), so that any token count is valid.

``torch._scaled_mm`` is private API; :func:`scaled_mm_2d` is the one place that calls it.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["E4M3", "E5M2", "FP8_DTYPES", "CUDA_MULTIPLE", "amax", "scale", "quantize",
           "scaled_mm", "scaled_mm_2d", "fp8_linear_grad", "FP8_FUNCTIONS"]

E4M3 = torch.float8_e4m3fn
"""Forward operands: activations and weights (max 448)."""
E5M2 = torch.float8_e5m2
"""Gradients: more range, less precision (max 57344)."""
FP8_DTYPES = (E4M3, E5M2)
_EPS = 1e-12
"""Smallest amax used for a scale: an all-zero tensor gets a finite scale, not 0/0."""


def amax(x: torch.Tensor) -> torch.Tensor:
    """The largest |x| of ``x`` as an fp32 0-dim tensor, on ``x``'s device (no host sync)."""
    return x.detach().abs().amax().to(torch.float32)


def scale(x_amax: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The per-tensor dequantisation scale for ``dtype``: ``amax / finfo(dtype).max``."""
    return x_amax.clamp(min=_EPS) / torch.finfo(dtype).max


def quantize(x: torch.Tensor, x_scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x / scale`` clamped to ``dtype``'s range and rounded to ``dtype`` (saturating)."""
    limit = torch.finfo(dtype).max
    return (x.detach().to(torch.float32) / x_scale).clamp(-limit, limit).to(dtype)


CUDA_MULTIPLE = 16
"""What CUDA's ``torch._scaled_mm`` needs of the shared dimension and of both dimensions of
``mat2``: multiples of 16."""


def scaled_mm_2d(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor,
                 scale_b: torch.Tensor, out_dtype: torch.dtype,
                 pad_to: int = CUDA_MULTIPLE) -> torch.Tensor:
    """``(a * scale_a) @ (b * scale_b)`` for 2-D fp8 ``a`` (``[m, k]``) and ``b``
    (``[k, n]``), in ``out_dtype``: the one call of the private ``torch._scaled_mm``.

    On CUDA's terms on every device (so that a model checked on a CPU runs on a GPU): ``a``
    row-major, ``b`` column-major, ``k`` and ``n`` multiples of ``pad_to``. Where they are
    not (the weight-gradient matmul contracts over batch x tokens), ``a`` and ``b`` are
    padded with zeros, which add nothing to any sum, and the padded columns of the result
    are dropped; ``m`` may be anything.

    NB: its signature, ``_scaled_mm(self, mat2, scale_a, scale_b, bias=None,
    scale_result=None, out_dtype=None, use_fast_accum=False)``, is the same from torch
    2.11 to 2.14 (``tests/test_fp8.py`` pins it). CUDA also needs sm_89 or newer; the CPU
    kernel has no limits of its own.
    """
    (m, k), n = a.shape, b.shape[1]
    k_pad, n_pad = _round_up(k, pad_to), _round_up(n, pad_to)
    if k_pad != k:
        wide = a.new_zeros(m, k_pad)
        wide[:, :k] = a
        a = wide
    if (k_pad, n_pad) != (k, n):
        wide = b.new_zeros(n_pad, k_pad).t()  # column-major
        wide[:k, :n] = b
        b = wide
    out = torch._scaled_mm(_row_major(a), _column_major(b), scale_a=scale_a, scale_b=scale_b,
                           out_dtype=out_dtype)
    return out[:, :n] if n_pad != n else out


def _round_up(size: int, multiple: int) -> int:
    return -(-size // multiple) * multiple


def _row_major(t: torch.Tensor) -> torch.Tensor:
    """``t`` with the same values, stored row-major as CUDA's ``_scaled_mm`` checks it
    (``stride(1) == 1 < stride(0)``)."""
    return t if t.stride(1) == 1 and t.stride(0) > 1 else t.contiguous()


def _column_major(t: torch.Tensor) -> torch.Tensor:
    """``t`` with the same values, stored column-major (``stride(0) == 1 < stride(1)``):
    what ``_scaled_mm`` wants for mat2."""
    return t if t.stride(0) == 1 and t.stride(1) > 1 else t.t().contiguous().t()


def scaled_mm(x: torch.Tensor, w: torch.Tensor, x_scale: torch.Tensor, w_scale: torch.Tensor,
              out_dtype: torch.dtype, pad_to: int = CUDA_MULTIPLE) -> torch.Tensor:
    """A linear layer's matmul ``x @ w.t()`` on fp8 ``x`` (``[..., in]``) and ``w``
    (``[out, in]``), with the leading dimensions of ``x`` flattened and restored."""
    rows = x.reshape(-1, x.shape[-1])
    out = scaled_mm_2d(rows, w.t(), x_scale, w_scale, out_dtype, pad_to)
    return out.reshape(*x.shape[:-1], w.shape[0])


class _Fp8LinearGrad(torch.autograd.Function):
    """Identity on the forward's output; its backward computes the gradients of the linear
    layer's input and weight with fp8 matmuls (e5m2 output gradient, e4m3 saved operands)."""

    @staticmethod
    def forward(ctx: Any, out: torch.Tensor, x: torch.Tensor, w: torch.Tensor,
                x_fp8: torch.Tensor, x_scale: torch.Tensor, w_fp8: torch.Tensor,
                w_scale: torch.Tensor, pad_to: int) -> torch.Tensor:
        ctx.save_for_backward(x_fp8, x_scale, w_fp8, w_scale)
        ctx.x_dtype, ctx.w_dtype, ctx.pad_to = x.dtype, w.dtype, pad_to
        # NB: "modified in place" hands ``out`` itself back with this node as its grad_fn.
        # Returned as-is or as a view, the model could not write into it in place.
        ctx.mark_dirty(out)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        x_fp8, x_scale, w_fp8, w_scale = ctx.saved_tensors
        g = grad.reshape(-1, grad.shape[-1])
        g_scale = scale(amax(g), E5M2)
        g_fp8 = quantize(g, g_scale, E5M2)
        grad_x = grad_w = None
        if ctx.needs_input_grad[1]:
            grad_x = scaled_mm_2d(g_fp8, w_fp8, g_scale, w_scale, ctx.x_dtype,
                                  ctx.pad_to).reshape(*grad.shape[:-1], w_fp8.shape[1])
        if ctx.needs_input_grad[2]:
            # NB: contracts over batch x tokens, which any step may make odd: padded there.
            x_rows = x_fp8.reshape(-1, x_fp8.shape[-1])
            grad_w = scaled_mm_2d(g_fp8.t(), x_rows, g_scale, x_scale, ctx.w_dtype,
                                  ctx.pad_to)
        return None, grad_x, grad_w, None, None, None, None, None


def fp8_linear_grad(out: torch.Tensor, x: torch.Tensor, w: torch.Tensor, x_fp8: torch.Tensor,
                    x_scale: torch.Tensor, w_fp8: torch.Tensor, w_scale: torch.Tensor,
                    pad_to: int = CUDA_MULTIPLE) -> torch.Tensor:
    """``out`` itself in the forward; in the backward, the gradients of ``x`` (the linear
    layer's high-precision input) and ``w`` (its fp32 master weight) computed in fp8 from the
    saved ``x_fp8`` and ``w_fp8`` (shapes padded to ``pad_to`` as :func:`scaled_mm_2d`
    does). Without grad mode it returns ``out`` untouched."""
    if not torch.is_grad_enabled() or not (x.requires_grad or w.requires_grad):
        return out
    return _Fp8LinearGrad.apply(out, x, w, x_fp8, x_scale, w_fp8, w_scale, pad_to)


FP8_FUNCTIONS = (amax, scale, quantize, scaled_mm, fp8_linear_grad)
