"""Which nodes InsertCastsPass re-runs on fake tensors, and what it says when one no longer
runs once the policy's casts changed its inputs' dtypes."""

from __future__ import annotations

import torch
import torch.fx as fx

from ..graph.meta import PIECES_KEY, decision
from ..graph.composites import has_composite_kernel
from ..graph.queries import input_dtypes
from ..policy.opkey import op_key
from ..policy.policy import Policy
from ..policy.tables import CPU_TABLE, CUDA_TABLE

__all__ = ["traced_dtype_may_differ", "run_failure", "mirrored_autocast_at"]

_AUTOCAST_LISTED = frozenset(CPU_TABLE) | frozenset(CUDA_TABLE)


def traced_dtype_may_differ(node: fx.Node) -> bool:
    """Whether ``node``'s recorded dtype may be autocast's rather than the policy's, its
    inputs unchanged: an op an autocast table lists, or one whose decomposition may reach
    such an op (a composite ATen op, unless DecomposeCompositesPass found its pieces
    unlisted; any call that is not an ATen op: torch-level functions and methods, modules).
    NB: re-running the other nodes on fake tensors would give their recorded value again;
    skipping them halves the pass on a segmentation network (LRASPP), whose batch norms,
    activations and views are most of the graph."""
    target = node.target
    if not isinstance(target, torch._ops.OpOverload):
        return True
    if op_key(node) in _AUTOCAST_LISTED:
        return True
    pieces = node.meta.get(PIECES_KEY)
    if pieces is not None:
        return not pieces.isdisjoint(_AUTOCAST_LISTED)
    try:
        return has_composite_kernel(target)
    except RuntimeError:  # a TorchScript-only overload (aten::size.default): not dispatchable
        return True


def mirrored_autocast_at(policy: Policy, node: fx.Node) -> torch.autocast | None:
    """The ``torch.autocast`` ``policy`` mirrors (:meth:`Policy.mirrored_autocast`) on the one
    device of ``node``'s floating inputs; None where it mirrors none there."""
    devices = {v.device.type for v in (a.meta.get("val") for a in node.all_input_nodes)
               if isinstance(v, torch.Tensor) and v.is_floating_point()}
    return policy.mirrored_autocast(devices.pop()) if len(devices) == 1 else None


def run_failure(node: fx.Node, exc: Exception, policy: Policy, dtype: torch.dtype) -> str:
    """Why ``node`` no longer runs once ``policy``'s casts changed its inputs' dtypes, and
    how to make it run: one dtype for its inputs, by a rule of the user's."""
    rec = decision(node)
    op = op_key(node)
    how = f"{rec.category.value}, {rec.rule}" if rec is not None else "no decision"
    if policy.preset in ("O2", "O3"):
        target = f"torch.ops.aten.{op}" if hasattr(torch.ops.aten, op) else op
        fix = (f"amprewrite.register_op({target}, OpCategory.PROMOTE) before "
               "convert casts its floating inputs to one dtype; or convert with "
               "opt_level='O1'")
    else:
        fix = (f"Policy().override(ops={{{op!r}: OpCategory.PROMOTE}}) casts its floating "
               f"inputs to one dtype (or nodes={{{node.name!r}: OpCategory.FP32}} for "
               "this node only)")
    return (f"node {node.format_node()} (op {op}: {how}) does not run on the dtypes the "
            f"casts of {policy.summary()} in {dtype} give its inputs ({input_dtypes(node)}): "
            f"{type(exc).__name__}: {_first_line(exc)}. Fix: {fix}.")


def _first_line(exc: BaseException) -> str:
    return str(exc).strip().splitlines()[0] if str(exc).strip() else ""
