"""Both training modes of a converted module: what a graph's mode is, and a mode that failed.

A capture runs the model's Python once and records the mode it ran in: ``torch.export``
records dropout with ``train=True`` or no dropout at all, batch norm with batch statistics
and running-stat updates or with the running statistics, and the branch of every
``if self.training:``; the symbolic tracer does the same for the code it traces through (it
keeps BatchNorm and Dropout as modules, which follow the flag, but not
``F.dropout(x, p, self.training)`` or a branch). So a converted module needs a graph for each
mode it runs in: ``convert`` captures the mode the model is in, and the first switch to the
other (``gm.train(mode)`` / ``gm.eval()``) captures that one, with the same inputs, as one more
entry of the module's cache (:meth:`~.cache.GraphCache.switch`). Conversion costs one
capture; a module never switched pays nothing more. A capture cannot run inside
``torch.compile``, ``torch.export`` or a fake or proxy tensor mode: a switch there to a mode
not captured yet raises, asking for one switch outside.

Where the two captures record the same code (a model without mode-dependent ops, or
symbolic capture of one whose only such ops are BatchNorm and Dropout modules) one graph
serves both modes. Where the other mode cannot be captured, the switch warns and that mode's
graph raises, naming the mode and the fix (:func:`not_captured_graph`), whether the module is
called, compiled or exported in that mode.
"""

from __future__ import annotations

import contextlib
import copy
from typing import Iterator

import torch.fx as fx
import torch.nn as nn

from ..errors import AmpRewriteError
from ..graph.meta import MODE_KEY
from .sharing import share_state

__all__ = ["MODE_KEY", "NOT_CAPTURED_KEY", "not_captured_graph", "in_mode", "mode_name"]


NOT_CAPTURED_KEY = "amprewrite_not_captured"
"""``gm.meta[NOT_CAPTURED_KEY]``: why the model could not be captured in this graph's mode
(the graph raises)."""

def mode_name(training: bool) -> str:
    return "train" if training else "eval"


def not_captured_message(model_name: str, training: bool, reason: str) -> str:
    mode, back = mode_name(training), "eval" if training else "train"
    return (f"this converted {model_name} was called in {mode} mode, but {model_name} could "
            f"not be captured in {mode} mode ({reason}); running its {back}-mode "
            f"graph instead would silently compute the other mode. Call gm.{back}() to run "
            f"the {back}-mode graph, make the model's {mode}-mode code capturable (the error "
            "above), or use amprewrite.compile(model), which captures each mode as it runs.")


def mode_not_captured(message: str) -> None:
    """The one op of a mode's graph that could not be captured (:func:`not_captured_graph`)."""
    raise AmpRewriteError(message)


def not_captured_graph(main: fx.GraphModule, training: bool, exc: BaseException | str
                       ) -> fx.GraphModule:
    """The graph of a mode ``main``'s model could not be captured in: the arguments of
    ``main``'s own (its signature, which ``Trainer`` reads), then a call that raises."""
    reason = exc if isinstance(exc, str) else \
        f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    graph = fx.Graph()
    graph._codegen = copy.deepcopy(main.graph._codegen)
    for node in main.graph.find_nodes(op="placeholder"):
        graph.node_copy(node)
    message = not_captured_message(type(main).__name__, training, reason)
    graph.output(graph.call_function(mode_not_captured, (message,)))
    stub = fx.GraphModule(main, graph, class_name=type(main).__name__)
    stub.meta.update({**main.meta, MODE_KEY: training, NOT_CAPTURED_KEY: reason})
    share_state(main, stub)
    return stub


@contextlib.contextmanager
def in_mode(model: nn.Module, training: bool, root_only: bool = False) -> Iterator[None]:
    """``model`` in ``training`` mode (``model.train(training)``) during the block, every
    module's flag put back after (a model may hold a frozen part in eval mode). With
    ``root_only``, the model's own flag only: its submodules' flags are the capture's to read
    as they are (a converted module whose submodules are the model's runs them so)."""
    flags = [(m, m.training) for m in model.modules()]
    if root_only:
        model.training = training
    else:
        model.train(training)
    try:
        yield
    finally:
        for module, flag in flags:
            module.training = flag


