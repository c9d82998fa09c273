"""The pass pipeline of a conversion: drop no-ops, decompose, classify, insert casts, fp8
linears (``Policy.fp8`` only), fit constants, eliminate casts, fold constants, native
kernels.

Decompose, classify and insert casts run again while a composite waits for the dtypes of its
inputs to be final before it is split (:class:`~amprewrite.graph.meta.PendingSplit`): one
more round per level of composites nested in composites."""

from __future__ import annotations

import torch
import torch.fx as fx
from torch.fx.passes.infra.pass_manager import PassManager

from ..errors import AmpRewriteError
from ..graph.meta import cast_info, pending_split
from ..policy.policy import Policy
from .classify import ClassifyPass
from .decompose import DecomposeCompositesPass
from .drop_noops import DropNoOpsPass
from .eliminate_casts import EliminateCastsPass, _report
from .fit_constants import FitConstantsPass
from .fold_constants import FoldConstantsPass
from .fp8 import Fp8LinearPass
from .insert_casts import InsertCastsPass
from .native_kernels import NativeKernelsPass

__all__ = ["amp_passes", "run_passes"]

_MAX_ROUNDS = 8
"""Rounds of decompose, classify and insert casts, at most: composites nest about 4 deep."""


def _phases(policy: Policy, dtype: torch.dtype) -> tuple[list, list, list]:
    """The passes before, of and after the rounds that decide dtypes."""
    fp8 = [Fp8LinearPass(policy)] if policy.fp8_rules is not None else []
    return ([DropNoOpsPass()],
            [DecomposeCompositesPass(policy), ClassifyPass(policy, dtype),
             InsertCastsPass(policy, dtype)],
            [*fp8, FitConstantsPass(), EliminateCastsPass(policy), FoldConstantsPass(),
             NativeKernelsPass()])


def amp_passes(policy: Policy, dtype: torch.dtype) -> list:
    """The graph-to-graph steps of a conversion, in order (each is idempotent)."""
    before, rounds, after = _phases(policy, dtype)
    return before + rounds + after


def _pending(gm: fx.GraphModule) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if pending_split(n) is not None]


def run_passes(gm: fx.GraphModule, policy: Policy, dtype: torch.dtype, *,
               mark_converted: bool = True) -> fx.GraphModule:
    """Run the amprewrite passes on a captured GraphModule (in place) and recompile it.

    ``mark_converted``: record the policy in ``gm.meta`` (what ``explain()`` reads and what
    makes a later ``convert`` of ``gm`` reuse its graph); the opt levels O2/O3 record their
    level instead."""
    report = _report(gm)
    before, rounds, after = _phases(policy, dtype)
    try:
        _run(before + rounds, gm)
        for _ in range(_MAX_ROUNDS):
            if not _pending(gm):
                break
            _run(rounds, gm)
        if _pending(gm):
            raise AmpRewriteError(
                "amprewrite: composites still wait to be split after "
                f"{_MAX_ROUNDS} rounds of the passes: "
                + ", ".join(n.format_node() for n in _pending(gm))
                + ". Please report this model; Policy().override(ops={...}) on these ops "
                "keeps them whole meanwhile.")
        _run(after, gm)
    except Exception as exc:
        # PassManager wraps every failure in a bare Exception naming the pass; the user
        # needs our own error (what, where, the fix), which is its cause.
        if isinstance(exc.__cause__, (AmpRewriteError, ValueError, TypeError)):
            raise exc.__cause__ from None
        raise
    casts = [n for n in gm.graph.nodes if cast_info(n) is not None]
    report.inserted = len(casts)
    report.guarded = sum(1 for n in casts if cast_info(n).guarded)
    if mark_converted:
        gm.meta["amprewrite_policy"] = (policy, dtype)
    gm.graph.lint()
    gm.recompile()
    return gm


def _run(passes: list, gm: fx.GraphModule) -> None:
    PassManager(passes=passes, run_checks_after_each_pass=True)(gm)
