"""Where an op runs: module path, FX node of a converted GraphModule, and forward or backward.

* **Modules** are tracked with global forward pre/post hooks that exist only while an audit is
  active; qualified names come from the outermost module's ``named_modules()``.
* **FX nodes**: the generated ``forward`` of a GraphModule executes one source line per node,
  and ``gm._lineno_map`` maps a line back to its node. While a converted GraphModule is on the
  module stack, the op's caller frames are walked up to that ``forward`` frame. Nothing is
  patched, so a converted module pays nothing when it is not audited.
* **Backward** ops are attributed to the forward context that created their autograd node.
  Every autograd node takes the next value of a thread-local sequence counter when it is
  created, just before the op it records is dispatched; so the node with sequence number
  ``s`` belongs to the first forward op that saw the counter above ``s``. Forward contexts are
  kept as segments ``(largest counter seen, context)``; a backward op looks its node up with
  one bisect.
"""

from __future__ import annotations

import bisect
import sys
import weakref
from types import CodeType
from typing import Any, NamedTuple

import torch
import torch.nn as nn
from torch.utils.hooks import RemovableHandle

from ..module.calling import generated_code
from ..graph.meta import CONVERTED_KEY, cast_info
from ..graph.queries import module_paths
from ..module.model_watch import own_global_hooks
from ..runtime.weight_table import is_fetch

__all__ = ["Context", "Attribution"]

_MAX_FRAMES = 24
"""How many caller frames to walk to find a converted ``forward`` (runtime helpers such as
``WeightCastCache.cast`` or ``F.softmax`` sit in between)."""


class Context(NamedTuple):
    """The forward context of an op: FX node name, module path, whether the node is a cast."""

    node: str | None
    module: str | None
    cast_node: bool


class _GraphInfo(NamedTuple):
    first_line: int
    lineno_map: dict[int, int | None]
    contexts: list[Context]


def _node_contexts(gm: torch.fx.GraphModule, prefix: str) -> list[Context]:
    out = []
    for node in gm.graph.nodes:
        paths = module_paths(node)
        inner = paths[-1] if paths else ""
        module = ".".join(p for p in (prefix, inner) if p)
        # The gathered weight reads make the cached and O2 copies of parameters: their ops
        # are casts.
        out.append(Context(node.name, module, cast_info(node) is not None or is_fetch(node)))
    return out


class Attribution:
    """Tracks the current forward context and maps backward ops to forward contexts."""

    def __init__(self, max_segments: int | None = None) -> None:
        self._stack: list[tuple[nn.Module, str]] = []
        self._names: dict[int, tuple[weakref.ref, dict[int, str]]] = {}
        self._graphs: dict[CodeType, _GraphInfo] = {}
        self._active_graphs = 0
        self._handles: list[RemovableHandle] = []
        self._max_segments = max_segments
        # Backward lookup: segment i covers forward ops up to sequence counter _seq[i].
        self._seq: list[int] = []
        self._ctx: list[Context] = []
        self._module_ctx: dict[str, Context] = {}
        self._params: dict[int, Context] | None = None
        self._params_roots = 0

    # -- lifetime ------------------------------------------------------------------------
    def start(self) -> None:
        reg = nn.modules.module
        self._handles = [reg.register_module_forward_pre_hook(self._pre),
                         reg.register_module_forward_hook(self._post, always_call=True)]
        own_global_hooks(self._handles)  # they see every module the audit runs

    def stop(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._stack.clear()
        self._active_graphs = 0

    # -- module hooks --------------------------------------------------------------------
    def _path(self, module: nn.Module) -> str:
        if not self._stack:
            return ""
        root = self._stack[0][0]
        entry = self._names.get(id(root))
        if entry is None or entry[0]() is not root:
            names = {id(m): n for n, m in root.named_modules(remove_duplicate=False)}
            entry = self._names[id(root)] = (weakref.ref(root), names)
        name = entry[1].get(id(module))
        if name is None:  # called from a forward but not a child of the outermost module
            parent = self._stack[-1][1]
            name = f"{parent}.<{type(module).__name__}>" if parent else f"<{type(module).__name__}>"
        return name

    def _pre(self, module: nn.Module, args: Any) -> None:
        path = self._path(module)
        self._stack.append((module, path))
        meta = getattr(module, "meta", None)
        if isinstance(module, torch.fx.GraphModule) and isinstance(meta, dict) \
                and CONVERTED_KEY in meta:
            code = generated_code(module)
            if code not in self._graphs:
                self._graphs[code] = _GraphInfo(code.co_firstlineno,
                                                dict(getattr(module, "_lineno_map", None) or {}),
                                                _node_contexts(module, path))
            self._active_graphs += 1

    def _post(self, module: nn.Module, args: Any, output: Any) -> None:
        # Pop up to and including ``module`` (robust to a hook that raised in between).
        while self._stack:
            top, _ = self._stack.pop()
            if isinstance(top, torch.fx.GraphModule) and self._active_graphs and \
                    generated_code(top) in self._graphs:
                self._active_graphs -= 1
            if top is module:
                break

    # -- forward -------------------------------------------------------------------------
    def forward_context(self) -> Context:
        """The context of the op being dispatched now (call from ``__torch_dispatch__``)."""
        ctx = self._graph_context() if self._active_graphs else None
        if ctx is None:
            module = self._stack[-1][1] if self._stack else None
            if module is None:
                ctx = _NO_CONTEXT
            else:
                ctx = self._module_ctx.get(module)
                if ctx is None:
                    ctx = self._module_ctx[module] = Context(None, module, False)
        self._note_forward(ctx)
        return ctx

    def _graph_context(self) -> Context | None:
        frame = sys._getframe(2)  # our own frames are skipped by the lookup below
        graphs = self._graphs
        for _ in range(_MAX_FRAMES):
            if frame is None:
                return None
            info = graphs.get(frame.f_code)
            if info is not None:
                index = info.lineno_map.get(frame.f_lineno - info.first_line)
                return info.contexts[index] if index is not None else None
            frame = frame.f_back
        return None

    def _note_forward(self, ctx: Context) -> None:
        seq = torch._C._autograd._get_sequence_nr()
        if self._ctx and self._ctx[-1] is ctx:
            self._seq[-1] = seq
            return
        self._seq.append(seq)
        self._ctx.append(ctx)
        if self._max_segments is not None and len(self._seq) > self._max_segments:
            # Bounded memory: backward runs soon after its forward; drop the oldest half.
            half = len(self._seq) // 2
            del self._seq[:half], self._ctx[:half]

    # -- backward ------------------------------------------------------------------------
    def backward_context(self, grad_fn: Any) -> Context:
        """The forward context that created autograd node ``grad_fn``."""
        index = bisect.bisect_right(self._seq, grad_fn._sequence_nr())
        if index < len(self._ctx):
            return self._ctx[index]
        # AccumulateGrad nodes (no forward op made them) belong to their parameter's module.
        param = getattr(grad_fn, "variable", None)
        return self._param_context(param) if isinstance(param, torch.Tensor) else _NO_CONTEXT

    def _param_context(self, param: torch.Tensor) -> Context:
        if self._params is None or self._params_roots != len(self._names):
            self._params, self._params_roots = {}, len(self._names)
            for root_ref, _ in self._names.values():
                root = root_ref()
                for name, p in (root.named_parameters() if root is not None else ()):
                    module = name.rpartition(".")[0]
                    self._params.setdefault(id(p), Context(None, module, False))
        return self._params.get(id(param), _NO_CONTEXT)


_NO_CONTEXT = Context(None, None, False)
