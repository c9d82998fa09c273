"""The recipe a converted module captures its model by: :class:`CaptureRecipe`, and the
converted module made from it: :func:`converted_module`.

``convert`` checks its arguments and calls :func:`converted_module`, which makes a recipe and
hands it to the module's :class:`~amprewrite.module.cache.GraphCache`, which calls it back at
every later capture (a new state, new input sizes, the other mode, the first call of
``capture="export"``) and, through :meth:`CaptureRecipe.part`, for the model's methods and
the submodules its code hands out (:mod:`amprewrite.module.methods`). It takes the model as it is now, captures and rewrites it
(:mod:`.rewrite`), and finishes the graphs as a converted module's: the model's own tensor dicts
and children in every graph, the inputs each was captured for, its calls and copies."""

from __future__ import annotations

from typing import Any

import torch.fx as fx
import torch.nn as nn

from ..capture.converted import CONVERTED_KEY, MODEL_KEY, is_converted
from ..capture.export import DynamicDims
from ..capture.logs import quiet_capture_logs
from ..capture.state import preserved_global_state
from ..graph.inputs import record_inputs
from ..module.cache import Entry, GraphCache
from ..module.calling import finish
from ..module.first_call import placeholder_module
from ..module.isolation import CAPTURE_LOCK, outside_modes
from ..module.model_view import adopt_model
from ..module.model_watch import ModelWatch, share_tensor_dicts, watch_model
from ..module.modes import NOT_CAPTURED_KEY, in_mode
from ..module.sharing import rebind_table, relink_graph
from ..module.tree import adopt_children, register_view
from ..options import ConvertOptions
from ..passes.opt_levels import OPT_LEVEL_KEY, OptLevel
from .rewrite import ModePair, capture_and_rewrite, capture_other

__all__ = ["CaptureRecipe", "converted_module"]


class CaptureRecipe:
    """How a converted module captures its model (:class:`~amprewrite.module.cache.Recipe`):
    ``convert``'s arguments, and the inputs of the call or the entry a capture is made for. A
    class, not a closure, so that a deep copy of the module copies the model with it."""

    def __init__(self, model: nn.Module, options: ConvertOptions, has_inputs: bool) -> None:
        self.model, self.options = model, options
        self.has_inputs = has_inputs
        """Whether a capture takes the call's inputs: convert's capture did (example inputs),
        or is to be made at the first call."""
        self.can_recapture = not is_converted(model)
        """A converted module converted again captures its other mode only: its model's
        state is the converted module's graph."""
        self.view = self.can_recapture and options.shares_modules
        """Whether the converted module's children are the model's (:mod:`.module.tree`):
        not for O3, which runs on low-precision copies of its own."""

    def __call__(self, gm: fx.GraphModule, args: tuple, kwargs: dict[str, Any],
                 varying: DynamicDims = frozenset()) -> list[Entry]:
        call_args, call_kwargs = (args, kwargs or None) if self.has_inputs else (None, None)
        # NB: the submodules' flags as they are (a frozen batch norm), where they are the
        # model's: the call runs the model in gm's mode with them, as eager would
        with in_mode(self.model, gm.training, root_only=self.view):
            return self.capture(call_args, call_kwargs, root=gm, varying=varying)

    def capture(self, args: tuple | None, kwargs: dict[str, Any] | None,
                root: fx.GraphModule | None = None,
                varying: DynamicDims = frozenset()) -> list[Entry]:
        """The model converted as it is now, in the mode it is in, finished (its calls and
        copies those of a converted module), holding the model's own tensor dicts: its entry,
        then the other mode's where an override made it captured now. ``root``: the
        converted module a capture for a new state shares its root tensors with."""
        model = self.model
        with CAPTURE_LOCK.writing(), outside_modes(), preserved_global_state(), \
                quiet_capture_logs():
            entries = capture_and_rewrite(model, args, kwargs, self.options, root=root,
                                           varying=varying)
            core = entries[0].holder
            if self.options.opt_level != "O3":  # O3 runs on its own copy: nothing shared
                share_tensor_dicts(core, model)
                if self.view:
                    for entry in entries:  # the model's own children, in every graph
                        adopt_children(entry.holder, model)
                for entry in entries[1:]:  # the weight tables read the shared dicts
                    relink_graph(core, entry.holder)
                rebind_table(core)
        for entry in entries:
            graph = entry.holder
            if NOT_CAPTURED_KEY not in graph.meta:
                _record_inputs(graph, model, args, kwargs, self.options.capture)
            graph.meta.setdefault(MODEL_KEY, type(model).__name__)  # a converted module
            # keeps its model's name
            finish(graph)
        return entries

    def capture_mode(self, gm: fx.GraphModule, training: bool, like: Entry) -> Entry | None:
        """The entry of ``training`` mode for ``like``'s group, which ``gm`` holds: captured
        with ``like``'s inputs, reading ``gm``'s tensors; None where it is ``like``'s code;
        one whose graph raises (:func:`not_captured_graph`), with a warning, where the capture
        fails."""
        pair = ModePair(varying=like.varying)
        pair.main, pair.main_code = gm, like.raw_code
        with CAPTURE_LOCK.writing(), outside_modes(), preserved_global_state(), \
                quiet_capture_logs():
            other = capture_other(like.source, training, like.inputs, self.options, pair)
        if other is None:
            return None
        if NOT_CAPTURED_KEY not in other.meta:
            _record_inputs(other, like.source, *like.inputs, self.options.capture)
        if self.view:
            adopt_children(other, self.model)
            rebind_table(other)  # its weights read through the model's modules
        return Entry(finish(other), (training,), like.source, like.inputs, like.varying)

    def part(self, module: nn.Module) -> fx.GraphModule:
        """``module`` (a submodule of the model, or one that runs a method of it) converted
        with this recipe's policy, dtype, opt level and ``on_change``, captured at its first
        call from that call's inputs."""
        o = self.options
        options = ConvertOptions.checked(
            module, None, None, policy=o.policy, dtype=o.low, capture="export",
            opt_level=o.opt_level, calibrate=None, on_change=o.on_change)
        return converted_module(module, options, None, None)

    def watch(self, gm: fx.GraphModule) -> ModelWatch | None:
        """The watch over the model's hooks and tensor slots, made once ``gm`` holds the
        model's tensors (at conversion, or at the first call)."""
        return watch_model(gm, self.model) if self.options.opt_level != "O3" else None


def _record_inputs(gm: fx.GraphModule, model: nn.Module, args: tuple | None,
                   kwargs: dict[str, Any] | None, capture: str) -> None:
    """The example inputs ``gm`` was captured for, named in the error of a call that does not
    fit them (:mod:`.graph.inputs`)."""
    if (args is not None or kwargs is not None) and not is_converted(model):
        exported = capture == "export" or capture == "auto"
        record_inputs(gm, model, args or (), kwargs, sizes_fixed=exported)


def converted_module(model: nn.Module, options: ConvertOptions, example_inputs: tuple | None,
                     example_kwargs: dict[str, Any] | None) -> fx.GraphModule:
    """``convert(model, ...)`` once its arguments are checked (``options``): the converted
    module, captured now from the example inputs, or at its first call where
    ``capture="export"`` comes without them (:mod:`amprewrite.module.first_call`)."""
    first_call = options.capture == "export" and example_inputs is None \
        and example_kwargs is None
    recipe = CaptureRecipe(model, options, has_inputs=first_call or example_inputs is not None
                           or example_kwargs is not None)
    if first_call:
        level, low = options.opt_level, options.low
        meta: dict[str, Any] = {CONVERTED_KEY: (options.policy, low),
                                MODEL_KEY: type(model).__name__}
        if level != "O1":
            meta[OPT_LEVEL_KEY] = OptLevel(level, None if level == "O0" else low)
        gm = finish(placeholder_module(model, meta, o2=level == "O2", shares=recipe.view))
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
