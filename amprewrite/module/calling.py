"""How a converted GraphModule is called: ``nn.Module.__call__``, from a frame of this package.

torch.fx calls every GraphModule through ``_WrappedCall``, which, when the generated code
raises, prints the lines around the one that failed. Under ``torch.compile`` that wrapper sits
in a file Dynamo skips (``torch/fx``): the compiled region starts below it, at the generated
``forward``, and the compiled call costs more than Python's two extra frames account for. On
the 50-layer launch-bound model, compiled (Inductor, CPU, torch 2.13, one thread), a forward
took 592-605 µs called through the wrapper and 549-568 µs called as below, about what
``torch.compile(model)`` takes; eagerly the two calls cost the same (0.6 µs apart).
:func:`finish` gives the module's class a ``__call__`` defined here, which Dynamo
traces from its first frame, and which reports a failing generated line as torch.fx does.

``gm.recompile()`` keeps both: torch.fx's ``recompile`` regenerates the class's ``forward``
and ``__call__``, so the class's ``recompile`` (:func:`_recompile_converted`) makes the new
code the held graph's forward and puts this call and the checked ``forward`` back; the code
is the readable code (:mod:`amprewrite.graph.codegen`: the generator is the graph's). A deep
copy keeps both too: torch.fx's ``__deepcopy__`` builds the copy through a new class and
``recompile()``, so the class's ``__deepcopy__`` finishes the copy as ``convert`` finished
the original (:func:`finish`).

**The cache.** Each call first asks the module's :class:`~amprewrite.module.cache.GraphCache`
whether the guards of the graph it holds still hold (one check: mode, model state), and
brings it up to date where not; a call its graph rejects for its inputs is captured again
for them (:meth:`~amprewrite.module.cache.GraphCache.refit`). ``train()`` (and so
``eval()``) makes the module hold the graph of its new mode, capturing it at the first switch
to it (:meth:`~amprewrite.module.cache.GraphCache.switch`).

Pickling (``torch.save(gm)``): torch.fx pickles a GraphModule as its generated code and
traces that code again on load, with the tracer class the module names (``_tracer_cls``).
A module converted from a torch.export capture names torch.export's, which needs arguments
the pickle does not hold, and any other tracer would run the forward's weight read during
that trace, so :func:`_reduce_converted` names the symbolic capture's tracer, which traces the weight read back into reads and casts of the
loaded module's own parameters. The loaded module is a plain GraphModule: the same outputs,
its weight casts made on every call (and an O2 module's optimizer bound again). It holds the
graph of the mode it was saved in only: switching it to the other mode raises.
"""

from __future__ import annotations

import copy
import functools
import linecache
import sys
import traceback
import types
import warnings
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn

from ..errors import _OWN_DIRS, AmpRewriteError, AutocastOverrideWarning, user_stacklevel
from ..graph.codegen import recompile_with_bindings
from ..graph.inputs import input_mismatch
from ..runtime.weight_cache import CACHE_ATTR, WeightCastCache
from ..capture.guards import GUARDS_ATTR, InputGuards
from .isolation import CAPTURE_LOCK, outside_saved_tensors_hooks
from .model_view import adopt_model
from .tree import adopt_children, register_view, trees, view_model
from .cache import CACHE_KEY, SERVES_ATTR, RefitFailed
from .sharing import FORWARD_ATTR, rebind_table
from ..capture.symbolic import _AmpTracer
from .first_call import NOT_CAPTURED_YET_KEY

__all__ = ["finish", "failure_context", "generated_code"]


def finish(gm: fx.GraphModule) -> fx.GraphModule:
    """``gm``'s code with proven bindings (:func:`recompile_with_bindings`), called through
    :func:`_converted_call`, and deep copies and ``gm.recompile()`` finished the same way. Its
    class is its own (torch.fx makes one class per GraphModule), so no other module changes."""
    recompile_with_bindings(gm)
    if type(gm).__dict__.get("recompile") is _recompile_converted:
        return gm  # finished before: the recompile above kept the call
    gm.__dict__.setdefault(SERVES_ATTR, (True, True))
    cls = type(gm)
    gm.__dict__[FORWARD_ATTR] = cls.forward
    cls.forward = _held_graph_forward(cls.forward)
    cls.__call__ = _converted_call
    cls.__deepcopy__ = _finished_copy
    cls.train = _train
    cls.__reduce__ = _reduce_converted
    cls.recompile = _recompile_converted
    return gm


def _recompile_converted(self: fx.GraphModule) -> Any:
    """torch.fx's ``recompile``, which regenerates the class's ``forward`` and ``__call__``:
    the new forward becomes the held graph's, and the class's checked ``forward`` (with the
    model's signature) and :func:`_converted_call` are put back."""
    cls = type(self)
    held_forward = cls.__dict__["forward"]
    python_code = fx.GraphModule.recompile(self)
    self.__dict__[FORWARD_ATTR] = cls.__dict__["forward"]
    cls.forward, cls.__call__ = held_forward, _converted_call
    return python_code


def _held_graph_forward(generated: Any) -> Any:
    """The class's ``forward``: the generated forward of the graph the module holds now (a
    mode switch or a new state exchanges graphs, not classes), one function per class, with
    the generated signature until :func:`~.model_view.adopt_model` gives it the model's.

    Eagerly, it is also where the cache's guards run and where a capture happens (a new
    state, mode or input sizes, the first call): after the module's forward pre-hooks and
    before its forward hooks, as the model's own forward runs. So each hook runs once per
    call, a call that captures included, and a capture sees the inputs and parameters the
    forward sees: a pre-hook's rewritten inputs, and FSDP2's all-gathered parameters of a
    block sharded with ``fully_shard`` (its pre-forward hook gathers them, and its
    post-forward hook frees them again after the capture)."""
    @functools.wraps(generated)
    def forward(self: fx.GraphModule, *args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling():  # NB: Dynamo folds it and sees nothing below
            return self.__dict__[FORWARD_ATTR](self, *args, **kwargs)
        cache = self.__dict__.get(CACHE_KEY)
        # NB: checked here, not in __call__: accelerate's mixed_precision enters autocast in a
        # wrapper of the instance's forward, between the two. Not while compiling:
        # torch.export (compiling too) traces a model that holds this module under its
        # policy's autocast (an autocast preset).
        if _any_autocast_enabled() and not getattr(cache, "autocast_warned", True):
            _warn_if_under_autocast(self, args, kwargs)
        if cache is None:  # a copy loaded from a pickle: its one graph
            return self.__dict__[FORWARD_ATTR](self, *args, **kwargs)
        if not cache.holds(self):
            # NB: another thread may have followed meanwhile
            with CAPTURE_LOCK.writing(), outside_saved_tensors_hooks():
                if not cache.holds(self):
                    cache.follow(self, args, kwargs)
        return _run(self, cache, args, kwargs)

    return forward


def generated_code(module: nn.Module) -> types.CodeType:
    """The code object of the generated forward a GraphModule runs now (a converted module's
    class ``forward`` calls it; a plain GraphModule's is that forward): what a frame walk
    looks for to map a line to its node."""
    held = module.__dict__.get(FORWARD_ATTR)
    return (held if held is not None else type(module).forward).__code__


def _train(self: fx.GraphModule, mode: bool = True) -> fx.GraphModule:
    leaving_training = self.training and not mode
    model = view_model(self)
    if model is not None:  # its children are the model's (.tree): the model's mode is its
        model.train(mode)  # mode, as torch.compile's module sets its model's
    nn.Module.train(self, mode)
    cache = self.__dict__.get(CACHE_KEY)
    if cache is not None:
        cache.switch(self, bool(mode))
        cache.switched(self)
    weights = self.__dict__.get(CACHE_ATTR)
    if leaving_training and isinstance(weights, WeightCastCache):
        # NB: a fused optimizer (Trainer's default AdamW on CPU) updates the weights in place
        # without bumping their version counters, so the cast copies cached by an earlier
        # evaluation would look current; an evaluation after training casts them afresh.
        weights.clear()
    return self


def _finished_copy(self: fx.GraphModule, memo: dict[int, Any]) -> fx.GraphModule:
    copied = fx.GraphModule.__deepcopy__(self, memo)
    # NB: torch.fx builds the copy from the copied attributes its graph reads; the cache
    # (whose entries the memo already copied, and finished) is put back by hand.
    copied.__dict__[SERVES_ATTR] = self.__dict__.get(SERVES_ATTR, (True, True))
    cache = self.__dict__.get(CACHE_KEY)
    if cache is not None:
        cache = copied.__dict__[CACHE_KEY] = copy.deepcopy(cache, memo)
        cache.relink(copied)
    rebind_table(copied)
    finish(copied)
    if cache is not None and cache.model is not None:  # reads as its own copy of the model
        adopt_model(copied, cache.model, signature=False)
        if view_model(self) is not None:  # and its children are that copy's
            for tree in trees(copied):
                adopt_children(tree, cache.model)
                rebind_table(tree)
            register_view(copied, cache.model)
    signature = getattr(type(self).forward, "__signature__", None)
    if signature is not None:
        type(copied).forward.__signature__ = signature
    return copied


_UNPICKLABLE = (
    "amprewrite: this converted module cannot be pickled (torch.save(gm) / pickle.dumps(gm)): "
    "its forward checks its inputs with torch.export's generated function in a form this torch "
    "version wraps in a way amprewrite cannot read back. Save it one of these ways instead: (1) the weights, converted again "
    "on load: torch.save(gm.state_dict(), f); then model.load_state_dict(torch.load(f)) and "
    "amprewrite.convert(model, example_inputs, ...); (2) the program: "
    "torch.export.save(torch.export.export(gm, example_inputs), f), loaded with "
    "torch.export.load(f).module() (needs only torch). copy.deepcopy(gm) works in-process.")


def _reduce_converted(self: fx.GraphModule) -> Any:
    guards = getattr(self, GUARDS_ATTR, None)  # an attribute where the children are the model's
    if guards is not None and not isinstance(guards, InputGuards):
        raise TypeError(_UNPICKLABLE)
    rebuild, (body, import_block) = _reduced_unchanged(self)
    body["_tracer_cls"], body["_tracer_extras"] = _AmpTracer, {}  # NB: module docstring
    # The graph's own modules, plain attributes where the children are the model's (.tree),
    # are children of the loaded module: its tracer calls only installed submodules.
    own = {name: value for name, value in body.items() if isinstance(value, nn.Module)}
    if own:
        body["_modules"] = {**body["_modules"], **own}
        for name in own:
            del body[name]
    body.pop(SERVES_ATTR, None)
    body.pop(FORWARD_ATTR, None)  # generated code: the load generates it again
    body.pop(CACHE_KEY, None)  # the other graphs and the model: not saved
    return _rebuild_in_saved_mode, (rebuild, body, import_block, self.training)


_CLASS_CODE = ("forward", "__call__", "_wrapped_call")
_INSTANCE_CODE = ("_code", "_lineno_map", "_prologue_start")


def _reduced_unchanged(self: fx.GraphModule) -> Any:
    """torch.fx's reduction of ``self``, which recompiles ``self`` to get its code (and so
    would put back the plain generated forward and call): what it replaces is put back, so
    that saving a converted module leaves it as it was."""
    cls = type(self)
    held_cls = {k: cls.__dict__[k] for k in _CLASS_CODE if k in cls.__dict__}
    held = {k: self.__dict__[k] for k in _INSTANCE_CODE if k in self.__dict__}
    try:
        return fx.GraphModule.__reduce__(self)
    finally:
        for key in _CLASS_CODE:
            if key in held_cls:
                setattr(cls, key, held_cls[key])
            elif key in cls.__dict__:
                delattr(cls, key)
        self.__dict__.update(held)


_SAVED_MODE_ATTR = "_amp_saved_mode"


def _rebuild_in_saved_mode(rebuild: Any, body: dict[str, Any], import_block: str,
                           training: bool) -> fx.GraphModule:
    gm = rebuild(body, import_block)
    gm.__dict__[_SAVED_MODE_ATTR] = training
    type(gm).train = _train_in_saved_mode
    return gm


def _train_in_saved_mode(self: fx.GraphModule, mode: bool = True) -> fx.GraphModule:
    saved = self.__dict__.get(_SAVED_MODE_ATTR, bool(mode))
    if bool(mode) != saved:
        names = {True: "train", False: "eval"}
        raise AmpRewriteError(
            f"this converted module was loaded from a pickle saved in {names[saved]} mode, "
            f"which holds that mode's graph only; {names[bool(mode)]}() cannot switch it. "
            "Convert the model again (amprewrite.convert) to run it in both modes, or save the "
            f"module in the mode you will load it for (gm.{names[bool(mode)]}() before torch.save).")
    return nn.Module.train(self, mode)


def _converted_call(self: fx.GraphModule, *args: Any, **kwargs: Any) -> Any:
    # NB: is_compiling first: Dynamo folds it to True and never sees the guard; what it traces
    # is the mode's graph (an int index: Dynamo on torch 2.11 cannot index a tuple with a
    # bool). Eagerly the guards run in the forward, after the pre-hooks (_held_graph_forward).
    if torch.compiler.is_compiling():
        if NOT_CAPTURED_YET_KEY in self.meta:
            _first_capture_outside(self, args, kwargs)  # compiled before any eager call
        elif not self.__dict__[SERVES_ATTR][1 if self.training else 0]:
            self.__dict__[CACHE_KEY].switch(self, self.training)
        return nn.Module.__call__(self, *args, **kwargs)
    # A capture by another thread waits for this call's graph to finish, and this call for
    # that capture (which swaps graphs and lends the model's tensors to torch.export).
    CAPTURE_LOCK.acquire_read()
    try:
        return nn.Module.__call__(self, *args, **kwargs)
    except Exception as exc:
        context = failure_context(exc)
        if context is not None:
            print(context, file=sys.stderr)
        raise
    finally:
        CAPTURE_LOCK.release_read()


_any_autocast_enabled = torch._C._is_any_autocast_enabled
"""Whether ``torch.autocast`` is enabled in this thread for any device type: one C call (about
0.2 µs) on every call of a converted module. NB: private, but the only single check of every
device type; tests/test_autocast_inside.py fails on a release without it."""


def _warn_if_under_autocast(self: fx.GraphModule, args: tuple, kwargs: dict[str, Any]) -> None:
    """An :class:`AutocastOverrideWarning`, once per module, when autocast is enabled for a
    device type the call's tensor inputs or the module's parameters are on."""
    tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
    param = next(self.parameters(), None)
    devices = {t.device.type for t in tensors + ([param] if param is not None else [])}
    under = sorted(d for d in devices if torch.is_autocast_enabled(d))
    if not under:
        return  # autocast of another device type: it does not touch this module's ops
    self.__dict__[CACHE_KEY].autocast_warned = True
    device = under[0]
    low = str(torch.get_autocast_dtype(device)).replace("torch.", "")
    warnings.warn(
        f"amprewrite: the converted {type(self).__name__} was called inside "
        f"torch.autocast({device!r}, dtype=torch.{low}), which casts again on top of the "
        "casts in its graph: an op its policy keeps in fp32 (a keep_fp32 override, say) runs "
        f"in {low} if autocast lists it as low precision, and nothing says so. Call the "
        "converted module outside torch.autocast (with accelerate: Accelerator("
        "mixed_precision=\"no\"); the casts are in the graph); for torch.autocast's own "
        f"numerics, convert with policy=amprewrite.Policy.autocast({device!r}, torch.{low}), "
        "which computes what the model computes under that autocast. (Given once per "
        "converted module.)",
        AutocastOverrideWarning, stacklevel=_stacklevel_past_call() or user_stacklevel())


def _stacklevel_past_call() -> int | None:
    """The ``stacklevel``, for a warning raised by the caller, of the user's line that called
    the converted module: the first frame outside amprewrite and torch past its ``__call__``
    (:func:`user_stacklevel` would stop at accelerate's wrapper of ``forward``, which sits
    below it); None when ``forward`` was called without it."""
    level, frame = 1, sys._getframe(1)
    while frame is not None and frame.f_code is not _converted_call.__code__:
        frame, level = frame.f_back, level + 1
    while frame is not None and frame.f_code.co_filename.startswith(_OWN_DIRS):
        frame, level = frame.f_back, level + 1
    return level if frame is not None else None


def _run(self: fx.GraphModule, guard: Any, args: tuple, kwargs: dict[str, Any]) -> Any:
    """The held graph's forward on the call's inputs; where its input check rejects them, the
    model captured again for them (:meth:`~.cache.GraphCache.refit`) and run, or an error
    that names the input that does not fit."""
    try:
        return self.__dict__[FORWARD_ATTR](self, *args, **kwargs)
    except Exception as exc:
        mismatch = input_mismatch(self, type(self).__name__, args, kwargs)
        try:
            if mismatch is not None and _refit(self, guard, args, kwargs):
                # captured for these inputs: its forward, not __call__ (the hooks ran)
                return self.__dict__[FORWARD_ATTR](self, *args, **kwargs)
        except RefitFailed as failed:
            mismatch = f"{mismatch}\nCapturing the model again for these inputs failed: {failed}"
        if mismatch is not None:
            raise AmpRewriteError(mismatch) from exc
        raise


def _refit(self: fx.GraphModule, guard: Any, args: tuple, kwargs: dict[str, Any]) -> bool:
    """The cache's :meth:`~.cache.GraphCache.refit`, as a capture: alone, after the calls
    of other threads (this thread's read is the only one it waits past)."""
    with CAPTURE_LOCK.writing(), outside_saved_tensors_hooks():
        return guard.refit(self, args, kwargs)


@torch.compiler.disable
def _first_capture_outside(gm: fx.GraphModule, args: tuple, kwargs: dict[str, Any]) -> None:
    """The first capture of a module captured at its first call, when that call is compiled:
    run eagerly (a graph break, once), then the compiler traces the captured graph."""
    with CAPTURE_LOCK.writing(), outside_saved_tensors_hooks():
        gm.__dict__[CACHE_KEY].follow(gm, args, kwargs)


def failure_context(exc: BaseException) -> str | None:
    """The generated lines around the one that raised ``exc``, marked, when the innermost
    frame of its traceback is a GraphModule's generated code; else None."""
    frames = traceback.extract_tb(exc.__traceback__)
    if not frames or "eval_with_key" not in frames[-1].filename:
        return None
    failed = frames[-1]
    lines = linecache.getlines(failed.filename)
    if failed.lineno is None or not 0 < failed.lineno <= len(lines):
        return None  # NB: never raise here: the caller is handling the model's own error
    i = failed.lineno - 1
    marker = "~" * len(lines[i].rstrip()) + " <--- HERE"
    return "\n".join([
        f"{type(exc).__name__} at line {failed.lineno} of the converted module's generated "
        "forward (print gm.code for all of it):",
        "".join(lines[max(i - 2, 0):i + 1]).rstrip(), marker,
        "".join(lines[i + 1:i + 3]).rstrip()])
