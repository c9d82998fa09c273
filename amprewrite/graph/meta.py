"""The metadata contract: tensor facts from ``node.meta["val"]``, our facts under one key.

``node.meta["val"]`` (set by torch.export, Dynamo, or fake-tensor propagation) is the only
source of dtype/device knowledge; :func:`tensor_meta` is the one accessor. Every decision
amprewrite makes about a node is a frozen record stored under ``node.meta[META_KEY]``:
a :class:`Decision` on op nodes, a :class:`CastInfo` on the cast nodes we insert.

Two facts have their own keys, because they are inputs to the decisions, not decisions:
``node.meta[PIECES_KEY]``, the ops a composite op kept whole is made of, and
``node.meta[RANGE_KEY]``, the largest finite |x| the node's floating output reached
over ``convert(..., calibrate=...)``'s fp32 calibration run (a float; absent on nodes the
run did not see or that produce no floating tensor). :func:`max_abs` reads it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch.fx import Node

from ..errors import AmpRewriteError
from ..policy.tables import OpCategory

__all__ = ["META_KEY", "Decision", "CastInfo", "Fp8Step", "PendingSplit", "tensor_meta",
           "decision", "cast_info", "fp8_step", "pending_split", "RANGE_KEY",
           "PIECES_KEY", "max_abs", "CONVERTED_KEY", "MODE_KEY"]

META_KEY = "amprewrite"
CONVERTED_KEY = "amprewrite_policy"
"""``gm.meta[CONVERTED_KEY]``: ``(policy, low dtype)``, set on every graph the passes
converted (a module ``convert`` returns, each graph ``amprewrite.compile`` rewrote)."""
MODE_KEY = "amprewrite_training"
"""``gm.meta[MODE_KEY]``: the mode (``model.training``) a converted graph was captured in."""
RANGE_KEY = "amprewrite_max_abs"
PIECES_KEY = "amprewrite_pieces"
"""``node.meta[PIECES_KEY]``: the op names of the decomposition of a composite op that
DecomposeCompositesPass traced and kept whole (a frozenset); absent where not traced."""


@dataclasses.dataclass(frozen=True)
class Decision:
    """How one op node runs. ``rule`` says which table entry or override decided."""

    op: str
    category: OpCategory
    compute_dtype: torch.dtype | None
    rule: str
    casts: tuple[str, ...] = ()
    """Names of the cast nodes feeding this node (filled in by InsertCastsPass)."""
    guarded: bool = False
    """True when dtypes were unknown and the casts check their input at run time."""
    fp8: str = ""
    """Under ``Policy.fp8``, why a linear stays in the low dtype (``"fp8 skipped: last
    linear"``); ``explain`` appends it to the rule."""


@dataclasses.dataclass(frozen=True)
class CastInfo:
    """A cast node inserted by amprewrite."""

    dtype: torch.dtype
    guarded: bool
    weight: bool
    """True when the cast input is a parameter or buffer (get_attr)."""


@dataclasses.dataclass(frozen=True)
class Fp8Step:
    """A node of the fp8 rewrite of a linear layer (:mod:`amprewrite.passes.fp8`).

    ``role`` is ``"amax"``, ``"scale"``, ``"quantize"``, ``"matmul"`` (the scaled matmul
    that replaced the linear) or ``"grad"`` (its fp8 backward); ``dtype`` the fp8 dtype of a
    quantize or scale, the output dtype of the matmul; ``rule`` (matmul only) what chose fp8.
    """

    role: str
    dtype: torch.dtype | None
    rule: str = ""


@dataclasses.dataclass(frozen=True)
class PendingSplit:
    """A composite op that DecomposeCompositesPass splits into its pieces once the dtypes of
    its inputs are final (:mod:`amprewrite.passes.decompose`); until then no pass decides or
    casts anything for it."""

    op: str


def tensor_meta(node: Any) -> torch.Tensor | None:
    """The fake/meta tensor recorded for ``node``; None for non-nodes and non-tensor values.

    Raises ``AmpRewriteError`` with the node if a node has no ``meta["val"]`` at all, since
    passes that ask for dtypes must only run on graphs whose dtypes were propagated.
    """
    if not isinstance(node, Node):
        return None
    if "val" not in node.meta:

        raise AmpRewriteError(
            f"node {node.format_node()} has no meta['val']: dtypes of this graph were not "
            "propagated. Capture with example inputs (convert(model, example_inputs=...))."
        )
    val = node.meta["val"]
    return val if isinstance(val, torch.Tensor) else None


def decision(node: Node) -> Decision | None:
    rec = node.meta.get(META_KEY)
    return rec if isinstance(rec, Decision) else None


def fp8_step(node: Node) -> Fp8Step | None:
    rec = node.meta.get(META_KEY)
    return rec if isinstance(rec, Fp8Step) else None


def pending_split(node: Node) -> PendingSplit | None:
    rec = node.meta.get(META_KEY)
    return rec if isinstance(rec, PendingSplit) else None


def cast_info(node: Node) -> CastInfo | None:
    rec = node.meta.get(META_KEY)
    return rec if isinstance(rec, CastInfo) else None


def max_abs(node: Node) -> float | None:
    """The calibrated largest finite |x| of ``node``'s output (see ``RANGE_KEY``), or None."""
    value = node.meta.get(RANGE_KEY)
    return value if isinstance(value, float) else None
