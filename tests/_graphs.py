"""Reading a converted graph in tests: its weight casts, whatever form they take."""

from __future__ import annotations

import re

import torch
import torch.fx as fx

from amprewrite.graph.meta import cast_info
from amprewrite.runtime.weight_table import is_fetch


def weight_casts(gm: fx.GraphModule) -> list[tuple[str, torch.dtype]]:
    """``(tensor name, dtype)`` of every weight cast: the cast nodes (parameter casts, which
    read an item of the gathered weight reads, and buffer casts) and the O2 low copies of the
    gathered reads (``_amp_weights.fetch(...)`` entries ``(name, dtype, 'low copy')``)."""
    out = []
    for node in gm.graph.nodes:
        if is_fetch(node):
            out += [(entry[0], entry[1]) for entry in node.args[1:] if len(entry) == 3]
        elif node.op == "call_method" and node.target in ("cast", "get") and \
                cast_info(node) is not None:
            read = node.args[1]
            if read.op == "get_attr":
                out.append((str(read.target), node.args[2]))
            else:  # an item of the gathered weight reads
                out.append((read.args[0].args[1 + read.args[1]][0], node.args[2]))
    return out


def one_line(code: str) -> str:
    """Generated code with each statement on one line: the converted code wraps a long
    statement between its arguments (:mod:`amprewrite.graph.layout`), which this joins."""
    return re.sub(r"(?<=[(\[,])\n +", lambda m: "" if m.string[m.start() - 1] in "([" else " ",
                  code)


def weight_entries(gm: fx.GraphModule) -> list[tuple]:
    """The entries of the forward's weight read: ``(name,)``, ``(name, dtype)`` for a
    parameter cast to ``dtype``, ``(name, dtype, 'low copy')`` for an O2 stored copy."""
    return [entry for node in gm.graph.nodes if is_fetch(node) for entry in node.args[1:]]
