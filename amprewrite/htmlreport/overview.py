"""The summary beside the first chart: a small table of what was converted and how it
compares with ``torch.autocast``, in words ("1.3x faster", "2% less memory"), and the ops
closest to fp16 overflow with their module."""

from __future__ import annotations

import math
from html import escape
from typing import TYPE_CHECKING, Any, Sequence

from .bands import magnitude
from .modules import TOP_LEVEL

if TYPE_CHECKING:
    from ..audit.report import AuditReport

__all__ = ["summary_table", "risk_table", "speed_words", "speed_verdict", "AS_FAST_WITHIN",
           "memory_words"]


def _ratio(x: float) -> str:
    return f"{x:.2f}".rstrip("0").rstrip(".")


AS_FAST_WITHIN = 0.03
"""A speed ratio this close to 1 either way reads "as fast": the spread of interleaved rounds
on a quiet machine. The demo's line and the page say the same."""


def speed_verdict(speedup: float) -> str:
    """``"faster"``, ``"slower"`` or ``"as fast"``: torch.autocast's time over ours (above 1:
    faster, as in every table of the project), with :data:`AS_FAST_WITHIN`."""
    if abs(speedup - 1) < AS_FAST_WITHIN:
        return "as fast"
    return "faster" if speedup > 1 else "slower"


def speed_words(converted_ms: float, autocast_ms: float) -> str:
    """``"1.3x faster than"`` / ``"1.29x slower than"`` / ``"as fast as"`` (torch.autocast:
    :func:`speed_verdict`)."""
    speedup = autocast_ms / converted_ms
    verdict = speed_verdict(speedup)
    if verdict == "as fast":
        return "as fast as"
    return f"{_ratio(speedup)}x faster than" if verdict == "faster" else \
        f"{_ratio(1 / speedup)}x slower than"


def memory_words(converted: float, autocast: float) -> str:
    """``"2% less memory than"`` / ``"5% more memory than"`` (torch.autocast); within 0.5%:
    ``"the same memory as"``."""
    change = converted / autocast - 1
    if abs(change) < 0.005:
        return "the same memory as"
    return f"{abs(change):.0%} {'less' if change < 0 else 'more'} memory than"


def _kib(n: float) -> str:
    return f"{n / 1024:,.0f} KiB" if n < 1 << 30 else f"{n / (1 << 30):.2f} GiB"


def _row(key: str, value: str, detail: str = "", good: bool | None = None,
         vs: bool = False) -> str:
    """``key``: ``value`` (bold green or red when ``good`` says how it compares; followed
    by "torch.autocast" with ``vs``, which ends the sentence) and ``detail`` in grey."""
    text = escape(value)
    if good is not None:
        text = f"<b class='{'good' if good else 'bad'}'>{text}</b>"
    if vs:
        text += " torch.autocast"
    extra = f" <span class='detail'>{escape(detail)}</span>" if detail else ""
    return f"<tr><th>{escape(key)}</th><td>{text}{extra}</td></tr>"


def summary_table(facts: Sequence[dict[str, Any]], low: str, casts: dict[str, int] | None,
                  vs_autocast: dict[str, Any] | None,
                  report: "AuditReport | None") -> str:
    """``facts``: :func:`amprewrite.summary.graph_facts` of each graph; ``low``: the low
    dtype's name (``"fp16"``, ``"bf16"``); ``casts``:
    :func:`~amprewrite.summary.count_forward_casts`; ``vs_autocast``: the demo's
    side-by-side measurement (forward ms, training-step bytes, error vs fp32)."""
    f0 = facts[0]
    ops = {k: sum(f["ops"][k] for f in facts) for k in ("low", "fp32", "passthrough")}
    graphs = f" in {len(facts)} graphs" if len(facts) > 1 else ""
    slow = "" if f0["fast_low_dtype"] else f"; no fast {low} kernels here"
    nodes = sum(f["cast_nodes"] for f in facts)
    rows = [_row("model", f0["model"]), _row("hardware", f0["hardware"] + slow),
            _row("policy", f"{f0['policy']}, low dtype {low}"),
            _row("ops", f"{ops['low']} {low} · {ops['fp32']} fp32 · {ops['passthrough']} "
                        f"passthrough{graphs}"),
            _row("cast nodes", f"{nodes}, {sum(f['weight_cast_nodes'] for f in facts)} of "
                               "them weights")]
    if casts is not None:
        ours, theirs = casts["converted"], casts["autocast"]
        words = "as many as" if ours == theirs else \
            f"{abs(theirs - ours)} {'fewer' if ours < theirs else 'more'} than"
        rows.append(_row("casts per forward", words, f"({ours} cast kernels vs {theirs})",
                         good=ours <= theirs, vs=True))
    if vs_autocast is not None:
        t, b, e = (vs_autocast[k] for k in ("forward_ms", "step_bytes", "max_abs_error"))
        rows.append(_row("speed", speed_words(t["converted"], t["autocast"]),
                         f"(forward {t['converted']:.2f} ms vs {t['autocast']:.2f} ms)",
                         good=speed_verdict(t["autocast"] / t["converted"]) != "slower",
                         vs=True))
        rows.append(_row("memory", memory_words(b["converted"], b["autocast"]),
                         f"(training step {_kib(b['converted'])} vs {_kib(b['autocast'])})",
                         good=b["converted"] <= b["autocast"] * 1.005, vs=True))
        rows.append(_row("error", f"max |output − fp32 output| {e['converted']:.3g}",
                         f"(torch.autocast {e['autocast']:.3g})"))
    if report is not None:
        rows += _audit_rows(report)
    return "<table class='facts'>" + "".join(rows) + "</table>"


def _audit_rows(report: "AuditReport") -> list[str]:
    s = report.summary()
    phases = ", ".join(f"{sum(per.values())} {phase}" for phase, per in
                       s["ops_per_dtype"].items() if per)
    first = report.first_nonfinite
    rows = [_row("one training step", f"{s['ops']} ops ({phases}), {s['casts']['count']} "
                                      "cast kernels"),
            _row("inf/NaN", "none produced", good=True) if first is None else
            _row("inf/NaN", f"first produced by {first.label} ({first.phase}) in "
                            f"{first.module or first.node or '?'}", good=False)]
    hist = report.grad_histogram
    if hist is not None and hist.recommended_loss_scale is not None:
        scale = hist.recommended_loss_scale
        rows.append(_row("fp16 loss scale", f"2^{round(math.log2(scale))} = {scale:g}",
                         f"(max |grad| {hist.max_abs:.3g}; {hist.fp16_flush_fraction:.1%} of "
                         "gradient values below fp16's smallest subnormal)"))
    return rows


def risk_table(report: "AuditReport") -> str:
    """The ops closest to fp16 overflow (real risk first, masks last), with their module;
    empty when none has a nonzero value."""
    rows = []
    for item in report.summary()["top_overflow_risk"]:
        r = report.records[item["record"]]
        room = f"overflowed ({r.fp16_overflow} values)" if r.fp16_overflow else \
            f"{item['headroom_bits']:.1f} bits"
        if r.is_mask:
            room += " (a mask)"
        rows.append(f"<tr{' class=warn' if r.fp16_overflow else ''}><td>{escape(r.label)} "
                    f"<span class='detail'>{escape(r.phase)}</span></td><td class='mod'>"
                    f"{escape(r.module or TOP_LEVEL)}</td><td class='num'>"
                    f"{magnitude(r.max_abs)}</td><td class='num'>{escape(room)}</td></tr>")
    if not rows:
        return ""
    return ("<h3>closest to fp16 overflow (65504)</h3><table class='risk'><thead><tr><th>op"
            "</th><th>module</th><th>max |x|</th><th>fp16 headroom</th></tr></thead><tbody>"
            + "".join(rows) + "</tbody></table>")
