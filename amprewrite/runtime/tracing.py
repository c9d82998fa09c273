"""One answer to "is this code being traced rather than run?", for the runtime's caches and
for the captures that cannot happen inside a trace.

A tracer or compiler must see plain ops: a cache filled while tracing would hold fake or
proxy tensors past the trace, and a capture started inside one would trace a trace. Tracing
here is any of: ``torch.compile`` / ``torch.export`` (Dynamo), ``torch.fx.symbolic_trace``, a
proxy tensor mode (``make_fx``, AOTAutograd), a fake tensor mode (shape propagation), and a
fake or functional tensor met outside them.
"""

from __future__ import annotations

import torch
import torch.fx as fx

__all__ = ["tracing"]

_FAKE = torch._C._TorchDispatchModeKey.FAKE
_PROXY = torch._C._TorchDispatchModeKey.PROXY


def tracing(tensor: torch.Tensor | None = None) -> bool:
    """Whether the caller runs under a tracer or compiler, or ``tensor`` is one's.

    NB: runs once per converted forward: each check is a flag or a dispatch-mode slot read
    (about 0.1 µs), not ``torch._guards.detect_fake_mode`` (5 µs)."""
    if tensor is not None and (isinstance(tensor, torch._subclasses.FakeTensor)
                               or torch._is_functional_tensor(tensor)):
        return True
    return (torch.compiler.is_compiling() or fx._symbolic_trace.is_fx_symbolic_tracing()
            or torch._C._get_dispatch_mode(_PROXY) is not None
            or torch._C._get_dispatch_mode(_FAKE) is not None)
