"""What the auditor records of an fp8 matmul: per ``torch._scaled_mm`` call, forward and
backward, for each of its two fp8 operands the scale it was given, the amax that scale stands
for (``scale * finfo(fp8).max``: the scales of :mod:`amprewrite.runtime.fp8` are dynamic,
``amax / max``), the share of its values at the fp8 range's edge (±448 for e4m3, ±57344 for
e5m2: saturated, or the amax itself) and the share that are zero (flushed to zero by the
quantisation, or zero already).

The shares are computed on the operands' device and read back once when the audit ends, with
the rest of the audit's statistics (:class:`Fp8Recorder.finish`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

__all__ = ["Fp8Record", "Fp8Recorder", "is_scaled_mm"]

_SCALED_MM = torch.ops.aten._scaled_mm.default


def is_scaled_mm(func: Any) -> bool:
    return func is _SCALED_MM


@dataclasses.dataclass(frozen=True)
class Fp8Record:
    """One ``_scaled_mm`` call: operand ``a`` (activation or gradient) and ``b`` (weight or
    saved activation)."""

    node: str | None
    module: str | None
    phase: str
    grad_fn: str | None
    a_dtype: str
    b_dtype: str
    a_scale: float
    b_scale: float
    a_amax: float
    b_amax: float
    a_saturated: float
    """Share of ``a``'s values at ±finfo(a_dtype).max."""
    b_saturated: float
    a_zero: float
    """Share of ``a``'s values that are zero in fp8."""
    b_zero: float
    shape: tuple[int, ...]

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["shape"] = list(self.shape)
        return d


def _operand(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """(scale, amax, saturated share, zero share) of one fp8 operand, on its device."""
    limit = torch.finfo(q.dtype).max
    v = q.to(torch.float32)
    scale = s.detach().to(torch.float32).reshape(-1)[0]
    n = max(v.numel(), 1)
    return torch.stack([scale, scale * limit, (v.abs() >= limit).sum().float() / n,
                        (v == 0).sum().float() / n])


class Fp8Recorder:
    """Pending statistics of the ``_scaled_mm`` calls of one audit."""

    def __init__(self) -> None:
        self.pending: list[tuple[tuple, torch.Tensor]] = []

    def record(self, meta: Any, args: tuple, kwargs: dict) -> None:
        a, b = args[0], args[1]
        sa = kwargs.get("scale_a", args[2] if len(args) > 2 else None)
        sb = kwargs.get("scale_b", args[3] if len(args) > 3 else None)
        if not all(isinstance(t, torch.Tensor) for t in (a, b, sa, sb)):
            return
        vec = torch.cat([_operand(a, sa), _operand(b, sb.to(b.device))])
        host = (meta.node, meta.module, meta.phase, meta.grad_fn, str(a.dtype)[6:],
                str(b.dtype)[6:], (a.shape[0], b.shape[1]))
        self.pending.append((host, vec))

    def finish(self) -> list[Fp8Record]:
        """Read every pending vector back: one ``.tolist()`` per device."""
        values: list[list[float]] = [[] for _ in self.pending]
        for device in {v.device for _, v in self.pending}:
            index = [i for i, (_, v) in enumerate(self.pending) if v.device == device]
            rows = torch.stack([self.pending[i][1] for i in index]).tolist()
            for i, row in zip(index, rows):
                values[i] = row
        out = []
        for (host, _), row in zip(self.pending, values):
            node, module, phase, grad_fn, a_dtype, b_dtype, shape = host
            out.append(Fp8Record(node, module, phase, grad_fn, a_dtype, b_dtype,
                                 a_scale=row[0], b_scale=row[4], a_amax=row[1], b_amax=row[5],
                                 a_saturated=row[2], b_saturated=row[6], a_zero=row[3],
                                 b_zero=row[7], shape=shape))
        return out
