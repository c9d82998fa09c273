"""A converted module's submodules are its model's own, at every moment.

A capture builds a module tree of its own: torch.fx's ``GraphModule(model, graph)`` and
torch.export's unlifted module make a plain ``nn.Module`` per path, holding the model's
tensors (*mirrors*). Whatever reads the converted module's tree then reads a copy of the
model's as it was at the capture: ``gm.parameters()``, ``gm.state_dict()``,
``gm.load_state_dict()``, ``gm.head``, ``named_modules()`` and ``isinstance`` checks on them.
After ``model.head = nn.Linear(...)`` an optimizer built over ``gm.parameters()`` would train
the old head, ``gm.state_dict()`` would save it, and a ``load_state_dict`` would load into it.

:func:`adopt_children` makes the converted module's table of children the model's own
``_modules`` dict, the same object, in the converted module and in every graph its cache
keeps (:mod:`.cache`). Every path below the root is then the model's, whatever happens to it:
a child replaced, added or deleted on the model (``model.head = ...``, ``del model.head``) or
on the converted module (``gm.head = ...`` sets the model's), at once, with nothing to follow.
The modules of a graph's own, torch.export's input check ``_guards_fn`` and the sub-graphs of
higher-order ops and fused attention, become plain attributes of the module holding the
graph (exchanged with it, :func:`~.sharing.exchange_graphs`): no helper is a child, so none
is in ``named_modules()``, ``state_dict()`` or a trainer's count of modules in eval mode.

Every path below the root is the model's, including a path where the capture's module holds
more than the model's: torch.export lifts a tensor that the forward makes (HF Llama's
attention blocks make some) into the module that made it, where the model's module does not
hold it. The graph reads such a tensor from a non-persistent buffer of the converted module's
root (out of ``state_dict()``, moved by ``gm.to()``), and a leaf module's copy that the graph
calls from a plain attribute (:func:`adopt_children`); so ``gm.model is model.model``, and
``list(gm.model.layers)`` and FSDP2's ``fully_shard(gm.model.layers[0])`` take the model's
blocks.

One root-level change is left to follow: a tensor replaced on or added to the model's root
(the converted module's root holds the capture's constants beside the model's root tensors,
so its tensor dicts are its own). :func:`register_view` follows it when it happens, through
torch's global registration hooks, and reads the model's set of non-persistent buffer names
live beside its own (:class:`_RootNames`): a buffer the model registers later with
``persistent=False`` stays out of ``gm.state_dict()`` as out of the model's.

What a graph *computes* with is not read through this tree: its weight table binds the
tensor dicts it was captured with (:mod:`amprewrite.runtime.weight_table`), and the cache's
state guard captures again at the next call where a replaced submodule is read by the forward.
So the tree is the view the model's users read, and the guard keeps the computation right.

Before and after, for ``convert(model, (x,))`` of a model with ``fc`` and ``head``::

    gm.head                   # before: Module() holding head.weight, head.bias
    gm._modules is model._modules                           # after: True
    model.head = nn.Linear(16, 3); gm.head is model.head   # after: True, at once
    [n for n, _ in gm.named_children()]                     # after: ['fc', 'head']

and for ``convert(llama, (ids,))`` of an HF ``LlamaForCausalLM``::

    gm.model.layers           # before: Module() (a capture's, holding lifted_tensor_0)
    gm.model is llama.model   # after: True (the graph reads the constant off the root)
"""

from __future__ import annotations

import itertools
import weakref
from typing import Any, Iterator

import torch
import torch.fx as fx
import torch.nn as nn
from torch.nn.modules.module import (register_module_buffer_registration_hook,
                                     register_module_parameter_registration_hook)

from ..runtime.weight_table import WEIGHTS_ATTR, WeightTable, is_fetch
from .cache import cache_of
from .sharing import mirrors

__all__ = ["adopt_children", "register_view", "view_model", "trees"]

_VIEWS: "weakref.WeakKeyDictionary[nn.Module, weakref.WeakSet[fx.GraphModule]]" = \
    weakref.WeakKeyDictionary()
"""model -> the converted modules that are views of it (both weakly: a view keeps its model
alive through its cache, never the other way)."""

_MODEL_OF: "weakref.WeakKeyDictionary[fx.GraphModule, weakref.ref]" = weakref.WeakKeyDictionary()

_hooks_installed = [False]


def adopt_children(gm: fx.GraphModule, model: nn.Module) -> None:
    """Make ``gm``'s table of children the model's (module docstring). What a capture's child
    holds that the model's child does not, its graph reads from elsewhere: a tensor (a
    constant torch.export lifted) from a non-persistent buffer of ``gm``'s root, a module
    (a leaf module's copy) from a plain attribute of ``gm`` (:func:`_move_own_parts`). A
    child at a path the model does not have (torch.export's input check, a sub-graph) becomes
    a plain attribute of ``gm``. Idempotent."""
    theirs = model._modules
    modules = gm.__dict__["_modules"]
    if modules is theirs:
        return
    moved: dict[str, str] = {}
    for name, child in modules.items():
        model_child = theirs.get(name)
        if child is model_child or (model_child is not None and mirrors(child, model_child)):
            continue
        if model_child is None:
            gm.__dict__[name] = child  # the graph's own: read and called as an attribute
        else:
            moved.update(_move_own_parts(gm, name, child, model_child))
    gm.__dict__["_modules"] = theirs
    if moved:
        _retarget(gm, moved)


def _move_own_parts(gm: fx.GraphModule, name: str, child: nn.Module,
                    model_child: nn.Module) -> dict[str, str]:
    """Move what the capture's ``child`` at ``name`` holds beside the model's ``model_child``
    out of the tree: each module that is neither a plain ``nn.Module`` nor the model's one at
    its path (with what it holds) to a plain attribute of ``gm``, each other tensor that is
    not the model's one at its path to a non-persistent root buffer (it follows ``gm.to()``
    and stays out of ``state_dict()``). Returns ``{path the graph reads: new name}``."""
    if type(child) is not nn.Module:  # a leaf module's copy, a graph's own module
        return {name: _plain_attr(gm, name, child)}
    model_modules = dict(model_child.named_modules(remove_duplicate=False))
    moved: dict[str, str] = {}
    own: list[str] = []
    for path, sub in child.named_modules(remove_duplicate=False):
        if not path or any(path.startswith(f"{p}.") for p in own):
            continue
        if type(sub) is not nn.Module and model_modules.get(path) is not sub:
            own.append(path)
            moved[f"{name}.{path}"] = _plain_attr(gm, f"{name}.{path}", sub)
    held = dict(itertools.chain(model_child.named_parameters(remove_duplicate=False),
                                model_child.named_buffers(remove_duplicate=False)))
    for path, tensor in itertools.chain(child.named_parameters(remove_duplicate=False),
                                        child.named_buffers(remove_duplicate=False)):
        if held.get(path) is tensor or any(path.startswith(f"{p}.") for p in own):
            continue
        moved[f"{name}.{path}"] = _root_buffer(gm, f"{name}.{path}", tensor)
    return moved


def _plain_attr(gm: fx.GraphModule, path: str, module: nn.Module) -> str:
    base = path.replace(".", "_")
    new, i = base, 1
    while hasattr(gm, new) or new in gm.__dict__:
        new, i = f"{base}_{i}", i + 1
    gm.__dict__[new] = module
    return new


def _root_buffer(gm: fx.GraphModule, path: str, tensor: torch.Tensor) -> str:
    """The name of a root buffer of ``gm`` holding ``tensor`` (an equal constant another
    graph of the module registered is shared: the graphs share the root's dicts)."""
    base = path.replace(".", "_")
    new, i = base, 1
    while True:
        held = gm._buffers.get(new)
        if held is tensor or (held is not None and not isinstance(held, nn.Parameter)
                              and held.dtype == tensor.dtype and held.device == tensor.device
                              and held.shape == tensor.shape and torch.equal(held, tensor)):
            return new
        if held is None and not hasattr(gm, new) and new not in gm.__dict__:
            gm.register_buffer(new, tensor, persistent=False)
            return new
        new, i = f"{base}_{i}", i + 1


def _retarget(gm: fx.GraphModule, moved: dict[str, str]) -> None:
    """Point the nodes and the weight table of ``gm`` that read a moved path at its new name;
    the caller's :func:`~amprewrite.module.calling.finish` regenerates the code."""
    def new(target: str) -> str:
        for old, name in moved.items():
            if target == old or target.startswith(f"{old}."):
                return name + target[len(old):]
        return target

    def entry(item: tuple[Any, ...]) -> tuple[Any, ...]:
        return (new(item[0]), *item[1:])

    for node in gm.graph.nodes:
        if node.op in ("get_attr", "call_module"):
            node.target = new(str(node.target))
        elif is_fetch(node):
            node.args = (node.args[0], *(entry(item) for item in node.args[1:]))
    table = gm.__dict__.get(WEIGHTS_ATTR)
    if isinstance(table, WeightTable):
        table.entries = tuple(entry(item) for item in table.entries)
        table.rebind(gm)


def register_view(gm: fx.GraphModule, model: nn.Module) -> None:
    """Follow the model's root tensors from now on (module docstring): ``gm``'s children are
    the model's (:func:`adopt_children` was applied to every graph of its cache)."""
    if not _hooks_installed[0]:
        register_module_parameter_registration_hook(_tensor_registered("_parameters"))
        register_module_buffer_registration_hook(_tensor_registered("_buffers"))
        _hooks_installed[0] = True
    _VIEWS.setdefault(model, weakref.WeakSet()).add(gm)
    _MODEL_OF[gm] = weakref.ref(model)
    # NB: a root buffer the model does not hold is a constant of a capture, never saved
    # (a deep copy's root registers every buffer it copies as persistent)
    constants = {name for name in gm._buffers if name not in model._buffers}
    gm.__dict__["_non_persistent_buffers_set"] = _RootNames(
        set(gm._non_persistent_buffers_set) | constants, model._non_persistent_buffers_set)


class _RootNames(set):
    """The converted module's non-persistent root buffers: its own (the capture's constants),
    and the model's, read live (a buffer the model registers later, :func:`register_view`).
    torch reads the set with ``in`` (``state_dict``, ``load_state_dict``)."""

    def __init__(self, own: set[str], model_names: set[str]) -> None:
        super().__init__(own)
        self.model_names = model_names

    def __contains__(self, name: object) -> bool:
        return set.__contains__(self, name) or name in self.model_names

    def __reduce__(self) -> Any:
        return (_RootNames, (set(self), self.model_names))


def view_model(gm: nn.Module) -> nn.Module | None:
    """The model ``gm`` is a view of, or None."""
    ref = _MODEL_OF.get(gm) if isinstance(gm, fx.GraphModule) else None
    return ref() if ref is not None else None


def trees(gm: fx.GraphModule) -> Iterator[fx.GraphModule]:
    """``gm`` and the module of every other graph its cache keeps."""
    yield gm
    cache = cache_of(gm)
    for entry in cache.entries if cache is not None else ():
        if entry.holder is not None and entry.holder is not gm:
            yield entry.holder


def _tensor_registered(kind: str) -> Any:
    def hook(module: nn.Module, name: str, tensor: Any) -> None:
        """Before ``module.<kind>[name] = tensor``: a view holding the model's old tensor at
        its root (the graphs share the root's dicts) takes the new one, and a tensor new to
        the model's root is the view's too."""
        if torch.compiler.is_compiling():
            return None  # NB: Dynamo would guard on the registry of views
        views = _VIEWS.get(module)
        if not views:
            return None
        old = getattr(module, kind).get(name)
        for gm in list(views):
            held = gm.__dict__[kind]
            if name in held and held[name] is old or name not in held and \
                    name not in gm.__dict__ and name not in gm._modules:
                held[name] = tensor  # replaced, or new to the model's root: the view's too
        return None

    return hook
