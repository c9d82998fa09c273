"""The parts of the HTML report below its charts, each a function from collected data to an
HTML fragment: the coloured code, the filter bar, and the decision and op tables (folded,
each row tagged with its module and category for the filter)."""

from __future__ import annotations

from html import escape
from typing import TYPE_CHECKING, Any, Sequence

from ..code_view import code_lines
from .bands import breakable, dtype_label
from .modules import TOP_LEVEL, module_prefixes

if TYPE_CHECKING:
    from ..audit.records import OpRecord

__all__ = ["code_section", "filter_bar", "decision_table", "op_table"]

_DTYPE_CLASS = {"bf16": "dt-low", "f16": "dt-low", "f32": "dt-f32", "f64": "dt-f64",
                "e4m3": "dt-fp8", "e5m2": "dt-fp8"}


def code_section(title: str, gm: Any) -> str:
    """``gm.code``, one block per line (long lines wrap, indented under their start), each
    coloured by the dtype it produces; casts carry class ``cast``."""
    rows = []
    for line in code_lines(gm):
        classes = ["ln", _DTYPE_CLASS.get(line.dtype or "", "dt-other" if line.dtype else
                                          "dt-none")]
        if line.cast:
            classes.append("cast")
        node = f" data-node='{escape(line.node)}'" if line.node else ""
        # The newline stays inside the line's block: copied code keeps its lines, and no
        # empty line is drawn between two blocks.
        rows.append(f"<span class='{' '.join(classes)}'{node}>{escape(line.text)}\n</span>")
    legend = ("<p class='legend'><span class='dt-low'>low precision</span> "
              "<span class='dt-f32'>fp32</span> <span class='dt-none'>not a float tensor"
              "</span> <span class='cast'>cast</span></p>")
    return (f"<section class='code'><h2>{escape(title)}</h2>{legend}<pre class='code'>"
            + "".join(rows) + "</pre></section>")


def filter_bar(modules: Sequence[str], categories: Sequence[str]) -> str:
    """Module (a module and everything under it), category and text filters, and whether
    plumbing rows show; the page's script applies them to every ``table.filterable``."""
    options = "".join(f"<option value='{escape(m or TOP_LEVEL)}'>{escape(m or TOP_LEVEL)}"
                      "</option>" for m in module_prefixes(modules))
    cats = "".join(f"<option>{escape(c)}</option>" for c in categories)
    return ("<div class='filters'><label>module <select id='f-module'><option value=''>all"
            f"</option>{options}</select></label><label>category <select id='f-category'>"
            f"<option value=''>all</option>{cats}</select></label><label>op or node "
            "<input id='f-text' type='search' size='14'></label><label><input "
            "id='f-plumbing' type='checkbox'> integer/bool/shape plumbing</label></div>")


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3g}"
    if isinstance(value, (list, tuple)):
        return ", ".join(map(str, value)) or "-"
    return "-" if value is None else str(value)


def _folded(title: str, note: str, header: Sequence[str], body: str, kind: str) -> str:
    """A table inside a closed ``<details>``: its columns sort on a click of their header.
    It scrolls inside its own box (wider than a narrow window, it leaves the page's width
    alone; taller than the window, its header stays in sight)."""
    head = "".join(f"<th>{escape(str(h))}</th>" for h in header)
    return (f"<details class='fold {kind}'><summary><h2>{escape(title)}</h2> "
            f"<span class='note'>{escape(note)}</span> <span class='count'></span></summary>"
            f"<div class='scroll tall'><table class='sortable filterable'><thead><tr>{head}"
            f"</tr></thead><tbody>\n{body}\n</tbody></table></div></details>")


_NAMES = frozenset({"node", "module", "casts"})
"""Columns of long names, which may wrap after a dot or an underscore (the tables fit the
window)."""


def _tr(header: Sequence[str], cells: Sequence[Any], module: str, category: str,
        classes: str = "", group: int | None = None) -> str:
    attrs = f" data-module='{escape(module)}' data-category='{escape(category)}'"
    if group is not None:
        attrs += f" data-group='{group}'"
    if classes:
        attrs += f" class='{classes}'"
    return f"<tr{attrs}>" + "".join(
        f"<td>{breakable(_cell(c)) if h in _NAMES else escape(_cell(c))}</td>"
        for h, c in zip(header, cells)) + "</tr>"


def decision_table(title: str, columns: Sequence[str], rows: Sequence[dict[str, Any]]) -> str:
    """Every decision, under one row per run of nodes of one module (as ``explain()``
    groups them); integer/bool/shape plumbing rows are there but hidden until asked for."""
    body, group = [], -1
    for i, row in enumerate(rows):
        if i == 0 or row["module"] != rows[i - 1]["module"]:
            group += 1
            folded = sum(not r["float"] for r in _run(rows, i))
            note = f" ({folded} integer/bool/shape node{'s' if folded != 1 else ''} folded)" \
                if folded else ""
            body.append(f"<tr class='group' data-group='{group}'><td colspan='{len(columns)}'>"
                        f"{escape(row['module'] or TOP_LEVEL)}<span class='note'>{note}"
                        "</span></td></tr>")
        body.append(_tr(columns, [row[c] for c in columns], row["module"], row["category"],
                        "" if row["float"] else "plumbing", group))
    floats = sum(r["float"] for r in rows)
    note = (f"{len(rows)} op nodes: {floats} on floating tensors, {len(rows) - floats} "
            "integer/bool/shape nodes folded")
    return _folded(title, note, columns, "\n".join(body), "decisions")


def _run(rows: Sequence[dict[str, Any]], start: int) -> list[dict[str, Any]]:
    """The rows from ``start`` on that share its module."""
    end = start
    while end < len(rows) and rows[end]["module"] == rows[start]["module"]:
        end += 1
    return list(rows[start:end])


def op_table(records: Sequence["OpRecord"], category_of: dict[str, str]) -> str:
    """Every audited op, forward and backward, with the category of the node it belongs to
    (backward ops: the forward node that created them; ``cast`` for a cast); rows of ops
    that produced inf/NaN (as the summary counts them: not a mask's ``-inf`` nor what an op
    was given) or went past fp16's max are marked."""
    header = ["#", "phase", "op", "node", "module", "category", "dtypes", "shape", "max|x|",
              "min|x|>0", "inf/NaN", ">65504", "<6.1e-5", "masks"]
    body = []
    for i, r in enumerate(records):
        category = "cast" if r.cast else category_of.get(r.node or "", "-")
        mark = "bad" if r.produced_nonfinite else "warn" if r.fp16_overflow else ""
        dtypes = ",".join(map(dtype_label, r.in_dtypes)) + " → " + dtype_label(r.out_dtype)
        cells = [i, r.phase, r.label, r.node, r.module if r.module is not None else "",
                 category, dtypes, "x".join(map(str, r.shape)), r.max_abs, r.min_nonzero_abs,
                 r.nonfinite, r.fp16_overflow, r.fp16_underflow, r.mask_values]
        body.append(_tr(header, cells, r.module or "", category, mark))
    bad = sum(1 for r in records if r.produced_nonfinite or r.fp16_overflow)
    note = f"{len(records)} ops, forward and backward" + (
        f"; {bad} that produced inf/NaN or went past fp16's max, marked" if bad else "")
    return _folded("every op (amprewrite.audit)", note, header, "\n".join(body), "ops")
