"""The pass pipeline of a conversion: drop no-ops, decompose, classify, insert casts, fp8
linears (``Policy.fp8`` only), fit constants, eliminate casts, fold constants, native
kernels."""

from __future__ import annotations

import torch
import torch.fx as fx
from torch.fx.passes.infra.pass_manager import PassManager

from ..errors import AmpRewriteError
from ..graph.meta import cast_info
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


def amp_passes(policy: Policy, dtype: torch.dtype) -> list:
    """The graph-to-graph steps of a conversion, in order (each is idempotent)."""
    fp8 = [Fp8LinearPass(policy)] if policy.fp8_rules is not None else []
    return [DropNoOpsPass(), DecomposeCompositesPass(policy), ClassifyPass(policy, dtype),
            InsertCastsPass(policy, dtype), *fp8, FitConstantsPass(), EliminateCastsPass(policy),
            FoldConstantsPass(), NativeKernelsPass()]


def run_passes(gm: fx.GraphModule, policy: Policy, dtype: torch.dtype, *,
               mark_converted: bool = True) -> fx.GraphModule:
    """Run the amprewrite passes on a captured GraphModule (in place) and recompile it.

    ``mark_converted``: record the policy in ``gm.meta`` (what ``explain()`` reads and what
    makes a later ``convert`` of ``gm`` reuse its graph); the opt levels O2/O3 record their
    level instead."""
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
    if mark_converted:
        gm.meta["amprewrite_policy"] = (policy, dtype)
    gm.graph.lint()
    gm.recompile()
    return gm
