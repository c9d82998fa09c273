"""amprewrite.html_report: one self-contained page, checked with the stdlib HTML parser."""

from __future__ import annotations

from html.parser import HTMLParser

import torch
import torch.nn as nn

import amprewrite
from amprewrite.code_view import code_lines


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


class Page(HTMLParser):
    """Collects tags, attributes, the lines of the code block and the cast lines."""

    def __init__(self) -> None:
        super().__init__()
        self.tags: list[tuple[str, dict[str, str | None]]] = []
        self.code_spans: list[tuple[str, str]] = []  # (classes, text)
        self.text: list[str] = []
        self._span: str | None = None
        self._in_code = False

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        attrs_d = dict(attrs)
        self.tags.append((tag, attrs_d))
        if tag == "pre" and attrs_d.get("class") == "code":
            self._in_code = True
        classes = (attrs_d.get("class") or "").split()
        if tag == "span" and any(c.startswith("dt-") for c in classes) and "data-node" in attrs_d \
                or tag == "span" and self._in_code:
            self._span = attrs_d.get("class") or ""
            self.code_spans.append((self._span, ""))

    def handle_endtag(self, tag: str) -> None:
        if tag == "span":
            self._span = None
        if tag == "pre":
            self._in_code = False

    def handle_data(self, data: str) -> None:
        self.text.append(data)
        if self._span is not None:
            classes, text = self.code_spans[-1]
            self.code_spans[-1] = (classes, text + data)


def _page(report: bool) -> tuple[torch.fx.GraphModule, str, Page]:
    x = torch.randn(2, 4, 8, requires_grad=True)
    gm = amprewrite.convert(Attention(), (x,))
    audit_report = None
    if report:
        with amprewrite.audit() as audit_report:
            gm(x).sum().backward()
    page = amprewrite.html_report(gm, audit_report=audit_report)
    parser = Page()
    parser.feed(page)
    return gm, page, parser


def test_every_node_and_every_cast_line(tmp_path) -> None:
    gm, page, parser = _page(report=True)
    text = "".join(parser.text)
    for node in gm.graph.nodes:
        if node.op not in ("placeholder", "output"):
            assert node.name in text, node.name
    casts = [line for line in code_lines(gm) if line.cast]
    assert casts
    highlighted = [t for classes, t in parser.code_spans if "cast" in classes.split()]
    assert highlighted == [line.text for line in casts]
    assert all("cast" not in c.split() for c, t in parser.code_spans
               if t not in highlighted)
    assert "dt-low" in page and "dt-f32" in page
    for title in ("summary", "decisions", "fp16 overflow risk", "every op",
                  "gradient magnitudes"):
        assert f"<h2>{title}" in page
    assert "<table class='sortable'>" in page and "addEventListener('click'" in page
    path = tmp_path / "r.html"
    assert amprewrite.html_report(gm, path=path) == path.read_text()


def test_no_external_resource() -> None:
    _, page, parser = _page(report=False)
    for tag, attrs in parser.tags:
        assert tag != "link", attrs
        assert not (tag == "script" and "src" in attrs), attrs
        for key in ("src", "href"):
            assert key not in attrs, (tag, attrs)
    assert "http://" not in page and "https://" not in page and "url(" not in page
    assert "<h2>summary</h2>" in page and "model: Attention" in page
