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

``gm.recompile()`` puts torch.fx's call back (it regenerates the class's ``__call__``), as it
puts the plain generated code back (:mod:`.codegen`). A deep copy keeps both: torch.fx's
``__deepcopy__`` builds the copy through a new class and ``recompile()``, so the class's
``__deepcopy__`` finishes the copy as ``convert`` finished the original (:func:`finish`).

Each call first lets the module's :class:`~amprewrite.runtime.model_watch.ModelWatch` keep its
tensors the model's own (two integer reads when nothing changed).

Pickling (``torch.save(gm)``): torch.fx pickles a GraphModule as its generated code and
traces that code again on load, with the tracer class the module names (``_tracer_cls``).
A module converted from a torch.export capture names torch.export's, which needs arguments
the pickle does not hold, and any other tracer would run the forward's weight read during
that trace, so :func:`_reduce_converted` names the symbolic capture's tracer, which traces the weight read back into reads and casts of the
loaded module's own parameters. The loaded module is a plain GraphModule: the same outputs,
its weight casts made on every call (and an O2 module's optimizer bound again).
"""

from __future__ import annotations

import linecache
import sys
import traceback
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn

from ..capture.guards import GUARDS_ATTR, InputGuards
from ..capture.symbolic import _AmpTracer
from ..runtime.model_watch import WATCH_ATTR
from .codegen import recompile_with_bindings

__all__ = ["finish", "failure_context"]


def finish(gm: fx.GraphModule) -> fx.GraphModule:
    """``gm``'s code with proven bindings (:func:`recompile_with_bindings`), called through
    :func:`_converted_call`, and deep copies finished the same way. Its class is its own
    (torch.fx makes one class per GraphModule), so no other module changes."""
    recompile_with_bindings(gm)
    cls = type(gm)
    cls.__call__ = _converted_call
    cls.__deepcopy__ = _finished_copy
    cls.__reduce__ = _reduce_converted
    return gm


def _finished_copy(self: fx.GraphModule, memo: dict[int, Any]) -> fx.GraphModule:
    return finish(fx.GraphModule.__deepcopy__(self, memo))


_UNPICKLABLE = (
    "amprewrite: this converted module cannot be pickled (torch.save(gm) / pickle.dumps(gm)): "
    "its forward checks its inputs with torch.export's generated function in a form this torch "
    "version wraps in a way amprewrite cannot read back. Save it one of these ways instead: (1) the weights, converted again "
    "on load: torch.save(gm.state_dict(), f); then model.load_state_dict(torch.load(f)) and "
    "amprewrite.convert(model, example_inputs, ...); (2) the program: "
    "torch.export.save(torch.export.export(gm, example_inputs), f), loaded with "
    "torch.export.load(f).module() (needs only torch). copy.deepcopy(gm) works in-process.")


def _reduce_converted(self: fx.GraphModule) -> Any:
    guards = self._modules.get(GUARDS_ATTR)
    if guards is not None and not isinstance(guards, InputGuards):
        raise TypeError(_UNPICKLABLE)
    rebuild, (body, import_block) = fx.GraphModule.__reduce__(self)
    body["_tracer_cls"], body["_tracer_extras"] = _AmpTracer, {}  # NB: module docstring
    return rebuild, (body, import_block)


def _converted_call(self: fx.GraphModule, *args: Any, **kwargs: Any) -> Any:
    # NB: is_compiling first: Dynamo folds it to True and never sees the watch.
    if not torch.compiler.is_compiling():
        watch = self.__dict__.get(WATCH_ATTR)
        if watch is not None:
            watch.check()
    try:
        return nn.Module.__call__(self, *args, **kwargs)
    except Exception as exc:
        context = failure_context(exc)
        if context is not None:
            print(context, file=sys.stderr)
        raise


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
