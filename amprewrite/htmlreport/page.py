"""The page: :func:`html_report` assembles the sections with the inline style sheet and script
of :mod:`.assets`. Everything is in the one file: no network, no link, no external script or
stylesheet.

First screen: precision per module (:mod:`.modules`) beside the summary and the ops closest
to fp16 overflow (:mod:`.overview`). Then, with an audit, the range of every op against the
low dtype's (:mod:`.ranges`); then the decision and op tables, folded, under one filter, and
the coloured code (:mod:`.sections`).
"""

from __future__ import annotations

from html import escape
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

import torch

from ..module.modes import mode_name
from ..explain import converted_graphs, explain_records
from ..summary import policy_of
from .assets import CSS, JS
from .bands import band_of, number
from .modules import module_chart
from .overview import risk_table, summary_table
from .ranges import out_of_band, range_chart
from .sections import code_section, decision_table, filter_bar, op_table

if TYPE_CHECKING:
    from ..audit.report import AuditReport

__all__ = ["html_report"]

_DECISION_COLUMNS = ("node", "module", "op", "category", "dtype", "out", "rule", "casts")


def html_report(target: Any, audit_report: "AuditReport | None" = None, *,
                path: str | Path | None = None, notes: Sequence[str] = (),
                casts: dict[str, int] | None = None,
                vs_autocast: dict[str, Any] | None = None) -> str:
    """One self-contained HTML page of a converted model.

    First screen: a bar per module (its float ops by precision, and its casts; a slider
    sets how deep module names are collapsed) beside the summary (ops, casts, and, when
    measured, speed and memory against ``torch.autocast`` in words) and, given an
    :class:`~amprewrite.AuditReport`, the ops closest to fp16 overflow. With the audit,
    next: every op's |x| range (forward and backward) on a log axis against the low dtype's
    range, and the gradient histogram on the same axis. Then the decision and op tables,
    folded, with a filter by module and category (integer/bool/shape plumbing folded as
    :func:`amprewrite.explain` folds it), and ``gm.code`` coloured by dtype with the casts
    highlighted.

    ``target`` is what :func:`amprewrite.explain` takes. ``casts`` (from
    :func:`amprewrite.summary.count_forward_casts`) adds the cast kernels of one forward
    against ``torch.autocast``'s; ``vs_autocast`` the forward time, training-step memory
    and error of both (``{"forward_ms": {"converted": ms, "autocast": ms},
    "forward_rounds": [[converted ms, autocast ms], ...], "step_bytes": {...},
    "max_abs_error": {...}}``, as ``python -m amprewrite demo`` measures them; the speed is
    judged over the rounds, with their spread, and without rounds not judged at all);
    ``notes`` are extra lines under the summary. Returns the HTML; with ``path``, also
    writes it there.
    """
    graphs = converted_graphs(target)
    records = explain_records(target)
    low = policy_of(graphs[0][1])[1]  # type: ignore[index]  # converted_graphs checked it
    rows = [r for (_, gm), rec in zip(graphs, records) for r in _current_rows(gm, rec)]
    low_name = band_of(low).name
    summary = summary_table([rec["facts"] for rec in records], low_name, casts, vs_autocast,
                            audit_report)
    summary += "".join(f"<p class='note'>{escape(line)}</p>" for line in notes)
    risks = risk_table(audit_report, low_name) if audit_report is not None else ""
    body = ["<div class='first'><section id='modules'><h2>precision per module</h2>"
            f"{module_chart(rows, low_name)}{risks}</section>"
            f"<section id='summary'><h2>summary</h2>{summary}</section></div>"]
    fp8_modules = {r["module"] for r in rows if r["precision"] == "fp8"}
    if audit_report is not None and audit_report.records:
        body.append(_range_section(audit_report, low, fp8_modules))
    body.append(_tables(records, rows, audit_report))
    body += [code_section(f"rewritten graph ({title})" if title else "rewritten graph", gm)
             for title, gm in graphs]
    model = escape(records[0]["facts"]["model"])
    page = ("<!DOCTYPE html>\n<html lang='en'><head><meta charset='utf-8'>"
            f"<title>amprewrite report: {model}</title><style>{CSS}</style></head><body>"
            f"<header><h1>amprewrite report</h1><span>{model}</span></header><main>\n"
            + "\n".join(body) + f"</main><script>{JS}</script></body></html>\n")
    if path is not None:
        Path(path).write_text(page, encoding="utf-8")
    return page


def _current_rows(gm: Any, rec: dict[str, Any]) -> list[dict[str, Any]]:
    """The rows of the graph a call runs now (a module with train and eval graphs has the
    rows of both in its record, each marked with its mode)."""
    if "modes" not in rec:
        return rec["nodes"]
    return [r for r in rec["nodes"] if r["mode"] in ("both", mode_name(gm.training))]


def _range_section(report: "AuditReport", low: torch.dtype, fp8_modules: set[str]) -> str:
    band = band_of(low)
    fp8 = "; behind fp8 layers, e4m3's (forward) and e5m2's (backward)" if fp8_modules else ""
    ref = "" if band.name == "fp16" else "; dotted: fp16's edges"
    caption = (f"Band: {band.name}'s range, dark where its values are normal (from "
               f"{number(band.normal)} to {number(band.max)}), light where subnormal (down to "
               f"{number(band.smallest)}){fp8}{ref}. Lines: the dtype an op produced, blue "
               "low precision, orange fp32, grey other. Marks at the top: red, an op that "
               "produced inf/NaN from finite values (what the summary counts); grey, an op "
               "that only carried them (a mask's -inf, written on purpose, and what it flows "
               "through). Hover a line for its op.")
    found = out_of_band(report.records, low, fp8_modules)
    if band.name != "fp16":
        found += " Against fp16: " + out_of_band(report.records, torch.float16, fp8_modules)
    return (f"<section id='ranges'><h2>range against the format: every op's |x| and "
            f"{band.name}'s range</h2><p class='note'>{escape(caption)}</p>"
            f"{range_chart(report.records, low, fp8_modules, report.grad_histogram)}"
            f"<p>{escape(found)}</p></section>")


def _tables(records: list[dict[str, Any]], rows: list[dict[str, Any]],
            report: "AuditReport | None") -> str:
    modules = [r["module"] for r in rows] + [
        r.module for r in (report.records if report is not None else ()) if r.module]
    categories = sorted({r["category"] for r in rows}
                        | ({"cast"} if report is not None and any(r.cast for r in report.records)
                           else set()))
    parts = ["<section id='tables'>", filter_bar(modules, categories)]
    for rec in records:
        columns = _DECISION_COLUMNS + (("mode",) if "modes" in rec else ())
        title = f"decisions ({rec['graph']})" if rec["graph"] else "decisions"
        parts.append(decision_table(title, columns, rec["nodes"]))
    if report is not None:
        category_of = {r["node"]: r["category"] for r in rows}
        parts.append(op_table(report.records, category_of))
    return "".join(parts) + "</section>"
