"""The summary beside the first chart: a small table of what was converted and how it
compares with ``torch.autocast``, in words ("1.3x faster", "2% less memory"; speed with the
spread of its timing rounds, "too noisy to tell", or "the machine is too busy to tell"), and
the ops closest to fp16 overflow with their module. In a run whose low dtype is not fp16,
what the audit says of fp16 (the overflow risk, a loss scale) answers a question, "could
this run in fp16?", and is labelled as that, not as advice for the run."""

from __future__ import annotations

import math
from html import escape
from typing import TYPE_CHECKING, Any, Sequence

from ..summary import (AS_FAST_WITHIN, BUSY, MIN_ROUNDS_TO_TELL, UNSURE, speed_spread,
                       speed_verdict)
from .bands import breakable, magnitude
from .modules import TOP_LEVEL

if TYPE_CHECKING:
    from ..audit.report import AuditReport

__all__ = ["summary_table", "risk_table", "speed_words", "speed_verdict", "AS_FAST_WITHIN",
           "memory_words"]


def _ratio(x: float) -> str:
    return f"{x:.2f}".rstrip("0").rstrip(".")


def speed_words(converted_ms: float, autocast_ms: float) -> str:
    """``"1.3x faster than"`` / ``"1.29x slower than"`` / ``"as fast as"`` (torch.autocast:
    :func:`speed_verdict`)."""
    speedup = autocast_ms / converted_ms
    verdict = speed_verdict(speedup)
    if verdict == "as fast":
        return "as fast as"
    return f"{_ratio(speedup)}x faster than" if verdict == "faster" else \
        f"{_ratio(1 / speedup)}x slower than"


def _speed_row(vs_autocast: dict[str, Any]) -> str:
    """The speed row: the median round in words, green or red, and the spread of the rounds
    it stands on; neither colour when the rounds disagree (:func:`speed_spread`). A
    measurement without rounds (only ``forward_ms``) is one round: too few to tell."""
    t = vs_autocast["forward_ms"]
    spread = speed_spread(vs_autocast.get("forward_rounds",
                                          [(t["converted"], t["autocast"])]))
    times = f"forward {t['converted']:.2f} ms vs {t['autocast']:.2f} ms"
    if spread.rounds < MIN_ROUNDS_TO_TELL:
        return _row("speed", "too few rounds to compare with",
                    f"({spread.rounds} round{'s' if spread.rounds > 1 else ''}: "
                    f"{_ratio(spread.ratio)}x its speed; {times})",
                    vs=True)
    if spread.busy:  # the demo's words (amprewrite.summary.speed_sentence)
        return _row("speed", "no verdict against",
                    f"({BUSY}: its slowest round took {spread.slowest:.0f}x the median "
                    f"round's time, of {spread.rounds} rounds; {times})", vs=True)
    its = (f"{spread.low:.2f}x-{spread.high:.2f}x its speed, middle half of {spread.rounds} "
           "rounds")
    if spread.verdict == UNSURE:
        return _row("speed", "about as fast as", f"({UNSURE}: {its}; {times})", vs=True)
    how_much = "" if spread.sized else f"how much is {UNSURE}: "
    return _row("speed", speed_words(1.0, spread.ratio), f"({how_much}{its}; {times})",
                good=spread.verdict != "slower", vs=True)


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
         vs: bool = False, what_if: bool = False) -> str:
    """``key``: ``value`` (bold green or red when ``good`` says how it compares; followed
    by "torch.autocast" with ``vs``, which ends the sentence) and ``detail`` in grey;
    ``what_if`` rows answer a hypothetical question (class ``what-if``)."""
    text = escape(value)
    if good is not None:
        text = f"<b class='{'good' if good else 'bad'}'>{text}</b>"
    if vs:
        text += " torch.autocast"
    extra = f" <span class='detail'>{escape(detail)}</span>" if detail else ""
    tr = "<tr class='what-if'>" if what_if else "<tr>"
    return f"{tr}<th>{escape(key)}</th><td>{text}{extra}</td></tr>"


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
        b, e = vs_autocast["step_bytes"], vs_autocast["max_abs_error"]
        rows.append(_speed_row(vs_autocast))
        rows.append(_row("memory", memory_words(b["converted"], b["autocast"]),
                         f"(training step {_kib(b['converted'])} vs {_kib(b['autocast'])})",
                         good=b["converted"] <= b["autocast"] * 1.005, vs=True))
        rows.append(_row("error", f"max |output − fp32 output| {e['converted']:.3g}",
                         f"(torch.autocast {e['autocast']:.3g})"))
    if report is not None:
        rows += _audit_rows(report, low)
    return "<table class='facts'>" + "".join(rows) + "</table>"


def _audit_rows(report: "AuditReport", low: str) -> list[str]:
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
    if hist is not None and hist.recommended_loss_scale is None:
        # No scale to give (fp16 overflowed, or nothing in the low dtype): the same words
        # as the terminal table.
        rows.append(_row("fp16 loss scale", "-", f"({hist.advice()})"))
    elif hist is not None:
        scale = hist.recommended_loss_scale
        power = f"2^{round(math.log2(scale))} = {scale:g}"
        grads = (f"max |grad| {hist.max_abs:.3g}; {hist.fp16_flush_fraction:.1%} of gradient "
                 "values below fp16's smallest subnormal")
        if hist.needs_probe:
            grads = f"an upper bound: {hist.probe()}; {grads}"
        if low == "fp16":
            rows.append(_row("fp16 loss scale", power, f"({grads})"))
        else:
            # NB: a question about another dtype, not advice: bf16 has fp32's exponent range,
            # and this run needs no loss scale.
            rows.append(_row("could it run in fp16?", f"with loss scale {power}",
                             f"(a what-if: {low} needs no loss scale; {grads})",
                             what_if=True))
    return rows


def risk_table(report: "AuditReport", low: str = "fp16") -> str:
    """The ops closest to fp16 overflow (real risk first, masks last), with their module;
    empty when none has a nonzero value. When ``low`` (the run's low dtype) is not fp16, the
    table answers "could this run in fp16?": its overflows are marked as ones that would
    happen, in no warning colour."""
    fp16 = low == "fp16"
    rows = []
    for item in report.summary()["top_overflow_risk"]:
        r = report.records[item["record"]]
        room = f"{'overflowed' if fp16 else 'would overflow'} ({r.fp16_overflow} values)" \
            if r.fp16_overflow else f"{item['headroom_bits']:.1f} bits"
        if r.is_mask:
            room += " (a mask)"
        warn = " class=warn" if r.fp16_overflow and fp16 else ""
        rows.append(f"<tr{warn}><td>{escape(r.label)} "
                    f"<span class='detail'>{escape(r.phase)}</span></td><td class='mod'>"
                    f"{breakable(r.module or TOP_LEVEL)}</td><td class='num'>"
                    f"{magnitude(r.max_abs)}</td><td class='num'>{escape(room)}</td></tr>")
    if not rows:
        return ""
    what_if = "" if fp16 else (
        f"<p class='note what-if'>A what-if: this run computes in {escape(low)}, which holds "
        "these values; the table answers “could this run in fp16?”</p>")
    return ("<h3>closest to fp16 overflow (65504)</h3>" + what_if + "<div class='scroll'>"
            "<table class='risk'><thead><tr><th>op</th><th>module</th><th>max |x|</th><th>"
            "fp16 headroom</th></tr></thead><tbody>" + "".join(rows) + "</tbody></table></div>")
