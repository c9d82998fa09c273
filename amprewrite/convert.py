"""``convert``: capture a model, classify its ops, insert explicit casts, clean them up."""

from __future__ import annotations

import dataclasses
import difflib
import fnmatch
import warnings
from typing import Any, Callable

import torch
import torch.fx as fx
import torch.nn as nn

from .capture.converted import CONVERTED_KEY, MODEL_KEY, capture_converted, is_converted
from .capture.export import DynamicDims, Regime, capture_export, dynamic_shapes
from .capture.guards import refuse_float64
from .module.first_call import placeholder_module
from .module.cache import CACHE_KEY, STATE_KEY, Entry, GraphCache
from .module.modes import MODE_KEY, NOT_CAPTURED_KEY, in_mode, mode_name, not_captured_graph
from .module.sharing import rebind_table, relink_graph, share_root_state, share_state
from .module.tree import adopt_children, register_view, view_model
from .module.isolation import CAPTURE_LOCK, outside_modes
from .capture.logs import quiet_capture_logs
from .capture.persistence import match_persistence
from .capture.reads import (Reads, note_forward, note_leaf_modules, recording_reads,
                            restore_classes, restore_writes)
from .capture.state import preserved_global_state
from .capture.symbolic import capture_symbolic, propagate_meta
from .errors import AmpRewriteError, user_stacklevel
from .module.calling import finish
from .module.model_view import adopt_model
from .graph.inputs import record_inputs
from .graph.meta import META_KEY
from .graph.queries import module_paths
from .hardware import model_device
from .passes.attention import fast_path_attention
from .passes.calibrate import record_ranges
from .passes.gather_weights import gather_weights
from .passes.opt_levels import (
    OPT_LEVEL_KEY,
    OptLevel,
    apply_opt_level,
    low_precision_twin,
)
from .passes.pipeline import run_passes
from .options import ConvertOptions, resolve_dtype
from .policy.policy import Policy
from .module.model_watch import ModelWatch, share_tensor_dicts, watch_model
from .capture.snapshot import StateSnapshot

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
    recapture = _Recapture(model, options, has_inputs=first_call or example_inputs is not None
                           or example_kwargs is not None)
    if first_call:
        return _placeholder(model, options, recapture)
    entries = recapture.capture(example_inputs, example_kwargs)
    gm = entries[0].holder  # not held yet: its own module
    assert gm is not None
    if recapture.view:  # NB: before the cache's stamp, which its first hooks move
        register_view(gm, model)
    cache = GraphCache(recapture, options.on_change)
    cache.start(gm, entries, "at conversion", recapture.watch(gm))
    cache.attach(gm)
    if not is_converted(model):
        # NB: the model's signature, not the capture's (which names the example's inputs):
        # Trainer reads it to pick the columns and whether to pass num_items_in_batch, and
        # must treat the converted module as it treats the model
        adopt_model(gm, model)
    return gm


def _placeholder(model: nn.Module, options: ConvertOptions, recapture: _Recapture
                 ) -> fx.GraphModule:
    """The module of ``convert(model, capture="export")`` without example inputs, captured at
    its first call (:mod:`.module.first_call`)."""
    level, low = options.opt_level, options.low
    meta: dict[str, Any] = {CONVERTED_KEY: (options.policy, low),
                            MODEL_KEY: type(model).__name__}
    if level != "O1":
        meta[OPT_LEVEL_KEY] = OptLevel(level, None if level == "O0" else low)
    gm = finish(placeholder_module(model, meta, o2=level == "O2"))
    if recapture.view:
        adopt_children(gm, model)
        register_view(gm, model)
    GraphCache(recapture, options.on_change, first_call=True).attach(gm)
    adopt_model(gm, model)  # ``(*args, **kwargs)`` until then: the model's signature
    return gm


class _Recapture:
    """How a converted module captures its model: ``convert``'s arguments, and the inputs of
    the call or the entry a capture is made for (:mod:`.module.cache`). A class, not a
    closure, so that a deep copy of the module copies the model with it."""

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
            entries = _capture_and_rewrite(model, args, kwargs, self.options, root=root,
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
        pair = _ModePair(varying=like.varying)
        pair.main, pair.main_code = gm, like.raw_code
        with CAPTURE_LOCK.writing(), outside_modes(), preserved_global_state(), \
                quiet_capture_logs():
            other = _capture_other(like.source, training, like.inputs, self.options, pair)
        if other is None:
            return None
        if NOT_CAPTURED_KEY not in other.meta:
            _record_inputs(other, like.source, *like.inputs, self.options.capture)
        if self.view:
            adopt_children(other, self.model)
            rebind_table(other)  # its weights read through the model's modules
        return Entry(finish(other), (training,), like.source, like.inputs, like.varying)

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


class _ModePair:
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


def _capture_and_rewrite(model: nn.Module, args: tuple | None, kwargs: dict[str, Any] | None,
                         options: ConvertOptions, root: fx.GraphModule | None = None,
                         varying: DynamicDims = frozenset()) -> list[Entry]:
    """The entry of the mode ``model`` is in; the other mode is captured when the module is
    first switched to it (see :mod:`.module.modes`), or now where an override names nothing
    in the first mode's capture (it may name something in the other's). ``root``: the
    converted module whose root tensors a capture for a new state shares."""
    if options.opt_level == "O3" and not is_converted(model):
        # O3 owns low-precision copies of everything
        model = low_precision_twin(model, options.low)
    pair = _ModePair(root, varying)
    main = _capture_one(model, args, kwargs, options, pair)
    assert main is not None  # the first mode is never the same code as another
    training = bool(main.meta[MODE_KEY])
    modes: tuple[bool, ...] = (training,)
    if is_converted(model) and _serves_both(model):
        modes = (False, True)  # one graph serves both modes of the converted input
    entries = [Entry(main, modes, model, (args, kwargs), varying, pair.main_code)]
    if len(modes) == 1 and any(_override_misses(pair, options.policy)):
        other = _capture_other(model, not training, (args, kwargs), options, pair)
        if other is not None:
            entries.append(Entry(other, (not training,), model, (args, kwargs), varying))
    if root is None:  # a new state's capture: the names were checked at conversion
        _check_override_names(pair, options.policy)
    return entries


def _serves_both(gm: nn.Module) -> bool:
    cache = gm.__dict__.get(CACHE_KEY)
    return cache is not None and cache.held is not None and len(cache.held.modes) == 2


def _capture_other(model: nn.Module, training: bool,
                   inputs: tuple[tuple | None, dict[str, Any] | None], options: ConvertOptions,
                   pair: _ModePair) -> fx.GraphModule | None:
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
                 options: ConvertOptions, pair: _ModePair) -> fx.GraphModule | None:
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
                        options: ConvertOptions, pair: _ModePair) -> fx.GraphModule | None:
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


def _rewrite(gm: fx.GraphModule, model: nn.Module, options: ConvertOptions, pair: _ModePair
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
    reads off tensors are the ones the converted graph computes (see :mod:`._export`)."""
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


def _record_override_names(gm: fx.GraphModule, pair: _ModePair) -> None:
    pair.nodes.update(n.name for n in gm.graph.nodes)
    pair.paths.update(q for q, _ in gm.named_modules() if q)
    for node in gm.graph.nodes:
        pair.paths.update(module_paths(node))


def _override_misses(pair: _ModePair, policy: Policy) -> tuple[list[str], list[str]]:
    """The node and module overrides that name nothing in the captures recorded in ``pair``."""
    return ([k for k, _ in policy.node_overrides if k not in pair.nodes],
            [p for p, _ in policy.module_overrides
             if not any(fnmatch.fnmatchcase(q, p) for q in pair.paths)])


def _check_override_names(pair: _ModePair, policy: Policy) -> None:
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
