"""``amprewrite.compile``'s module reads as its model: names, signature and methods.

``torch.compile(model)`` returns an ``OptimizedModule`` that forwards attribute reads to the
model (``compiled.config``), but is a module of its own for the rest, which libraries notice:

* its ``state_dict()`` and ``named_parameters()`` name every entry ``_orig_mod.*``, so a
  checkpoint saved from it does not load into the model, nor the model's into it;
* ``inspect.signature(compiled.forward)`` is ``(*args, **kwargs)``: HF ``Trainer``'s
  ``remove_unused_columns`` then keeps no column (a ``KeyError`` in the collator);
* the model's methods run bound to the model: ``compiled.generate(ids)`` calls the model's
  own, eager forward at every step, silently uncompiled (and in fp32 under amprewrite).

:func:`view_of` gives the compiled module its own subclass (no other module changes) with the
model's names for tensors (``state_dict``, ``load_state_dict``, ``named_parameters``,
``named_buffers``, and a module holding it loads a checkpoint with the model's names), the model's forward signature, and the methods and class attributes of the
model's class, which then run with the compiled module as ``self``: ``generate`` calls
``self(...)``, the compiled forward, for the prefill and every decode step.
"""

from __future__ import annotations

import inspect
from typing import Any, Iterator, Mapping

import torch
import torch.nn as nn

__all__ = ["view_of"]


def view_of(compiled: nn.Module, model: nn.Module) -> nn.Module:
    """Make ``compiled`` (``torch.compile(model, ...)``) read as ``model`` (module docstring);
    returns it."""
    base = type(compiled)
    own = frozenset(name for klass in base.__mro__ for name in vars(klass))
    namespace: dict[str, Any] = dict(_NAMES)
    for klass in reversed(type(model).__mro__):
        if klass is object or klass in nn.Module.__mro__:
            continue
        for name, value in vars(klass).items():
            if name not in own and name != "forward" and \
                    not (name.startswith("__") and name.endswith("__")):
                namespace[name] = value
    compiled.__class__ = type(base.__name__, (base,), namespace)
    compiled.register_load_state_dict_pre_hook(_model_keys_load)
    _adopt_signature(compiled, model)
    return compiled


def _adopt_signature(compiled: nn.Module, model: nn.Module) -> None:
    try:
        signature = inspect.signature(type(model).forward)
    except (TypeError, ValueError):
        return
    params = list(signature.parameters.values())
    if any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in params):
        return  # a PEFT model's (*args, **kwargs): nothing more to say
    forward = compiled.__dict__.get("forward")
    if forward is not None:  # the instance's compiled forward (a function object)
        # NB: the bound signature, without ``self``, as inspect shows a bound method's
        forward.__signature__ = signature.replace(parameters=params[1:])


def _state_dict(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    return self._orig_mod.state_dict(*args, **kwargs)


def _load_state_dict(self: nn.Module, state_dict: Mapping[str, Any], strict: bool = True,
                     assign: bool = False) -> Any:
    return self._orig_mod.load_state_dict(state_dict, strict=strict, assign=assign)


def _named_parameters(self: nn.Module, prefix: str = "", recurse: bool = True,
                      remove_duplicate: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    return self._orig_mod.named_parameters(prefix, recurse, remove_duplicate)


def _named_buffers(self: nn.Module, prefix: str = "", recurse: bool = True,
                   remove_duplicate: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    return self._orig_mod.named_buffers(prefix, recurse, remove_duplicate)


def _model_keys_load(module: nn.Module, state_dict: dict[str, Any], prefix: str,
                     *args: Any) -> None:
    """Loading a module that holds the compiled one (a LightningModule's checkpoint): its
    entries carry the model's names, which torch's recursion looks for under
    ``_orig_mod.``; renamed in place (a key already under ``_orig_mod.`` stays)."""
    inner = prefix + "_orig_mod."
    for key in [k for k in state_dict if k.startswith(prefix) and not k.startswith(inner)]:
        state_dict[inner + key[len(prefix):]] = state_dict.pop(key)


_NAMES = {"state_dict": _state_dict, "load_state_dict": _load_state_dict,
          "named_parameters": _named_parameters, "named_buffers": _named_buffers}
"""The model's names for its tensors, on the compiled module."""
