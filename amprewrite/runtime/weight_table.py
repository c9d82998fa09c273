"""The weight table: every tensor one converted forward reads, fetched in one call.

A converted forward starts with::

    (b_0_l_weight,   # f32[8, 8] or its kept bf16 copy
     b_0_n_weight,   # f32[8]
    ) = self._amp_weights.fetch(cache=self._amp_weight_cache)

and casts each parameter where it is used::

    b_0_l_weight_bf16 = b_0_l_weight.bfloat16()  # bf16[8, 8] kept copy or autograd cast

In the graph, that is a ``fetch`` node whose arguments are the entries,
``weights = _amp_weights.fetch(('b.0.l.weight', torch.bfloat16), ('b.0.n.weight',),
cache = _amp_weight_cache)`` (torch.fx's own code generator writes it so), an item node
``weights[i]`` per entry, named after its tensor, and a cast node
``_amp_weight_cache.cast(b_0_l_weight, torch.bfloat16)``, which the code calls as the dtype's
method (the same thing here, :func:`handed_cast_dtype`); the layout is
:mod:`amprewrite.graph.layout`.

:class:`WeightTable` is the ``_amp_weights`` object: it reads each tensor through two dict
lookups, looks up the cached copies of the parameter casts in batches (so that in inference
each ``cast`` returns the copy it is handed, :mod:`.weight_cache`) and reads O2's stored copies
(:mod:`.low_copies`). The functions below read that spelling off a graph (:func:`is_fetch`,
:func:`read_name`, ...) and undo it (:func:`ungather_weights`); the pass that writes it is
:mod:`amprewrite.passes.gather_weights`.

An entry is ``(name,)`` for a tensor read as it is stored, ``(name, dtype)`` for a parameter
that the forward casts to ``dtype`` (the item is the parameter, or its cached copy where the
cast needs no gradient; only ``cast`` nodes to ``dtype`` use it) and
``(name, dtype, 'low copy')`` for an O2 parameter's stored low-precision copy.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn

from ..errors import AmpRewriteError
from .low_copies import LOW_COPIES_ATTR, LowPrecisionCopies
from .weight_cache import WeightCastCache

__all__ = ["WeightTable", "WEIGHTS_ATTR", "LOW_COPY", "is_fetch", "fetched_entry", "read_name",
           "gathered_cast_dtype", "handed_cast_dtype", "entry_nodes", "ungather_weights",
           "owner_node"]

WEIGHTS_ATTR = "_amp_weights"


LOW_COPY = "low copy"


class WeightTable:
    """Where the tensors of one converted forward live, and how to read them all at once.

    Holds each tensor's owner module and attribute name, so a read is one dict lookup and
    follows a replaced parameter (``module.weight = nn.Parameter(...)``). A copy of the
    GraphModule (``copy.deepcopy``, pickling) copies the table with it, pointing at the copy's
    modules; the cached low-precision copies are never copied (their owners start empty).
    """

    def __init__(self, root: nn.Module, entries: tuple[tuple[Any, ...], ...]) -> None:
        self.entries = entries
        self._groups = _groups(root, entries)
        self._casts = _by_dtype(entries, 2)
        self._low = _by_dtype(entries, 3)

    def rebind(self, root: nn.Module) -> None:
        """Read the tensors from ``root``'s modules and dicts from now on (after ``root``
        was rebuilt around the same tensors: a deep copy's dicts are made afresh)."""
        self._groups = _groups(root, self.entries)

    def fetch(self, *entries: tuple[Any, ...], cache: WeightCastCache | None = None,
              store: LowPrecisionCopies | None = None) -> tuple[torch.Tensor, ...]:
        """The tensors of the table's entries: for a parameter cast, the cached copy from
        ``cache`` where the cast needs no gradient (:meth:`WeightCastCache.lookup_many`); O2
        low copies from ``store`` (the module's own, passed by the graph so that copies of
        the module keep them). ``entries``: the entries the graph's fetch node names, which
        torch.fx's own code generator passes (the converted code does not: it unpacks the
        tensors by the names of the nodes that read them, :mod:`amprewrite.graph.layout`)."""
        if entries and len(entries) != len(self.entries):
            raise AmpRewriteError(
                f"the weight table of this module has {len(self.entries)} entries but the "
                f"forward asks for {len(entries)}: the graph was edited after conversion. "
                "Convert the model again.")
        tensors: list[Any] = [None] * len(self.entries)
        for container, owner, items in self._groups:
            for i, attr in items:
                value = container.get(attr)
                tensors[i] = value if value is not None else getattr(owner, attr)
        out = list(tensors)
        for dtype, indices in self._casts:
            made = cache.lookup_many([tensors[i] for i in indices], dtype)  # type: ignore[union-attr]
            for i, t in zip(indices, made):
                out[i] = t
        for dtype, indices in self._low:
            made = store.get_many([tensors[i] for i in indices], dtype)  # type: ignore[union-attr]
            for i, t in zip(indices, made):
                out[i] = t
        return tuple(out)

    def __repr__(self) -> str:
        return f"WeightTable({len(self.entries)} entries)"


def _by_dtype(entries: tuple[tuple[Any, ...], ...],
              length: int) -> list[tuple[torch.dtype, list[int]]]:
    groups: dict[torch.dtype, list[int]] = {}
    for i, entry in enumerate(entries):
        if len(entry) == length:
            groups.setdefault(entry[1], []).append(i)
    return list(groups.items())


_Group = tuple[dict, nn.Module, tuple[tuple[int, str], ...]]


def _groups(root: nn.Module, entries: tuple[tuple[Any, ...], ...]) -> list[_Group]:
    """Where each entry's tensor is read: ``(dict, owner, ((index, key), ...))`` per dict
    holding some of them (a module's ``_parameters`` or ``_buffers``, else its ``__dict__``),
    each dict once.

    NB: one place per dict, not one per tensor: Dynamo, tracing the read under
    ``torch.compile``, guards that two places holding one object still do (``a is b``, a
    Python guard run on every call), which for a weight and a bias of one module was one
    guard per pair, 10 µs per call of a compiled 50-layer model."""
    groups: dict[int, tuple[dict, nn.Module, list[tuple[int, str]]]] = {}
    for i, entry in enumerate(entries):
        owner_name, _, attr = entry[0].rpartition(".")
        owner = root.get_submodule(owner_name)
        container = owner.__dict__
        for store in ("_parameters", "_buffers"):
            held = owner.__dict__.get(store)
            if held is not None and attr in held:
                container = held
                break
        groups.setdefault(id(container), (container, owner, []))[2].append((i, attr))
    return [(container, owner, tuple(items)) for container, owner, items in groups.values()]


def fetched_entry(node: Any) -> tuple[Any, ...] | None:
    """The table entry that a ``weights[i]`` item of the forward's weight read hands over,
    else None (other nodes)."""
    if isinstance(node, fx.Node) and node.op == "call_function" and \
            node.target is operator.getitem and isinstance(node.args[0], fx.Node) and \
            is_fetch(node.args[0]):
        return node.args[0].args[1 + node.args[1]]
    return None


def read_name(node: Any) -> str | None:
    """The qualified name of the tensor ``node`` reads as stored (a ``get_attr``, or a
    ``weights[i]`` item of a plain entry), else None."""
    if isinstance(node, fx.Node) and node.op == "get_attr":
        return str(node.target)
    entry = fetched_entry(node)
    return entry[0] if entry is not None and len(entry) == 1 else None


def gathered_cast_dtype(node: Any) -> torch.dtype | None:
    """The dtype of an O2 low copy's ``weights[i]`` item, None for other nodes."""
    entry = fetched_entry(node)
    return entry[1] if entry is not None and len(entry) == 3 else None


def handed_cast_dtype(node: Any) -> torch.dtype | None:
    """The dtype of a parameter cast's ``weights[i]`` item (a ``(name, dtype)`` entry: the
    read hands over the cached copy in ``dtype`` where the cast needs no gradient), None for
    other nodes."""
    entry = fetched_entry(node)
    return entry[1] if entry is not None and len(entry) == 2 else None


def entry_nodes(gm: fx.GraphModule) -> dict[str, str]:
    """Tensor name -> the name of the first node that reads it (a ``get_attr``, or a gathered
    ``weights[i]`` item)."""
    out: dict[str, str] = {}
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            out.setdefault(str(node.target), node.name)
        elif node.op == "call_function" and node.target is operator.getitem and \
                isinstance(node.args[0], fx.Node) and is_fetch(node.args[0]):
            out.setdefault(node.args[0].args[1 + node.args[1]][0], node.name)
    return out


def is_fetch(node: fx.Node) -> bool:
    return node.op == "call_method" and node.target == "fetch" and bool(node.args) and \
        isinstance(node.args[0], fx.Node) and node.args[0].target == WEIGHTS_ATTR


def ungather_weights(gm: fx.GraphModule, source: nn.Module | None = None) -> None:
    """Undo :class:`GatherWeightsPass`: one ``get_attr`` per tensor, read by the parameter
    casts (which stay where they are) and by one O2 ``get`` node per low copy, as the other
    passes expect them.

    ``source``: the module whose attributes the tensors are (when ``gm`` is a new
    GraphModule built from a gathered graph, it holds only the table, not the tensors)."""
    from torch.fx.graph_module import _copy_attr

    graph = gm.graph
    for fetch in [n for n in graph.nodes if is_fetch(n)]:
        holder, *entries = fetch.args
        items = sorted(fetch.users, key=lambda item: item.args[1])
        names = {entries[item.args[1]][0] for item in items}
        for name in sorted(names):
            if source is not None:
                _copy_attr(source, gm, name)
        reads: dict[str, fx.Node] = {}
        low_copies = []
        # Reads first (plain entries and the parameters that casts read): they become
        # get_attr nodes in place, a second read of one tensor is merged into the first.
        for item in items:
            entry = entries[item.args[1]]
            if len(entry) == 3:
                low_copies.append((item, entry))
                continue
            if entry[0] in reads:
                item.replace_all_uses_with(reads[entry[0]])
                graph.erase_node(item)
            else:
                item.op, item.target, item.args, item.kwargs = "get_attr", entry[0], (), {}
                reads[entry[0]] = item
        for item, entry in low_copies:
            if entry[0] not in reads:
                with graph.inserting_before(item):
                    reads[entry[0]] = graph.get_attr(entry[0])
            owner = owner_node(graph, LOW_COPIES_ATTR, gm, source)
            item.op, item.target = "call_method", "get"
            item.args, item.kwargs = (owner, reads[entry[0]], entry[1]), {}
        graph.erase_node(fetch)
        graph.erase_node(holder)
    if WEIGHTS_ATTR in gm.__dict__:
        delattr(gm, WEIGHTS_ATTR)
    graph.lint()
    gm.recompile()


def owner_node(graph: fx.Graph, attr: str, gm: fx.GraphModule,
                source: nn.Module | None) -> fx.Node:
    if attr not in gm.__dict__ and source is not None and attr in source.__dict__:
        setattr(gm, attr, source.__dict__[attr])
    for node in graph.nodes:
        if node.op == "get_attr" and node.target == attr:
            return node
    first = next(n for n in graph.nodes if n.op != "placeholder")
    with graph.inserting_before(first):
        return graph.create_node("get_attr", attr)
