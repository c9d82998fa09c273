"""One self-contained HTML page of a converted model (:func:`html_report`): precision per
module beside the summary, every op's range against the low dtype's, coloured code, and
folded, filterable decision and op tables. No network, no external resource, no dependency:
the charts are SVG and HTML written here, the script is a few lines inline."""

from .page import html_report

__all__ = ["html_report"]
