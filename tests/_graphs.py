"""Reading a converted graph in tests: its weight casts, whatever form they take."""

from __future__ import annotations

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
