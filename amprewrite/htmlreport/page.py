"""The page: :func:`html_report` assembles the sections with inline CSS and a few lines of
inline JavaScript (sortable tables). Everything is in the one file: no network, no link, no
external script or stylesheet."""

from __future__ import annotations

from html import escape
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

from ..explain import converted_graphs, explain_records
from ..summary import graph_facts, summary_lines
from .sections import code_section, histogram_section, table_section, text_section

if TYPE_CHECKING:
    from ..audit.report import AuditReport

__all__ = ["html_report"]

_CSS = """
body{font:14px/1.4 system-ui,sans-serif;margin:1.5em;color:#222}
pre{font:12px/1.35 ui-monospace,monospace;background:#fafafa;padding:.6em;overflow-x:auto}
pre.code span{display:block;white-space:pre}
.dt-low{color:#0a58ca}.dt-f32{color:#a35200}.dt-f64{color:#7a1fa2}.dt-none,.dt-other{color:#777}
.cast{background:#fff1a8;font-weight:bold}
table{border-collapse:collapse;font-size:12px}th,td{border:1px solid #ddd;padding:2px 6px}
th{background:#eee;cursor:pointer;position:sticky;top:0}
.bar-row{display:flex;align-items:center;font:12px ui-monospace,monospace}
.bar-label{width:6em;text-align:right;margin-right:.5em}.bar{height:12px;margin-right:.5em}
.normal{background:#4a90d9}.subnormal{background:#e0a030}.flush{background:#c0392b}
.overflow{background:#c0392b}
"""

_JS = """
document.querySelectorAll('table.sortable th').forEach(function (th, col) {
  th.addEventListener('click', function () {
    var body = th.closest('table').tBodies[0], up = th.dataset.dir !== 'up';
    th.dataset.dir = up ? 'up' : 'down';
    var key = function (tr) { var t = tr.cells[th.cellIndex].textContent, n = parseFloat(t);
                              return isNaN(n) ? t : n; };
    Array.from(body.rows).sort(function (a, b) {
      var x = key(a), y = key(b), c = (typeof x === typeof y) ? (x < y ? -1 : x > y ? 1 : 0)
              : (typeof x === 'number' ? -1 : 1);
      return up ? c : -c; }).forEach(function (tr) { body.appendChild(tr); });
  });
});
"""

_DECISION_COLUMNS = ("node", "module", "op", "category", "dtype", "out", "rule", "casts")


def html_report(target: Any, audit_report: "AuditReport | None" = None, *,
                path: str | Path | None = None, notes: Sequence[str] = ()) -> str:
    """One self-contained HTML page: the summary, ``gm.code`` coloured by dtype with casts
    highlighted, the decisions of every node (sortable columns), and, given an
    :class:`~amprewrite.AuditReport`, its tables and gradient histogram.

    ``target`` is what :func:`amprewrite.explain` takes. ``notes`` are extra summary lines
    (the CLI adds its measurements). Returns the HTML; with ``path``, also writes it there.
    """
    graphs = converted_graphs(target)
    sections = []
    lines = list(notes) or [line for _, gm in graphs for line in summary_lines(graph_facts(gm))]
    sections.append(text_section("summary", lines))
    for (title, gm), rec in zip(graphs, explain_records(target)):
        suffix = f" ({title})" if title else ""
        sections.append(code_section(f"rewritten graph{suffix}", gm))
        columns = _DECISION_COLUMNS + (("mode",) if "modes" in rec else ())
        sections.append(table_section(
            f"decisions{suffix}", columns, [[r[c] for c in columns] for r in rec["nodes"]],
            "click a column header to sort"))
    if audit_report is not None:
        sections += _audit_sections(audit_report)
    page = ("<!DOCTYPE html>\n<html lang='en'><head><meta charset='utf-8'>"
            "<title>amprewrite report</title><style>" + _CSS + "</style></head><body>"
            "<h1>amprewrite report</h1>\n" + "\n".join(sections)
            + "<script>" + _JS + "</script></body></html>\n")
    if path is not None:
        Path(path).write_text(page, encoding="utf-8")
    return page


def _audit_sections(report: "AuditReport") -> list[str]:
    from ..audit.tables import risk_rows

    s = report.summary()
    out = [text_section("one training step (amprewrite.audit)", [
        f"{s['ops']} ops, {s['casts']['count']} casts ({s['casts']['bytes']} bytes)",
        *(f"{phase}: " + ", ".join(f"{n} {d}" for d, n in per.items())
          for phase, per in s["ops_per_dtype"].items())])]
    risk = risk_rows(report)
    if risk:
        out.append(table_section("fp16 overflow risk (real risk first; masks apart)",
                                 ["#", "phase", "op", "node/module", "dtype",
                                  "max finite |x|", "fp16 headroom"], risk))
    header = ["#", "phase", "op", "node", "module", "in", "out", "shape", "max|x|",
              "min|x|>0", "nonfinite", ">f16max", "<f16tiny", "mask values"]
    rows = [[i, r.phase, r.label, r.node, r.module, ",".join(r.in_dtypes), r.out_dtype,
             "x".join(map(str, r.shape)), r.max_abs, r.min_nonzero_abs, r.nonfinite,
             r.fp16_overflow, r.fp16_underflow, r.mask_values]
            for i, r in enumerate(report.records)]
    out.append(table_section("every op", header, rows))
    hist = report.grad_histogram
    if hist is not None:
        kinds = {"normal": "normal", "subnormal": "subnormal", "flush to 0": "flush",
                 "overflow": "overflow"}
        out.append(histogram_section(
            "gradient magnitudes (backward op outputs)",
            [(b, c, kinds[fate]) for b, c, _, fate in hist.rows()],
            f"max |grad| {hist.max_abs}; recommended static loss scale "
            f"{hist.recommended_loss_scale}"))
    return out
