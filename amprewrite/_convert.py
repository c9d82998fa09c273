"""``convert``: capture a model, classify its ops, insert explicit casts, clean them up."""

from __future__ import annotations

import difflib
import fnmatch
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn
from torch.fx.passes.infra.pass_manager import PassManager

from ._capture import (capture_converted, capture_export, capture_symbolic, is_converted,
                       propagate_meta)
from ._classify import ClassifyPass, module_paths
from ._decompose import DecomposeCompositesPass
from ._errors import AmpRewriteError
from ._eliminate_casts import EliminateCastsPass, _report
from ._insert_casts import InsertCastsPass
from ._meta import META_KEY, cast_info
from ._opt_levels import apply_opt_level, check_opt_level
from .policy import Policy, check_low_dtype

__all__ = ["convert", "amp_passes", "resolve_dtype"]

_CAPTURES = ("auto", "symbolic", "export")


def resolve_dtype(model: nn.Module, policy: Policy, dtype: torch.dtype | None) -> torch.dtype:
    """``dtype`` argument > the policy's dtype > fp16 for a model on CUDA, bf16 otherwise."""
    if dtype is not None:
        return check_low_dtype(dtype, "amprewrite.convert")
    if policy.dtype is not None:
        return policy.dtype
    first = next(iter(model.parameters()), None)
    return torch.float16 if first is not None and first.is_cuda else torch.bfloat16


def amp_passes(policy: Policy, dtype: torch.dtype) -> list:
    """The graph-to-graph steps of a conversion, in order (each is idempotent)."""
    return [DecomposeCompositesPass(policy), ClassifyPass(policy, dtype),
            InsertCastsPass(policy, dtype), EliminateCastsPass(policy)]


def convert(
    model: nn.Module,
    example_inputs: tuple | None = None,
    *,
    example_kwargs: dict[str, Any] | None = None,
    policy: Policy | None = None,
    dtype: torch.dtype | None = None,
    capture: str = "auto",
    opt_level: str = "O1",
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
    low = resolve_dtype(model, policy, dtype)

    has_inputs = example_inputs is not None or example_kwargs is not None
    if is_converted(model):
        # NB: re-capturing would lose what only the nodes' meta holds (the model's own
        # autocast regions, the decisions), so converting twice could cast more.
        gm = capture_converted(model)  # type: ignore[arg-type]
    elif capture == "export" or (capture == "auto" and has_inputs):
        gm = capture_export(model, example_inputs or (), example_kwargs)
    else:
        gm = capture_symbolic(model)
        if has_inputs:
            propagate_meta(gm, example_inputs or (), example_kwargs)
    gm.meta.pop(META_KEY, None)
    if opt_level != "O1":
        return apply_opt_level(gm, model, opt_level, low)
    _check_override_names(gm, policy)
    run_passes(gm, policy, low)
    return gm


def run_passes(gm: fx.GraphModule, policy: Policy, dtype: torch.dtype) -> fx.GraphModule:
    """Run the amprewrite passes on a captured GraphModule (in place) and recompile it."""
    report = _report(gm)
    try:
        PassManager(passes=amp_passes(policy, dtype), run_checks_after_each_pass=True)(gm)
    except Exception as exc:
        # PassManager wraps every failure in a bare Exception naming the pass; the user
        # needs our own error (what, where, the fix), which is its cause.
        if isinstance(exc.__cause__, (AmpRewriteError, ValueError, TypeError)):
            raise exc.__cause__ from None
        raise
    casts = [n for n in gm.graph.nodes if cast_info(n) is not None]
    report.inserted = len(casts)
    report.guarded = sum(1 for n in casts if cast_info(n).guarded)
    gm.meta["amprewrite_policy"] = (policy, dtype)
    gm.graph.lint()
    gm.recompile()
    return gm


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
