"""Range against the format: every audited op's magnitudes on one log axis, as an SVG.

One vertical line per op, forward then backward in execution order, from its smallest
nonzero |x| to its largest finite |x| (mask sentinels left out, as the auditor counts them),
coloured by the dtype it produced; behind them, the low dtype's range as a band (dark where
its values are normal, light where subnormal), e4m3 (forward) and e5m2 (backward) behind the
ops of fp8 layers. Beside them, on the same axis, the gradient histogram: the share of
backward-op output values per power of two, as Figure 3 of the Mixed Precision Training
paper plots it, each bucket coloured by what the low dtype makes of it.

inf/NaN are marked by the rule the summary counts them with (``OpRecord.produced_nonfinite``):
red where an op made them from finite inputs, grey where an op only carried them (an attention
mask's ``-inf``, written on purpose, and every op it flows through). Marks sit inside the plot,
clear of the panel titles above it.

Everything is drawn here, as SVG text: no plotting library, no script.
"""

from __future__ import annotations

import math
from html import escape
from typing import TYPE_CHECKING, Callable, NamedTuple, Sequence

import torch

from .bands import Band, band_of, dtype_label, fate, magnitude, number
from .modules import TOP_LEVEL

if TYPE_CHECKING:
    from ..audit.grad_hist import GradHistogram
    from ..audit.records import OpRecord

__all__ = ["range_chart", "out_of_band"]

_W, _TOP, _BOTTOM = 1200, 34, 300
_LEFT, _LABELS, _HIST, _GAP = 46, 150, 170, 14
_H = _BOTTOM + 22
_MARK = 3.5
"""Half the width of an inf/NaN mark (a triangle twice as tall)."""
_CHAR_W = 6.6
"""Width of a character of a panel title (11 px, semibold), generous: titles are cut to fit."""
_MAX_COLUMNS = 600
"""More ops than this in one phase are drawn in groups of consecutive ops (their envelope)."""
_LOW_DTYPES = ("float16", "bfloat16")


class _Column(NamedTuple):
    lo: float | None
    hi: float | None
    kind: str
    """CSS class: ``low``, ``f32`` or ``other`` (the dtype produced)."""
    mark: str | None
    """``"nonfinite"`` when an op of the column produced inf/NaN, ``"carried"`` when its
    ops only carried them (given, or written on purpose), else None."""
    band: Band
    title: str


def _mark(records: Sequence["OpRecord"]) -> str | None:
    """The marker of ``records``: the summary's rule, ``produced_nonfinite``, decides red."""
    if any(r.produced_nonfinite for r in records):
        return "nonfinite"
    return "carried" if any(r.nonfinite for r in records) else None


def _nonfinite_words(r: "OpRecord") -> str:
    """How a column's title names an op's inf/NaN: made there, or only carried."""
    if not r.nonfinite:
        return ""
    if r.produced_nonfinite:
        return f", produced {r.nonfinite} inf/NaN"
    how = "written on purpose (a mask)" if r.mask_fill or not any(
        d.startswith(("float", "bfloat")) for d in r.in_dtypes) else "passed on from its inputs"
    return f", {r.nonfinite} inf/NaN {how}, none produced"


def _kind(dtype: str | None) -> str:
    return "low" if dtype in _LOW_DTYPES else "f32" if dtype == "float32" else "other"


def _columns(records: Sequence[tuple[int, "OpRecord"]],
             band_for: Callable[["OpRecord"], Band]) -> list[_Column]:
    """One column per op with statistics (an fp8 output has none), or per group of
    consecutive ops when there are more than ``_MAX_COLUMNS``."""
    kept = [(i, r) for i, r in records if r.max_abs is not None or r.nonfinite]
    size = max(1, math.ceil(len(kept) / _MAX_COLUMNS))
    out = []
    for start in range(0, len(kept), size):
        group = kept[start:start + size]
        his = [r.max_abs for _, r in group if r.max_abs]
        # NB: an op that wrote only mask sentinels has no max_abs (they are left out of it)
        # but its smallest nonzero |x| is one of them: it has no range to draw.
        los = [min(r.min_nonzero_abs or r.max_abs, r.max_abs) for _, r in group if r.max_abs]
        (first, r0), (last, _) = group[0], group[-1]
        where = r0.module or TOP_LEVEL
        if len(group) == 1:
            title = (f"#{first} {r0.phase} {r0.label} in {where}: "
                     f"{dtype_label(r0.out_dtype)}, max |x| {magnitude(r0.max_abs)}, "
                     f"smallest nonzero |x| {magnitude(r0.min_nonzero_abs)}"
                     + _nonfinite_words(r0))
        else:
            made = sum(r.nonfinite for _, r in group if r.produced_nonfinite)
            carried = sum(r.nonfinite for _, r in group if not r.produced_nonfinite)
            title = (f"ops #{first} to #{last} ({r0.phase}, from {where}): max |x| "
                     f"{magnitude(max(his, default=None))}, smallest nonzero |x| "
                     f"{magnitude(min(los, default=None))}"
                     + (f", produced {made} inf/NaN" if made else "")
                     + (f", {carried} inf/NaN carried, not produced" if carried else ""))
        bands = {band_for(r) for _, r in group}
        out.append(_Column(min(los, default=None), max(his, default=None),
                           _kind(r0.out_dtype), _mark([r for _, r in group]),
                           bands.pop() if len(bands) == 1 else band_for(r0), title))
    return out


class _Axis(NamedTuple):
    lo: int
    """Bottom of the axis, a power of ten."""
    hi: int

    def y(self, value: float) -> float:
        """The y coordinate of ``value`` (clamped to the plot)."""
        e = math.log10(value) if value > 0 else self.lo
        t = (self.hi - e) / (self.hi - self.lo)
        return round(_TOP + min(1.0, max(0.0, t)) * (_BOTTOM - _TOP), 1)

    def holds(self, value: float) -> bool:
        return 10.0 ** self.lo <= value <= 10.0 ** self.hi


def _axis(values: list[float], bands: set[Band]) -> _Axis:
    """Decades spanning the data, widened to the bands' edges within 8 decades of it."""
    lo = math.floor(math.log10(min(values))) if values else -8
    hi = math.ceil(math.log10(max(values))) if values else 5
    for band in bands:
        for edge in (band.smallest, band.max):
            e = math.log10(edge)
            if lo - 8 <= e < lo:
                lo = math.floor(e)
            if hi < e <= hi + 8:
                hi = math.ceil(e)
    if hi - lo < 4:
        lo, hi = lo - 2, hi + 2
    return _Axis(lo, hi)


def _band_rects(axis: _Axis, band: Band, x: float, width: float) -> str:
    top, normal, bottom = axis.y(band.max), axis.y(band.normal), axis.y(band.smallest)
    return (f"<rect class='band-n' x='{x:.1f}' y='{top}' width='{width:.1f}' "
            f"height='{normal - top:.1f}'/><rect class='band-s' x='{x:.1f}' y='{normal}' "
            f"width='{width:.1f}' height='{bottom - normal:.1f}'/>")


def _tick_label(e: int) -> str:
    return {0: "1", 1: "10"}.get(e, f"1e{e}")


def _grid(axis: _Axis, right: float) -> list[str]:
    span = axis.hi - axis.lo
    step = next(s for s in (1, 2, 5, 10, 20) if span / s <= 14)
    out = []
    for e in range(axis.lo, axis.hi + 1):
        if e % step:
            continue
        y = axis.y(10.0 ** e)
        out.append(f"<line class='grid' x1='{_LEFT}' x2='{right:.1f}' y1='{y}' y2='{y}'/>"
                   f"<text class='tick' x='{_LEFT - 4}' y='{y + 3.5}'>{_tick_label(e)}</text>")
    return out


def _fit(titles: Sequence[str], width: float) -> str:
    """The first of ``titles`` that fits ``width`` (a narrow panel's title would run into
    the next one's), or none."""
    return next((t for t in titles if len(t) * _CHAR_W <= width), "")


def _panel(axis: _Axis, title: str, columns: list[_Column], x0: float,
           width: float) -> list[str]:
    """One phase: its bands (one rect pair per run of columns with one band), its title and
    one line per column."""
    out = [f"<text class='panel' x='{x0:.1f}' y='{_TOP - 8}'>{escape(title)}</text>"]
    step = width / max(1, len(columns))
    start = 0
    for i in range(1, len(columns) + 1):
        if i == len(columns) or columns[i].band != columns[start].band:
            band = columns[start].band
            out.append(_band_rects(axis, band, x0 + start * step, (i - start) * step))
            if band.name.startswith("e") and (i - start) * step >= 24:
                out.append(f"<text class='fp8' x='{x0 + start * step + 2:.1f}' "
                           f"y='{axis.y(band.max) - 2}'>{band.name}</text>")
            start = i
    stroke = min(3.0, max(1.0, 0.7 * step))
    out.append(f"<g class='ops' stroke-width='{stroke:.1f}'>")
    for i, col in enumerate(columns):
        x = round(x0 + (i + 0.5) * step, 1)
        if col.hi is not None:
            y1, y2 = axis.y(col.hi), axis.y(col.lo if col.lo is not None else col.hi)
            if y2 - y1 < 3:
                y1, y2 = y1 - 1.5, y2 + 1.5
            out.append(f"<line class='{col.kind}' x1='{x}' x2='{x}' y1='{y1}' y2='{y2}'>"
                       f"<title>{escape(col.title)}</title></line>")
        if col.mark is not None:
            # Inside the plot, below its top edge: above it is the panel's title. Kept
            # within the panel's width, so a first or last column's mark reaches no label.
            mx = min(max(x, x0 + _MARK), x0 + width - _MARK)
            out.append(f"<path class='{col.mark}' d='M{mx:.1f},{_TOP + 2 + _MARK * 2:.1f} "
                       f"l{-_MARK},{-_MARK * 2} h{_MARK * 2} z'>"
                       f"<title>{escape(col.title)}</title></path>")
    out.append("</g>")
    return out


def _histogram(axis: _Axis, hist: "GradHistogram", band: Band, x0: float) -> list[str]:
    out = [f"<text class='panel' x='{x0:.1f}' y='{_TOP - 8}'>gradients: share of values</text>",
           _band_rects(axis, band, x0, _HIST)]
    total = hist.total or 1
    top = max(hist.counts.values(), default=1)
    for e, n in sorted(hist.counts.items()):
        lo, hi = 2.0 ** e, 2.0 ** (e + 1)
        if not (axis.holds(lo) or axis.holds(hi)):
            continue
        y1, y2 = axis.y(hi), axis.y(lo)
        what = fate(band, e)
        out.append(f"<rect class='h-{what}' x='{x0:.1f}' y='{y1}' width="
                   f"'{max(1.0, _HIST * n / top):.1f}' height='{max(1.0, y2 - y1 - 0.4):.1f}'>"
                   f"<title>2^{e} to 2^{e + 1}: {n} values ({n / total:.1%}), {what} in "
                   f"{band.name}</title></rect>")
    return out


def _edge_labels(axis: _Axis, bands: Sequence[tuple[Band, str]], right: float) -> list[str]:
    """Dashed lines at the bands' edges across the chart, named on the right (pushed apart
    where they would overlap); an edge of the main band off the axis is named at the axis'
    end, with an arrow."""
    lines, labels = [], []
    for band, kind in bands:
        for value, name in ((band.max, "max"), (band.normal, "normal ≥"),
                            (band.smallest, "subnormal ≥")):
            label = f"{band.name} {name} {number(value)}"
            if axis.holds(value):
                y = axis.y(value) + 3.5
                lines.append(f"<line class='{kind}' x1='{_LEFT}' x2='{right:.1f}' "
                             f"y1='{y - 3.5}' y2='{y - 3.5}'/>")
            elif kind == "edge":
                above = value > 10.0 ** axis.hi
                y = _TOP + 3.5 if above else _BOTTOM
                label += " ↑" if above else " ↓"
            else:
                continue
            labels.append([y, label, kind])
    labels.sort()
    for prev, cur in zip(labels, labels[1:]):  # push down, then back up from the bottom
        cur[0] = max(cur[0], prev[0] + 12)
    labels[-1][0] = min(labels[-1][0], _H - 4)
    for cur, nxt in reversed(list(zip(labels, labels[1:]))):
        cur[0] = min(cur[0], nxt[0] - 12)
    return lines + [f"<text class='{kind}' x='{right + 4:.1f}' y='{y:.1f}'>{escape(label)}"
                    "</text>" for y, label, kind in labels]


def range_chart(records: Sequence["OpRecord"], low: torch.dtype, fp8_modules: set[str],
                hist: "GradHistogram | None") -> str:
    """The SVG: ops of ``records`` per phase, ``low``'s band behind them (fp8 bands behind
    the ops of ``fp8_modules``), and ``hist`` beside them."""
    band = band_of(low)
    fp8 = {"forward": band_of(torch.float8_e4m3fn), "backward": band_of(torch.float8_e5m2)}

    def band_for(r: "OpRecord") -> Band:
        return fp8.get(r.phase, fp8["forward"]) if r.module in fp8_modules else band

    phases = [(p, _columns([(i, r) for i, r in enumerate(records) if r.phase == p], band_for))
              for p in dict.fromkeys(r.phase for r in records)]
    phases = [(p, cols) for p, cols in phases if cols]
    values = [v for _, cols in phases for c in cols for v in (c.lo, c.hi) if v]
    if hist is not None and hist.counts:
        values += [2.0 ** min(hist.counts), 2.0 ** (max(hist.counts) + 1)]
    edges = [(band, "edge")]
    if band.name != "fp16":  # the audit's overflow counts and loss scale speak of fp16
        edges.append((band_of(torch.float16), "ref"))
    axis = _axis(values, {c.band for _, cols in phases for c in cols} | {b for b, _ in edges})
    hist_width = _HIST + _GAP if hist is not None and hist.counts else 0
    right = _W - _LABELS
    room = right - _LEFT - hist_width - _GAP * max(0, len(phases) - 1)
    n = sum(len(cols) for _, cols in phases) or 1
    # NB: no xmlns: an SVG inline in HTML does not need one, and the page names no URL.
    parts = [f"<svg class='ranges' viewBox='0 0 {_W} {_H}' width='100%' role='img'>"
             f"<title>|x| of every op on a log axis, against the range of {band.name}</title>"]
    body, x = [], float(_LEFT)
    for phase, cols in phases:
        width = room * len(cols) / n
        title = _fit((f"{phase}: {len(cols)} ops with float outputs",
                      f"{phase}: {len(cols)} ops", phase), width + _GAP)
        body += _panel(axis, title, cols, x, width)
        x += width + _GAP
    if hist_width:
        body += _histogram(axis, hist, band, right - _HIST)  # type: ignore[arg-type]
    parts += _grid(axis, right) + body + _edge_labels(axis, edges, right)
    parts.append(f"<text class='axis' x='{_LEFT}' y='{_H - 4}'>|x| (log scale): each line "
                 "spans one op's smallest nonzero to largest finite |x|</text></svg>")
    return "".join(parts)


def out_of_band(records: Sequence["OpRecord"], low: torch.dtype,
                fp8_modules: set[str]) -> str:
    """One sentence: the ops whose values reach past ``low``'s range (fp8 layers apart)."""
    band = band_of(low)
    mine = [r for r in records if r.max_abs is not None and r.module not in fp8_modules]
    over = [r for r in mine if r.max_abs > band.max]  # type: ignore[operator]
    under = [r for r in mine
             if r.min_nonzero_abs is not None and r.min_nonzero_abs < band.smallest]
    if not over and not under:
        return f"Every op's values lie within {band.name}'s range."
    named = ", ".join(f"{r.label} ({r.phase}) in {r.module or TOP_LEVEL}" for r in over[:3])
    parts = []
    if over:
        parts.append(f"{len(over)} op{'s' if len(over) != 1 else ''} reach above "
                     f"{band.name}'s max {number(band.max)}: {named}"
                     + (", ..." if len(over) > 3 else ""))
    if under:
        parts.append(f"{len(under)} op{'s' if len(under) != 1 else ''} hold values below "
                     f"its smallest subnormal {number(band.smallest)} (zero in {band.name})")
    return "; ".join(parts) + "."
