"""``gm.code`` line by line, each line tied to the node it assigns: which lines are casts and
which dtype each produces (for the CLI's marked code and the HTML report's coloured code).

::

    linear = torch.ops.aten.linear.default(x_bf16, w_bf16)
    x_bf16 = torch.ops.aten._to_copy.default(x, dtype = torch.bfloat16)  # cast
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
    """The lines of ``gm.code`` (blank lines dropped), each with its node facts."""
    nodes = {n.name: n for n in gm.graph.nodes}
    out = []
    for text in gm.code.strip("\n").splitlines():
        if not text.strip():
            continue
        match = _ASSIGNED.match(text)
        node = nodes.get(match.group(1)) if match else None
        val = node.meta.get("val") if node is not None else None
        dtype = short_dtype(val.dtype) if isinstance(val, torch.Tensor) else None
        cast = node is not None and cast_info(node) is not None
        out.append(CodeLine(text, node.name if node is not None else None, dtype, cast))
    return out


def marked_code(gm: fx.GraphModule, casts_only: bool = False, context: int = 1) -> str:
    """``gm.code`` with ``# cast`` after each cast line; ``casts_only``: only the cast lines
    and ``context`` lines around each, gaps shown as ``...``."""
    lines = code_lines(gm)
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
