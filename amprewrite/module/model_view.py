"""A converted module reads as its model: the model's attributes and methods, on its class.

Libraries inspect the module they are handed: HF ``Trainer`` reads ``model.loss_type`` and
``accepts_loss_kwargs`` (which decide how the loss is normalised), ``main_input_name`` and
``config``; ``generate`` reads ``generation_config`` and calls ``self(...)``, looking methods
up on ``type(self)``. A converted module is a GraphModule, whose class knows none of them.

:func:`adopt_model` gives the converted module's own class (torch.fx makes one per
GraphModule, so no other module changes):

* each **method and class attribute** of the model's class that ``fx.GraphModule`` does not
  define, as the model's class holds it: a method then runs with the converted module as
  ``self``, so one that calls ``self(...)`` (``generate``, a ``predict`` helper) runs the
  converted forward, never the model's fp32 one;
* each **instance attribute** of the model (``config``, ``loss_type``, ``generation_config``;
  not its parameters, buffers, submodules or torch's bookkeeping) as a property that reads
  and writes the model's: the value at every moment, not a copy made at conversion.

An attribute the model gets **after** conversion (``model.is_parallelizable = True``, a
library's marker) is reached through the class's ``__getattr__`` (:func:`_model_getattr`),
which Python calls only where every other lookup failed: it reads the model's instance
attribute, or what the model's own ``__getattr__`` hands out (PEFT's model forwards to its
base model), never a method bound to the model (which would run the model's fp32 forward:
an ``AttributeError`` says so). The attributes the model had at conversion keep their
properties, which Dynamo reads as plain attributes.

The model's **class is a base** of the converted module's class (:func:`_inherit_model_class`),
so ``isinstance(gm, type(model))`` holds: libraries that ask what a module is before they
save it take the converted module for the model. ``Trainer`` saves a ``PreTrainedModel``
(and a PEFT model) with ``save_pretrained``, config included, and anything else as a bare
``model.safetensors`` that ``from_pretrained`` cannot load; with the model's class among its
bases, ``Trainer.save_model``, its checkpoints and ``load_best_model_at_end`` run the model's
``save_pretrained`` on the converted module (the model's config, and ``gm.state_dict()``,
the model's keys). What a GraphModule defines still comes first: where the model's class
overrides ``nn.Module`` (``PreTrainedModel.to``/``train``/``half``, a ``__getstate__``), the
converted module's class pins the GraphModule's, so only the type and the methods that
were already adopted change.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch.fx as fx
import torch.nn as nn

from .cache import CACHE_KEY, cache_of
from .methods import wrap_method, wrappable

__all__ = ["adopt_model", "model_of"]

_OWN = frozenset(name for klass in fx.GraphModule.__mro__ for name in vars(klass))
"""What a GraphModule (and so an nn.Module) defines: never replaced."""

_GRAPH_MODULE_MRO = frozenset(fx.GraphModule.__mro__)

_BOOKKEEPING = frozenset(nn.Module().__dict__) | {"training"}


def adopt_model(gm: fx.GraphModule, model: nn.Module, signature: bool = True) -> None:
    """Give ``gm``'s class the model's methods, class attributes and instance attributes
    (module docstring), and with ``signature`` its forward's signature (which
    ``inspect.signature(gm.forward)`` reads: ``Trainer`` drops the columns it does not name).
    NB: not where the forward takes ``*args`` (a PEFT model's), whose capture names more."""
    cls = type(gm)
    if signature:
        adopt_signature(gm, model)
    for klass in reversed(type(model).__mro__):
        if klass is object or klass in fx.GraphModule.__mro__:
            continue
        for name, value in vars(klass).items():
            if name not in _OWN and not (name.startswith("__") and name.endswith("__")):
                setattr(cls, name, wrap_method(name, value) if wrappable(name, value)
                        else value)  # computes in mixed precision (.methods)
    for name in model.__dict__:
        if name in _BOOKKEEPING or name in _OWN or name in gm.__dict__ or \
                name.startswith(("__", "_amp")):
            continue
        setattr(cls, name, _ModelAttribute(name))
    cls.__getattr__ = _model_getattr
    _inherit_model_class(cls, type(model))


_TYPE_SLOTS = frozenset({"__dict__", "__weakref__", "__module__", "__doc__", "__qualname__",
                         "__annotations__", "__init_subclass__", "__subclasshook__"})
"""Names of a class's own that are not behaviour: never pinned."""


def _inherit_model_class(cls: type, model_cls: type) -> None:
    """Append ``model_cls`` to the bases of ``cls`` (the converted module's own class), after
    pinning on ``cls`` every attribute GraphModule's classes define that ``model_cls``
    overrides (module docstring): the MRO then puts the model's classes before
    ``nn.Module``, and without the pins ``PreTrainedModel.train`` would replace the one
    the converted module's graphs are switched by.

    Not for a class of torch's own (``nn.Sequential``, ``nn.Linear``): torch recognises its
    layers by class (Dynamo inlines them as built-in modules, quantization and pruning swap
    them), and a converted module is not the layer. Not where Python refuses the bases (a
    model class with ``__slots__`` lays its instances out otherwise): the converted module
    then reads as its model through its adopted methods only, as before."""
    if model_cls in cls.__mro__ or issubclass(model_cls, fx.GraphModule) or \
            model_cls.__module__.partition(".")[0] == "torch":
        return
    overridden = {name for klass in model_cls.__mro__ if klass not in _GRAPH_MODULE_MRO
                  for name in vars(klass)}
    pins = {}
    for name in (overridden & _OWN) - _TYPE_SLOTS - set(vars(cls)):
        pins[name] = next(vars(k)[name] for k in cls.__mro__ if name in vars(k))
    bases = cls.__bases__
    try:
        cls.__bases__ = (*bases, model_cls)
    except TypeError:  # NB: layout or MRO conflict (docstring)
        return
    for name, value in pins.items():
        setattr(cls, name, value)


def _model_getattr(gm: Any, name: str) -> Any:
    """``nn.Module.__getattr__`` (the converted module's tensors and children), then the
    model's attribute of that name (module docstring)."""
    try:
        return nn.Module.__getattr__(gm, name)
    except AttributeError:
        if name.startswith(("__", "_amp")) or name in _BOOKKEEPING:
            raise
        model = getattr(gm.__dict__.get(CACHE_KEY), "model", None)
        if model is None:
            raise
    try:
        value = getattr(model, name)
    except AttributeError:
        raise AttributeError(f"'{type(gm).__name__}' object has no attribute '{name}' (nor has "
                             "the model it was converted from)") from None
    if inspect.ismethod(value) and value.__self__ is model:
        raise AttributeError(
            f"'{type(gm).__name__}' object has no attribute '{name}': the model it was "
            f"converted from has it as a method bound to the model ({type(model).__name__}"
            f".{name}), which would run the model's own forward in fp32, not the converted "
            "one. Define the method on the model's class before amprewrite.convert (its "
            "methods run on the converted module), or call it on the model.")
    return value


def adopt_signature(gm: fx.GraphModule, model: nn.Module) -> None:
    try:
        signature = inspect.signature(type(model).forward)
    except (TypeError, ValueError):
        return
    if not any(p.kind is inspect.Parameter.VAR_POSITIONAL
               for p in signature.parameters.values()):
        type(gm).forward.__signature__ = signature  # type: ignore[attr-defined]


def model_of(gm: nn.Module) -> nn.Module:
    """The model ``gm`` was converted from (its capture recipe holds it)."""
    model = getattr(cache_of(gm), "model", None)
    if model is None:
        raise AttributeError(f"this {type(gm).__name__} holds no model to read attributes from "
                             "(a copy loaded from a pickle)")
    return model


class _ModelAttribute:
    """An instance attribute of the model, read and written through the converted module."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __get__(self, gm: Any, owner: type | None = None) -> Any:
        if gm is None:
            return self
        own = gm.__dict__
        if self.name in own:  # set on the converted module itself before adoption
            return own[self.name]
        return getattr(model_of(gm), self.name)

    def __set__(self, gm: Any, value: Any) -> None:
        setattr(model_of(gm), self.name, value)

    def __repr__(self) -> str:
        return f"<the model's attribute {self.name!r}>"


