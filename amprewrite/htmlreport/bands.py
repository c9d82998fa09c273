"""The range of a low-precision format, as the charts draw it: a band from its smallest
subnormal to its largest finite value, darker where its values are normal; and how the page
writes dtypes, magnitudes and long names."""

from __future__ import annotations

from html import escape
from typing import NamedTuple

import torch

from ..audit.tables import magnitude
from ..summary import short_dtype

__all__ = ["Band", "band_of", "fate", "dtype_label", "magnitude", "number", "breakable"]

_NAMES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float8_e4m3fn: "e4m3",
          torch.float8_e5m2: "e5m2"}


class Band(NamedTuple):
    name: str
    """``"fp16"``, ``"bf16"``, ``"e4m3"``, ``"e5m2"``."""
    max: float
    """Largest finite value."""
    normal: float
    """Smallest normal value."""
    smallest: float
    """Smallest subnormal value: anything below rounds to zero (or to it)."""


def band_of(dtype: torch.dtype) -> Band:
    """The band of a floating dtype, from ``torch.finfo`` (fp16: 6.0e-8, 6.1e-5, 65504)."""
    info = torch.finfo(dtype)
    # The smallest subnormal is one unit in the last place of the smallest normal.
    return Band(_NAMES.get(dtype, str(dtype).replace("torch.", "")), info.max,
                info.smallest_normal, info.smallest_normal * info.eps)


def fate(band: Band, exponent: int) -> str:
    """What ``band``'s format makes of values in ``[2**exponent, 2**(exponent+1))``:
    ``"overflow"``, ``"normal"``, ``"subnormal"`` or ``"flush"`` (below its smallest
    subnormal: zero). For fp16 this is :meth:`GradHistogram.rows`'s fate."""
    if 2.0 ** exponent > band.max:
        return "overflow"
    if 2.0 ** exponent >= band.normal:
        return "normal"
    if 2.0 ** exponent >= band.smallest:
        return "subnormal"
    return "flush"


def dtype_label(name: str | None) -> str:
    """An audit record's dtype name as the tables write it: ``"bfloat16"`` → ``"bf16"``."""
    dtype = getattr(torch, name, None) if name else None
    return short_dtype(dtype) if isinstance(dtype, torch.dtype) else name or "-"


def number(x: float) -> str:
    """A format limit as people write it: ``65504``, ``6.1e-5``, ``3.4e38``."""
    if 1e-3 <= x < 1e6:
        return f"{x:.5g}"
    mantissa, exponent = f"{x:.2g}".split("e")
    return f"{mantissa}e{int(exponent)}"


def breakable(name: str) -> str:
    """``name`` as HTML that may wrap after a dot or an underscore (a module path in a narrow
    column breaks between its parts, not inside one)."""
    return escape(name).replace(".", ".<wbr>").replace("_", "_<wbr>")
