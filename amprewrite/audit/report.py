"""``amprewrite.audit()``: per-op dtype and range statistics for forward and backward.

::

    with amprewrite.audit() as report:   # converted, eager, or eager under torch.autocast
        loss = model(x).float().sum()
        loss.backward()
    report.first_nonfinite               # the op that first *produced* inf/NaN, or None
    print(report.table())

Collection is apart from presentation (as in ``torch.utils.flop_counter``): a private
``TorchDispatchMode`` records every ATen op with device-side statistics
(:mod:`amprewrite.audit.mode`), attribution to module, FX node and phase is in
:mod:`amprewrite.audit.where`, and this module owns the report. Statistics are read back
from the device once, when the ``with`` block exits; ``report`` is empty until then.

NB: the context is not reentrant. It records the thread that entered it, and autograd's
backward threads (which inherit the dispatch mode).
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any, Iterator

import torch

from ..errors import user_stacklevel
from .fp8 import Fp8Record
from .grad_hist import GradHistogram
from .mode import Recorder, _AuditMode
from .stats import release_scratch
from .records import LOW_OUTPUTS, OpRecord
from .tables import render, summarize
from .where import Attribution

__all__ = ["audit", "AuditReport", "OpRecord"]

_MAX_SEGMENTS = 1 << 16
"""Aggregate mode keeps at most this many forward-context segments for backward lookup."""


@dataclasses.dataclass
class AuditReport:
    """What an audit saw: ``records`` in execution order, and what they add up to."""

    records: list[OpRecord] = dataclasses.field(default_factory=list)
    first_nonfinite: OpRecord | None = None
    """The first op (in execution order) with ``produced_nonfinite``."""
    grad_histogram: GradHistogram | None = None
    aggregate: bool = False
    fp8: list[Fp8Record] = dataclasses.field(default_factory=list)
    """One record per fp8 matmul call (``torch._scaled_mm``), forward and backward: the
    scales, the amax they stand for, and the shares of saturated and zero fp8 values."""

    @property
    def producers(self) -> list[OpRecord]:
        """Records of ops that produced inf/NaN from finite inputs, in execution order."""
        return [r for r in self.records if r.produced_nonfinite]

    def summary(self) -> dict[str, Any]:
        """Ops per dtype, matmul/conv FLOPs per dtype, casts, producers, overflow risk."""

        return summarize(self)

    def table(self, max_rows: int = 40) -> str:
        """The report as text tables (needs ``tabulate``); the per-op table shows at most
        ``max_rows`` rows, the rows with inf/NaN or fp16 range problems first."""
        if not isinstance(max_rows, int) or max_rows < 0:
            raise ValueError(f"AuditReport.table(max_rows={max_rows!r}): expected an int >= 0")

        return render(self, max_rows)

    def fp8_table(self) -> str:
        """The fp8 matmuls as a fixed-width text table (empty string when there were none):
        per operand ``dtype scale amax saturated% zero%``."""
        if not self.fp8:
            return ""
        head = ("node", "phase", "a", "a scale", "a amax", "a sat%", "a zero%", "b",
                "b scale", "b amax", "b sat%", "b zero%")
        rows = [(r.node or "-", r.phase, r.a_dtype, f"{r.a_scale:.3g}", f"{r.a_amax:.3g}",
                 f"{100 * r.a_saturated:.3g}", f"{100 * r.a_zero:.3g}", r.b_dtype,
                 f"{r.b_scale:.3g}", f"{r.b_amax:.3g}", f"{100 * r.b_saturated:.3g}",
                 f"{100 * r.b_zero:.3g}") for r in self.fp8]
        widths = [max(len(str(x)) for x in col) for col in zip(head, *rows)]
        return "\n".join("  ".join(str(c).ljust(w) for c, w in zip(line, widths)).rstrip()
                         for line in [head, tuple("-" * w for w in widths), *rows])

    def to_dict(self) -> dict[str, Any]:
        """Plain, JSON-serialisable data (``json.dumps(report.to_dict())``)."""
        first = None
        if self.first_nonfinite is not None:
            first = next(i for i, r in enumerate(self.records) if r is self.first_nonfinite)
        return {"records": [r.to_dict() for r in self.records],
                "first_nonfinite": first,
                "grad_histogram": None if self.grad_histogram is None
                else self.grad_histogram.to_dict(),
                "aggregate": self.aggregate,
                "fp8": [r.to_dict() for r in self.fp8],
                "summary": self.summary()}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "AuditReport":
        """Rebuild a report from :meth:`to_dict` output (e.g. after ``json.loads``)."""
        records = [OpRecord.from_dict(r) for r in data["records"]]
        first = data.get("first_nonfinite")
        hist = data.get("grad_histogram")
        fp8 = [Fp8Record(**{**r, "shape": tuple(r["shape"])}) for r in data.get("fp8", [])]
        return cls(records, records[first] if first is not None else None,
                   GradHistogram.from_dict(hist) if hist is not None else None,
                   bool(data.get("aggregate", False)), fp8)

    def __iter__(self) -> Iterator[OpRecord]:
        return iter(self.records)

    def __len__(self) -> int:
        return len(self.records)


class _AuditSession:
    """The context manager :func:`audit` returns; owns the mode, the hooks and the report."""

    def __init__(self, aggregate: bool) -> None:
        self.report = AuditReport(aggregate=aggregate)
        self._where = Attribution(max_segments=_MAX_SEGMENTS if aggregate else None)
        self._recorder = Recorder(self._where, aggregate)
        self._mode = _AuditMode(self._recorder)
        self._entered = False

    def __enter__(self) -> AuditReport:
        if self._entered:
            raise RuntimeError("amprewrite.audit(): this context was already entered; it is "
                               "not reentrant. Open a new one: with amprewrite.audit() as r:")
        self._entered = True
        self._where.start()
        try:
            self._mode.__enter__()
        except BaseException:
            self._where.stop()
            raise
        return self.report

    def __exit__(self, *exc: Any) -> None:
        try:
            self._mode.__exit__(*exc)
        finally:
            self._where.stop()
            release_scratch()
        self._build()

    def _build(self) -> None:
        recorder = self._recorder
        if recorder.failures:
            warnings.warn(
                f"amprewrite.audit: {len(recorder.failures)} op call(s) could not be recorded "
                f"and are missing from the report; the first: {recorder.failures[0]}",
                stacklevel=user_stacklevel())
        stats, hist, grad_max, grad_nonfinite = recorder.finish()
        records = []
        first_call, first = None, None
        for group, s in zip(recorder.groups, stats):
            m = group.meta
            # fp16 range flags only where fp16 holds the value (or would, for bf16).
            held = m.out_dtype in LOW_OUTPUTS
            record = OpRecord(
                op=m.op, node=m.node, module=m.module, phase=m.phase, in_dtypes=m.in_dtypes,
                out_dtype=m.out_dtype, shape=m.shape, max_abs=s.max_abs,
                min_nonzero_abs=s.min_nonzero_abs, nonfinite=s.nonfinite,
                fp16_overflow=s.fp16_overflow if held else 0,
                fp16_underflow=s.fp16_underflow if held else 0, cast=m.cast,
                grad_fn=m.grad_fn, produced_nonfinite=s.producer_call is not None,
                count=group.count, flops=group.flops, cast_bytes=group.nbytes,
                mask_values=s.mask_values, mask_fill=m.mask_fill)
            records.append(record)
            if s.producer_call is not None and (first_call is None or s.producer_call < first_call):
                first_call, first = s.producer_call, record
        self.report.records = records
        self.report.first_nonfinite = first
        self.report.fp8 = recorder.fp8.finish()
        if hist is not None:
            # fp16 when it held any of them: the run's own limits, not a what-if.
            dtype = "float16" if torch.float16 in recorder.grad_dtypes else "bfloat16"
            self.report.grad_histogram = GradHistogram.from_counts(hist, grad_max, dtype,
                                                                   grad_nonfinite)


def audit(*, aggregate: bool = False) -> _AuditSession:
    """Record every op that runs inside the ``with`` block, forward and backward.

    Works for any module: a converted GraphModule (rows carry the FX ``node`` name), an eager
    model, or an eager model under ``torch.autocast``. Backward ops are attributed to the
    forward node/module that created them. Statistics stay on the tensors' device until the
    block exits, then are read back once.

    Args:
        aggregate: keep one row per (node or module, op, phase, dtypes) with ``count``,
            max/min and summed counts, instead of one row per call: bounded memory for long
            runs (a training loop under one audit).

    Returns:
        A context manager; ``with audit() as report`` binds the :class:`AuditReport`, which
        is filled in when the block exits.
    """
    if not isinstance(aggregate, bool):
        raise TypeError(f"amprewrite.audit(aggregate={aggregate!r}): expected True or False")
    return _AuditSession(aggregate)
