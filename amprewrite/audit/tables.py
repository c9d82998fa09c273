"""Presentation of an :class:`~amprewrite.audit.AuditReport`: summary numbers and text tables.

``tabulate`` is imported only when a table is rendered.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from .records import OpRecord, ReportView

__all__ = ["summarize", "render", "risk_rows", "magnitude"]

_LOW = ("float16", "bfloat16", "float8_e4m3fn", "float8_e5m2")
_SHORT = {"float16": "f16", "bfloat16": "bf16", "float32": "f32", "float64": "f64",
          "float8_e4m3fn": "e4m3", "float8_e5m2": "e5m2"}
_TOP_RISK = 5


def summarize(report: ReportView) -> dict[str, Any]:
    """Plain numbers: ops per dtype and phase, matmul/conv FLOPs per dtype, casts,
    non-finite producers (record indices) and the records closest to fp16 overflow."""
    records = report.records
    per_dtype: dict[str, Counter] = {"forward": Counter(), "backward": Counter()}
    flops: Counter = Counter()
    casts = {"count": 0, "bytes": 0}
    for r in records:
        per_dtype.setdefault(r.phase, Counter())[r.out_dtype or "-"] += r.count
        if r.flops:
            flops[_compute_dtype(r)] += r.flops
        if r.cast:
            casts["count"] += r.count
            casts["bytes"] += r.cast_bytes
    total = sum(flops.values())
    # Real risk first: rows that overflowed fp16 (mask sentinels are not counted), then by
    # headroom; rows of masks after every other row.
    risk = sorted((i for i, r in enumerate(records)
                   if r.headroom_bits is not None or r.fp16_overflow),
                  key=lambda i: (records[i].is_mask, not records[i].fp16_overflow,
                                 records[i].headroom_bits or 0.0, i))[:_TOP_RISK]
    return {
        "ops": sum(r.count for r in records),
        "ops_per_dtype": {phase: dict(sorted(c.items())) for phase, c in per_dtype.items()},
        "flops": {"total": total, "by_dtype": dict(sorted(flops.items())),
                  "low_precision_share": (sum(flops[d] for d in _LOW) / total) if total
                  else None},
        "casts": casts,
        "nonfinite_producers": [i for i, r in enumerate(records) if r.produced_nonfinite],
        "masks": [i for i, r in enumerate(records) if r.is_mask],
        "top_overflow_risk": [{"record": i, "headroom_bits": records[i].headroom_bits,
                               "fp16_overflow": records[i].fp16_overflow,
                               "what_if": records[i].what_if} for i in risk],
    }


def _compute_dtype(r: OpRecord) -> str:
    # A matmul computes in its floating input dtype (the output may differ: dtype= args).
    for d in r.in_dtypes:
        if d in _SHORT:
            return d
    return r.out_dtype or "-"


def _short(dtype: str | None) -> str:
    """Table cells use short dtype names; the data keeps torch's."""
    return "-" if dtype is None else _SHORT.get(dtype, dtype)


def magnitude(x: float | None) -> str:
    """A measured |x| in three digits (``"-"`` for none), as every table writes it."""
    return "-" if x is None else f"{x:.3g}"


def _where(r: OpRecord) -> str:
    if r.node is not None:
        return r.node
    return "" if r.module is None else (r.module or "(root)")


def _row(i: int, r: OpRecord, aggregate: bool) -> list[Any]:
    row = [i, r.phase[:3], r.label, _where(r), r.module if r.node is not None else "",
           ",".join(map(_short, r.in_dtypes)), _short(r.out_dtype),
           "x".join(map(str, r.shape)) or "()",
           magnitude(r.max_abs), magnitude(r.min_nonzero_abs),
           f"{r.nonfinite}{'*' if r.produced_nonfinite else ''}", r.fp16_overflow,
           r.fp16_underflow]
    if aggregate:
        row.insert(3, r.count)
    return row


def _bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    return str(n)


def render(report: ReportView, max_rows: int) -> str:
    import tabulate

    tabulate.PRESERVE_WHITESPACE = True
    s = summarize(report)
    records = report.records
    parts = []
    fwd = sum(s["ops_per_dtype"].get("forward", {}).values())
    bwd = sum(s["ops_per_dtype"].get("backward", {}).values())
    parts.append(f"amprewrite audit: {s['ops']} ops ({fwd} forward, {bwd} backward), "
                 f"{s['casts']['count']} casts ({_bytes(s['casts']['bytes'])})")

    dtypes = sorted({d for c in s["ops_per_dtype"].values() for d in c})
    parts.append(tabulate.tabulate(
        [[_short(d)] + [s["ops_per_dtype"].get(p, {}).get(d, 0) for p in ("forward", "backward")]
         for d in dtypes], headers=["out dtype", "forward ops", "backward ops"]))

    fl = s["flops"]
    if fl["total"]:
        rows = [[_short(d), f"{n:,}", f"{n / fl['total']:.1%}"]
                for d, n in fl["by_dtype"].items()]
        parts.append(tabulate.tabulate(rows, headers=["matmul/conv dtype", "FLOPs", "share"],
                                       colalign=("left", "right", "right"))
                     + f"\nin fp16/bf16: {fl['low_precision_share']:.1%} of matmul/conv FLOPs")

    first = report.first_nonfinite
    if first is None:
        parts.append("non-finite values: none produced")
    else:
        rows = [[i, r.phase, r.label, _where(r), r.grad_fn or "", r.nonfinite]
                for i, r in ((i, records[i]) for i in s["nonfinite_producers"])]
        parts.append("non-finite producers (inf/NaN from finite inputs, or NaN from NaN-free "
                     "ones); first: "
                     f"{first.label} at {_where(first) or '?'} ({first.phase})\n"
                     + tabulate.tabulate(rows, headers=["#", "phase", "op", "node/module",
                                                        "grad_fn", "nonfinite"]))

    if s["masks"]:
        masks = [records[i] for i in s["masks"]]
        parts.append(f"masking, not overflow: {len(masks)} ops wrote or carried mask values "
                     "(±finfo(dtype).max, or an inf filled on purpose):\n  "
                     + ", ".join(f"{r.op} at {_where(r) or '?'}" for r in masks[:6])
                     + (", ..." if len(masks) > 6 else ""))
    rows = risk_rows(report, s)
    if rows:
        parts.append(tabulate.tabulate(rows, headers=["#", "phase", "op", "node/module", "dtype",
                                                      "max finite |x|", "fp16 headroom (bits)"],
                                       colalign=("right", "left", "left", "left", "left",
                                                 "right", "right")))

    parts.append(_ops_table(report, max_rows, tabulate))
    if report.grad_histogram is not None:
        parts.append(report.grad_histogram.title + "\n" + report.grad_histogram.table())
    return "\n\n".join(parts)


def risk_rows(report: ReportView, s: dict[str, Any] | None = None) -> list[list[Any]]:
    """The rows closest to fp16 overflow, real risk first (masks last), as table cells."""
    s = summarize(report) if s is None else s
    rows = []
    for item in s["top_overflow_risk"]:
        r = report.records[item["record"]]
        bits = item["headroom_bits"]
        room = f"overflowed ({r.fp16_overflow})" if r.fp16_overflow else f"{bits:.1f}"
        if r.what_if:
            room = room.replace("overflowed", "would overflow") + " (fp16 what-if)"
        if r.is_mask:
            room += f" (mask: {r.mask_values} sentinel values)"
        rows.append([item["record"], r.phase, r.label, _where(r), _short(r.out_dtype),
                     magnitude(r.max_abs), room])
    return rows


def _ops_table(report: ReportView, max_rows: int, tabulate: Any) -> str:
    records = report.records
    index = list(range(len(records)))
    if len(index) > max_rows:
        # Rows with range problems first, then execution order.
        flagged = [i for i in index if records[i].nonfinite or records[i].fp16_overflow
                   or records[i].fp16_underflow]
        rest = [i for i in index if i not in set(flagged)]
        index = sorted((flagged + rest)[:max_rows])
    headers = ["#", "ph", "op", "node/module", "module", "in", "out", "shape", "max|x|",
               "min|x|>0", "nonfinite", ">f16max", "<f16tiny"]
    align = ["right"] + ["left"] * 7 + ["right"] * 5
    if report.aggregate:
        headers.insert(3, "calls")
        align.insert(3, "right")
    body = tabulate.tabulate([_row(i, records[i], report.aggregate) for i in index],
                             headers=headers, colalign=align)
    note = "(* = produced the inf/NaN, did not only pass it on)"
    if len(index) < len(records):
        note += f"; {len(records) - len(index)} more rows not shown"
    return body + "\n" + note
