"""Which user-defined ``torch.autograd.Function`` classes a captured graph came through.

Non-strict ``torch.export`` runs a custom Function's ``forward`` as plain Python and records
its ops; the Function's own ``backward`` is not kept, so autograd differentiates the recorded
ops instead. That changes gradients (never outputs) and the user should hear of it.

The graph itself says where its ops came from: every node torch.export records carries
``meta["stack_trace"]``, the Python frames that were running when the op was called::

    File "model.py", line 15, in forward
        return Swish.apply(self.lin(x))
    File "model.py", line 6, in forward
        return x * torch.sigmoid(x)

A node whose trace has a frame inside the ``forward`` of a ``Function`` subclass was recorded
from that Function. The subclasses are found with ``type.__subclasses__`` and their source
lines from their code objects: nothing of torch is replaced while the model runs, so other
threads running autograd Functions meanwhile are not affected, and no torch release's
implementation of ``Function.apply`` matters.
"""

from __future__ import annotations

import re
from typing import Iterator

import torch
import torch.fx as fx

__all__ = ["custom_functions_in"]

_FRAME = re.compile(r'File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<name>\S+)')


def _subclasses(cls: type) -> Iterator[type]:
    for sub in cls.__subclasses__():
        yield sub
        yield from _subclasses(sub)


def _forward_lines() -> dict[str, list[tuple[range, str]]]:
    """``{file: [(lines of a forward, "module.QualName"), ...]}`` for the user-defined
    Function subclasses alive now (torch's own are not reported)."""
    found: dict[str, list[tuple[range, str]]] = {}
    for cls in set(_subclasses(torch.autograd.Function)):
        if cls.__module__.startswith("torch.") or "forward" not in vars(cls):
            continue
        code = getattr(vars(cls)["forward"], "__func__", vars(cls)["forward"])
        code = getattr(code, "__code__", None)
        if code is None:
            continue
        lines = [line for _, _, line in code.co_lines() if line is not None]
        if lines:
            span = range(min(lines), max(lines) + 1)
            found.setdefault(code.co_filename, []).append(
                (span, f"{cls.__module__}.{cls.__qualname__}"))
    return found


def custom_functions_in(graph: fx.Graph) -> set[str]:
    """Names (``module.QualName``) of the user-defined autograd Functions whose ``forward``
    recorded ops of ``graph`` (read from the nodes' ``stack_trace``, module docstring)."""
    forwards = _forward_lines()
    if not forwards:
        return set()
    seen: set[str] = set()
    for node in graph.nodes:
        trace = node.meta.get("stack_trace")
        if not trace:
            continue
        for frame in _FRAME.finditer(trace):
            for span, name in forwards.get(frame["file"], ()):
                if int(frame["line"]) in span:
                    seen.add(name)
    return seen
