"""One audited op call (:class:`OpRecord`), and the read-only view of a report that the
tables draw (:class:`ReportView`): the data both the report (``report``) and its
presentation (``tables``) need, kept apart so that neither imports the other."""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Protocol, Sequence

from .grad_hist import GradHistogram
from .mode import FP16_MAX

__all__ = ["OpRecord", "ReportView", "LOW_OUTPUTS"]

LOW_OUTPUTS = ("float16", "bfloat16")
"""Output dtypes whose values fp16 holds, or would hold under the fp16 policy."""


@dataclasses.dataclass(frozen=True)
class OpRecord:
    """One ATen op call (or, with ``aggregate=True``, all calls with the same key).

    Statistics are over the op's floating outputs: ``max_abs`` is the largest finite |x|,
    ``min_nonzero_abs`` the smallest nonzero finite |x|, ``nonfinite`` counts inf/NaN,
    ``fp16_overflow`` counts infs in an fp16 output, or bf16 values above 65504 (they would
    become inf under the fp16 policy: a what-if), ``fp16_underflow`` counts nonzero values
    below fp16's smallest normal (6.1e-5) in those outputs. Both are 0, and
    :attr:`headroom_bits` is None, for an output in fp32 or fp64: fp16 never holds it (an
    fp32-category op, an internal of a backward formula), so it is no fp16 risk. ``produced_nonfinite`` is True when this op turned finite
    inputs into inf/NaN, or NaN-free inputs into NaN (rather than passing them on). NB: ops
    without floating inputs (``full``, ``scalar_tensor``) that make inf do it on purpose
    (attention masks) and are not blamed; a softmax that turns such a row into NaN is.

    Masks are masks: ``mask_values`` counts output values equal to ``±finfo(dtype).max``
    (what ``masked_fill(mask, torch.finfo(dtype).min)`` writes, and what adding a score to
    it gives back), which ``max_abs`` and ``fp16_overflow`` leave out; ``mask_fill`` marks an
    op that writes a given inf or ``finfo.max`` (``masked_fill``, ``where``, ``full``,
    ``fill_``) on purpose. :attr:`is_mask` is either.
    """

    op: str
    node: str | None
    module: str | None
    phase: str
    in_dtypes: tuple[str, ...]
    out_dtype: str | None
    shape: tuple[int, ...]
    max_abs: float | None
    min_nonzero_abs: float | None
    nonfinite: int
    fp16_overflow: int
    fp16_underflow: int
    cast: bool = False
    """A dtype conversion: a cast node of a converted graph, or ``_to_copy`` to a new dtype."""
    grad_fn: str | None = None
    """Backward ops: the autograd node that ran them (``"AddmmBackward0"``)."""
    produced_nonfinite: bool = False
    count: int = 1
    flops: int = 0
    cast_bytes: int = 0
    mask_values: int = 0
    mask_fill: bool = False

    @property
    def is_mask(self) -> bool:
        """The op wrote or carried attention-mask sentinels (masking, not overflow)."""
        return bool(self.mask_values or self.mask_fill)

    @property
    def label(self) -> str:
        return f"cast ({self.op})" if self.cast else self.op

    @property
    def holds_low(self) -> bool:
        """The output is fp16, or bf16 (which the fp16 policy would hold as fp16)."""
        return self.out_dtype in LOW_OUTPUTS

    @property
    def what_if(self) -> bool:
        """A bf16 output: its fp16 flags say what the fp16 policy would meet."""
        return self.out_dtype == "bfloat16"

    @property
    def headroom_bits(self) -> float | None:
        """log2(65504 / max_abs): doublings left before fp16 overflows (negative: already
        past it); None when there are no nonzero finite values, or fp16 does not hold them
        (:attr:`holds_low`)."""
        return math.log2(FP16_MAX / self.max_abs) if self.max_abs and self.holds_low else None

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["in_dtypes"], d["shape"] = list(self.in_dtypes), list(self.shape)
        return d

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "OpRecord":
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - fields
        if unknown:
            raise ValueError(f"OpRecord.from_dict: unknown keys {sorted(unknown)}; expected "
                             f"the keys of OpRecord.to_dict() ({', '.join(sorted(fields))})")
        return cls(**{**data, "in_dtypes": tuple(data["in_dtypes"]),
                      "shape": tuple(data["shape"])})


class ReportView(Protocol):
    """What the tables read of an :class:`~amprewrite.audit.AuditReport`."""

    @property
    def records(self) -> Sequence[OpRecord]: ...

    @property
    def first_nonfinite(self) -> OpRecord | None: ...

    @property
    def grad_histogram(self) -> GradHistogram | None: ...

    @property
    def aggregate(self) -> bool: ...
