"""amprewrite.html_report: one self-contained page, checked with the stdlib HTML parser (the
layout and the script run in a real browser in test_html_browser.py)."""

from __future__ import annotations

import math
import re
from collections import Counter
from html.parser import HTMLParser
from typing import Any, Iterator

import pytest
import torch
import torch.nn as nn

import amprewrite
from amprewrite.audit.records import OpRecord
from amprewrite.code_view import code_lines
from amprewrite.explain import explain_records
from amprewrite.htmlreport.overview import memory_words, speed_words
from amprewrite.htmlreport.ranges import range_chart
from amprewrite.summary import graph_facts

_VOID = {"meta", "input", "wbr", "br", "img", "hr"}


class Element:
    def __init__(self, tag: str, attrs: dict[str, str | None], parent: "Element | None"):
        self.tag, self.attrs, self.parent = tag, attrs, parent
        self.children: list[Element] = []
        self.parts: list[str] = []

    @property
    def classes(self) -> list[str]:
        return (self.attrs.get("class") or "").split()

    @property
    def text(self) -> str:
        return "".join(self.parts)

    def iter(self, tag: str | None = None, cls: str | None = None) -> Iterator["Element"]:
        for child in self.children:
            if (tag is None or child.tag == tag) and (cls is None or cls in child.classes):
                yield child
            yield from child.iter(tag, cls)

    def find(self, tag: str | None = None, cls: str | None = None) -> "Element":
        return next(self.iter(tag, cls))


class Page(HTMLParser):
    """The page as a tree of elements; ``text`` of an element includes its descendants'."""

    def __init__(self, page: str) -> None:
        super().__init__()
        self.root = self._open = Element("#root", {}, None)
        self.feed(page)

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        element = Element(tag, dict(attrs), self._open)
        self._open.children.append(element)
        if tag not in _VOID:
            self._open = element

    def handle_startendtag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self._open.children.append(Element(tag, dict(attrs), self._open))

    def handle_endtag(self, tag: str) -> None:
        element = self._open
        while element.tag != tag and element.parent is not None:
            element = element.parent
        if element.parent is not None:
            self._open = element.parent

    def handle_data(self, data: str) -> None:
        element: Element | None = self._open
        while element is not None:
            element.parts.append(data)
            element = element.parent


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.q = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mask = torch.ones(x.shape[1], x.shape[1], dtype=torch.bool).triu(1)
        q = self.q(x)
        scores = (q @ q.transpose(-1, -2)).float().masked_fill(mask, torch.finfo(torch.float32).min)
        return scores.softmax(-1) @ x


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x).softmax(-1) * x


def _page(report: bool, **kwargs: Any) -> tuple[torch.fx.GraphModule, Any, str, Page]:
    x = torch.randn(2, 4, 8, requires_grad=True)
    gm = amprewrite.convert(Attention(), (x,))
    audit_report = None
    if report:
        with amprewrite.audit() as audit_report:
            gm(x).sum().backward()
    page = amprewrite.html_report(gm, audit_report=audit_report, **kwargs)
    return gm, audit_report, page, Page(page)


def _blocks(dtype: torch.dtype) -> tuple[torch.fx.GraphModule, Any, str, Page]:
    torch.manual_seed(0)
    x = torch.randn(4, 8, requires_grad=True)
    gm = amprewrite.convert(nn.Sequential(Block(), Block()), (x,), dtype=dtype)
    with amprewrite.audit() as report:
        gm(x).float().sum().backward()
    page = amprewrite.html_report(gm, report)
    return gm, report, page, Page(page)


def test_every_node_and_every_cast_line(tmp_path) -> None:
    gm, _, page, parsed = _page(report=True)
    text = parsed.root.text
    for node in gm.graph.nodes:
        if node.op not in ("placeholder", "output"):
            assert node.name in text, node.name
    code = parsed.root.find("pre", "code")
    spans = list(code.iter("span", "ln"))
    lines = code_lines(gm)
    # one block per line of gm.code, its newline inside (copied code keeps its lines)
    assert [s.text for s in spans] == [line.text + "\n" for line in lines]
    assert code.text == "".join(line.text + "\n" for line in lines)
    casts = [line.text for line in lines if line.cast]
    assert casts
    assert [s.text.rstrip("\n") for s in spans if "cast" in s.classes] == casts
    assert "dt-low" in page and "dt-f32" in page
    for title in ("precision per module", "summary", "decisions", "every op (amprewrite.audit)",
                  "range against the format"):
        assert any(h.text.startswith(title) for h in parsed.root.iter("h2")), title
    assert "closest to fp16 overflow" in parsed.root.find("section").text
    for details in parsed.root.iter("details", "fold"):  # folded by default
        assert "open" not in details.attrs
    assert "<table class='sortable filterable'>" in page and "addEventListener('click'" in page
    path = tmp_path / "r.html"
    assert amprewrite.html_report(gm, path=path) == path.read_text()


def test_no_external_resource() -> None:
    gm, _, page, parsed = _page(report=True)
    for element in parsed.root.iter():
        assert element.tag != "link", element.attrs
        for key in ("src", "href", "xlink:href"):
            assert key not in element.attrs, (element.tag, element.attrs)
    assert "http://" not in page and "https://" not in page and "url(" not in page
    assert "@import" not in page
    facts = {tr.find("th").text: tr.find("td").text for tr in parsed.root.find(
        "table", "facts").iter("tr")}
    ops = graph_facts(gm)["ops"]
    assert facts["model"] == "Attention" and facts["ops"] == (
        f"{ops['low']} bf16 · {ops['fp32']} fp32 · {ops['passthrough']} passthrough")


def test_summary_in_words() -> None:
    # above 1 = faster, as in every table: a converted forward of 11.74 ms against
    # autocast's 9.11 ms is slower
    assert speed_words(11.74, 9.11) == "1.29x slower than"
    assert speed_words(9.11, 11.74) == "1.29x faster than"
    assert speed_words(10.0, 13.0) == "1.3x faster than"
    assert speed_words(10.0, 10.05) == "as fast as"
    # the page judges as the demo's line does (2% apart: as fast, in both)
    from amprewrite.cli.measure import speed_words as line_words
    assert speed_words(10.0, 10.2) == "as fast as"
    assert line_words(10.2 / 10.0) == "1.02x, as fast as torch.autocast"
    assert memory_words(179, 183) == "2% less memory than"
    assert memory_words(110, 100) == "10% more memory than"
    assert memory_words(1000, 1001) == "the same memory as"
    # five rounds whose middle half (0.76x-0.84x of autocast's speed) is slower throughout
    measured = {"forward_ms": {"converted": 11.74, "autocast": 9.11},
                "forward_rounds": [[11.74, 9.11], [11.0, 9.2], [12.5, 9.0], [11.2, 9.4],
                                   [12.0, 9.1]],
                "step_bytes": {"converted": 179 * 1024, "autocast": 183 * 1024},
                "max_abs_error": {"converted": 1.5e-3, "autocast": 2.5e-3}}
    _, _, _, parsed = _page(report=False, casts={"converted": 15, "autocast": 18},
                         vs_autocast=measured, notes=("measured on a busy machine",))
    rows = {tr.find("th").text: tr.find("td") for tr in parsed.root.find("table", "facts")
            .iter("tr")}
    assert rows["speed"].text == ("1.29x slower than torch.autocast (0.76x-0.84x its speed, "
                                  "middle half of 5 rounds; forward 11.74 ms vs 9.11 ms)")
    assert rows["speed"].find("b").classes == ["bad"]
    assert rows["memory"].text == ("2% less memory than torch.autocast (training step "
                                   "179 KiB vs 183 KiB)")
    assert rows["memory"].find("b").classes == ["good"]
    assert rows["casts per forward"].text == ("3 fewer than torch.autocast (15 cast kernels "
                                              "vs 18)")
    assert rows["error"].text == "max |output − fp32 output| 0.0015 (torch.autocast 0.0025)"
    notes = [p.text for p in _section(parsed, "summary").iter("p", "note")]
    assert notes == ["measured on a busy machine"]


def _bars(parsed: Page) -> dict[int, dict[str, dict[str, float]]]:
    """depth -> module -> {precision: width %} of the module charts."""
    out: dict[int, dict[str, dict[str, float]]] = {}
    for chart in parsed.root.iter("div", "mchart"):
        rows = out.setdefault(int(chart.attrs["data-depth"]), {})
        for row in chart.iter("div", "mrow"):
            if "data-module" in row.attrs:
                rows[row.attrs["data-module"]] = {
                    seg.classes[0][2:]: float(re.search(r"width:([\d.]+)%", seg.attrs["style"])[1])
                    for seg in row.find("span", "mbar").iter("i")}
    return out


def test_module_bars_per_depth() -> None:
    gm, _, page, parsed = _blocks(torch.float16)
    rows = [r for r in explain_records(gm)[0]["nodes"] if r["float"]]
    bars = _bars(parsed)
    assert sorted(bars) == [1, 2]  # "0" and "1", then "0.lin", "0", "1.lin", "1"
    for depth, modules in bars.items():
        expected: dict[str, Counter] = {}
        for r in rows:
            key = ".".join(r["module"].split(".")[:depth])
            expected.setdefault(key, Counter())[r["precision"]] += 1
        assert list(modules) == list(expected)  # first appearance first
        widest = max(sum(c.values()) for c in expected.values())
        for module, counts in expected.items():
            assert modules[module] == pytest.approx(
                {p: 100 * n / widest for p, n in counts.items()}, abs=0.01), module
    assert bars[1]["0"].keys() == {"low", "fp32", "passthrough"}
    # the deepest depth with at most 12 rows shows; the others wait for the slider
    shown = [c.attrs["data-depth"] for c in parsed.root.iter("div", "mchart")
             if "hidden" not in c.attrs]
    assert shown == ["2"]
    assert "<input type='range' id='depth' min='1' max='2' value='2'>" in page
    row = next(r for r in parsed.root.iter("div", "mrow") if r.attrs.get("data-module") == "0.lin")
    assert row.attrs["title"] == "0.lin: 1 fp16; 3 cast nodes feed them"


class _Svg:
    """The range chart's geometry, read back: the log axis from two of its tick labels."""

    def __init__(self, parsed: Page) -> None:
        self.svg = parsed.root.find("svg", "ranges")
        ticks = [(math.log10(float(t.text)), float(t.attrs["y"]) - 3.5)
                 for t in self.svg.iter("text", "tick")]
        (self.a, self.ya), (b, yb) = ticks[0], ticks[-1]
        self.slope = (yb - self.ya) / (b - self.a)

    def y(self, value: float) -> float:
        return self.ya + (math.log10(value) - self.a) * self.slope


def _section(parsed: Page, id_: str) -> Element:
    return next(s for s in parsed.root.iter("section") if s.attrs.get("id") == id_)


def test_range_chart_lines_and_band() -> None:
    _, report, page, parsed = _blocks(torch.float16)
    svg = _Svg(parsed)
    lines = [ln for g in svg.svg.iter("g", "ops") for ln in g.iter("line")]
    drawn = [r for r in report.records if r.max_abs is not None]
    assert len(lines) == len(drawn)
    ranged = 0
    for ln, r in zip(lines, drawn):
        assert ln.find("title").text.startswith(f"#{report.records.index(r)} {r.phase} "
                                                f"{r.label} in ")
        kind = {"float16": "low", "float32": "f32"}.get(r.out_dtype, "other")
        assert ln.classes == [kind]
        top, bottom = float(ln.attrs["y1"]), float(ln.attrs["y2"])
        if bottom - top > 3.01:  # single values are drawn 3 px tall
            assert top == pytest.approx(svg.y(r.max_abs), abs=0.11)
            assert bottom == pytest.approx(svg.y(min(r.min_nonzero_abs, r.max_abs)), abs=0.11)
            ranged += 1
    assert ranged > len(drawn) // 2
    # fp16's band: normal from 6.1e-5 to 65504, subnormal down to 6e-8, named on the right
    names = [t.text for t in svg.svg.iter("text", "edge")]
    assert names == ["fp16 max 65504", "fp16 normal ≥ 6.1e-5", "fp16 subnormal ≥ 6e-8"]
    normal = [r for r in svg.svg.iter("rect", "band-n") if "x" in r.attrs]
    assert normal and all(float(r.attrs["y"]) == pytest.approx(svg.y(65504), abs=0.11)
                          for r in normal)
    # the gradient histogram on the same axis, each bucket coloured by its fate in fp16
    hist = report.grad_histogram
    bars = {b.find("title").text.split(" to ")[0]: b for b in svg.svg.iter("rect") if b.children}
    fates = {"normal": "h-normal", "subnormal": "h-subnormal", "flush to 0": "h-flush",
             "overflow": "h-overflow"}
    assert len(bars) == len(hist.counts)
    for bucket, n, _, fate in hist.rows():
        bar = bars[bucket]
        assert bar.classes == [fates[fate]]
        assert float(bar.attrs["y"]) == pytest.approx(svg.y(2.0 ** (int(bucket[2:]) + 1)),
                                                      abs=0.11)
        assert f": {n} values (" in bar.find("title").text
    caption = _section(parsed, "ranges").find("p", "note").text
    assert caption.startswith("Band: fp16's range") and "dotted" not in caption  # no reference


def test_fp8_layers_against_e4m3_and_e5m2() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(),
                          nn.Linear(64, 16))
    x = torch.randn(16, 32)
    gm = amprewrite.convert(model, (x,), policy=amprewrite.Policy.fp8())
    with amprewrite.audit() as report:
        gm(x).float().pow(2).mean().backward()
    parsed = Page(amprewrite.html_report(gm, report))
    assert _bars(parsed)[1]["2"].keys() == {"fp8"}  # the middle linear
    svg = _Svg(parsed)
    assert [t.text for t in svg.svg.iter("text", "fp8")] == ["e4m3", "e5m2"]
    tops = [float(r.attrs["y"]) for r in svg.svg.iter("rect", "band-n")]
    for fp8_max in (448, 57344):  # e4m3's and e5m2's largest values
        assert any(t == pytest.approx(svg.y(fp8_max), abs=0.11) for t in tops), fp8_max
    # the quantized operands reach exactly the fp8 maximum: drawn inside their band
    quantize = [ln for ln in svg.svg.iter("line", "f32")
                if " in 2: " in ln.find("title").text and "max |x| 448," in ln.find("title").text]
    assert quantize
    caption = _section(parsed, "ranges").find("p", "note").text
    assert "behind fp8 layers, e4m3's (forward) and e5m2's (backward)" in caption


def test_decision_table_folds_plumbing_under_modules() -> None:
    gm, report, _, parsed = _page(report=True)
    rows = explain_records(gm)[0]["nodes"]
    table = next(t for t in parsed.root.iter("table") if "filterable" in t.classes)
    trs = list(table.find("tbody").iter("tr"))
    data = [tr for tr in trs if "group" not in tr.classes]
    assert [tr.find("td").text for tr in data] == [r["node"] for r in rows]
    assert ["plumbing" in tr.classes for tr in data] == [not r["float"] for r in rows]
    assert [(tr.attrs["data-module"], tr.attrs["data-category"]) for tr in data] == [
        (r["module"], r["category"]) for r in rows]
    # one group row per run of one module, counting the plumbing folded there
    runs: list[tuple[str, int]] = []
    for i, r in enumerate(rows):
        if i == 0 or r["module"] != rows[i - 1]["module"]:
            runs.append((r["module"], 0))
        runs[-1] = (runs[-1][0], runs[-1][1] + (not r["float"]))
    groups = [tr.text for tr in trs if "group" in tr.classes]
    assert groups == [(m or "(top level)") + (f" ({n} integer/bool/shape node"
                                              f"{'s' if n != 1 else ''} folded)" if n else "")
                      for m, n in runs]
    folded = sum(n for _, n in runs)
    details = table.parent.parent  # the table scrolls in its own box inside the fold
    assert details.tag == "details" and table.parent.classes == ["scroll", "tall"]
    assert folded and f"{folded} integer/bool/shape nodes folded" in details.text
    # the filter offers every module and every category of the tables
    options = {s.attrs["id"]: [o.attrs.get("value", o.text) for o in s.iter("option")]
               for s in parsed.root.iter("select")}
    assert options["f-module"] == ["", "(top level)", "q"]
    assert options["f-category"] == ["", *sorted({r["category"] for r in rows} | {"cast"})]
    ops = next(t for t in parsed.root.iter("details") if "ops" in t.classes)
    cast_rows = [tr for tr in ops.iter("tr") if tr.attrs.get("data-category") == "cast"]
    assert [tr.find("td").text for tr in cast_rows] == [
        str(i) for i, r in enumerate(report.records) if r.cast]
    assert cast_rows


def test_modes_and_several_graphs(fresh_dynamo: None) -> None:
    torch.manual_seed(0)
    x = torch.randn(4, 8)
    gm = amprewrite.convert(nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8)).eval(), (x,))
    gm.train().eval()  # both modes captured: the rows of each, marked
    parsed = Page(amprewrite.html_report(gm))
    table = next(t for t in parsed.root.iter("table") if "filterable" in t.classes)
    assert [th.text for th in table.find("thead").iter("th")][-1] == "mode"
    modes = {tr.find("td").text: list(tr.iter("td"))[-1].text
             for tr in table.find("tbody").iter("tr") if "group" not in tr.classes}
    assert modes["add_"] == "train" and modes["linear"] == "both"
    # the bars count what a call runs now (eval): not the train mode's own nodes
    rows = [r for r in explain_records(gm)[0]["nodes"] if r["float"] and r["mode"] != "train"]
    assert {m: sum(b.values()) for m, b in _bars(parsed)[1].items()} == {
        m: 100 * n / max(Counter(r["module"] for r in rows).values())
        for m, n in Counter(r["module"] for r in rows).items()}

    class Break(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = self.a(x).softmax(-1)
            torch._dynamo.graph_break()
            return self.b(y)

    compiled = amprewrite.compile(Break(), eager=True)
    compiled(x)
    parsed = Page(amprewrite.html_report(compiled))
    titles = [h.text for h in parsed.root.iter("h2")]
    assert titles.count("decisions (graph 0)") == titles.count("decisions (graph 1)") == 1
    assert "rewritten graph (graph 1)" in titles
    facts = {tr.find("th").text: tr.find("td").text for tr in parsed.root.find(
        "table", "facts").iter("tr")}
    assert facts["ops"] == "2 bf16 · 1 fp32 · 0 passthrough in 2 graphs"
    assert list(_bars(parsed)[1]) == ["a", "", "b"]


def test_range_chart_of_many_ops_draws_groups() -> None:
    # more ops than the chart has columns for: groups of consecutive ops, drawn as their
    # envelope (a real model's audit can hold thousands)
    records = [OpRecord(op="mul", node=f"mul_{i}", module="m", phase="forward",
                        in_dtypes=("bfloat16",), out_dtype="bfloat16", shape=(4,),
                        max_abs=2.0 ** (i % 7), min_nonzero_abs=2.0 ** -(i % 5), nonfinite=0,
                        fp16_overflow=0, fp16_underflow=0) for i in range(1300)]
    parsed = Page(range_chart(records, torch.bfloat16, set(), None))
    svg = parsed.root.find("svg", "ranges")
    lines = list(svg.find("g", "ops").iter("line"))
    assert len(lines) == math.ceil(1300 / 3)  # groups of 3: at most 600 columns
    first = lines[0].find("title").text
    assert first == "ops #0 to #2 (forward, from m): max |x| 4, smallest nonzero |x| 0.25"
    # bf16's edges lie far off this axis: named at its ends; fp16's drawn for reference
    labels = [t.text for t in svg.iter("text") if t.classes in (["edge"], ["ref"])]
    assert labels == ["bf16 max 3.4e38 ↑", "fp16 max 65504", "fp16 normal ≥ 6.1e-5",
                      "fp16 subnormal ≥ 6e-8", "bf16 normal ≥ 1.2e-38 ↓",
                      "bf16 subnormal ≥ 9.2e-41 ↓"]


class Masks(nn.Module):
    """Attention scores masked the four ways models write it on purpose."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.q = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[1]
        future = torch.ones(n, n, dtype=torch.bool).triu(1)
        scores = (self.q(x) @ x.transpose(-1, -2)).float()
        filled = scores.masked_fill(future, float("-inf"))
        added = scores + torch.full((n, n), float("-inf")).triu(1)
        lowest = scores.masked_fill(future, torch.finfo(torch.float32).min)
        kept = torch.where(~future, scores, float("-inf"))
        probs = filled.softmax(-1) + added.softmax(-1) + lowest.softmax(-1) + kept.softmax(-1)
        return probs @ x


class Overflow(nn.Module):
    """exp of scores far past fp32's range: inf produced from finite values."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.q = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.q(x).float() * 1e3).exp() + 1


def _audited(model: nn.Module, **kwargs: Any) -> tuple[Any, str, Page]:
    x = torch.randn(2, 5, 8, requires_grad=True)
    gm = amprewrite.convert(model, (x,), **kwargs)
    with amprewrite.audit() as report:
        gm(x).float().sum().backward()
    page = amprewrite.html_report(gm, report)
    return report, page, Page(page)


def _marks(parsed: Page) -> list[tuple[int, str]]:
    """(op index, class) of every inf/NaN mark of the range chart, read off its title."""
    svg = parsed.root.find("svg", "ranges")
    return [(int(p.find("title").text.split()[0][1:]), p.classes[0]) for p in svg.iter("path")]


def _expected_marks(report: Any) -> list[tuple[int, str]]:
    """The summary's rule: red where an op produced inf/NaN, grey where it only had them."""
    return [(i, "nonfinite" if r.produced_nonfinite else "carried")
            for i, r in enumerate(report.records) if r.nonfinite]


def _facts(parsed: Page) -> dict[str, Element]:
    return {tr.find("th").text: tr.find("td") for tr in parsed.root.find("table", "facts")
            .iter("tr")}


def test_masks_written_on_purpose_are_not_marked_as_inf_nan() -> None:
    report, page, parsed = _audited(Masks())
    assert report.first_nonfinite is None
    assert _facts(parsed)["inf/NaN"].text == "none produced"
    marks = _marks(parsed)
    # three of the masks write -inf (the finfo.min one is a finite value): each is marked,
    # grey, with what flows on from it; none red, as the summary says
    assert len(marks) >= 3 and marks == _expected_marks(report)
    assert {cls for _, cls in marks} == {"carried"}
    titles = [p.find("title").text for p in parsed.root.find("svg", "ranges").iter("path")]
    assert all(t.endswith(", none produced") for t in titles), titles
    assert any("written on purpose (a mask)" in t for t in titles), titles
    # the op table marks no row red either
    ops = next(t for t in parsed.root.iter("details") if "ops" in t.classes)
    assert not [tr for tr in ops.iter("tr") if "bad" in tr.classes]
    assert "produced inf/NaN" not in ops.find("summary").text


def test_inf_produced_is_marked_red_where_the_summary_names_it() -> None:
    report, page, parsed = _audited(Overflow())
    first = report.first_nonfinite
    assert first is not None and first.op == "exp"
    assert _facts(parsed)["inf/NaN"].text.startswith("first produced by exp (forward)")
    marks = _marks(parsed)
    assert marks == _expected_marks(report)
    red = [i for i, cls in marks if cls == "nonfinite"]
    assert red[0] == report.records.index(first)
    assert ("carried" in {cls for _, cls in marks})  # the add after it only passes it on
    ops = next(t for t in parsed.root.iter("details") if "ops" in t.classes)
    assert [int(tr.find("td").text) for tr in ops.iter("tr") if "bad" in tr.classes] == red


def test_marks_stay_inside_the_plot_below_the_titles() -> None:
    _, _, parsed = _audited(Masks())
    svg = parsed.root.find("svg", "ranges")
    titles = [t for t in svg.iter("text") if "panel" in t.classes]
    # the plot's top edge: the top of the band and of the highest grid line
    top = min(float(r.attrs["y"]) for r in svg.iter("rect") if "band-n" in r.classes)
    top = min(top, *(float(ln.attrs["y1"]) for ln in svg.iter("line") if "grid" in ln.classes))
    assert all(float(t.attrs["y"]) < top for t in titles)
    panels = [(float(t.attrs["x"]), t) for t in titles]
    for path in svg.iter("path"):
        x0, y0, dx, dy, h = map(float, re.match(
            r"M([\d.]+),([\d.]+) l(-?[\d.]+),(-?[\d.]+) h([\d.]+) z", path.attrs["d"]).groups())
        ys, xs = (y0, y0 + dy), (x0, x0 + dx, x0 + dx + h)
        assert min(ys) >= top and max(ys) <= top + 12, path.attrs["d"]
        # within the panel it belongs to: right of its title's start, clear of the left axis
        start = max(x for x, _ in panels if x <= x0)
        assert min(xs) >= start, path.attrs["d"]


def test_fp16_advice_in_a_bf16_run_is_a_what_if() -> None:
    _, _, _, parsed = _blocks(torch.bfloat16)
    facts = _facts(parsed)
    assert "fp16 loss scale" not in facts
    row = next(tr for tr in parsed.root.find("table", "facts").iter("tr")
               if tr.find("th").text == "could it run in fp16?")
    assert row.classes == ["what-if"]
    assert row.find("td").text.startswith("with loss scale 2^")
    assert "(a what-if: bf16 needs no loss scale; max |grad| " in row.find("td").text
    risks = _section(parsed, "modules")
    note = risks.find("p", "what-if").text
    assert note.startswith("A what-if: this run computes in bf16")
    assert not [tr for tr in risks.iter("tr") if "warn" in tr.classes]
    # an fp16 run: the loss scale is advice for it
    _, _, _, parsed = _blocks(torch.float16)
    assert _facts(parsed)["fp16 loss scale"].text.startswith("2^")
    assert not list(parsed.root.iter("p", "what-if"))


def test_narrow_windows_scroll_tables_in_their_own_box() -> None:
    # what keeps the page at the window's width (the browser test measures it at 800 px)
    _, _, page, parsed = _page(report=True)
    tables = list(parsed.root.iter("table"))
    assert len(tables) >= 4
    for table in tables:
        if "facts" in table.classes:  # two columns whose text wraps
            continue
        assert "scroll" in table.parent.classes, table.classes
    svg = parsed.root.find("svg", "ranges")
    assert svg.attrs["width"] == "100%" and re.fullmatch(r"0 0 \d+ \d+", svg.attrs["viewbox"])
    from amprewrite.htmlreport.assets import CSS
    assert ".scroll{overflow-x:auto;max-width:100%}" in CSS
    assert "#ranges svg{display:block;width:100%;height:auto;" in CSS


def test_speed_row_says_when_rounds_cannot_tell() -> None:
    base = {"step_bytes": {"converted": 1024, "autocast": 1024},
            "max_abs_error": {"converted": 1e-3, "autocast": 1e-3}}
    # rounds that disagree: no direction and no colour
    noisy = {**base, "forward_ms": {"converted": 10.0, "autocast": 11.0},
             "forward_rounds": [[10, 7], [10, 8], [10, 9], [10, 11], [10, 12], [10, 13],
                                [10, 14]]}
    row = _facts(_page(report=False, vs_autocast=noisy)[3])["speed"]
    assert row.text == ("about as fast as torch.autocast (too noisy to tell: 0.85x-1.25x its "
                        "speed, middle half of 7 rounds; forward 10.00 ms vs 11.00 ms)")
    assert not list(row.iter("b"))
    # one figure, no rounds: stated as such, never as a verdict
    single = {**base, "forward_ms": {"converted": 25.44, "autocast": 2.31}}
    row = _facts(_page(report=False, vs_autocast=single)[3])["speed"]
    assert row.text == ("too few rounds to compare with torch.autocast (1 round: 0.09x its "
                        "speed; forward 25.44 ms vs 2.31 ms)")
    assert not list(row.iter("b"))


class _Deep(nn.Module):
    """Module names longer than the chart's label column: two that differ only in the middle."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder_with_a_long_descriptive_name = nn.ModuleList(
            nn.ModuleDict({"a_rather_long_attention_projection_name": Block()}) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.encoder_with_a_long_descriptive_name:
            x = layer["a_rather_long_attention_projection_name"](x)
        return x


def test_long_module_names_are_shown_whole_and_wrap() -> None:
    """A module name longer than its column wraps (after its dots) instead of being cut
    at the column's width: the whole name is in the label, and no style clips it."""
    x = torch.randn(4, 8)
    page = amprewrite.html_report(amprewrite.convert(_Deep(), (x,)))
    parsed = Page(page)
    names = {f"encoder_with_a_long_descriptive_name.{i}.a_rather_long_attention_projection_name"
             f".lin" for i in (0, 1)}
    labels = {}
    for row in parsed.root.iter("div", "mrow"):
        if row.attrs.get("data-module") in names:
            labels[row.attrs["data-module"]] = row.find("span", "mlabel").text
    assert labels == {name: name for name in names}  # whole, no "…"
    assert "…" not in "".join(r.find("span", "mlabel").text
                              for r in parsed.root.iter("div", "mrow"))
    assert ".<wbr>a_rather_long_attention_projection_name.<wbr>" in page
    from amprewrite.htmlreport.assets import CSS
    label_rule = re.search(r"\.mlabel\{([^}]*)\}", CSS)[1]
    assert "overflow-wrap:anywhere" in label_rule
    assert "overflow:hidden" not in label_rule and "nowrap" not in label_rule
    assert "text-overflow" not in CSS


def test_speed_row_says_when_the_machine_is_too_busy() -> None:
    """One round 100 ms where the others took 1.4 ms: the page, as the demo's line, draws no
    verdict and says why, in no colour."""
    busy = {"step_bytes": {"converted": 1024, "autocast": 1024},
            "max_abs_error": {"converted": 1e-3, "autocast": 1e-3},
            "forward_ms": {"converted": 1.41, "autocast": 2.01},
            "forward_rounds": [[1.40, 2.00], [1.41, 2.02], [100.0, 101.0], [1.39, 1.98],
                               [1.42, 2.01], [1.40, 2.03], [1.41, 1.99]]}
    row = _facts(_page(report=False, vs_autocast=busy)[3])["speed"]
    assert row.text == ("no verdict against torch.autocast (the machine is too busy to tell: "
                        "its slowest round took 71x the median round's time, of 7 rounds; "
                        "forward 1.41 ms vs 2.01 ms)")
    assert not list(row.iter("b"))
