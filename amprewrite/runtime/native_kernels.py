"""The kernels eager code runs, called where a library's traced code took a slower path.

Hugging Face's mixture-of-experts layers multiply each expert's tokens with
``torch._grouped_mm`` when they run eagerly, but while they are traced (``torch.export``,
``torch.compile``) with weights that are not bf16 they call
``transformers::grouped_mm_fallback`` instead: a custom op whose forward loops over the experts
in Python and whose backward is a Python autograd function, because ``_grouped_mm``'s meta
kernel accepts only bf16. A captured graph keeps the traced choice, so a converted Mixtral
trained at 0.97x autocast's speed on the CPU, where eager code (and autocast) runs the C++
kernel. :func:`grouped_mm` runs the kernel eager code runs, with the same result bit for bit
(one ``mm`` per expert either way), and gives the library's op back to anything that traces
the converted module again.
"""

from __future__ import annotations

import torch
import torch.nn as nn

__all__ = ["grouped_mm", "GROUPED_MM_ON_CPU"]

GROUPED_MM_ON_CPU = hasattr(torch, "_grouped_mm") and \
    tuple(int(v) for v in torch.__version__.split(".")[:2]) >= (2, 9)
"""Whether this torch has ``_grouped_mm`` with a CPU kernel (added in 2.9)."""

_REAL = (torch.Tensor, nn.Parameter)
"""Types of the tensors the native kernel runs on. Fake and functional tensors (tracing by
``make_fx``/AOTAutograd) and ``fx.Proxy`` (symbolic tracing) take the library's op, which has
a meta kernel for every dtype."""


def _rows_aligned(t: torch.Tensor) -> bool:
    """Whether ``t``'s start and the stride between its rows (or columns, if transposed) are
    multiples of 16 bytes, as ``_grouped_mm`` requires on the CPU (torch 2.9-2.13)."""
    size = t.element_size()
    *_, rows, cols = t.stride()
    lead = rows if cols == 1 else cols
    return (t.data_ptr() % 16 == 0 and (lead * size) % 16 == 0
            and (cols == 1 or rows == 1))


def _native(input: torch.Tensor, weight: torch.Tensor) -> bool:
    return (GROUPED_MM_ON_CPU and type(input) in _REAL and type(weight) in _REAL
            and not torch.compiler.is_compiling()
            and input.device.type == "cpu" and weight.device.type == "cpu"
            and input.dim() == 2 and weight.dim() == 3
            and _rows_aligned(input) and _rows_aligned(weight))


def grouped_mm(input: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``transformers::grouped_mm_fallback(input, weight, offs)``, computed by
    ``torch._grouped_mm`` where eager code would run it: plain CPU tensors whose rows are
    16-byte aligned, outside tracing. Elsewhere (CUDA, where the two have not been compared
    here; under tracing; unaligned rows) it calls the library's op itself."""
    if _native(input, weight):
        # NB: contiguous() is free here (the CPU kernel returns a contiguous result) and keeps
        # the layout the traced graph's later views were recorded against.
        return torch._grouped_mm(input, weight, offs=offs).contiguous()
    return torch.ops.transformers.grouped_mm_fallback.default(input, weight, offs)
