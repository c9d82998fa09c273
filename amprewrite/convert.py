"""``convert``: capture a model, classify its ops, insert explicit casts, clean them up."""

from __future__ import annotations

import difflib
import fnmatch
import warnings
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn

from .capture.converted import capture_converted, is_converted
from .capture.export import Regime, capture_export
from .capture.persistence import match_persistence
from .capture.state import preserved_global_state
from .capture.symbolic import capture_symbolic, propagate_meta
from .errors import AmpRewriteError
from .graph.calling import finish
from .graph.meta import META_KEY
from .graph.queries import module_paths
from .hardware import model_device, warn_if_slow
from .passes.calibrate import CalibrationInput, check_calibrate, record_ranges
from .passes.gather_weights import gather_weights
from .passes.opt_levels import apply_opt_level, check_opt_level, low_precision_twin
from .passes.pipeline import run_passes
from .policy.policy import Policy, check_low_dtype
from .runtime.model_watch import watch_model

__all__ = ["convert", "resolve_dtype"]

_CAPTURES = ("auto", "symbolic", "export")


def resolve_dtype(model: nn.Module, policy: Policy, dtype: torch.dtype | None) -> torch.dtype:
    """``dtype`` argument > the policy's dtype > fp16 for a model on CUDA, bf16 otherwise."""
    if dtype is not None:
        return check_low_dtype(dtype, "amprewrite.convert")
    if policy.dtype is not None:
        return policy.dtype
    first = next(iter(model.parameters()), None)
    return torch.float16 if first is not None and first.is_cuda else torch.bfloat16


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
        dtype: torch.float16 or torch.bfloat16; default fp16 for models on CUDA, else bf16.
        capture: ``"auto"`` (export when example inputs are given, else symbolic),
            ``"symbolic"`` or ``"export"``.
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

    Returns:
        A ``torch.fx.GraphModule``; ``print(gm.code)`` shows every cast, and
        ``amprewrite.explain(gm)`` every decision.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"amprewrite.convert expects a torch.nn.Module, got "
                        f"{type(model).__name__}; wrap functions in an nn.Module first.")
    if example_inputs is not None and not isinstance(example_inputs, tuple):
        raise TypeError(
            f"amprewrite.convert: example_inputs must be a tuple of positional arguments, got "
            f"{type(example_inputs).__name__}; for one input write example_inputs=(x,).")
    if example_kwargs is not None and not isinstance(example_kwargs, dict):
        raise TypeError(f"amprewrite.convert: example_kwargs must be a dict, got "
                        f"{type(example_kwargs).__name__}")
    if capture not in _CAPTURES:
        raise ValueError(f"amprewrite.convert: capture={capture!r} is unknown; expected one of "
                         f"{', '.join(map(repr, _CAPTURES))}")
    if policy is None:
        policy = Policy()
    if not isinstance(policy, Policy):
        raise TypeError(f"amprewrite.convert: policy must be an amprewrite.Policy, got "
                        f"{type(policy).__name__}")
    if capture == "export" and example_inputs is None:
        raise ValueError("amprewrite.convert(capture='export') needs example_inputs=(...)")
    check_opt_level(opt_level, policy, dtype)
    calibration = check_calibrate(calibrate, model, opt_level)
    low = resolve_dtype(model, policy, dtype)
    if opt_level != "O0":
        warn_if_slow(model_device(model, example_inputs, example_kwargs), low)
    with preserved_global_state():
        gm = _capture_and_rewrite(model, example_inputs, example_kwargs, policy, low, capture,
                                  opt_level, calibration)
        if opt_level != "O3":  # O3 runs on its own copy of the model: nothing is shared
            watch_model(gm, model)
        return finish(gm)


def _capture_and_rewrite(model: nn.Module, args: tuple | None, kwargs: dict[str, Any] | None,
                         policy: Policy, low: torch.dtype, capture: str, opt_level: str,
                         calibration: list[CalibrationInput] | None = None) -> fx.GraphModule:
    has_inputs = args is not None or kwargs is not None
    if opt_level == "O3" and not is_converted(model):
        model = low_precision_twin(model, low)  # O3 owns low-precision copies of everything
    if is_converted(model):
        # NB: re-capturing would lose what only the nodes' meta holds (the model's own
        # autocast regions, the decisions), so converting twice could cast more.
        return _rewrite(capture_converted(model), model, policy, low, opt_level)  # type: ignore[arg-type]
    if capture == "export" or (capture == "auto" and has_inputs):
        return _export_and_rewrite(model, args or (), kwargs, policy, low, opt_level,
                                   calibration)
    gm = capture_symbolic(model)
    if has_inputs:
        propagate_meta(gm, args or (), kwargs)
    return _rewrite(gm, model, policy, low, opt_level, calibration)


def _export_and_rewrite(model: nn.Module, args: tuple, kwargs: dict[str, Any] | None,
                        policy: Policy, low: torch.dtype, opt_level: str,
                        calibration: list[CalibrationInput] | None = None) -> fx.GraphModule:
    """Export with dynamic dimensions and rewrite; if either fails under symbolic sizes
    (some ATen meta kernels reject them), export again with the example's static shapes."""
    regime = _regime(model, args, kwargs, policy, low, opt_level)
    faithful = opt_level != "O0"
    try:
        gm = capture_export(model, args, kwargs, regime=regime, dynamic=True, faithful=faithful)
    except AmpRewriteError as exc:
        dynamic_error: Exception = exc
    else:
        if not _has_symbolic_shapes(gm):
            return _rewrite(gm, model, policy, low, opt_level, calibration)
        try:
            return _rewrite(gm, model, policy, low, opt_level, calibration)
        except (ValueError, TypeError):
            raise  # the user's input is wrong: shapes have nothing to do with it
        except Exception as exc:
            dynamic_error = exc
    gm = capture_export(model, args, kwargs, regime=regime, dynamic=False, faithful=faithful)
    gm = _rewrite(gm, model, policy, low, opt_level, calibration)
    warnings.warn(
        f"amprewrite.convert: {type(model).__name__} could not be converted with dynamic "
        f"shapes ({type(dynamic_error).__name__}: {str(dynamic_error).splitlines()[0]}); it was "
        "converted for the example inputs' shapes, so the converted module accepts only "
        "those shapes. Convert again with example inputs of the shapes you will run.",
        stacklevel=3)
    return gm


def _rewrite(gm: fx.GraphModule, model: nn.Module, policy: Policy, low: torch.dtype,
             opt_level: str, calibration: list[CalibrationInput] | None = None) -> fx.GraphModule:
    gm.meta.pop(META_KEY, None)
    match_persistence(gm, model)
    if opt_level != "O1":
        return apply_opt_level(gm, model, opt_level, low)
    _check_override_names(gm, policy)
    if calibration:
        record_ranges(gm, calibration, policy)  # read by ClassifyPass (range_rule)
    run_passes(gm, policy, low)
    return gather_weights(gm)


def _regime(model: nn.Module, args: tuple, kwargs: dict[str, Any] | None, policy: Policy,
            low: torch.dtype, opt_level: str) -> Regime | None:
    """The ``torch.autocast`` to trace the model under, so that the dtypes its Python code
    reads off tensors are the ones the converted graph computes (see :mod:`._export`)."""
    if opt_level == "O0":
        return None
    device = model_device(model, args, kwargs).type
    if policy.device_type is not None and policy.device_type != device:
        return None  # the preset casts nothing on this device
    if not torch.amp.is_autocast_available(device) or \
            (device == "cuda" and not torch.cuda.is_available()):
        return None  # (fake CUDA tensors on a CPU-only build: autocast disables itself)
    return device, low


def _has_symbolic_shapes(gm: fx.GraphModule) -> bool:
    for node in gm.graph.nodes:
        val = node.meta.get("val")
        if node.op == "placeholder" and isinstance(val, torch.Tensor) and any(
                isinstance(s, torch.SymInt) for s in val.shape):
            return True
    return False


def _check_override_names(gm: fx.GraphModule, policy: Policy) -> None:
    """Node and module overrides must name something in this capture (with near matches)."""
    names = {n.name for n in gm.graph.nodes}
    _fail_unmatched("node overrides name nodes that are not in the captured graph",
                    [k for k, _ in policy.node_overrides if k not in names], names,
                    "Node names come from amprewrite.explain(gm) of this capture path.")
    paths = {q for q, _ in gm.named_modules() if q}
    for node in gm.graph.nodes:
        paths.update(module_paths(node))
    _fail_unmatched("module overrides match no module of the model",
                    [p for p, _ in policy.module_overrides
                     if not any(fnmatch.fnmatchcase(q, p) for q in paths)], paths,
                    "Use qualified names as in model.named_modules(), globs allowed.")


def _fail_unmatched(what: str, unmatched: list[str], known: set[str], fix: str) -> None:
    if unmatched:
        raise ValueError(
            f"Policy {what}: "
            + "; ".join(f"{k!r} (near: {', '.join(difflib.get_close_matches(k, known, 3)) or '-'})"
                        for k in unmatched)
            + f". {fix}")
