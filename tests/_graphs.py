"""Reading a converted graph in tests: its weight casts, whatever form they take."""

from __future__ import annotations

import torch
import torch.fx as fx

from amprewrite.graph.meta import cast_info
from amprewrite.runtime.weight_table import is_fetch


def weight_casts(gm: fx.GraphModule) -> list[tuple[str, torch.dtype]]:
    """``(tensor name, dtype)`` of every weight cast: the entries of the gathered weight reads
    (``_amp_weights.fetch(...)``) that name a dtype, and the cast nodes still in the graph
    (buffer casts, graphs that were not gathered)."""
    out = []
    for node in gm.graph.nodes:
        if is_fetch(node):
            out += [(entry[0], entry[1]) for entry in node.args[1:] if len(entry) > 1]
        elif node.op == "call_method" and node.target in ("cast", "get") and \
                cast_info(node) is not None:
            out.append((str(node.args[1].target), node.args[2]))
    return out
