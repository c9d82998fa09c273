"""``gm.code`` line by line, each line tied to the node it assigns: which lines are casts and
which dtype each produces (for the CLI's marked code and the HTML report's coloured code).

::

    x_bf16 = x.bfloat16()  # bf16[2, 8]  # cast
    linear = torch.nn.functional.linear(x_bf16, w_bf16)  # bf16[2, 16]
"""

from __future__ import annotations

import re
from typing import NamedTuple

import torch
import torch.fx as fx

from .graph.meta import cast_info
from .summary import short_dtype

__all__ = ["CodeLine", "code_lines", "marked_code", "CAST_MARK"]

CAST_MARK = "  # cast"
_ASSIGNED = re.compile(r"^\s*([A-Za-z_][A-Za-z0-9_]*)\s*=[^=]")


class CodeLine(NamedTuple):
    text: str
    node: str | None
    """The node the line assigns, if any."""
    dtype: str | None
    """Short name of the dtype it produces (``"bf16"``), None for non-tensors."""
    cast: bool
    """The line is a cast node amprewrite inserted."""


def code_lines(gm: fx.GraphModule) -> list[CodeLine]:
    """The lines of ``gm.code`` (blank lines dropped), each with its node facts: the node
    whose code the line is part of (torch.fx's line map, ``gm._lineno_map``: a statement
    wrapped over several lines is one node's, the weight read is the fetch node's), else the
    node the line assigns."""
    nodes = list(gm.graph.nodes)
    by_name = {n.name: n for n in nodes}
    lines = getattr(gm, "_lineno_map", None) or {}
    start = getattr(gm, "_prologue_start", 0)
    out = []
    # NB: gm._code, the text the line map counts in (gm.code leaves out its blank first lines)
    for number, text in enumerate(gm._code.splitlines(), start=1):
        if not text.strip():
            continue
        index = lines.get(number - start)
        node = nodes[index] if index is not None and index < len(nodes) else None
        if node is None:
            match = _ASSIGNED.match(text)
            node = by_name.get(match.group(1)) if match else None
        val = node.meta.get("val") if node is not None else None
        dtype = short_dtype(val.dtype) if isinstance(val, torch.Tensor) else None
        cast = node is not None and cast_info(node) is not None
        out.append(CodeLine(text, node.name if node is not None else None, dtype, cast))
    return out


def marked_code(gm: fx.GraphModule, casts_only: bool = False, context: int = 1) -> str:
    """``gm.code`` with ``# cast`` after each cast line; ``casts_only``: only the cast lines
    and ``context`` lines around each, gaps shown as ``...``."""
    # NB: of a cast's lines (a comment above it, a ``del`` after), the one assigning it
    lines = [line._replace(cast=line.cast and _assigns(line)) for line in code_lines(gm)]
    keep = set(range(len(lines)))
    if casts_only:
        keep = {j for i, line in enumerate(lines) if line.cast
                for j in range(i - context, i + context + 1) if 0 <= j < len(lines)}
    out, last = [], -1
    for i, line in enumerate(lines):
        if i not in keep:
            continue
        if casts_only and i != last + 1:
            out.append("    ...")
        out.append(line.text + (CAST_MARK if line.cast else ""))
        last = i
    return "\n".join(out)


def _assigns(line: CodeLine) -> bool:
    match = _ASSIGNED.match(line.text)
    return match is not None and match.group(1) == line.node
