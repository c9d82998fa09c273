"""The parts of the HTML report, each a function from collected data to an HTML fragment."""

from __future__ import annotations

from html import escape
from typing import Any, Sequence

from ..code_view import code_lines

__all__ = ["code_section", "table_section", "histogram_section", "text_section"]

_DTYPE_CLASS = {"bf16": "dt-low", "f16": "dt-low", "f32": "dt-f32", "f64": "dt-f64"}


def text_section(title: str, lines: Sequence[str]) -> str:
    body = "\n".join(escape(line) for line in lines)
    return f"<section><h2>{escape(title)}</h2><pre class='summary'>{body}</pre></section>"


def code_section(title: str, gm: Any) -> str:
    """``gm.code``, each line coloured by the dtype it produces; casts carry class ``cast``."""
    rows = []
    for line in code_lines(gm):
        classes = [_DTYPE_CLASS.get(line.dtype or "", "dt-other" if line.dtype else "dt-none")]
        if line.cast:
            classes.append("cast")
        node = f" data-node='{escape(line.node)}'" if line.node else ""
        rows.append(f"<span class='{' '.join(classes)}'{node}>{escape(line.text)}</span>")
    legend = ("<p class='legend'><span class='dt-low'>low precision</span> "
              "<span class='dt-f32'>fp32</span> <span class='dt-none'>not a float tensor"
              "</span> <span class='cast'>cast</span></p>")
    return (f"<section><h2>{escape(title)}</h2>{legend}<pre class='code'>"
            + "\n".join(rows) + "</pre></section>")


def table_section(title: str, header: Sequence[str], rows: Sequence[Sequence[Any]],
                  note: str = "") -> str:
    """A table whose columns sort on a click of their header (the page's inline script)."""
    head = "".join(f"<th>{escape(str(h))}</th>" for h in header)
    body = "\n".join("<tr>" + "".join(f"<td>{escape(_cell(c))}</td>" for c in row) + "</tr>"
                     for row in rows)
    extra = f"<p>{escape(note)}</p>" if note else ""
    return (f"<section><h2>{escape(title)}</h2>{extra}<table class='sortable'><thead><tr>"
            f"{head}</tr></thead><tbody>\n{body}\n</tbody></table></section>")


def histogram_section(title: str, buckets: Sequence[tuple[str, int, str]],
                      note: str = "") -> str:
    """Horizontal CSS bars: (label, count, class) per bucket."""
    top = max((n for _, n, _ in buckets), default=0) or 1
    rows = "\n".join(
        f"<div class='bar-row'><span class='bar-label'>{escape(label)}</span>"
        f"<span class='bar {escape(kind)}' style='width:{max(1, round(300 * n / top))}px'>"
        f"</span><span class='bar-count'>{n}</span></div>" for label, n, kind in buckets)
    extra = f"<p>{escape(note)}</p>" if note else ""
    return f"<section><h2>{escape(title)}</h2>{extra}<div class='hist'>{rows}</div></section>"


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3g}"
    if isinstance(value, (list, tuple)):
        return ", ".join(map(str, value)) or "-"
    return "-" if value is None else str(value)
