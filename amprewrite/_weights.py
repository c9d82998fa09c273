"""GatherWeightsPass: every parameter and buffer read of a forward, and every parameter cast,
in one call at its start.

Why: a converted graph reads each weight through a chain of ``nn.Module.__getattr__`` calls
(``getattr(self.layers, "3").attn.q_proj.weight``, about 1 µs a level) and casts it with a
Python call per weight; ``torch.autocast`` pays a C++ dispatch per cast instead. For a small
model run eagerly (GPU training of small and medium models, launch-bound) that Python is the
step time. After this pass one call reads every tensor through dict lookups and casts all
trainable parameters in one batch (one autograd node; on every device two kernels per group
of weights instead of one per weight), and ``gm.code`` still names each weight and its dtype.

Before::

    b_0_l_weight = getattr(self.b, "0").l.weight
    b_0_l_weight_bf16 = _amp_weight_cache.cast(b_0_l_weight, torch.bfloat16)
    b_0_n_weight = getattr(self.b, "0").n.weight

After::

    weights = _amp_weights.fetch(('b.0.l.weight', torch.bfloat16), ('b.0.n.weight',),
                                 cache = _amp_weight_cache)
    b_0_l_weight_bf16 = weights[0]
    b_0_n_weight = weights[1]

An entry is ``(name,)`` for a tensor read as it is stored, ``(name, dtype)`` for a parameter
cast (autograd-tracked in training, a cached copy in inference: see
:mod:`amprewrite._weight_cache`) and ``(name, dtype, 'low copy')`` for an O2 parameter's stored
low-precision copy (:mod:`amprewrite._low_copies`).

NB: only *parameters* have their casts gathered. A buffer can be written in place during the
forward (a static KV cache, BatchNorm's running statistics): its cast stays where the graph
had it, reading the buffer's value at that point.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn
from torch.fx.passes.infra.pass_base import PassBase, PassResult

from ._errors import AmpRewriteError
from ._low_copies import LOW_COPIES_ATTR, LowPrecisionCopies
from ._meta import cast_info
from ._weight_cache import CACHE_ATTR, WeightCastCache

__all__ = ["GatherWeightsPass", "WeightTable", "WEIGHTS_ATTR", "gather_weights",
           "ungather_weights", "is_fetch", "read_name", "gathered_cast_dtype", "entry_nodes"]

WEIGHTS_ATTR = "_amp_weights"
_LOW = "low copy"


class WeightTable:
    """Where the tensors of one converted forward live, and how to read them all at once.

    Holds each tensor's owner module and attribute name, so a read is two dict lookups and
    follows a replaced parameter (``module.weight = nn.Parameter(...)``). A copy of the
    GraphModule (``copy.deepcopy``, pickling) copies the table with it, pointing at the copy's
    modules; the cached low-precision copies are never copied (their owners start empty).
    """

    def __init__(self, root: nn.Module, entries: tuple[tuple[Any, ...], ...]) -> None:
        self.entries = entries
        self._slots = [_slot(root, entry[0]) for entry in entries]
        self._casts = _by_dtype(entries, 2)
        self._low = _by_dtype(entries, 3)

    def fetch(self, *entries: tuple[Any, ...], cache: WeightCastCache | None = None,
              store: LowPrecisionCopies | None = None) -> tuple[torch.Tensor, ...]:
        """The tensors of ``entries`` (the table's own, repeated in the generated code so that
        it shows them), cast where an entry names a dtype: parameter casts by ``cache``, O2
        low copies from ``store`` (the module's own, passed by the graph so that copies of the
        module keep them)."""
        if len(entries) != len(self._slots):
            raise AmpRewriteError(
                f"the weight table of this module has {len(self._slots)} entries but the "
                f"forward asks for {len(entries)}: the graph was edited after conversion. "
                "Convert the model again.")
        tensors = [_read(slot) for slot in self._slots]
        out = list(tensors)
        for dtype, indices in self._casts:
            made = cache.cast_many([tensors[i] for i in indices], dtype)  # type: ignore[union-attr]
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


def _slot(root: nn.Module, name: str) -> tuple[Any, str, nn.Module]:
    """(the dict holding the tensor, its key, its owner) for a qualified attribute name."""
    owner_name, _, attr = name.rpartition(".")
    owner = root.get_submodule(owner_name)
    for store in ("_parameters", "_buffers"):
        container = owner.__dict__.get(store)
        if container is not None and attr in container:
            return container, attr, owner
    return owner.__dict__, attr, owner


def _read(slot: tuple[Any, str, nn.Module]) -> torch.Tensor:
    container, attr, owner = slot
    value = container.get(attr)
    return value if value is not None else getattr(owner, attr)


# ---------------------------------------------------------------------------------------------
class GatherWeightsPass(PassBase):
    """Replace the graph's tensor ``get_attr`` reads and parameter casts by one
    ``_amp_weights.fetch(...)`` call and an item per tensor (see the module docstring).

    The items keep the names and metadata of the nodes they replace, so decisions, ``explain``
    and the auditor keep referring to ``b_0_l_weight_bf16``. A graph that already has a fetch
    is left alone (idempotent); :func:`ungather_weights` undoes the pass.
    """

    def call(self, gm: fx.GraphModule) -> PassResult:
        graph = gm.graph
        if any(is_fetch(n) for n in graph.nodes):
            return PassResult(gm, False)
        reads = [n for n in graph.nodes if n.op == "get_attr"
                 and isinstance(_attr(gm, str(n.target)), torch.Tensor)]
        if not reads:
            return PassResult(gm, False)
        from ._eliminate_casts import _mutated

        index: dict[tuple[Any, ...], int] = {}  # entry -> its position (one per tensor/dtype)
        replaced: list[tuple[fx.Node, int]] = []
        for read in reads:
            name = str(read.target)
            value = _attr(gm, name)
            gathered = [u for u in read.users if _parameter_cast(u, read)] \
                if isinstance(value, nn.Parameter) and not _mutated(read) else []
            found = [((name,), read)] if any(u not in gathered for u in read.users) else []
            # NB: casts the graph kept apart for the model's no_grad regions are one entry
            # here: hoisted to the start, they all run in the caller's grad mode.
            found += [((name, c.args[2], _LOW) if c.target == "get" else (name, c.args[2]), c)
                      for c in gathered]
            for entry, node in found:
                replaced.append((node, index.setdefault(entry, len(index))))
        entries = tuple(index)
        table = WeightTable(gm, entries)
        setattr(gm, WEIGHTS_ATTR, table)
        anchor = [n for n in graph.nodes if n.op == "placeholder"]
        with graph.inserting_after(anchor[-1]) if anchor else \
                graph.inserting_before(next(iter(graph.nodes))):
            # NB: create_node: the table is a plain attribute, which get_attr warns on.
            holder = graph.create_node("get_attr", WEIGHTS_ATTR)
        owners, last = {}, holder
        for key, attr, length in (("cache", CACHE_ATTR, 2), ("store", LOW_COPIES_ATTR, 3)):
            if any(len(e) == length for e in entries):
                owners[key] = _owner_node(graph, attr, gm, None)
                last.append(owners[key])  # moved next to the table: the fetch reads both
                last = owners[key]
        with graph.inserting_after(last):
            fetch = graph.create_node("call_method", "fetch", (holder, *entries), owners,
                                      name="weights")
        # Each replaced node becomes its item in place (FX never reuses an erased node's name,
        # and decisions refer to these names), moved to just after the fetch.
        previous = fetch
        for node, i in sorted(replaced, key=lambda pair: pair[1]):
            node.op, node.target = "call_function", operator.getitem
            node.args, node.kwargs = (fetch, i), {}
            previous.append(node)
            previous = node
        for read in reads:
            if read.op == "get_attr" and not read.users:
                graph.erase_node(read)
        graph.lint()
        gm.recompile()
        return PassResult(gm, True)


def gather_weights(gm: fx.GraphModule) -> fx.GraphModule:
    """Run :class:`GatherWeightsPass` and drop the cast-cache reads it left unused."""
    GatherWeightsPass()(gm)
    for node in list(gm.graph.nodes):
        if node.op == "get_attr" and node.target in (CACHE_ATTR, LOW_COPIES_ATTR) \
                and not node.users:
            gm.graph.erase_node(node)
    gm.recompile()
    return gm


def _attr(gm: nn.Module, target: str) -> Any:
    obj: Any = gm
    for part in target.split("."):
        obj = getattr(obj, part, None)
    return obj


def _parameter_cast(node: fx.Node, read: fx.Node) -> bool:
    """``_amp_weight_cache.cast(read, dtype)`` or O2's ``_amp_low_copies.get(read, dtype)``."""
    info = cast_info(node)
    return (info is not None and info.weight and node.op == "call_method"
            and node.target in ("cast", "get") and len(node.args) == 3
            and node.args[1] is read)


def read_name(node: Any) -> str | None:
    """The qualified name of the tensor ``node`` reads as stored (a ``get_attr``, or a
    ``weights[i]`` item of a plain entry), else None."""
    if not isinstance(node, fx.Node):
        return None
    if node.op == "get_attr":
        return str(node.target)
    if node.op == "call_function" and node.target is operator.getitem and \
            isinstance(node.args[0], fx.Node) and is_fetch(node.args[0]):
        entry = node.args[0].args[1 + node.args[1]]
        return entry[0] if len(entry) == 1 else None
    return None


def gathered_cast_dtype(node: Any) -> torch.dtype | None:
    """The dtype a ``weights[i]`` item casts its parameter to, None for other nodes."""
    if isinstance(node, fx.Node) and node.op == "call_function" and \
            node.target is operator.getitem and isinstance(node.args[0], fx.Node) and \
            is_fetch(node.args[0]):
        entry = node.args[0].args[1 + node.args[1]]
        return entry[1] if len(entry) > 1 else None
    return None


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
    """Undo :class:`GatherWeightsPass`: one ``get_attr`` per tensor and one cast node per
    parameter cast, as the other passes expect them.

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
        for item in items:  # plain reads first: they become get_attr nodes in place
            entry = entries[item.args[1]]
            if len(entry) == 1 and entry[0] not in reads:
                item.op, item.target, item.args, item.kwargs = "get_attr", entry[0], (), {}
                reads[entry[0]] = item
        for item in items:
            entry = entries[item.args[1]] if item.op == "call_function" else None
            if entry is None:
                continue
            if entry[0] not in reads:
                with graph.inserting_before(item):
                    reads[entry[0]] = graph.get_attr(entry[0])
            if len(entry) == 1:  # a second plain read of one tensor
                item.replace_all_uses_with(reads[entry[0]])
                graph.erase_node(item)
                continue
            owner = _owner_node(graph, LOW_COPIES_ATTR if len(entry) == 3 else CACHE_ATTR,
                                gm, source)
            item.op, item.target = "call_method", "get" if len(entry) == 3 else "cast"
            item.args, item.kwargs = (owner, reads[entry[0]], entry[1]), {}
        graph.erase_node(fetch)
        graph.erase_node(holder)
    if WEIGHTS_ATTR in gm.__dict__:
        delattr(gm, WEIGHTS_ATTR)
    graph.lint()
    gm.recompile()


def _owner_node(graph: fx.Graph, attr: str, gm: fx.GraphModule,
                source: nn.Module | None) -> fx.Node:
    if attr not in gm.__dict__ and source is not None and attr in source.__dict__:
        setattr(gm, attr, source.__dict__[attr])
    for node in graph.nodes:
        if node.op == "get_attr" and node.target == attr:
            return node
    first = next(n for n in graph.nodes if n.op != "placeholder")
    with graph.inserting_before(first):
        return graph.create_node("get_attr", attr)
