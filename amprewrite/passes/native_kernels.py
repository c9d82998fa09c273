"""NativeKernelsPass: call the kernel eager code runs where tracing took a library's fallback.

Some libraries branch on ``torch.compiler.is_compiling()`` and, while traced, call an op that
traces well but runs slowly; the captured graph keeps that branch. The pass rewrites those
calls to a function of :mod:`amprewrite.runtime.native_kernels` that runs eager code's kernel
(the same values and gradients) and hands the library's op back to anything that traces the
converted module again (``torch.compile``, ``torch.export``). Which ops, and what replaces
them, is the table :data:`TRACE_FALLBACKS`.

It runs after the precision passes, so the policy sees the library's op under its own name
(``"transformers::grouped_mm_fallback"`` in overrides and in ``explain()``) and the casts
around it are already decided: only the callee changes.

Before (a converted Mixtral's experts)::

    grouped_mm_fallback = torch.ops.transformers.grouped_mm_fallback.default(
        index_1, transpose_5, cumsum)

After::

    grouped_mm_fallback = amprewrite_runtime_native_kernels_grouped_mm(
        index_1, transpose_5, cumsum)
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Callable, Mapping

import torch.fx as fx
from torch.fx.passes.infra.pass_base import PassBase, PassResult

from ..policy.opkey import callable_key
from ..runtime.native_kernels import GROUPED_MM_ON_CPU, grouped_mm

__all__ = ["NativeKernelsPass", "TRACE_FALLBACKS"]

TRACE_FALLBACKS: Mapping[str, Callable] = MappingProxyType(
    {"transformers::grouped_mm_fallback": grouped_mm} if GROUPED_MM_ON_CPU else {})
"""Op name (:func:`amprewrite.policy.opkey.callable_key`) -> the function that replaces its
calls; it takes the op's arguments."""


class NativeKernelsPass(PassBase):
    """Route calls of traced-only fallback ops through :data:`TRACE_FALLBACKS`."""

    def call(self, gm: fx.GraphModule) -> PassResult:
        modified = False
        for node in gm.graph.nodes:
            if node.op != "call_function":
                continue
            replacement = TRACE_FALLBACKS.get(callable_key(node.target))
            if replacement is not None:
                node.target = replacement
                modified = True
        if modified:
            gm.recompile()
        return PassResult(gm, modified)
