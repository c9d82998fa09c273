"""Capture and rewrite: from the model, in the mode it is in, to the converted graph of each
mode that needs one.

:func:`capture_and_rewrite` captures the model (``torch.export`` with dynamic sizes, falling back
to the example's static ones; the symbolic tracer; or a converted module's own graph), records
what its code read (:mod:`amprewrite.capture.reads`) as the graph's state, and runs the passes
of the opt level. The other mode is captured the first time the module switches to it
(:func:`capture_other`), or at once where an override names nothing in the first mode's
capture; a mode whose code is the first's shares its graph. :class:`ModePair` carries what the
two captures share."""

from __future__ import annotations

import dataclasses
import difflib
import fnmatch
import warnings
from typing import Any, Callable

import torch
import torch.fx as fx
import torch.nn as nn

from ..capture.converted import capture_converted, is_converted
from ..capture.export import DynamicDims, Regime, capture_export, dynamic_shapes
from ..capture.guards import refuse_float64
from ..capture.persistence import match_persistence
from ..capture.reads import (Reads, note_forward, note_leaf_modules, recording_reads,
                             restore_classes, restore_writes)
from ..capture.snapshot import StateSnapshot
from ..capture.symbolic import capture_symbolic, propagate_meta
from ..errors import AmpRewriteError, user_stacklevel
from ..graph.meta import META_KEY
from ..graph.queries import module_paths
from ..hardware import model_device
from ..module.cache import CACHE_KEY, STATE_KEY, Entry
from ..module.modes import MODE_KEY, NOT_CAPTURED_KEY, in_mode, mode_name, not_captured_graph
from ..module.sharing import share_root_state, share_state
from ..module.tree import view_model
from ..options import ConvertOptions
from ..passes.attention import fast_path_attention
from ..passes.calibrate import record_ranges
from ..passes.gather_weights import gather_weights
from ..passes.opt_levels import apply_opt_level, low_precision_twin
from ..passes.pipeline import run_passes
from ..policy.policy import Policy

__all__ = ["ModePair", "capture_and_rewrite", "capture_other"]


class ModePair:
    """What the capture of the second mode shares with the first: the first's converted
    module, the code it was captured as, and the names both graphs give node and module
    overrides."""

    def __init__(self, root: fx.GraphModule | None = None,
                 varying: DynamicDims = frozenset()) -> None:
        self.varying = varying
        """Dimensions both captures make dynamic (:func:`.capture.export.dynamic_shapes`)."""
        self.main: fx.GraphModule | None = None
        self.main_code = ""
        self.nodes: set[str] = set()
        self.paths: set[str] = set()
        self.root = root
        """The converted module a new state's capture shares its root tensors with."""


def capture_and_rewrite(model: nn.Module, args: tuple | None, kwargs: dict[str, Any] | None,
                        options: ConvertOptions, root: fx.GraphModule | None = None,
                        varying: DynamicDims = frozenset()) -> list[Entry]:
    """The entry of the mode ``model`` is in; the other mode is captured when the module is
    first switched to it (see :mod:`.module.modes`), or now where an override names nothing
    in the first mode's capture (it may name something in the other's). ``root``: the
    converted module whose root tensors a capture for a new state shares."""
    if options.opt_level == "O3" and not is_converted(model):
        # O3 owns low-precision copies of everything
        model = low_precision_twin(model, options.low)
    pair = ModePair(root, varying)
    main = _capture_one(model, args, kwargs, options, pair)
    assert main is not None  # the first mode is never the same code as another
    training = bool(main.meta[MODE_KEY])
    modes: tuple[bool, ...] = (training,)
    if is_converted(model) and _serves_both(model):
        modes = (False, True)  # one graph serves both modes of the converted input
    entries = [Entry(main, modes, model, (args, kwargs), varying, pair.main_code)]
    if len(modes) == 1 and any(_override_misses(pair, options.policy)):
        other = capture_other(model, not training, (args, kwargs), options, pair)
        if other is not None:
            entries.append(Entry(other, (not training,), model, (args, kwargs), varying))
    if root is None:  # a new state's capture: the names were checked at conversion
        _check_override_names(pair, options.policy)
    return entries


def _serves_both(gm: nn.Module) -> bool:
    cache = gm.__dict__.get(CACHE_KEY)
    return cache is not None and cache.held is not None and len(cache.held.modes) == 2


def capture_other(model: nn.Module, training: bool,
                  inputs: tuple[tuple | None, dict[str, Any] | None], options: ConvertOptions,
                  pair: ModePair) -> fx.GraphModule | None:
    """The graph of ``training`` mode, the other of ``pair.main``'s: None where it is the
    same code; a graph that raises, with a warning, where the model cannot be captured in
    that mode."""
    main = pair.main
    assert main is not None
    args, kwargs = inputs
    if is_converted(model):  # the converted input's graph of that mode
        source = model.__dict__[CACHE_KEY].graph_in(model, training)
        if NOT_CAPTURED_KEY in source.meta:
            return not_captured_graph(main, training, source.meta[NOT_CAPTURED_KEY])
        return _capture_one(source, args, kwargs, options, pair)
    try:
        with in_mode(model, training):
            return _capture_one(model, args, kwargs, options, pair)
    except Exception as exc:
        other = not_captured_graph(main, training, exc)
        warnings.warn(
            f"amprewrite: {type(model).__name__} could not be captured in "
            f"{mode_name(training)} mode ({other.meta[NOT_CAPTURED_KEY]}); the converted "
            f"module runs in {mode_name(not training)} mode only, and raises if called "
            f"after gm.{mode_name(training)}().", stacklevel=user_stacklevel())
        return other


def _capture_one(model: nn.Module, args: tuple | None, kwargs: dict[str, Any] | None,
                 options: ConvertOptions, pair: ModePair) -> fx.GraphModule | None:
    """One mode's converted graph (the mode ``model`` is in); None where it is the code of
    the first mode's (``pair.main``)."""
    has_inputs = args is not None or kwargs is not None
    if is_converted(model):
        # NB: re-capturing would lose what only the nodes' meta holds (the model's own
        # autocast regions, the decisions), so converting twice could cast more.
        copied = capture_converted(model)  # type: ignore[arg-type]
        state = copied.meta.get(STATE_KEY)
        if isinstance(state, StateSnapshot):  # its mode is the copied graph's, whatever
            copied.meta[STATE_KEY] = state.without_flags()  # the flags of its model
        return _rewrite(copied, model, dataclasses.replace(options, calibration=None), pair)
    if options.capture == "export" or (options.capture == "auto" and has_inputs):
        return _export_and_rewrite(model, args or (), kwargs, options, pair)
    gm = _recorded(model, lambda: capture_symbolic(model, options.shares_modules),
                   options.shares_modules)
    if has_inputs:
        propagate_meta(gm, args or (), kwargs)
    return _rewrite(gm, model, options, pair)


def _export_and_rewrite(model: nn.Module, args: tuple, kwargs: dict[str, Any] | None,
                        options: ConvertOptions, pair: ModePair) -> fx.GraphModule | None:
    """Export with dynamic dimensions (:func:`~.capture.export.dynamic_dims`) and rewrite;
    if either fails under symbolic sizes (some ATen meta kernels reject them), export again
    with the example's static shapes."""
    regime = _regime(model, args, kwargs, options)
    faithful = options.opt_level != "O0"
    flags = options.shares_modules
    if dynamic_shapes(model, args, kwargs, pair.varying) is None:  # one static export
        gm = _recorded_export(model, args, kwargs, regime, False, faithful, flags)
        return _rewrite(gm, model, options, pair)
    try:
        gm = _recorded_export(model, args, kwargs, regime, True, faithful, flags,
                              pair.varying)
    except AmpRewriteError as exc:
        dynamic_error: Exception = exc
    else:
        if not _has_symbolic_shapes(gm):
            return _rewrite(gm, model, options, pair)
        try:
            return _rewrite(gm, model, options, pair)
        except (ValueError, TypeError):
            raise  # the user's input is wrong: shapes have nothing to do with it
        except Exception as exc:
            dynamic_error = exc
    gm = _recorded_export(model, args, kwargs, regime, False, faithful, flags)
    converted = _rewrite(gm, model, options, pair)
    if pair.varying:  # a capture at a call: its RecaptureWarning names the dimensions
        return converted
    warnings.warn(
        f"amprewrite.convert: {type(model).__name__} could not be converted with dynamic "
        f"shapes ({type(dynamic_error).__name__}: {str(dynamic_error).splitlines()[0]}); it was "
        "converted for the example inputs' shapes, and a call with other sizes is captured "
        "again for them, one graph per size. Convert again with example inputs of the sizes "
        "you will run most.", stacklevel=user_stacklevel())
    return converted


def _recorded_export(model: nn.Module, args: tuple, kwargs: dict[str, Any] | None,
                     regime: Regime | None, dynamic: bool, faithful: bool, flags: bool,
                     varying: DynamicDims = frozenset()) -> fx.GraphModule:
    return _recorded(model, lambda: capture_export(model, args, kwargs, regime=regime,
                                                   dynamic=dynamic, faithful=faithful,
                                                   varying=varying), flags)


def _recorded(model: nn.Module, capture: Callable[[], fx.GraphModule], flags: bool
              ) -> fx.GraphModule:
    """``capture()``'s graph of ``model``, with what the model's code read meanwhile
    (:mod:`.capture.reads`; ``flags``: the submodules' ``training`` flags too) as its
    ``meta[STATE_KEY]``. The layers a symbolic capture keeps whole read their state at each
    call: all of it counts as read."""
    with recording_reads(model, flags) as reads:
        try:
            gm = capture()
        finally:
            written = restore_writes(reads, model)
    restore_classes(gm)
    if written:
        raise AmpRewriteError(
            f"the forward of {type(model).__name__} sets Python attributes of its modules "
            f"({'; '.join(written[:4])}), and a converted graph cannot repeat such a write at "
            "each call: the attribute would stay as it is while the outputs of eager calls "
            "follow it. Pass that value as an input (forward(x, step)), keep the counter "
            "outside the forward, or use amprewrite.compile(model), which replays the write "
            "after each compiled graph. The model was left as it was.")
    _check_seen(reads, model)
    note_forward(reads, model)  # NB: the symbolic tracer reads the class's, never looks it up
    note_leaf_modules(reads, model, gm)
    gm.meta[STATE_KEY] = StateSnapshot(reads, model)
    return gm


def _check_seen(reads: Reads, model: nn.Module) -> None:
    if reads.blind(model):
        warnings.warn(
            f"amprewrite.convert: the capture of {type(model).__name__} read none of its "
            "attributes, submodules or tensors through the model's own modules, so changes to "
            "the model's Python state after conversion cannot be followed (this torch may trace "
            "a copy of the model). Convert again after changing the model, or use "
            "amprewrite.compile(model).", stacklevel=user_stacklevel())


def _rewrite(gm: fx.GraphModule, model: nn.Module, options: ConvertOptions, pair: ModePair
             ) -> fx.GraphModule | None:
    """The passes of the opt level on a fresh capture ``gm`` of ``model``. The capture of the
    second mode reads the first's tensors (:func:`share_state`); None if it is the same code."""
    policy, low, opt_level = options.policy, options.low, options.opt_level
    calibration = options.calibration
    gm.meta.pop(META_KEY, None)
    gm.meta.setdefault(MODE_KEY, model.training)
    code = gm.code
    if pair.main is not None:
        if code == pair.main_code:
            _join_states(pair.main, gm)
            return None  # no mode-dependent code: one graph serves both modes
        share_state(pair.main, gm, view=view_model(pair.main) is model)
    elif pair.root is not None:
        share_root_state(pair.root, gm, suffix="state")
    _record_override_names(gm, pair)
    match_persistence(gm, model)
    if opt_level != "O1":
        gm = apply_opt_level(gm, model, opt_level, low)
    else:
        if calibration:
            record_ranges(gm, calibration, policy)  # read by ClassifyPass (range_rule)
        run_passes(gm, policy, low)
        fast_path_attention(gm, policy, low)
        gm = gather_weights(gm)
        refuse_float64(gm)  # the graph casts per op where autocast leaves float64 alone
    if pair.main is None:
        pair.main, pair.main_code = gm, code
    return gm


def _join_states(main: fx.GraphModule, same: fx.GraphModule) -> None:
    """``main``'s graph serves the mode ``same`` was captured in too: it depends on what
    either capture read."""
    mine, theirs = main.meta.get(STATE_KEY), same.meta.get(STATE_KEY)
    if isinstance(mine, StateSnapshot) and isinstance(theirs, StateSnapshot):
        main.meta[STATE_KEY] = mine.union(theirs)


def _regime(model: nn.Module, args: tuple, kwargs: dict[str, Any] | None,
            options: ConvertOptions) -> Regime | None:
    """The ``torch.autocast`` to trace the model under, so that the dtypes its Python code
    reads off tensors are the ones the converted graph computes
    (:mod:`amprewrite.capture.export`)."""
    policy, low, opt_level = options.policy, options.low, options.opt_level
    if opt_level == "O0":
        return None
    device = model_device(model, args, kwargs).type
    if policy.device_type is not None and policy.device_type != device:
        return None  # the preset casts nothing on this device
    if not torch.amp.is_autocast_available(device):
        return None
    return device, low


def _has_symbolic_shapes(gm: fx.GraphModule) -> bool:
    for node in gm.graph.nodes:
        val = node.meta.get("val")
        if node.op == "placeholder" and isinstance(val, torch.Tensor) and any(
                isinstance(s, torch.SymInt) for s in val.shape):
            return True
    return False


def _record_override_names(gm: fx.GraphModule, pair: ModePair) -> None:
    pair.nodes.update(n.name for n in gm.graph.nodes)
    pair.paths.update(q for q, _ in gm.named_modules() if q)
    for node in gm.graph.nodes:
        pair.paths.update(module_paths(node))


def _override_misses(pair: ModePair, policy: Policy) -> tuple[list[str], list[str]]:
    """The node and module overrides that name nothing in the captures recorded in ``pair``."""
    return ([k for k, _ in policy.node_overrides if k not in pair.nodes],
            [p for p, _ in policy.module_overrides
             if not any(fnmatch.fnmatchcase(q, p) for q in pair.paths)])


def _check_override_names(pair: ModePair, policy: Policy) -> None:
    """Node and module overrides must name something in the capture of either mode (with
    near matches)."""
    nodes, modules = _override_misses(pair, policy)
    _fail_unmatched("node overrides name nodes that are not in the captured graph", nodes,
                    pair.nodes, "Node names come from amprewrite.explain(gm) of this capture path.")
    _fail_unmatched("module overrides match no module of the model", modules, pair.paths,
                    "Use qualified names as in model.named_modules(), globs allowed.")


def _fail_unmatched(what: str, unmatched: list[str], known: set[str], fix: str) -> None:
    if unmatched:
        raise ValueError(
            f"Policy {what}: "
            + "; ".join(f"{k!r} (near: {', '.join(difflib.get_close_matches(k, known, 3)) or '-'})"
                        for k in unmatched)
            + f". {fix}")
