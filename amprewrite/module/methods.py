"""The model's other methods, called on its converted module, compute in mixed precision.

:func:`~.model_view.adopt_model` gives the converted module the model's methods, which then
run with the converted module as ``self``. One that calls ``self(...)`` (``generate``'s
decoding steps) runs the converted forward; one that calls the model's submodules
(CLIP's ``get_text_features`` calls ``self.text_model(...)`` and ``self.text_projection``)
would run them as they are: the model's own eager modules, in fp32, where
``torch.autocast`` would have computed their matmuls in the low dtype. Nothing would say so.

So each adopted method is wrapped (:func:`wrap_method`), and its **first call** on the
converted module is watched: a global forward pre-hook, registered for that call only, sees
whether one of the model's submodules runs its forward eagerly (outside every converted
module's call, and outside a capture, which traces rather than computes).

* **None does** (``save_pretrained``, ``get_input_embeddings``, ``generate``, whose model
  calls go through ``self(...)``): the method runs as it is, unwatched from then on. A method
  that computes nothing with the model must not be captured: its graph would be empty, or
  the capture would fail on what is not a computation (files, Python objects).
* **One does** (``get_text_features``): the call stops there, before that submodule
  computes, and the method is captured as an entry of its own: ``model.<method>`` bound on
  the model, through a module whose forward it is (:func:`_method_call`: the model's own
  attributes, tensors and children), converted with the converted module's options
  (``amprewrite.convert(..., capture="export")``, captured at its first call from the call's
  inputs). Its guards, automatic dynamic sizes, capture lock and recapture report are those
  of every converted module (:mod:`.cache`); the converted module's cache keeps it under the
  method's name, and ``explain(gm)`` lists its graphs under that name. That call and every
  later one run the entry's graph: bitwise what the method computes under
  ``torch.autocast`` with an autocast preset policy. NB: what the method did before it
  called the submodule runs twice at that first call (it is the model's computation, which
  the graph repeats): a method with side effects before its first submodule call is not
  one to call on a converted module.
* **The capture fails** (the method is not traceable): one warning naming the method, the
  submodule it runs eagerly and what to do; it then runs eagerly, as before, warned once.

**Submodules the model's code hands out.** ``generate`` of an encoder-decoder model calls
``self.get_encoder()(...)``: a method that returns a submodule, which the calling code then
runs. A method called from another method on the converted module (the model's own code)
that returns one of the model's submodules with children of its own (a tower, an encoder
stack; a leaf layer such as the embedding ``resize_token_embeddings`` swaps is returned as
it is) returns a converted module of it instead (captured at its first call, kept in the
cache under ``get_encoder()``), which reads as that submodule (its attributes, methods and
children are the submodule's). The model itself handed out returns the converted module.
NB: ``gm.get_encoder()`` called by the user returns the model's own module: calling that
computes in fp32, as calling ``model.encoder`` would.

Not at O2 and O3 (whose low-precision copies are the converted module's own) and not for a
converted module converted again: there a method that runs a submodule eagerly warns once.
"""

from __future__ import annotations

import functools
import inspect
import threading
import warnings
import weakref
from typing import Any, Callable

import torch
import torch.fx as fx
import torch.nn as nn
from torch.nn.modules.module import (register_module_forward_hook,
                                     register_module_forward_pre_hook)

from ..errors import user_stacklevel
from ..runtime.tracing import tracing
from .cache import CACHE_KEY, GraphCache, cache_of
from .isolation import CAPTURE_LOCK
from .model_watch import changes, own_global_hooks

__all__ = ["wrap_method", "MethodEntries", "WRAPPED_ATTR"]

WRAPPED_ATTR = "__amp_method__"
"""``method.__amp_method__``: the model's function a wrapped method calls."""

_NOT_WRAPPED = frozenset({"forward"})
"""The forward is the converted graph's (:mod:`.calling`)."""

_CONVERTIBLE_LEVELS = ("O0", "O1")


class _RanEagerly(BaseException):
    """Raised by the watch at a method's first call where one of the model's submodules is
    about to compute eagerly: the call stops before it computes, and the method is captured.
    A ``BaseException``: the model's own ``except Exception`` must not swallow it."""

    def __init__(self, module: nn.Module, path: str) -> None:
        super().__init__(path)
        self.module, self.path = module, path


class _Watch:
    """One method's first call on a converted module, watched in this thread."""

    def __init__(self, gm: fx.GraphModule, name: str, model: nn.Module, stop: bool) -> None:
        self.gm, self.name, self.stop = gm, name, stop
        self.paths = _paths(model)
        self.depth = 0
        """How many converted modules' calls are running (their graphs call no model
        submodule eagerly: whatever runs inside them is theirs)."""
        self.found: tuple[nn.Module, str] | None = None


class _Local(threading.local):
    watch: _Watch | None = None

    def __init__(self) -> None:
        self.running: list[Any] = []
        """The converted modules whose methods run in this thread, outermost first: a
        method of one of them called meanwhile is called by the model's own code."""


_local = _Local()
_hooks_lock = threading.Lock()
_hooks: list[Any] = []
_hook_users = [0]


def wrap_method(name: str, func: Callable[..., Any]) -> Callable[..., Any]:
    """``func``, a method of the model's class, as the converted module's method (module
    docstring)."""
    @functools.wraps(func)
    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        return _call(self, name, func, args, kwargs)

    setattr(method, WRAPPED_ATTR, func)
    return method


def wrappable(name: str, value: Any) -> bool:
    """Whether ``value``, the model's class's ``name``, is a method to wrap: a plain function
    (not a static or class method, a property, or one wrapped already)."""
    return inspect.isfunction(value) and name not in _NOT_WRAPPED and \
        not hasattr(value, WRAPPED_ATTR)


def _call(gm: Any, name: str, func: Callable[..., Any], args: tuple,
          kwargs: dict[str, Any]) -> Any:
    cache = cache_of(gm) if isinstance(gm, fx.GraphModule) else None
    if cache is None or cache.model is None or torch.compiler.is_compiling() or tracing():
        return func(gm, *args, **kwargs)
    entries = MethodEntries.of(cache)
    if any(running is gm for running in _local.running):  # by the model's own code
        return _nested(gm, cache, entries, name, func, args, kwargs)
    converted = entries.converted.get(name)
    if converted is not None:
        return entries.run(gm, name, args, kwargs)
    if name in entries.decided:
        return _running(gm, cache, entries, name, func, args, kwargs)
    return _first_call(gm, cache, entries, name, func, args, kwargs)


def _running(gm: Any, cache: GraphCache, entries: MethodEntries, name: str,
             func: Callable[..., Any], args: tuple, kwargs: dict[str, Any]) -> Any:
    _local.running.append(gm)
    try:
        return func(gm, *args, **kwargs)
    finally:
        _local.running.pop()


def _nested(gm: Any, cache: GraphCache, entries: MethodEntries, name: str,
            func: Callable[..., Any], args: tuple, kwargs: dict[str, Any]) -> Any:
    result = _running(gm, cache, entries, name, func, args, kwargs)
    if not isinstance(result, nn.Module) or isinstance(result, fx.GraphModule) or \
            not entries.convertible:
        return result
    if result is cache.model:
        return gm
    if not result._modules or result not in _paths(cache.model):
        return result  # a leaf layer, or not the model's
    return entries.handout(gm, f"{name}()", result)


def _first_call(gm: Any, cache: GraphCache, entries: MethodEntries, name: str,
                func: Callable[..., Any], args: tuple, kwargs: dict[str, Any]) -> Any:
    watch = _Watch(gm, name, cache.model, stop=entries.convertible)
    try:
        with _watching(watch):
            result = _running(gm, cache, entries, name, func, args, kwargs)
    except _RanEagerly as ran:
        return entries.capture(gm, name, func, ran.module, ran.path, args, kwargs)
    entries.decided[name] = "plain"
    if watch.found is not None:  # not convertible here: said once
        _warn_eager(gm, name, *watch.found, entries.why_not)
    return result


class _watching:
    """Install the global hooks (once for all threads watching) and watch this thread."""

    def __init__(self, watch: _Watch) -> None:
        self.watch = watch
        self.outer: _Watch | None = None
        """The first call of another converted module's method this one runs inside."""

    def __enter__(self) -> None:
        with _hooks_lock:
            if not _hook_users[0]:
                _hooks[:] = [register_module_forward_pre_hook(_before),
                             register_module_forward_hook(_after, always_call=True)]
                own_global_hooks(_hooks)
            _hook_users[0] += 1
        self.outer, _local.watch = _local.watch, self.watch

    def __exit__(self, *exc: Any) -> None:
        _local.watch = self.outer
        with _hooks_lock:
            _hook_users[0] -= 1
            if not _hook_users[0]:
                for handle in _hooks:
                    handle.remove()
                _hooks.clear()


def _before(module: nn.Module, args: Any) -> None:
    watch = _local.watch
    if watch is None:
        return
    if CACHE_KEY in module.__dict__:
        watch.depth += 1
        return
    if watch.depth or watch.found is not None or CAPTURE_LOCK.written_here() or tracing():
        return
    path = watch.paths.get(module)
    if path is None:
        return
    watch.found = (module, path)
    if watch.stop:
        raise _RanEagerly(module, path)


def _after(module: nn.Module, args: Any, output: Any) -> None:
    watch = _local.watch
    if watch is not None and CACHE_KEY in module.__dict__:
        watch.depth -= 1


_PATHS: "weakref.WeakKeyDictionary[nn.Module, tuple[Any, dict[nn.Module, str]]]" = \
    weakref.WeakKeyDictionary()


def _paths(model: nn.Module) -> dict[nn.Module, str]:
    """The model's submodules (not the model itself) by their paths, as of the last module
    or tensor registration anywhere (a replaced child registers its tensors)."""
    stamp = changes()
    known = _PATHS.get(model)
    if known is None or known[0] != stamp:
        paths = {m: p for p, m in model.named_modules(remove_duplicate=False) if p}
        known = _PATHS[model] = (stamp, paths)
    return known[1]


def _method_call(model: nn.Module, name: str) -> nn.Module:
    """The model with its method ``name`` as the forward: what a method entry captures.

    An instance of a subclass of the model's class (named ``Model.method``, which every
    message of its converted module names) whose ``__dict__`` is the model's own: its
    attributes, tensors and children are the model's at every moment, so the capture
    names them as the forward's does (module overrides and the converted module's children
    apply) and records what the method reads of them, which the entry's guards check at
    each call (``model.scale = 3.0`` is a new state). Its forward is the method, with the
    method's signature (how torch.export binds the call, and what a mismatch names); its
    call runs no hooks (the model's hooks are its forward's), and a call of ``self(...)``
    inside the method is the model's forward."""
    base = type(model)
    method = getattr(base, name)
    inside = [0]

    def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        return method(self, *args, **kwargs)

    def call(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        if inside[0]:
            return base.forward(self, *args, **kwargs)
        inside[0] += 1
        try:
            return self.forward(*args, **kwargs)
        finally:
            inside[0] -= 1

    try:
        forward.__signature__ = inspect.signature(method)  # type: ignore[attr-defined]
    except (TypeError, ValueError):
        pass
    cls = type(f"{base.__name__}.{name}", (base,), {
        "forward": forward, "__call__": call,
        "__module__": base.__module__, "__qualname__": f"{base.__qualname__}.{name}"})
    view = object.__new__(cls)
    object.__setattr__(view, "__dict__", model.__dict__)
    return view


class MethodEntries:
    """A converted module's entries for the model's other methods and hand-outs, kept in its
    cache (``GraphCache.methods``); each is a converted module captured at its first call."""

    def __init__(self, cache: GraphCache) -> None:
        options = getattr(cache.recipe, "options", None)
        self.options = options
        self.recipe = cache.recipe
        level = getattr(options, "opt_level", None)
        self.why_not = "" if level in _CONVERTIBLE_LEVELS and cache.recipe.view else (
            f"a module converted at opt_level={level!r} keeps its low-precision weights "
            "for its forward only" if level is not None
            else "this module was converted from a converted module")
        self.convertible = not self.why_not
        self.converted: dict[str, fx.GraphModule] = {}
        """Method name, or ``name()`` for a hand-out -> its converted module."""
        self.decided: dict[str, str] = {}
        """Method name -> ``"plain"`` (ran no submodule eagerly at its first call) or
        ``"eager"`` (its capture failed: the reason)."""

    @staticmethod
    def of(cache: GraphCache) -> MethodEntries:
        entries = cache.methods
        if entries is None:
            entries = cache.methods = MethodEntries(cache)
        return entries

    def _convert(self, module: nn.Module) -> fx.GraphModule:
        # NB: through the converted module's recipe (which convert made), not convert: this
        # package sits below both
        return self.recipe.part(module)

    def run(self, gm: Any, name: str, args: tuple, kwargs: dict[str, Any]) -> Any:
        """Call ``name``'s entry in ``gm``'s mode."""
        return self.converted[name](*args, **kwargs)  # NB: in the model's mode, as gm

    def capture(self, gm: Any, name: str, func: Callable[..., Any], module: nn.Module,
                path: str, args: tuple, kwargs: dict[str, Any]) -> Any:
        """The method's entry, captured from this call; where that fails, the method run
        eagerly, with one warning."""
        model = cache_of(gm).model
        try:
            self.converted[name] = self._convert(_method_call(model, name))
            return self.run(gm, name, args, kwargs)
        except Exception as exc:  # noqa: BLE001: any failure of the capture
            self.converted.pop(name, None)
            why = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        _local.running.append(gm)
        try:
            result = func(gm, *args, **kwargs)  # the model's own error, if it is one
        finally:
            _local.running.pop()
        self.decided[name] = why
        _warn_eager(gm, name, module, path, f"it could not be captured ({why})")
        return result

    def handout(self, gm: Any, key: str, module: nn.Module) -> fx.GraphModule:
        """The converted module of ``module``, which the model's code handed out through
        ``key`` (module docstring)."""
        converted = self.converted.get(key)
        if converted is None or cache_of(converted).model is not module:
            converted = self.converted[key] = self._convert(module)
        return converted

    def describe(self) -> list[str]:
        """``explain``'s lines: each entry's graphs under its method's name, and the methods
        that run eagerly and why."""
        lines = []
        for name, converted in self.converted.items():
            for line in cache_of(converted).describe():
                lines.append(f"method {name}: {line}")
        for name, why in self.decided.items():
            if why != "plain":
                lines.append(f"method {name}: runs eagerly, in fp32: {why}")
        return lines

    def __deepcopy__(self, memo: dict[int, Any]) -> None:
        return None  # a copy captures its methods again, on its own copy of the model


def _warn_eager(gm: Any, name: str, module: nn.Module, path: str, why: str) -> None:
    warnings.warn(
        f"amprewrite: {type(gm).__name__}.{name}, called on the converted module, ran the "
        f"model's {type(module).__name__} ({path}) eagerly, in fp32, not in mixed precision: "
        f"{why}. Convert what it computes with yourself (amprewrite.convert(model.{path}, "
        f"...), or a module whose forward calls model.{name}) and call that, or call "
        f"model.{name} under torch.autocast. (Given once per method.)",
        UserWarning, stacklevel=user_stacklevel())
