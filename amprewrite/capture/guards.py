"""torch.export's input-shape check, without a Dynamo config patch on every call.

An exported module checks its inputs against the shapes it was traced for, right after its
placeholders::

    _guards_fn = self._guards_fn(x);  _guards_fn = None

which asserts ``x.size()[0] == 1`` and the like. torch.export wraps that check in a Dynamo
config patch (``dont_skip_tracing``, so that a later ``torch.compile`` traces into the check and
keeps its guards), and the patch is entered and left on every eager call as well: 7-9 µs for a
check of 0.5-2 µs (CPU, torch 2.13), paid by every forward of a converted module.

:func:`fast_input_guards` gives the converted module an :class:`InputGuards` in its place:
the same check, called directly when Python runs the forward, and through torch.export's
wrapper when Dynamo traces it. Where the check cannot be found (another torch version
wraps it differently) the module keeps torch.export's own.

Pickling: torch.export generates the check as source code it runs with ``exec`` and does not
keep, so an :class:`InputGuards` pickles the check's compiled code (``marshal``) and rebuilds
the function in the namespace torch.export runs it in. NB: marshalled code loads only on the
Python version that wrote it; another version raises a ``TypeError`` that says so.
"""

from __future__ import annotations

import inspect
import marshal
import math
import sys
import types
from typing import Any, Callable

import torch
import torch.fx as fx
import torch.nn as nn

from ..errors import AmpRewriteError
from ..graph.meta import cast_info

__all__ = ["InputGuards", "fast_input_guards", "is_input_guards", "refuse_float64",
           "GUARDS_ATTR"]

GUARDS_ATTR = "_guards_fn"


class InputGuards(nn.Module):
    """The input-shape assertions of an exported module (``self._guards_fn(x)``), and a check
    that each tensor is floating where the capture's was and not where it was not.

    NB: an integer tensor where a floating one was traced (or the reverse) takes other paths
    through the model: token ids where features were traced would reach the captured cast
    and come out as floats, where the model itself raises (*mat1 and mat2 must have the same
    dtype*). Another floating dtype is fine (O2/O3 cast floating inputs at the entry). The
    check costs one ``is_floating_point()`` per tensor argument, next to the shape check it
    joins; the converted module's call turns its error into one naming the argument
    (:func:`amprewrite.graph.inputs.input_mismatch`).

    NB: float64 where the capture traced fp32/fp16/bf16 is refused too where the graph casts
    per op (O1, :func:`refuse_float64`): autocast never casts float64, so the model, eagerly
    or under autocast, raises where an fp64 tensor meets an fp32 weight, while the captured
    casts would round it to the low dtype and return a result. O2/O3 cast every floating
    input at the entry, as Apex does, and O0 casts nothing (its graph raises as the model
    does): there float64 passes."""

    # NB: the node calling it has no users; fx's dead-code elimination keeps it for this flag,
    # as it keeps torch.export's own guard module.
    _is_impure = True

    def __init__(self, check: Callable[..., None], traced: Callable[..., None],
                 floating: tuple[bool | None, ...] = (),
                 no_float64: frozenset[int] = frozenset()) -> None:
        super().__init__()
        self._check = check
        self._traced = traced
        self._floating = floating
        """Per argument: whether the captured tensor was floating; None for non-tensors."""
        self._no_float64 = frozenset(no_float64)
        """The arguments where a float64 tensor is refused (:func:`refuse_float64`)."""

    def forward(self, *args: Any) -> None:
        if torch.compiler.is_dynamo_compiling():
            return self._traced(*args)  # Dynamo guards on dtypes itself
        # NB: one pass over the arguments (a call's hot path): the kind, then float64
        for i, (x, floating) in enumerate(zip(args, self._floating)):
            if floating is None:
                continue
            if x.is_floating_point() is not floating:
                raise AmpRewriteError(
                    f"argument {i} of the converted module's forward is a {x.dtype} tensor, "
                    f"where the capture traced a{' floating' if floating else 'n integer'} "
                    "one: the graph holds the model's code for that kind of tensor. Convert "
                    "again with example inputs of the dtypes you will pass.")
            if floating and i in self._no_float64 and x.dtype is torch.float64:
                raise AmpRewriteError(
                    f"argument {i} of the converted module's forward is a torch.float64 "
                    "tensor, where the capture traced a lower-precision floating one: "
                    "autocast never casts float64, so the model raises for it, while the "
                    "graph's casts would round it to the low dtype. Pass the dtype of the "
                    "example inputs, or convert again with float64 example inputs.")
        return self._check(*args)

    # NB: called as a function, not through nn.Module.__call__: bookkeeping of the capture,
    # not a layer of the model, so no module hook (a global one included) sees it.
    def __call__(self, *args: Any) -> None:
        if fx._symbolic_trace.is_fx_symbolic_tracing():
            return nn.Module.__call__(self, *args)  # a tracer records it (a pickle's load)
        return self.forward(*args)

    def __reduce__(self) -> Any:
        return (_rebuilt_guards, (marshal.dumps(self._check.__code__), sys.version_info[:2],
                                  self._floating, self._no_float64))


def _rebuilt_guards(code: bytes, version: tuple[int, int],
                    floating: tuple[bool | None, ...] = (),
                    no_float64: frozenset[int] = frozenset()) -> InputGuards:
    if version != sys.version_info[:2]:
        raise TypeError(
            f"amprewrite: this converted module was pickled on Python {version[0]}.{version[1]} "
            f"and cannot be loaded on {sys.version_info[0]}.{sys.version_info[1]}: its input "
            "check is torch.export's generated code, saved compiled. Load it on the Python "
            "that saved it, or save gm.state_dict() and convert again.")
    from torch.fx.experimental.symbolic_shapes import SYMPY_INTERP

    # The namespace torch.export runs the check in (torch/export/_unlift.py).
    check = types.FunctionType(marshal.loads(code),
                               {**SYMPY_INTERP, "math": math, "inf": float("inf")}, "_")
    return InputGuards(check, torch._dynamo.dont_skip_tracing(check), floating, no_float64)


def is_input_guards(node: fx.Node) -> bool:
    """Whether ``node`` is the forward's input-shape check (``self._guards_fn(x)``):
    bookkeeping of the capture, not an op of the model."""
    return node.op == "call_module" and node.target == GUARDS_ATTR


def _plain_check(guards: nn.Module) -> Callable[..., None] | None:
    """The assertion function inside torch.export's wrapped guard module, or None."""
    forward = guards.__dict__.get("forward")
    if not inspect.isfunction(forward) or forward.__closure__ is None:
        return None
    check = inspect.getclosurevars(forward).nonlocals.get("func")
    return check if inspect.isfunction(check) else None


def fast_input_guards(gm: fx.GraphModule) -> None:
    """Replace ``gm``'s torch.export guard module with an :class:`InputGuards` running the
    same check (module docstring); nothing changes if ``gm`` has none or it cannot be read."""
    guards = gm._modules.get(GUARDS_ATTR)
    if guards is None or isinstance(guards, InputGuards):
        return
    check = _plain_check(guards)
    if check is not None:
        setattr(gm, GUARDS_ATTR, InputGuards(check, guards.forward, _floating_args(gm)))


def _floating_args(gm: fx.GraphModule) -> tuple[bool | None, ...]:
    """For each argument of the guard call, whether the capture traced a floating tensor."""
    call = next((n for n in gm.graph.nodes if is_input_guards(n)), None)
    if call is None:
        return ()
    vals = [a.meta.get("val") if isinstance(a, fx.Node) else a for a in call.args]
    return tuple(v.is_floating_point() if isinstance(v, torch.Tensor) else None for v in vals)


def refuse_float64(gm: fx.GraphModule) -> None:
    """Make ``gm``'s input check refuse a float64 tensor for each argument the capture traced
    as fp32, fp16 or bf16 and whose value reaches a cast amprewrite inserted (:class:`InputGuards`,
    NB): called for graphs that cast per op (O1). An argument that only meets ops running in
    whatever dtype arrives (a mask added to scores) computes in float64 as the model does,
    and stays allowed. Nothing changes if ``gm`` has no :class:`InputGuards`."""
    guards = gm._modules.get(GUARDS_ATTR)
    call = next((n for n in gm.graph.nodes if is_input_guards(n)), None)
    if not isinstance(guards, InputGuards) or call is None:
        return
    guards._no_float64 = frozenset(i for i, a in enumerate(call.args)
                                   if isinstance(a, fx.Node) and _reaches_inserted_cast(a))


def _reaches_inserted_cast(arg: fx.Node) -> bool:
    """Whether ``arg``, a floating non-fp64 input, flows into one of our casts through ops
    that keep its dtype: where a float64 tensor there would be rounded down by the graph but
    left alone by autocast. NB: the model's own conversions (``x.float()``) keep their dtype
    as traced and so stop the walk only where they change it."""
    val = arg.meta.get("val")
    if not isinstance(val, torch.Tensor) or not val.is_floating_point() or \
            val.dtype == torch.float64:
        return False
    seen, todo = {arg}, [arg]
    while todo:
        for user in todo.pop().users:
            if user in seen:
                continue
            seen.add(user)
            if cast_info(user) is not None:
                return True
            out = user.meta.get("val")
            if isinstance(out, torch.Tensor) and out.dtype == val.dtype:
                todo.append(user)
    return False
