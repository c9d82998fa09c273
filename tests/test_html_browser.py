"""The HTML report in a real browser: headless Chromium renders the demo's page (what
``python -m amprewrite demo --html report.html`` writes), a script measures its layout and
drives its controls, and the first screen is kept as a screenshot; in an 800 px window, the
page stays within the window's width and the range chart's inf/NaN marks clear of its text.

Skipped when no Chromium is installed (``apt-get install -y chromium``) or
``AMPREWRITE_CHROMIUM=skip``; ``AMPREWRITE_CHROMIUM=/path/to/chromium`` names the browser,
which must then run. With ``AMPREWRITE_SCREENSHOT=docs/html-report.png`` the screenshot test
also writes the picture that ``docs/auditing.md`` shows.
"""

from __future__ import annotations

import contextlib
import io
import os
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn as nn

import amprewrite
from _browser import BROWSER_ENV, chromium, measure, png_size, screenshot
from amprewrite.cli.main import main

ROOT = Path(__file__).resolve().parent.parent
DOCS_PICTURE = ROOT / "docs" / "html-report.png"
WINDOW = (1300, 900)
"""The first screen: a laptop's browser window."""
NARROW = (800, 900)
"""A window half a screen wide: the page must still fit its width."""

needs_browser = pytest.mark.skipif(
    chromium() is None,
    reason=f"no Chromium to render the page in (apt-get install -y chromium), or "
           f"{BROWSER_ENV}=skip")


@needs_browser
def test_demo_page(tmp_path: Path) -> None:
    """One test, one demo run (the page takes a converted Llama and an audited step; under
    pytest-xdist separate tests could each make it): layout, controls, screenshot."""
    path = tmp_path / "report.html"
    with contextlib.redirect_stdout(io.StringIO()):
        assert main(["demo", "--html", str(path)]) == 0
    page = path.read_text()
    _check_layout(page, tmp_path)
    _check_controls(page, tmp_path)
    _check_screenshot(page, tmp_path)
    _check_narrow(page, tmp_path)


_LAYOUT = """
var lineHeight = parseFloat(getComputedStyle(document.querySelector('pre.code')).lineHeight);
var lines = Array.from(document.querySelectorAll('pre.code .ln')).map(function (el) {
  var range = document.createRange(); range.selectNodeContents(el);
  var rows = new Set(Array.from(range.getClientRects()).map(function (r) {
    return Math.round(r.top); }));
  var box = el.getBoundingClientRect();
  return {top: box.top, height: box.height, rows: rows.size}; });
function box(sel) { var r = document.querySelector(sel).getBoundingClientRect();
  return {top: r.top, bottom: r.bottom, left: r.left, right: r.right, width: r.width,
          height: r.height}; }
var pre = document.querySelector('pre.code');
var chart = document.querySelector('.mchart:not([hidden])');
var out = {width: innerWidth, lineHeight: lineHeight, lines: lines,
  preOverflow: pre.scrollWidth - pre.clientWidth,
  chart: box('.mchart:not([hidden])'),
  chartRows: chart.querySelectorAll('.mrow[data-module]').length,
  summary: box('#summary table.facts'), risks: box('#modules table.risk'),
  svg: box('svg.ranges'), open: document.querySelectorAll('details[open]').length,
  pageWidth: document.documentElement.scrollWidth};
document.querySelectorAll('details').forEach(function (d) { d.open = true; });
document.getElementById('f-plumbing').click();
out.pageWidthOpen = document.documentElement.scrollWidth;
return out;
"""


def _check_layout(page: str, tmp_path: Path) -> None:
    m = measure(page, _LAYOUT, tmp_path, WINDOW)
    assert m["width"] == WINDOW[0]
    # single-spaced code: no line taller than its own rows of text (a long line wraps, and
    # is as many rows tall as it wraps to), and no line runs off to the right
    assert m["lineHeight"] > 10
    for line, below in zip(m["lines"], m["lines"][1:] + [None]):
        assert line["height"] == pytest.approx(line["rows"] * m["lineHeight"], abs=0.5), line
        if below is not None:  # and no empty line between two lines
            assert below["top"] == pytest.approx(line["top"] + line["height"], abs=0.5), line
    assert sum(line["rows"] == 1 for line in m["lines"]) > 100
    # gm.code keeps every line within 100 characters: none wraps at this width
    assert max(line["rows"] for line in m["lines"]) == 1
    assert m["preOverflow"] <= 0
    # the first screen holds the module chart and the summary, side by side, whole
    for part in ("chart", "summary", "risks"):
        assert 0 < m[part]["top"] and m[part]["bottom"] <= WINDOW[1], (part, m[part])
        assert m[part]["right"] <= WINDOW[0], (part, m[part])
    assert m["chart"]["right"] < m["summary"]["left"]
    assert m["chartRows"] >= 5
    assert m["svg"]["width"] > 1000 and m["svg"]["height"] > 250  # the SVG renders
    # tables folded; open, they fit the window's width as the rest of the page does
    assert m["open"] == 0
    assert m["pageWidth"] <= WINDOW[0] and m["pageWidthOpen"] <= WINDOW[0]


_CONTROLS = """
function visible(sel) { return Array.from(document.querySelectorAll(sel)).filter(function (e) {
  return e.getClientRects().length > 0; }); }
function rows(kind) { return visible('details.' + kind + ' tbody tr:not(.group)').map(
  function (tr) { return [tr.dataset.module, tr.dataset.category,
                          tr.classList.contains('plumbing')]; }); }
document.querySelectorAll('details').forEach(function (d) { d.open = true; });
var out = {start: {decisions: rows('decisions'), ops: rows('ops')}};
var slider = document.getElementById('depth');
out.depths = [];
for (var d = 1; d <= +slider.max; d++) {
  slider.value = String(d); slider.dispatchEvent(new Event('input'));
  out.depths.push(visible('.mchart .mrow[data-module]').map(function (r) {
    return r.dataset.module; }));
}
var target = document.querySelector('.mchart .mrow[data-module="model.model.layers.0.self_attn"]');
document.querySelectorAll('details').forEach(function (d) { d.open = false; });
target.click();
out.module = document.getElementById('f-module').value;
out.opened = Array.from(document.querySelectorAll('details[open]')).map(function (d) {
  return d.className; });
document.querySelectorAll('details').forEach(function (d) { d.open = true; });
out.clicked = {decisions: rows('decisions'), ops: rows('ops')};
var plumbing = document.getElementById('f-plumbing'); plumbing.click();
out.plumbing = rows('decisions');
var category = document.getElementById('f-category');
category.value = 'lower'; category.dispatchEvent(new Event('input'));
out.lower = rows('decisions');
out.groups = visible('details.decisions tr.group').map(function (g) { return g.textContent; });
document.querySelector('details.decisions th:nth-child(3)').click();  // sort by op
out.sorted = visible('details.decisions tbody tr').map(function (tr) {
  return tr.cells[2].textContent; });
return out;
"""


def _under(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def _check_controls(page: str, tmp_path: Path) -> None:
    m = measure(page, _CONTROLS, tmp_path, WINDOW)
    start = m["start"]
    assert start["decisions"] and not any(p for _, _, p in start["decisions"])  # plumbing folded
    assert len(start["ops"]) > 150
    # the slider: at depth d, one row per module name cut after d parts
    modules = [mod for mod, _, plumbing in start["decisions"]]
    for depth, shown in enumerate(m["depths"], start=1):
        expected = list(dict.fromkeys(".".join(mod.split(".")[:depth]) for mod in modules))
        assert shown == expected, depth
    # a click on a module's bar filters both tables to it and what runs inside it
    attn = "model.model.layers.0.self_attn"
    assert m["module"] == attn and m["opened"] == ["fold decisions"]
    assert m["clicked"]["decisions"] == [r for r in start["decisions"] if _under(r[0], attn)]
    assert m["clicked"]["ops"] == [r for r in start["ops"] if _under(r[0], attn)]
    assert len(m["clicked"]["decisions"]) < len(start["decisions"])
    plumbing = [r for r in m["plumbing"] if r[2]]
    assert plumbing and all(_under(r[0], attn) for r in m["plumbing"])
    assert m["lower"] == [r for r in m["plumbing"] if r[1] == "lower"] and m["lower"]
    assert m["groups"] and all(g.startswith(attn) for g in m["groups"])
    # sorted: the kept rows in op order, group rows out of the way
    assert m["sorted"] == sorted(m["sorted"]) and len(m["sorted"]) == len(m["lower"])


def _check_screenshot(page: str, tmp_path: Path) -> None:
    png = screenshot(page, tmp_path / "first-screen.png", tmp_path, WINDOW)
    assert png_size(png) == WINDOW
    assert png.stat().st_size > 50_000  # a page of text and bars, not a blank window
    target = os.environ.get("AMPREWRITE_SCREENSHOT")
    if target:
        shutil.copyfile(png, ROOT / target)


def test_docs_show_the_screenshot() -> None:
    assert png_size(DOCS_PICTURE) == WINDOW
    assert f"]({DOCS_PICTURE.name})" in (ROOT / "docs" / "auditing.md").read_text()


_NARROW = """
function box(e) { var r = e.getBoundingClientRect();
  return {top: r.top, bottom: r.bottom, left: r.left, right: r.right}; }
function hit(a, b) { return Math.min(a.right, b.right) - Math.max(a.left, b.left) > 0.5
                       && Math.min(a.bottom, b.bottom) - Math.max(a.top, b.top) > 0.5; }
var out = {width: innerWidth, closed: document.documentElement.scrollWidth};
document.querySelectorAll('details').forEach(function (d) { d.open = true; });
document.getElementById('f-plumbing').click();
out.open = document.documentElement.scrollWidth;
out.body = document.body.scrollWidth;
// the widest table scrolls inside its box instead of widening the page
out.scrolls = Array.from(document.querySelectorAll('.scroll')).map(function (d) {
  return {inner: d.scrollWidth, outer: d.clientWidth, right: box(d).right}; });
var svg = document.querySelector('svg.ranges');
out.svg = box(svg);
var texts = Array.from(svg.querySelectorAll('text')).map(function (t) {
  return {text: t.textContent, box: box(t)}; });
var marks = Array.from(svg.querySelectorAll('path.nonfinite, path.carried')).map(function (p) {
  return {cls: p.getAttribute('class'), box: box(p)}; });
var bands = Array.from(svg.querySelectorAll('rect.band-n')).map(box);
out.marks = marks.length;
out.red = svg.querySelectorAll('path.nonfinite').length;
out.plotTop = Math.min.apply(null, bands.map(function (b) { return b.top; }));
out.plotBottom = Math.max.apply(null, bands.map(function (b) { return b.bottom; }));
out.markBoxes = marks.map(function (m) { return m.box; });
out.markOverText = [];
marks.forEach(function (m) { texts.forEach(function (t) {
  if (hit(m.box, t.box)) out.markOverText.push([m.cls, t.text]); }); });
out.textOverText = [];
texts.forEach(function (a, i) { texts.slice(i + 1).forEach(function (b) {
  if (hit(a.box, b.box)) out.textOverText.push([a.text, b.text]); }); });
return out;
"""


def _check_narrow(page: str, tmp_path: Path, marks: bool = False) -> dict:
    """In an 800 px window: no horizontal scroll of the page (its folded tables open, the
    plumbing rows shown), the chart within the window, no mark over a label and no label
    over another; and a screenshot of the first screen at that width."""
    m = measure(page, _NARROW, tmp_path, NARROW)
    assert m["width"] == NARROW[0]
    assert m["closed"] <= NARROW[0] and m["open"] <= NARROW[0] and m["body"] <= NARROW[0], m
    assert any(s["inner"] > s["outer"] for s in m["scrolls"])  # the op table scrolls
    assert all(s["right"] <= NARROW[0] for s in m["scrolls"])
    assert 0 < m["svg"]["left"] and m["svg"]["right"] <= NARROW[0]
    assert m["markOverText"] == [] and m["textOverText"] == []
    for mark in m["markBoxes"]:  # inside the plot, below the panel titles
        assert m["plotTop"] - 0.5 <= mark["top"] and mark["bottom"] <= m["plotBottom"], mark
    if marks:
        assert m["marks"] > 0
    png = screenshot(page, tmp_path / "narrow.png", tmp_path, NARROW)
    assert png_size(png) == NARROW and png.stat().st_size > 30_000
    return m


class _MaskedOverflow(nn.Module):
    """An attention mask's -inf, written on purpose and passed on (grey marks), and an exp
    that overflows (a red mark), in a bf16 run (the fp16 loss scale is a what-if)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.q = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[1]
        scores = (self.q(x) @ x.transpose(-1, -2)).float()
        scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        return scores.softmax(-1) @ x + (self.q(x).float() * 1e3).exp()


@needs_browser
def test_marks_clear_of_text_in_a_narrow_window(tmp_path: Path) -> None:
    x = torch.randn(2, 6, 16, requires_grad=True)
    gm = amprewrite.convert(_MaskedOverflow(), (x,), dtype=torch.bfloat16)
    with amprewrite.audit() as report:
        gm(x).float().sum().backward()
    assert report.first_nonfinite is not None and report.first_nonfinite.op == "exp"
    page = amprewrite.html_report(gm, report)
    m = _check_narrow(page, tmp_path, marks=True)
    # red only where the summary says inf/NaN was produced; grey for the mask's -inf
    assert m["red"] == sum(1 for r in report.records if r.produced_nonfinite and
                           (r.max_abs is not None or r.nonfinite))
    assert m["marks"] == sum(1 for r in report.records if r.nonfinite)
