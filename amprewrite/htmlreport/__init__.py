"""One self-contained HTML page of a converted model (:func:`html_report`): precision per
module beside the summary, every op's range against the low dtype's, coloured code, and
folded, filterable decision and op tables. No network, no external resource, no dependency:
the charts are SVG and HTML written here, the script is a few lines inline. The page (``page``) assembles the
summary (``overview``), precision per module (``modules``), ranges against the format
(``ranges``, drawn with ``bands``), the code and tables (``sections``), with the inline style
sheet and script of ``assets``."""

from .page import html_report

__all__ = ["html_report"]
