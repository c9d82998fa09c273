"""What the converted module shares with its model, kept shared after conversion.

``convert(model, ...)`` returns a GraphModule whose parameters and buffers are the model's
own tensors, held by modules of its own. Two things done to the *model* afterwards would not
reach it: a tensor replaced on the model (``model.fc.weight = nn.Parameter(w)``,
``model.load_state_dict(sd, assign=True)``), which the converted module would never read
while an optimizer over ``model.parameters()`` trains it; and a hook registered on one of the
model's submodules, which the converted graph never calls (it calls no submodule of the
model). :class:`ModelWatch` checks for both at the start of each call, but only when
something of the kind happened anywhere in the process since its last check: a tensor was
registered on some module, or a hook handle was made (:func:`changes`, two integer reads on
the common path). Then it

* follows a replaced tensor: the converted module takes the model's new one, so it computes
  with what the model holds and what its optimizer trains;
* warns once about a tensor replaced on the converted module instead (``gm.load_state_dict(sd,
  assign=True)``), which the model no longer shares: saving the model would save the old one;
* warns once per hook registered on the model's submodules after conversion (not on a
  layer the graph calls, which runs its hooks itself: the symbolic capture's batch norm).

O3 modules are their own low-precision copy of the model (``convert`` says so): no watch.
A copy of the converted module (``copy.deepcopy``, pickling) shares nothing with the model,
so it carries no watch either.
"""

from __future__ import annotations

import warnings
import weakref
from typing import Any, NamedTuple

import torch
import torch.fx
import torch.nn as nn
from torch.nn.modules.module import (register_module_buffer_registration_hook,
                                     register_module_parameter_registration_hook)
from torch.nn.modules import module as nn_module
from torch.utils.hooks import RemovableHandle

from ..errors import user_stacklevel

__all__ = ["ModelWatch", "watch_model", "share_tensor_dicts", "share_root_parameters", "changes",
           "report_global_hooks", "own_global_hooks"]

_HOOK_DICTS = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks")

_registrations = [0]
_counting = [False]


def _count_registration(module: nn.Module, name: str, value: Any) -> None:
    _registrations[0] += 1  # NB: returns None, or the value would replace the tensor


def changes() -> tuple[int, int]:
    """A stamp that moves whenever a parameter or buffer is registered on any module or any
    hook handle is made.

    NB: hook registrations are counted by ``RemovableHandle.next_id``, the class-wide counter
    that numbers every handle torch makes (``register_forward_hook`` and the others): torch
    offers no global hook for hook registration. ``test_stale_weights`` checks it still moves.
    """
    return _registrations[0], RemovableHandle.next_id


class _Slot(NamedTuple):
    name: str
    kind: str
    """``"_parameters"`` or ``"_buffers"``."""
    attr: str
    model_owner: weakref.ref
    """The model's module holding it, weakly: the watch must keep no tensor of the model
    alive (a replaced parameter would live as long as the converted module)."""
    own_owner: nn.Module


class ModelWatch:
    """Keeps a converted module's tensors the model's own, and reports model hooks it cannot
    run (module docstring)."""

    def __init__(self, gm: torch.fx.GraphModule, model: nn.Module) -> None:
        if not _counting[0]:
            register_module_parameter_registration_hook(_count_registration)
            register_module_buffer_registration_hook(_count_registration)
            _counting[0] = True
        self._model = weakref.ref(model)
        self._slots = _shared_slots(gm, model)
        self._shared = [weakref.ref(_held(s.own_owner, s)) for s in self._slots]
        """Each slot's tensor as last shared, weakly (see _Slot.model_owner)."""
        self._hooks = set(_hook_ids(model))
        self._called = frozenset(str(n.target) for n in gm.graph.find_nodes(op="call_module"))
        """The model's submodules the graph calls (the layers a symbolic capture keeps
        whole): they run their hooks, whenever registered."""
        self._warned: set[Any] = set()
        self._stamp = changes()

    def check(self) -> None:
        """Run at the start of each call of the converted module (:mod:`amprewrite.module.calling`)."""
        stamp = changes()
        if stamp == self._stamp:
            return
        self._stamp = stamp
        model = self._model()
        if model is None:
            return  # the model is gone: nothing left to share with
        self._follow_replaced()
        self._report_new_hooks(model)

    def _follow_replaced(self) -> None:
        diverged = []
        for i, slot in enumerate(self._slots):
            owner = slot.model_owner()
            if owner is None:
                continue
            theirs, ours = _held(owner, slot), _held(slot.own_owner, slot)
            if theirs is not self._shared[i]() and theirs is not None:
                getattr(slot.own_owner, slot.kind)[slot.attr] = theirs
                self._shared[i] = weakref.ref(theirs)
            elif ours is not theirs and ("replaced", slot.name) not in self._warned:
                self._warned.add(("replaced", slot.name))
                diverged.append(slot.name)
        if diverged:
            names = ", ".join(map(repr, diverged[:6])) + (", ..." if len(diverged) > 6 else "")
            warnings.warn(
                f"amprewrite: {len(diverged)} tensor{'s were' if len(diverged) > 1 else ' was'} "
                f"replaced on the converted module after conversion ({names}); the model it "
                "was converted from still holds the old ones, so saving or evaluating that "
                "model uses the old values. Replace them on the model instead (the converted "
                "module follows the model), or save the converted module's state_dict().",
                stacklevel=user_stacklevel())

    def _report_new_hooks(self, model: nn.Module) -> None:
        for name, module in model.named_modules():
            if name in self._called:
                continue
            for kind in _HOOK_DICTS:
                for hook_id in getattr(module, kind, {}):
                    if hook_id in self._hooks or hook_id in self._warned:
                        continue
                    self._warned.add(hook_id)
                    where = f"submodule {name!r}" if name else "the model itself"
                    what = kind.strip("_").replace("_hooks", " hook").replace("_", " ")
                    warnings.warn(
                        f"amprewrite: a {what} was registered on {where} "
                        f"({type(module).__name__}) after conversion; the converted module "
                        "does not run it (its graph calls none of the model's submodules). "
                        "Register the hook before amprewrite.convert (the capture records "
                        "what it computes), or register it on the converted module itself "
                        "(gm.register_forward_hook(...) runs around each call).",
                        stacklevel=user_stacklevel())

    # A copy of the converted module has tensors of its own: nothing to keep shared.
    def __deepcopy__(self, memo: dict) -> None:
        return None

    def __reduce__(self) -> Any:
        return (_no_watch, ())


def _no_watch() -> None:
    return None


def _held(owner: nn.Module, slot: _Slot) -> Any:
    return getattr(owner, slot.kind).get(slot.attr)


def _hook_ids(model: nn.Module) -> list[int]:
    return [hook_id for m in model.modules() for kind in _HOOK_DICTS
            for hook_id in getattr(m, kind, {})]


def _shared_slots(gm: nn.Module, model: nn.Module) -> list[_Slot]:
    """The parameters and buffers that ``gm`` and ``model`` hold under the same name and
    share (the same tensor object)."""
    slots = []
    for name, module in gm.named_modules(remove_duplicate=False):
        for kind in ("_parameters", "_buffers"):
            for attr, tensor in getattr(module, kind).items():
                qualified = f"{name}.{attr}" if name else attr
                try:
                    owner = model.get_submodule(name)
                except AttributeError:
                    continue
                if tensor is not None and getattr(owner, kind).get(attr) is tensor:
                    slots.append(_Slot(qualified, kind, attr, weakref.ref(owner), module))
    return slots


_TENSOR_DICTS = ("_parameters", "_buffers", "_non_persistent_buffers_set")


def share_tensor_dicts(gm: nn.Module, model: nn.Module) -> int:
    """Make each submodule of ``gm`` hold the ``_parameters``, ``_buffers`` and
    ``_non_persistent_buffers_set`` of the model's submodule at the same path, where it holds
    the same tensors under the same names (a subset: the symbolic capture keeps the ones its
    graph reads). Returns how many submodules now share.

    Why: a tensor the model's code (or a library: accelerate's device-map loading writes
    ``module._parameters[name] = t``) puts in one of those dicts is then the converted
    module's at once, at no cost per call; ``setattr``, ``load_state_dict(assign=True)`` and
    ``module.to()`` all end there. At the root, only ``_parameters`` is shared (its buffers
    hold constants of the capture beside the model's own tensors): FSDP2's ``fully_shard(gm)``
    swaps the root's parameters by writing that dict, and a capture at a later call (the
    first call, a new state) reads them through the model, so both must see the same
    (sharded, then all-gathered) parameters, not the model's unsharded originals."""
    shared = share_root_parameters(gm, model)
    for name, module in gm.named_modules():
        if not name or isinstance(module, torch.fx.GraphModule):
            continue
        try:
            theirs = model.get_submodule(name)
        except AttributeError:
            continue
        if theirs is module or not all(_subset(module.__dict__[kind], theirs.__dict__[kind])
                                       for kind in ("_parameters", "_buffers")):
            continue
        for kind in _TENSOR_DICTS:
            module.__dict__[kind] = theirs.__dict__[kind]
        shared += 1
    return shared  # NB: the caller points the weight tables at the new dicts (relink_graph)


def share_root_parameters(gm: nn.Module, model: nn.Module) -> int:
    """Make ``gm``'s root ``_parameters`` the model's dict where it holds a subset of the
    model's root parameters (the same tensors under the same names); 1 if it does now."""
    ours, theirs = gm.__dict__["_parameters"], model.__dict__["_parameters"]
    if ours is theirs:
        return 1
    if gm is model or not _subset(ours, theirs):
        return 0
    gm.__dict__["_parameters"] = theirs
    return 1


def _subset(ours: dict[str, Any], theirs: dict[str, Any]) -> bool:
    return all(name in theirs and theirs[name] is tensor for name, tensor in ours.items())


def watch_model(gm: nn.Module, model: nn.Module) -> ModelWatch | None:
    """A :class:`ModelWatch` of ``gm`` over ``model`` if they share any tensor."""
    if gm is model:
        return None
    watch = ModelWatch(gm, model)
    return watch if watch._slots else None


_GLOBAL_HOOKS = ("forward_pre_hook", "forward_hook", "backward_pre_hook", "backward_hook")
"""``torch.nn.modules.module.register_module_<kind>`` registers into ``_global_<kind>s``."""
_warned_global: set[int] = set()


def own_global_hooks(handles: list[RemovableHandle]) -> None:
    """Global hooks of this package (the auditor's, which attribute ops to modules and see
    every module that runs): not reported."""
    _warned_global.update(handle.id for handle in handles)


def report_global_hooks() -> None:
    """Warn once per global module hook (``register_module_forward_hook`` and the like): it
    runs around the converted module's own call, but not around the model's submodules,
    which its graph does not call."""
    for kind in _GLOBAL_HOOKS:
        for hook_id in getattr(nn_module, f"_global_{kind}s", {}):
            if hook_id in _warned_global:
                continue
            _warned_global.add(hook_id)
            warnings.warn(
                f"amprewrite: a global module {kind.replace('_', ' ')} (torch.nn.modules."
                f"module.register_module_{kind}) is registered: it runs around the converted "
                "module's call, but not around the model's submodules, whose code the "
                "converted graph holds inline. Register the hook on the submodules you need "
                "before amprewrite.convert (the capture records what it computes), or audit "
                "with amprewrite.audit(), which sees every op.", stacklevel=user_stacklevel())
