"""What the graphs of one converted module share: the module's tensors, hooks and stores.

A converted module keeps several graphs (:mod:`.cache`: one per mode, state and set of
inputs) and holds one of them at a time. The others are converted GraphModules of their own,
*holders*, kept out of the module's tree (the ``state_dict`` keys, ``named_modules()`` and
``parameters()`` are the ones a single graph has), that read every tensor from the module:
their root ``_parameters`` / ``_buffers`` dicts (and hook dicts) are the module's own dict
objects (:func:`share_state`, :func:`share_root_state`), so ``.to()``, ``load_state_dict``
and an optimizer's steps reach every graph, and so do the cached weight casts and O2's
low-precision copies (:func:`share_runtime`). Only what belongs to one graph is its own
(:data:`_GRAPH_ATTRS`: the graph, its code, its ``meta``, its weight table; torch.export's
input check, the sub-graphs of higher-order ops; the submodules of a capture of another
state).

**Holding a graph** exchanges the two modules' own parts (:func:`exchange_graphs`, a few dict
writes), so the module *is* the graph it holds for everything that reads it: its call,
``gm.graph`` and ``gm.code``, ``torch.export.export(gm)`` (which interprets ``gm.graph`` and
never calls ``gm``), ``explain`` and the auditor.
"""

from __future__ import annotations

import itertools
from typing import Any, Iterator

import torch
import torch.fx as fx
import torch.nn as nn

from ..graph.meta import MODE_KEY
from ..runtime.low_copies import LOW_COPIES_ATTR
from ..runtime.weight_cache import CACHE_ATTR
from ..runtime.weight_table import WEIGHTS_ATTR, WeightTable
from ..capture.guards import InputGuards

__all__ = ["FORWARD_ATTR", "share_state", "share_root_state", "share_runtime",
           "exchange_graphs", "relink_graph", "mirrors", "own_modules"]

FORWARD_ATTR = "_amp_forward"
"""``gm.__dict__[FORWARD_ATTR]``: the generated forward of the graph ``gm`` holds, which the
class's ``forward`` calls (:func:`amprewrite.module.calling.finish`)."""

_GRAPH_ATTRS = ("_graph", "_code", "_lineno_map", "_prologue_start", "meta", "_in_spec",
                "_out_spec", "_tracer_cls", "_tracer_extras", WEIGHTS_ATTR, FORWARD_ATTR)
"""What :func:`exchange_graphs` exchanges: one graph's own instance attributes."""

_SHARED_DICTS = ("_parameters", "_buffers", "_non_persistent_buffers_set",
                 "_forward_hooks", "_forward_hooks_with_kwargs", "_forward_hooks_always_called",
                 "_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_backward_hooks",
                 "_backward_pre_hooks", "_state_dict_hooks", "_state_dict_pre_hooks",
                 "_load_state_dict_pre_hooks", "_load_state_dict_post_hooks")
"""What every graph shares with the module: its root tensors, and the hooks a user or a
library registers on the module (they run whatever graph it holds)."""


# ---------------------------------------------------------------------------------------------
# one set of tensors
def share_state(main: fx.GraphModule, other: fx.GraphModule, view: bool = False) -> None:
    """Make ``other`` (a fresh capture of the other mode, before its passes) read its tensors
    and submodules from ``main``: the same root dicts, the same children. A tensor or child
    that ``main`` lacks is added to ``main`` (a parameter the other mode alone uses is still
    the model's); a root tensor of the same name but another value (a constant lifted out of
    the other mode's code) is added under a new name, read by ``other``'s graph. ``view``:
    ``main``'s children are the model's (:mod:`.tree`), to which nothing is added: a child
    of ``other`` that is not a mirror of one of them is ``other``'s own."""
    share_root_state(main, other, suffix="train" if other.meta.get(MODE_KEY) else "eval")
    own = {}
    for name, child in other._modules.items():
        held = main._modules.get(name)
        if held is not None and held is not child and mirrors(child, held):
            continue  # ``main`` holds the model's own child (.tree), or the same mirror
        if view and held is not child:
            own[name] = child
        elif held is None and _holds_state(child):
            main.add_module(name, child)
        elif held is None or (held is not child and not _merge(held, child)):
            own[name] = child  # a graph's own: its input check, a sub-graph
    other.__dict__["_modules"] = {**main._modules, **own}  # the passes may add to it


def share_root_state(main: fx.GraphModule, other: fx.GraphModule, suffix: str) -> None:
    """Make ``other`` (a fresh capture, before its passes) read its root tensors from
    ``main``'s root dicts, and run ``main``'s root hooks; a root tensor that ``main`` holds
    under the same name with another value is added as ``<name>_<suffix>`` and read by
    ``other``'s graph. Its submodules stay its own."""
    for name, tensor in list(itertools.chain(other._parameters.items(), other._buffers.items())):
        held = main._parameters.get(name, main._buffers.get(name))
        if tensor is None or held is tensor or (held is not None and _same_constant(held, tensor)):
            continue
        if held is None:
            _register(main, name, tensor, name not in other._non_persistent_buffers_set)
            continue
        new = _free_name(main, f"{name}_{suffix}")
        _register(main, new, tensor, False)
        for node in other.graph.find_nodes(op="get_attr", target=name):
            node.target = new
    for attr in _SHARED_DICTS:
        other.__dict__[attr] = main.__dict__[attr]


def share_runtime(main: fx.GraphModule, other: fx.GraphModule) -> None:
    """One cache of weight casts and one store of O2 low-precision copies for both graphs
    (each graph's passes made its own): twice the copies would cost twice the memory."""
    for attr in (CACHE_ATTR, LOW_COPIES_ATTR):
        if attr in main.__dict__ and attr in other.__dict__:
            other.__dict__[attr] = main.__dict__[attr]


def _same_constant(a: torch.Tensor, b: torch.Tensor) -> bool:
    return not isinstance(a, nn.Parameter) and a.dtype == b.dtype and a.device == b.device \
        and a.shape == b.shape and torch.equal(a, b)


def _register(module: nn.Module, name: str, tensor: torch.Tensor, persistent: bool) -> None:
    if isinstance(tensor, nn.Parameter):
        module.register_parameter(name, tensor)
    else:
        module.register_buffer(name, tensor, persistent=persistent)


def _free_name(module: nn.Module, name: str) -> str:
    candidate, i = name, 1
    while hasattr(module, candidate):
        candidate, i = f"{name}_{i}", i + 1
    return candidate


def mirrors(child: Any, model_child: nn.Module) -> bool:
    """Whether ``child`` (a capture's module at a path) is a mirror of ``model_child``: plain
    ``nn.Module`` objects (or the model's own modules) holding only ``model_child``'s tensors,
    under the same names, so the model's module can stand for it. NB: not where it holds a
    leaf module's copy that the graph calls (:func:`~amprewrite.capture.symbolic.
    unshare_leaf_modules`), which runs in the converted module's mode, not the model's."""
    if child is None or isinstance(child, (fx.GraphModule, InputGuards)):
        return False
    theirs = dict(model_child.named_modules(remove_duplicate=False))
    if any(type(sub) is not nn.Module and theirs.get(path) is not sub
           for path, sub in child.named_modules(remove_duplicate=False)):
        return False
    held = dict(_tensors(model_child))
    return all(held.get(name) is tensor for name, tensor in _tensors(child))


def _holds_state(module: nn.Module) -> bool:
    """A part of the model (it holds parameters or buffers), not one graph's own module."""
    return not isinstance(module, (fx.GraphModule, InputGuards)) and \
        next(itertools.chain(module.parameters(), module.buffers()), None) is not None


def _tensors(module: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    return itertools.chain(module.named_parameters(remove_duplicate=False),
                           module.named_buffers(remove_duplicate=False))


def _merge(held: nn.Module, child: nn.Module) -> bool:
    """Whether ``child`` (the other capture's) is ``held`` (``main``'s) as far as ``child``'s
    graph can tell: the same kind of module, holding the same tensors where both hold one.
    If so, the tensors only ``child`` holds are added to ``held``."""
    if type(held) is not type(child) or not _holds_state(child):
        return False
    held_modules = dict(held.named_modules(remove_duplicate=False))
    if any(name in held_modules and type(held_modules[name]) is not type(sub)
           for name, sub in child.named_modules(remove_duplicate=False)):
        return False
    held_tensors = dict(_tensors(held))
    missing = []
    for name, tensor in _tensors(child):
        if name not in held_tensors:
            missing.append((name, tensor))
        elif held_tensors[name] is not tensor:
            return False
    for name, tensor in missing:
        prefix, _, attr = name.rpartition(".")
        # NB: where a submodule holds the model's own tensor dicts (model_watch), a tensor the
        # other capture found there is already in them: nothing is written.
        owner = held
        for part in prefix.split(".") if prefix else ():
            if part not in owner._modules:
                owner.add_module(part, nn.Module())
            owner = owner._modules[part]
        source = child.get_submodule(prefix)
        _register(owner, attr, tensor, attr not in source._non_persistent_buffers_set)
    return True


def exchange_graphs(gm: fx.GraphModule, other: fx.GraphModule) -> None:
    """Exchange what belongs to one graph (:data:`_GRAPH_ATTRS`, its generated forward among
    them) and the submodules the two do not share, between ``gm`` and
    ``other``. NB: the classes' ``forward`` stay: a bound ``gm.forward`` that a library kept
    (accelerate's autocast wrapper) runs whatever graph ``gm`` holds when it is called."""
    mine, theirs = gm.__dict__, other.__dict__
    owned = tuple(_plain_attrs(gm) | _plain_attrs(other))
    for attr in _GRAPH_ATTRS + owned:
        a, b = mine.pop(attr, _MISSING), theirs.pop(attr, _MISSING)
        if b is not _MISSING:
            mine[attr] = b
        if a is not _MISSING:
            theirs[attr] = a
    if gm._modules is other._modules:
        return  # the model's own children (.tree); the graphs' own modules are owned above
    for name in set(gm._modules) | set(other._modules):  # the graphs' own modules
        a, b = gm._modules.get(name), other._modules.get(name)
        if a is not b:
            _put(gm._modules, name, b)
            _put(other._modules, name, a)


_MISSING = object()

_RUNTIME_ATTRS = (CACHE_ATTR, LOW_COPIES_ATTR)
"""One per module, whatever graph it holds (:func:`share_runtime`): never exchanged."""


def _plain_attrs(gm: fx.GraphModule) -> set[str]:
    """Plain attributes of ``gm`` its graph reads or calls (a constant a pass stored with
    ``setattr``; torch.export's input check and the sub-graphs, kept out of the tree of a
    converted module whose children are the model's, :mod:`.tree`): the graph's own,
    exchanged with it."""
    own = gm.__dict__
    nodes = [*gm.graph.find_nodes(op="get_attr"), *gm.graph.find_nodes(op="call_module")]
    return {str(n.target) for n in nodes
            if "." not in str(n.target) and str(n.target) in own
            and str(n.target) not in _RUNTIME_ATTRS and str(n.target) not in _GRAPH_ATTRS}


def own_modules(gm: fx.GraphModule) -> list[nn.Module]:
    """The modules of the graph ``gm`` holds that are plain attributes of ``gm``, not children
    (:mod:`.tree`): a ``gm.train()`` recursing over the children does not reach them."""
    own = gm.__dict__
    return [own[name] for name in _plain_attrs(gm) if isinstance(own[name], nn.Module)]


def _put(modules: dict[str, Any], name: str, module: Any) -> None:
    if module is None:
        modules.pop(name, None)
    else:
        modules[name] = module


def relink_graph(main: fx.GraphModule, holder: fx.GraphModule) -> None:
    """Share ``main``'s tensors with ``holder`` again after ``main`` was rebuilt
    (``copy.deepcopy`` builds the copy's dicts afresh), and point its weight table at the
    rebuilt modules."""
    for attr in _SHARED_DICTS:
        holder.__dict__[attr] = main.__dict__[attr]
    if holder._modules is not main._modules:  # else both hold the model's own (.tree)
        own = {k: v for k, v in holder._modules.items() if main._modules.get(k) is not v}
        holder.__dict__["_modules"] = {**main._modules, **own}
    share_runtime(main, holder)
    rebind_table(holder)


def rebind_table(gm: fx.GraphModule) -> None:
    table = gm.__dict__.get(WEIGHTS_ATTR)
    if isinstance(table, WeightTable):
        table.rebind(gm)
