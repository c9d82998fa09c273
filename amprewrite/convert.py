"""``convert``: capture a model, classify its ops, insert explicit casts, clean them up."""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn

from .capture.converted import CONVERTED_KEY, MODEL_KEY, is_converted
from .module.cache import GraphCache
from .module.calling import finish
from .module.first_call import placeholder_module
from .module.model_view import adopt_model
from .module.tree import adopt_children, register_view
from .options import ConvertOptions, resolve_dtype
from .passes.opt_levels import OPT_LEVEL_KEY, OptLevel
from .policy.policy import Policy
from .recipe import CaptureRecipe

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
    first_call = capture == "export" and example_inputs is None and example_kwargs is None
    recipe = CaptureRecipe(model, options, has_inputs=first_call or example_inputs is not None
                           or example_kwargs is not None)
    if first_call:  # captured at its first call, from its inputs (:mod:`.module.first_call`)
        level, low = options.opt_level, options.low
        meta: dict[str, Any] = {CONVERTED_KEY: (options.policy, low),
                                MODEL_KEY: type(model).__name__}
        if level != "O1":
            meta[OPT_LEVEL_KEY] = OptLevel(level, None if level == "O0" else low)
        gm = finish(placeholder_module(model, meta, o2=level == "O2",
                                       shares=recipe.view))
        if recipe.view:
            adopt_children(gm, model)
            register_view(gm, model)
        GraphCache(recipe, options.on_change, first_call=True).attach(gm)
        adopt_model(gm, model)  # ``(*args, **kwargs)`` until then: the model's signature
        return gm
    entries = recipe.capture(example_inputs, example_kwargs)
    gm = entries[0].holder  # not held yet: its own module
    assert gm is not None
    if recipe.view:  # NB: before the cache's stamp, which its first hooks move
        register_view(gm, model)
    cache = GraphCache(recipe, options.on_change)
    cache.start(gm, entries, "at conversion", recipe.watch(gm))
    cache.attach(gm)
    if not is_converted(model):
        # NB: the model's signature, not the capture's (which names the example's inputs):
        # Trainer reads it to pick the columns and whether to pass num_items_in_batch, and
        # must treat the converted module as it treats the model
        adopt_model(gm, model)
    return gm
