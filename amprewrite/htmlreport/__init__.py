"""One self-contained HTML page of a converted model: summary, coloured code, decisions and
audit (:func:`html_report`). No network, no external resource, no dependency."""

from .page import html_report

__all__ = ["html_report"]
