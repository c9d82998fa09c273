"""Precision per module: for each module, collapsed to a depth of its qualified name, one bar
of its float ops by precision (fp8, low, fp32, passthrough) and one of the cast nodes that
feed them. One chart per depth is written; the page shows one and a slider picks another
(without script, the default depth shows). Integer, bool and shape plumbing is left out, as
``explain()`` folds it.
"""

from __future__ import annotations

from collections import Counter
from html import escape
from typing import Any, Sequence

__all__ = ["module_chart", "module_prefixes", "PRECISIONS", "TOP_LEVEL"]

PRECISIONS = ("fp8", "low", "fp32", "passthrough")
TOP_LEVEL = "(top level)"
"""How the page names ops outside any submodule (the script's filter matches it too)."""
_MAX_ROWS = 12
"""The default depth is the deepest whose chart has at most this many rows."""


def _prefix(module: str, depth: int) -> str:
    return ".".join(module.split(".")[:depth]) if module else ""


def _depth(module: str) -> int:
    return len(module.split(".")) if module else 0


def module_prefixes(modules: Sequence[str]) -> list[str]:
    """Every module and every module above it, in the order they first appear."""
    out: dict[str, None] = {}
    for module in modules:
        for d in range(1, _depth(module) + 1):
            out.setdefault(_prefix(module, d))
        out.setdefault(module)
    return list(out)


def _groups(rows: Sequence[dict[str, Any]], depth: int) -> dict[str, tuple[Counter, set]]:
    """Per module prefix (first appearance first): ops per precision, cast nodes."""
    out: dict[str, tuple[Counter, set]] = {}
    for row in rows:
        ops, casts = out.setdefault(_prefix(row["module"], depth), (Counter(), set()))
        ops[row["precision"]] += 1
        casts.update(row["casts"])
    return out


def _label(module: str) -> str:
    """The module's whole name, the part above it greyed. A long name wraps in its column
    after its dots (``<wbr>``; ``.mlabel`` breaks a long part too) rather than being cut:
    ``model.layers.11.self_attn`` and ``model.layers.17.self_attn`` differ in the middle."""
    name = module or TOP_LEVEL
    parent, dot, own = name.rpartition(".")
    return (f"<span class='parent'>{escape(parent + dot).replace('.', '.<wbr>')}</span>"
            f"{escape(own)}")


def _chart(groups: dict[str, tuple[Counter, set]], depth: int, shown: bool,
           names: dict[str, str]) -> str:
    widest = max((sum(ops.values()) for ops, _ in groups.values()), default=1) or 1
    most_casts = max((len(c) for _, c in groups.values()), default=1) or 1
    rows = []
    for module, (ops, casts) in groups.items():
        total = sum(ops.values())
        segments = "".join(
            f"<i class='p-{p}' style='width:{100 * ops[p] / widest:.2f}%'></i>"
            for p in PRECISIONS if ops[p])
        counts = ", ".join(f"{ops[p]} {names[p]}" for p in PRECISIONS if ops[p])
        title = f"{module or TOP_LEVEL}: {counts}; {len(casts)} cast nodes feed them"
        rows.append(
            f"<div class='mrow' data-module='{escape(module)}' title='{escape(title)}'>"
            f"<span class='mlabel'>{_label(module)}</span>"
            f"<span class='mbar'>{segments}</span><span class='mnum'>{total}</span>"
            f"<span class='mcast'><i style='width:{100 * len(casts) / most_casts:.2f}%'>"
            f"</i></span><span class='mnum'>{len(casts)}</span></div>")
    head = ("<div class='mrow mhead'><span class='mlabel'>module</span><span class='mbar'>"
            "float ops by precision</span><span class='mnum'>ops</span><span class='mcast'>"
            "casts</span><span class='mnum'></span></div>")
    return (f"<div class='mchart' data-depth='{depth}'{'' if shown else ' hidden'}>"
            + head + "".join(rows) + "</div>")


def module_chart(rows: Sequence[dict[str, Any]], low: str) -> str:
    """The charts of ``rows`` (``explain_records`` node rows) at every depth, the depth
    slider and the legend. ``low`` names the low dtype (``"bf16"``)."""
    floats = [r for r in rows if r["float"]]
    deepest = max((_depth(r["module"]) for r in floats), default=0) or 1
    per_depth = {d: _groups(floats, d) for d in range(1, deepest + 1)}
    default = max((d for d, g in per_depth.items() if len(g) <= _MAX_ROWS), default=1)
    names = {"fp8": "fp8", "low": low, "fp32": "fp32", "passthrough": "passthrough"}
    present = {r["precision"] for r in floats}
    legend = "".join(f"<span><i class='p-{p}'></i>{names[p]}</span>" for p in PRECISIONS
                     if p in present or p != "fp8")
    folded = len(rows) - len(floats)
    slider = (f"<label>depth <input type='range' id='depth' min='1' max='{deepest}' "
              f"value='{default}'> <output id='depth-out'>{default}</output> of {deepest}"
              "</label>") if deepest > 1 else ""
    note = (f"{len(floats)} ops on floating tensors"
            + (f"; {folded} integer/bool/shape nodes left out" if folded else "")
            + ". Click a module to list its decisions.")
    return (f"<div class='mcontrols'>{slider}<span class='legend'>{legend}"
            "<span><i class='p-cast'></i>casts</span></span></div>"
            + "".join(_chart(g, d, d == default, names) for d, g in per_depth.items())
            + f"<p class='note'>{escape(note)}</p>")
