"""The pass schedule, the one place passes are run in order: a conversion's (drop no-ops,
decompose, classify, insert casts, fp8 linears with ``Policy.fp8`` only, fit constants,
eliminate casts, then :func:`speed_passes`: fold constants, native kernels), used by
``convert`` and ``amprewrite.compile`` (:func:`run_passes`) and by the opt levels
(:mod:`.opt_levels`: O0 runs the speed passes alone, O2/O3 the conversion's with their rules).

Decompose, classify and insert casts run again while a composite waits for the dtypes of its
inputs to be final before it is split (:class:`~amprewrite.graph.meta.PendingSplit`): one
more round per level of composites nested in composites, for as long as a round changes the
graph (``PassResult.modified``); a round that changes nothing while composites wait is a bug,
reported with the nodes."""

from __future__ import annotations

import torch
import torch.fx as fx

from ..errors import AmpRewriteError
from ..graph.meta import CONVERTED_KEY, pending_split
from ..graph.queries import input_dtypes
from ..policy.opkey import op_key
from ..policy.policy import Policy
from .classify import ClassifyPass
from .decompose import DecomposeCompositesPass
from .drop_noops import DropNoOpsPass
from .eliminate_casts import EliminateCastsPass
from .fit_constants import FitConstantsPass
from .fold_constants import FoldConstantsPass
from .fp8 import Fp8LinearPass
from .insert_casts import InsertCastsPass
from .native_kernels import NativeKernelsPass

__all__ = ["amp_passes", "run_passes", "run_in_order", "speed_passes"]

_MAX_ROUNDS = 8
"""Rounds of decompose, classify and insert casts, at most: composites nest about 4 deep."""


def speed_passes() -> list:
    """The passes every opt level runs, O0 included: constant subgraphs computed once,
    traced-only fallback ops routed to eager code's kernel. Neither changes a dtype."""
    return [FoldConstantsPass(), NativeKernelsPass()]


def _phases(policy: Policy, dtype: torch.dtype) -> tuple[list, list, list]:
    """The passes before, of and after the rounds that decide dtypes."""
    fp8 = [Fp8LinearPass(policy)] if policy.fp8_rules is not None else []
    return ([DropNoOpsPass()],
            [DecomposeCompositesPass(policy), ClassifyPass(policy, dtype),
             InsertCastsPass(policy, dtype)],
            [*fp8, FitConstantsPass(), EliminateCastsPass(policy), *speed_passes()])


def amp_passes(policy: Policy, dtype: torch.dtype) -> list:
    """The graph-to-graph steps of a conversion, in order, each idempotent, with one round
    of the passes that decide dtypes (:func:`run_passes` repeats it while a composite waits
    to be split)."""
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
    before, rounds, after = _phases(policy, dtype)
    run_in_order(before, gm)
    for count in range(1, _MAX_ROUNDS + 2):
        modified = run_in_order(rounds, gm)
        pending = _pending(gm)
        if not pending:
            break
        if not modified or count > _MAX_ROUNDS:
            raise AmpRewriteError(
                "amprewrite: composites still wait to be split after "
                f"{count} rounds of the passes"
                + ("" if modified else ", the last of which changed nothing") + ": "
                + ", ".join(n.format_node() for n in pending)
                + ". Please report this model; Policy().override(ops={...}) on these ops "
                "keeps them whole meanwhile.")
    run_in_order(after, gm)
    if mark_converted:
        gm.meta[CONVERTED_KEY] = (policy, dtype)
    gm.graph.lint()
    gm.recompile()
    return gm


def run_in_order(passes: list, gm: fx.GraphModule) -> bool:
    """Run ``passes`` on ``gm``'s graph in order, each checked (``graph.lint()``), a
    failure no pass explains reported with its pass and node; whether any reported a change
    (``PassResult.modified``). The caller recompiles ``gm`` once, at the end."""
    # NB: not torch's PassManager, which recompiles the module's code after every pass
    # (0.1 s each for a 1500-node graph, 15% of a convolutional network's conversion); the
    # passes edit the graph, and the code is generated once, at the end.
    modified = False
    for step in passes:
        try:
            result = step(gm)
            gm.graph.lint()
        except (AmpRewriteError, ValueError, TypeError):
            raise  # ours: what, where, the fix
        except Exception as exc:
            raise AmpRewriteError(_unexpected(type(step).__name__, exc)) from exc
        modified |= bool(result is not None and result.modified)
    return modified


def _unexpected(step: str, exc: Exception) -> str:
    """A failure no pass explains: the pass, and the node it was at when it raised (the
    innermost frame of the traceback that holds one), with its op and input dtypes."""
    text = str(exc).strip()
    what = f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"
    node = _failing_node(exc)
    where, name = "", "<node name>"
    if node is not None:
        where, name = (f" at node {node.format_node()} (op {op_key(node)}; inputs "
                       f"{input_dtypes(node)})"), node.name
    return (f"{step} failed{where}: {what}. This is a bug in amprewrite: please report it "
            "with this message. Meanwhile, keep the node out of the rewrite with "
            f"Policy().override(nodes={{{name!r}: OpCategory.PASSTHROUGH}}) (opt_level "
            "'O1'), or convert the model with amprewrite.compile(model).")


def _failing_node(exc: BaseException) -> fx.Node | None:
    tb, found = exc.__traceback__, None
    while tb is not None:
        node = tb.tb_frame.f_locals.get("node")
        if isinstance(node, fx.Node):
            found = node
        tb = tb.tb_next
    return found
