"""``convert``: capture a model, classify its ops, insert explicit casts, clean them up."""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn

from .options import ConvertOptions, resolve_dtype
from .policy.policy import Policy
from .recipe import converted_module

__all__ = ["convert", "resolve_dtype"]

def convert(
    model: nn.Module,
    example_inputs: tuple | None = None,
    *,
    example_kwargs: dict[str, Any] | None = None,
    policy: Policy | None = None,
    dtype: torch.dtype | None = None,
    capture: str = "auto",
    opt_level: str = "O1",
    calibrate: tuple[tuple, dict] | list[tuple[tuple, dict]] | None = None,
    on_change: str = "recapture",
) -> fx.GraphModule:
    """Rewrite ``model`` into a GraphModule that runs in mixed precision with explicit casts.

    Args:
        model: any ``nn.Module``; it is not modified. The result shares its parameters
            (fp32 master weights): an optimizer over ``model.parameters()`` trains it.
        example_inputs: a tuple of positional arguments. With them, dtypes are known
            statically (every cast is exact and visible); without them, the symbolic tracer
            is used and activation casts check their input at run time.
        example_kwargs: keyword arguments to go with ``example_inputs``.
        policy: op precision rules; default :class:`Policy()` (CUDA AMP rules everywhere).
            ``Policy.fp8(...)``: bf16, with the linear layers as fp8 matmuls (e4m3,
            per-tensor dynamic scales, e5m2 gradients; see :mod:`amprewrite.passes.fp8`).
        dtype: torch.float16 or torch.bfloat16; default fp16 for models on CUDA, else bf16.
        capture: ``"auto"`` (export when example inputs are given, else symbolic),
            ``"symbolic"`` or ``"export"``. ``"export"`` without example inputs captures at
            the first call, from its inputs, and again for inputs the graph does not fit
            (:mod:`amprewrite.module.first_call`): for trainers that take the model before
            any batch exists.
        opt_level: Apex's levels. ``"O1"`` (default): the per-op policy above. ``"O0"``: fp32,
            no casts (the baseline). ``"O2"``: weights stored in the low dtype (except
            normalisation layers, which stay fp32) with fp32 master weights, which stay the
            parameters; train it with ``amprewrite.MasterWeights(gm, optimizer)``.
            ``"O3"``: everything in the low dtype, on copies of the parameters (the speed
            baseline). O2 and O3 take floating inputs in any dtype and return fp32.
            ``policy`` applies to O1 only.
        calibrate: ``(args, kwargs)`` or a list of them (``((x,), {})`` for one tensor; a
            bare tuple of arguments is refused as ambiguous). Before the passes, the captured
            graph runs in fp32 on each (no grad; the model is not changed) and every node's
            largest finite |x| is recorded; then an op that would compute in the low dtype
            and whose output or inputs exceed ``finfo(low).max / 2**policy.range_headroom_bits``
            computes in fp32 (rule ``"range: ..."`` in ``explain``). O1 only.
        on_change: what a call does when the model's Python state that the capture read has
            changed since (an attribute, a config value, a submodule replaced, an adapter
            switched: see :mod:`amprewrite.module.cache`). ``"recapture"`` (default):
            capture the model as it is now, with the call's inputs, warning once with what
            changed, and keep the earlier graph for when the state returns (at most 8 states).
            ``"raise"``: raise :class:`AmpRewriteError` naming what changed.

    Returns:
        A ``torch.fx.GraphModule``; ``print(gm.code)`` shows every cast, and
        ``amprewrite.explain(gm)`` every decision.

    ``model`` is captured in the mode it is in (``model.training``); the other mode is
    captured, with the same inputs and options, the first time ``gm.train(mode)`` /
    ``gm.eval()`` switches to it (outside ``torch.compile`` and tracing; see
    :mod:`amprewrite.module.modes`). ``gm`` holds a reference to ``model`` and to the
    example inputs (and a deep copy of ``gm`` a copy of them).

    ``gm`` stays the model: it computes with the model's tensors as they are at each call
    (replaced ones included), and each call checks that the Python state the capture read
    still holds (``on_change``). Its submodules are the model's own (``gm.head is
    model.head``, :mod:`amprewrite.module.tree`; not at O3), so ``gm.parameters()`` and
    ``gm.state_dict()`` are the model's at every moment, and ``gm.train()`` / ``gm.eval()``
    switch the model too, as ``torch.compile``'s module does.
    """
    options = ConvertOptions.checked(
        model, example_inputs, example_kwargs, policy=policy, dtype=dtype, capture=capture,
        opt_level=opt_level, calibrate=calibrate, on_change=on_change)
    return converted_module(model, options, example_inputs, example_kwargs)
