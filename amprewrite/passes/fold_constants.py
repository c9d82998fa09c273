"""FoldConstantsPass: what a graph computes the same on every call, computed once.

Models build index tables from literals in their forward. BEiT's relative position index is
``arange`` -> ``meshgrid`` -> ``stack`` -> ``sub`` -> in-place ``add_``/``mul_`` on ``select``
views -> ``zeros`` -> ``copy_``/``fill_`` -> ``view``: 36 ATen ops per layer and call, whose
result depends on the config only. ``torch.export`` records each of them, with a write-back
``copy_`` after every in-place op on a view, so a converted forward dispatched them all on
every call (and a training step kept their outputs for nothing). This pass runs such a
subgraph once, at conversion, and keeps what leaves it as a constant of the module.

Before (one layer of a converted BEiT)::

    arange_4 = torch.arange(4, device = device(type='cpu'), pin_memory = False)
    ...
    select = torch.select(contiguous, 2, 0)
    add_ = torch.ops.aten.add_.Tensor(select, 3);  select = None
    select_1 = torch.select(contiguous, 2, 0)
    copy_ = torch.ops.aten.copy_.default(select_1, add_)
    ...
    view = zeros_1.view([-1]);  zeros_1 = None
    index = torch.ops.aten.index.Tensor(cat_1, [view])

After::

    index = torch.ops.aten.index.Tensor(cat_1, [folded_view])

What counts as constant: a literal of the model's code (a tensor the capture lifted, see
:data:`~amprewrite.capture.facts.LIFTED_CONSTANTS`, or an attribute that is neither a parameter
nor a buffer: a buffer is state that ``load_state_dict`` or the user may change) and any ATen
op, not a random one, whose inputs are all constant; casts and
``getitem`` of constants too. Three guards keep the values those of a call:

* **Writes.** Ops are grouped by the storage they share (views, in-place results). A group
  that an op outside the folded set writes to, or that the graph returns (the caller may
  write to it), is not folded: a stored value would change between calls.
* **Order.** A group read from outside the folded set before its last in-place write is not
  folded: the folded value is the one after every write.
* **Size.** A stored value of more than :data:`MAX_FOLDED_BYTES` stays computed per call; the
  ops before it still fold.

The computation runs at conversion on the graph's own ops, devices and dtypes (the casts of
the policy are already in the graph), so the stored values are bitwise those a call computes.
Equal values are stored once, neither in ``state_dict`` nor as weights that O2 stores in the
low dtype. A value is kept the way its literals were: a non-persistent buffer where the
capture registered one of them as a buffer (``torch.export`` lifts literals so), so that
``gm.to(device)`` moves it as it moved them; else a plain attribute, as torch.fx keeps the
literals of traced code, which stay on the device the code names.
Nothing folds under a fake mode (the ``torch.compile`` backend: Inductor folds constants
itself) or on the meta device.
"""

from __future__ import annotations

import contextlib
import operator
from typing import Any

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensor
from torch.fx.passes.infra.pass_base import PassBase, PassResult

from ..capture.facts import LIFTED_CONSTANTS
from ..graph.composites import has_composite_kernel
from ..graph.queries import attr_at

__all__ = ["FoldConstantsPass", "MAX_FOLDED_BYTES"]

MAX_FOLDED_BYTES = 1 << 20
"""The largest value (bytes) stored as a constant; bigger ones are computed per call."""

_PREFIX = "folded_"


# -- what each node does to its tensor inputs ----------------------------------------------


def _node_inputs(node: fx.Node) -> list[fx.Node]:
    return list(node.all_input_nodes)


def _is_cast(node: fx.Node) -> bool:
    return (node.op == "call_method" and node.target == "to" and len(node.args) == 2
            and isinstance(node.args[1], torch.dtype) and not node.kwargs)


def _foldable_op(node: fx.Node) -> bool:
    """Whether ``node`` gives the same result whenever its inputs are the same."""
    if _is_cast(node):
        return True
    if node.op != "call_function":
        return False
    if node.target is operator.getitem:
        return True
    op = node.target
    return (isinstance(op, torch._ops.OpOverload) and bool(op._schema.returns)
            and torch.Tag.nondeterministic_seeded not in op.tags)


def _effects(node: fx.Node) -> tuple[list[fx.Node], list[fx.Node]]:
    """The inputs whose storage ``node``'s result may share, and those it may write to.

    Read off the ATen schema (``Tensor(a)`` aliases, ``Tensor(a!)`` is written); a cast may
    return its input; anything else (a Python function, a module, the output) is assumed
    to do both with every input."""
    if _is_cast(node) or (node.op == "call_function" and node.target is operator.getitem):
        return [node.args[0]], []
    op = node.target
    if node.op == "call_function" and isinstance(op, torch._ops.OpOverload):
        if _unannotated_composite(op):
            return _node_inputs(node), []
        aliased, written = [], []
        for arg, value in _bind(node, op):
            nodes = [v for v in _flat(value) if isinstance(v, fx.Node)]
            if arg.alias_info is not None:
                aliased += nodes
                if arg.alias_info.is_write:
                    written += nodes
        return aliased, written
    inputs = _node_inputs(node)
    return inputs, inputs


def _unannotated_composite(op: torch._ops.OpOverload) -> bool:
    """A composite op without alias annotations, which may still return views of its inputs
    (``meshgrid``'s outputs are views, its schema says ``-> Tensor[]``)."""
    schema = op._schema
    return (has_composite_kernel(op)
            and all(a.alias_info is None for a in schema.arguments)
            and all(r.alias_info is None for r in schema.returns))


def _bind(node: fx.Node, op: torch._ops.OpOverload) -> list[tuple[Any, Any]]:
    """(schema argument, value) for every argument the node passes."""
    out = []
    for i, arg in enumerate(op._schema.arguments):
        if i < len(node.args):
            out.append((arg, node.args[i]))
        elif arg.name in node.kwargs:
            out.append((arg, node.kwargs[arg.name]))
    return out


def _flat(value: Any) -> list[Any]:
    return [v for item in value for v in _flat(item)] if isinstance(value, (list, tuple)) \
        else [value]


# -- storage groups --------------------------------------------------------------------------


class _Groups:
    """Union-find of nodes whose values may share storage."""

    def __init__(self) -> None:
        self.parent: dict[fx.Node, fx.Node] = {}

    def find(self, node: fx.Node) -> fx.Node:
        root = self.parent.setdefault(node, node)
        while root is not self.parent[root]:
            root = self.parent[root]
        self.parent[node] = root
        return root

    def union(self, a: fx.Node, b: fx.Node) -> None:
        self.parent[self.find(a)] = self.find(b)


# -- the pass --------------------------------------------------------------------------------


def _constant_attr(gm: fx.GraphModule, node: fx.Node, weights: set[str]) -> bool:
    """Whether ``node`` reads a literal of the model's code: one the capture lifted, or a
    tensor attribute that is neither a parameter nor a buffer; without a gradient."""
    if node.op != "get_attr" or (node.target in weights and
                                 node.target not in gm.meta.get(LIFTED_CONSTANTS, ())):
        return False
    value = _attr(gm, node.target)
    return isinstance(value, torch.Tensor) and _real(value) and not value.requires_grad


def _attr(gm: fx.GraphModule, target: str) -> Any:
    return attr_at(gm, target, None)


def _real(value: torch.Tensor) -> bool:
    return not isinstance(value, FakeTensor) and value.device.type != "meta"


class FoldConstantsPass(PassBase):
    """Compute input- and weight-independent subgraphs once and store their results."""

    def call(self, gm: fx.GraphModule) -> PassResult:
        nodes = list(gm.graph.nodes)
        weights = {name for name, _ in gm.named_parameters()} | \
            {name for name, _ in gm.named_buffers()}
        literal = {n for n in nodes if _constant_attr(gm, n, weights)}
        if not any(_foldable_op(n) and all(i in literal for i in n.all_input_nodes)
                   for n in nodes):
            return PassResult(gm, False)  # nothing starts a constant subgraph
        values = self._evaluate(gm, nodes, literal)
        folded = self._settle(nodes, literal, values)
        buffers = {name for name, _ in gm.named_buffers()}
        modified = self._store(gm, folded, values, _from_buffers(nodes, folded, buffers)) > 0
        for node in reversed(nodes):
            if node in folded and not node.users:
                gm.graph.erase_node(node)  # NB: by hand: DCE keeps in-place ops
                modified = True
        if modified:
            gm.recompile()
        return PassResult(gm, modified)

    @staticmethod
    def _evaluate(gm: fx.GraphModule, nodes: list[fx.Node],
                  literal: set[fx.Node]) -> dict[fx.Node, Any]:
        """Run every node whose inputs are all constant, in graph order, on real values."""
        # NB: copies: an in-place op on a literal must not change the module's attribute
        # (such a graph is not folded, see _settle, but it has run by then).
        values: dict[fx.Node, Any] = {n: _attr(gm, n.target).clone() for n in literal}
        with torch.no_grad(), contextlib.ExitStack() as stack:
            for device in ("cpu", "cuda"):  # the graph's casts are explicit
                if torch.is_autocast_enabled(device):
                    stack.enter_context(torch.autocast(device, enabled=False))
            for node in nodes:
                if node in values or not _foldable_op(node) or \
                        any(i not in values for i in node.all_input_nodes):
                    continue
                args, kwargs = fx.node.map_arg((node.args, node.kwargs), values.__getitem__)
                try:
                    if node.op == "call_method":
                        out = getattr(args[0], node.target)(*args[1:], **kwargs)
                    else:
                        out = node.target(*args, **kwargs)
                except Exception:  # noqa: BLE001 - an op that cannot run now stays per call
                    continue
                if any(isinstance(t, torch.Tensor) and not _real(t) for t in _flat([out])):
                    continue
                values[node] = out
        return values

    @staticmethod
    def _settle(nodes: list[fx.Node], literal: set[fx.Node],
                values: dict[fx.Node, Any]) -> set[fx.Node]:
        """The nodes to fold: evaluated, and clear of the three guards (module docstring)."""
        groups = _Groups()
        written: dict[fx.Node, list[fx.Node]] = {}
        for node in nodes:
            aliased, writes = _effects(node) if node.op != "output" else \
                (_node_inputs(node), _node_inputs(node))
            for a in aliased:
                if isinstance(a, fx.Node):
                    groups.union(node, a)
            written[node] = writes
        position = {n: i for i, n in enumerate(nodes)}
        # a literal written by the graph changes from call to call
        stateful = {groups.find(n) for n in literal}
        folded = set(values)
        while True:
            unsafe: set[fx.Node] = set()  # roots of groups
            too_big: set[fx.Node] = set()
            last_write: dict[fx.Node, int] = {}
            for node in nodes:
                for target in written[node]:
                    root = groups.find(target)
                    if node in folded and root not in stateful:
                        last_write[root] = position[node]
                    else:
                        unsafe.add(root)
            for node in folded:
                outside = [u for u in node.users if u not in folded]
                if not outside:
                    continue
                root = groups.find(node)
                if any(position[u] < last_write.get(root, -1) for u in outside):
                    unsafe.add(root)
                if node not in literal and not _storable(values[node]):
                    too_big.add(node)  # its own value only: the ops before it still fold
            drop = too_big | {n for n in folded if groups.find(n) in unsafe}
            if not drop:
                return folded
            folded -= drop
            for node in nodes:  # what read a dropped node is no longer constant
                if node in folded and node not in literal and \
                        any(i not in folded for i in node.all_input_nodes):
                    folded.discard(node)

    @staticmethod
    def _store(gm: fx.GraphModule, folded: set[fx.Node], values: dict[fx.Node, Any],
               as_buffer: set[fx.Node]) -> int:
        """Replace each folded node read from outside the set by a stored constant: a
        non-persistent buffer if it is in ``as_buffer``, else a plain attribute."""
        stored: list[tuple[str, torch.Tensor, bool]] = []
        count = 0
        for node in list(gm.graph.nodes):
            if node not in folded or node.op == "get_attr" or \
                    all(u in folded for u in node.users):
                continue
            value, buffer = _compact(values[node]), node in as_buffer
            name = next((n for n, v, b in stored if b == buffer and _same(v, value)), None)
            if name is None:
                name = _free_name(gm, _PREFIX + node.name)
                if buffer:
                    gm.register_buffer(name, value, persistent=False)
                else:
                    setattr(gm, name, value)
                stored.append((name, value, buffer))
            with gm.graph.inserting_before(node):
                read = gm.graph.create_node("get_attr", name)
            for key in ("val", "tensor_meta", "stack_trace", "nn_module_stack"):
                if key in node.meta:
                    read.meta[key] = node.meta[key]
            node.replace_all_uses_with(read)
            count += 1
        return count


def _from_buffers(nodes: list[fx.Node], folded: set[fx.Node], buffers: set[str]) -> set[fx.Node]:
    """The folded nodes computed from a literal the capture registered as a buffer."""
    out: set[fx.Node] = set()
    for node in nodes:
        if node in folded and (node.target in buffers if node.op == "get_attr"
                               else any(i in out for i in node.all_input_nodes)):
            out.add(node)
    return out


def _storable(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and \
        value.numel() * value.element_size() <= MAX_FOLDED_BYTES


def _compact(value: torch.Tensor) -> torch.Tensor:
    """``value`` on storage of its own size (a view would keep its whole base alive)."""
    if value.untyped_storage().nbytes() > value.numel() * value.element_size():
        return value.clone()
    return value


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.dtype == b.dtype and a.device == b.device and a.shape == b.shape
            and a.stride() == b.stride() and torch.equal(a, b))


def _free_name(gm: fx.GraphModule, name: str) -> str:
    candidate, i = name, 1
    while hasattr(gm, candidate):
        candidate, i = f"{name}_{i}", i + 1
    return candidate
