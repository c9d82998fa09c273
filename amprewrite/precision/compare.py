"""``compare``: which op of a converted graph loses precision, measured against fp64.

The converted graph and an fp64 reference of the same computation run side by side, node
for node (:mod:`amprewrite.precision.shadow`). Per op node: the relative error of its
output, the error it *adds* (its own casts and arithmetic, on exact inputs) and the error it
*inherits* (from upstream), the largest ``|x|`` of its output and the headroom that leaves in
fp16/bf16. With ``backward=True``, the relative error of every parameter's gradient, too.

The docs' example (docs/precision-tools.md), fp16: ``Linear(16, 16)`` with outputs of ~1e5, a LayerNorm, a Linear,
plus the mean of large values that cancel, which the policy forces into fp16::

    >>> print(amprewrite.compare(gm, model, (x, y)).table())
    node        op          dtype    error    added    inherited    max |x|    headroom f16
    ----------  ----------  -------  -------  -------  -----------  ---------  --------------
    linear      linear      f16      inf      inf      0            1.56e+05   -1.3
    mean        mean        f16      7.9e-03  7.9e-03  6.7e-06      1          +16.0
    linear_1    linear      f16      inf      4.0e-04  inf          1.25       +15.7
    add         add         f16      inf      2.2e-04  inf          2.25       +14.8
    mul         mul         f32      3.0e-08  3.0e-08  0            1.62e+04   +2.0
    layer_norm  layer_norm  f32      inf      0        inf          2.23       +14.8

Read it from the top: ``linear`` overflows fp16 (negative headroom) and adds the inf that
the nodes after it only inherit; ``Policy().override(nodes={"linear": OpCategory.FP32})``
fixes it, and :func:`amprewrite.search` finds such overrides for a tolerance.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from typing import Any, Callable

import torch
import torch.fx as fx
import torch.nn as nn
from torch.utils._pytree import tree_leaves

from ..errors import user_stacklevel
from ..explain import short_dtype
from ..graph.meta import CONVERTED_KEY, decision
from .shadow import (
    Run,
    headroom_bits,
    max_abs,
    node_numbers,
    op_nodes,
    record,
    reference_module,
    rel_error,
)

__all__ = ["compare", "PrecisionReport", "NodeError", "GradError"]

_RANDOM_OPS = ("dropout", "bernoulli", "rand", "randn", "randint", "rand_like", "randn_like",
               "native_dropout", "normal", "multinomial")


@dataclasses.dataclass(frozen=True)
class NodeError:
    """The numbers of one op node; relative errors are ``max|x - ref| / max|ref|``."""

    node: str
    op: str
    dtype: str
    """What the node computes in (its decision), or its output dtype for passthrough ops."""
    error: float
    added: float
    inherited: float
    max_abs: float
    """Largest finite ``|x|`` of the reference output."""
    headroom: float
    """``log2(finfo(low).max / max_abs)`` in bits; negative: the value overflows ``low``."""


@dataclasses.dataclass(frozen=True)
class GradError:
    """The gradient of one trainable parameter against the reference gradient."""

    parameter: str
    shape: tuple[int, ...]
    error: float
    """Relative error; ``nan`` where neither run produced a gradient."""
    max_abs: float
    """Largest ``|g|`` of the reference gradient."""


@dataclasses.dataclass
class PrecisionReport:
    """What :func:`compare` measured. ``nodes`` are in graph order; ``worst(n)`` and
    ``table()`` sort them by added error."""

    low_dtype: torch.dtype
    reference_dtype: torch.dtype
    output_error: float
    """Largest relative error over the floating outputs."""
    nodes: list[NodeError]
    grads: list[GradError]
    unmatched: list[str]
    """Op nodes the reference graph has no counterpart of (no numbers)."""

    def worst(self, n: int = 10) -> list[NodeError]:
        """The ``n`` nodes that add the most error, worst first (ties in graph order)."""
        order = sorted(range(len(self.nodes)), key=lambda i: (-self.nodes[i].added, i))
        return [self.nodes[i] for i in order[:n]]

    def table(self, top: int | None = None) -> str:
        """Op nodes by added error, worst first; ``top`` rows at most (None: all)."""
        from tabulate import tabulate

        rows = self.worst(len(self.nodes) if top is None else top)
        low = short_dtype(self.low_dtype)
        body = tabulate([(r.node, r.op, r.dtype, _sci(r.error), _sci(r.added),
                          _sci(r.inherited), f"{r.max_abs:.3g}", _bits(r.headroom))
                         for r in rows],
                        headers=["node", "op", "dtype", "error", "added", "inherited",
                                 "max |x|", f"headroom {low}"], disable_numparse=True)
        more = len(self.nodes) - len(rows)
        return body + (f"\n... {more} more node{'s' if more != 1 else ''}" if more else "")

    def grad_table(self) -> str:
        """One row per trainable parameter, in the model's order."""
        from tabulate import tabulate

        return tabulate([(g.parameter, "x".join(map(str, g.shape)) or "()", _sci(g.error),
                          f"{g.max_abs:.3g}") for g in self.grads],
                        headers=["parameter", "shape", "grad error", "max |grad|"],
                        disable_numparse=True)

    def summary(self) -> str:
        worst = self.worst(1)
        line = (f"output error {_sci(self.output_error)} ({short_dtype(self.low_dtype)} vs "
                f"{short_dtype(self.reference_dtype)} reference); {len(self.nodes)} op nodes")
        if worst and worst[0].added > 0:
            line += f"; adds most: {worst[0].node} ({_sci(worst[0].added)})"
        if self.unmatched:
            line += f"; no reference for: {', '.join(self.unmatched)}"
        return line

    def to_dict(self) -> dict[str, Any]:
        """Plain values for JSON (``inf`` stays a float: ``json.dumps`` writes ``Infinity``)."""
        return {"low_dtype": short_dtype(self.low_dtype),
                "reference_dtype": short_dtype(self.reference_dtype),
                "output_error": self.output_error,
                "nodes": [dataclasses.asdict(n) for n in self.nodes],
                "grads": [{**dataclasses.asdict(g), "shape": list(g.shape)} for g in self.grads],
                "unmatched": list(self.unmatched)}

    def __str__(self) -> str:
        parts = [self.summary(), self.table(top=25)]
        if self.grads:
            parts.append(self.grad_table())
        return "\n\n".join(parts)


def _sci(x: float) -> str:
    if math.isnan(x):
        return "-"
    return "0" if x == 0 else "inf" if math.isinf(x) else f"{x:.1e}"


def _bits(x: float) -> str:
    return "inf" if math.isinf(x) else f"{x:+.1f}"


# -- collection --------------------------------------------------------------------------------
def compare(gm: fx.GraphModule, model: nn.Module, example_inputs: Any, *,
            example_kwargs: dict[str, Any] | None = None,
            reference_dtype: torch.dtype = torch.float64, backward: bool = True,
            loss_fn: Callable[[Any], torch.Tensor] | None = None) -> PrecisionReport:
    """Run ``gm`` (``amprewrite.convert(model, ...)``'s result) and a ``reference_dtype``
    copy of ``model`` node for node on ``example_inputs`` (a tuple, or one tensor) and
    ``example_kwargs``; report each op node's error (module docstring).

    ``backward=True`` also differentiates a loss of both outputs, ``loss_fn(outputs)`` (default:
    the sum of every floating output), and reports each trainable parameter's gradient error.
    Neither ``model`` nor ``gm`` is changed: gradients are returned by ``torch.autograd.grad``,
    never accumulated into ``.grad``, and buffers a forward updates are put back.

    NB: the two runs must compute the same function: ops that draw random numbers (dropout
    in training mode) draw different ones in each; put the model in ``eval()`` mode.
    """
    inputs = _check_args(gm, model, example_inputs, example_kwargs, reference_dtype, loss_fn)
    low = gm.meta[CONVERTED_KEY][1]
    capture = "export" if hasattr(gm, "_in_spec") else "symbolic"
    ref_gm, ref_args, ref_kwargs = reference_module(model, inputs, example_kwargs,
                                                    reference_dtype, capture)
    warn_if_random(gm)
    with _buffers_kept(gm):
        low_run = record(gm, inputs, example_kwargs, grad=backward)
        ref_run = record(ref_gm, ref_args, ref_kwargs, grad=backward)
        grads = _grad_errors(low_run, ref_run, loss_fn) if backward else []
    nodes, unmatched = node_errors(low_run, ref_run, low)
    return PrecisionReport(low, reference_dtype, rel_error(low_run.outputs, ref_run.outputs),
                           nodes, grads, unmatched)


def node_errors(low: Run, ref: Run, low_dtype: torch.dtype) -> tuple[list[NodeError],
                                                                      list[str]]:
    """The numbers of every op node of ``low.gm`` with a floating output, in graph order, and
    the names of those without a reference counterpart."""
    rows, unmatched = [], []
    for node in op_nodes(low.gm):
        numbers = node_numbers(node, low, ref)
        if numbers is None:
            if any(isinstance(t, torch.Tensor) and t.is_floating_point()
                   for t in tree_leaves(low.values.get(node))):
                unmatched.append(node.name)
            continue
        rec = decision(node)
        out = next(t for t in tree_leaves(low.values[node]) if isinstance(t, torch.Tensor)
                   and t.is_floating_point())
        largest = max_abs(numbers.ref)
        rows.append(NodeError(node.name, rec.op, short_dtype(rec.compute_dtype or out.dtype),
                              numbers.error, numbers.added, numbers.inherited, largest,
                              headroom_bits(largest, low_dtype)))
    return rows, unmatched


def _grad_errors(low: Run, ref: Run, loss_fn: Callable[[Any], torch.Tensor] | None
                 ) -> list[GradError]:
    """Each trainable parameter's gradient of the loss against the reference's."""
    params = [(name, p) for name, p in low.gm.named_parameters() if p.requires_grad]
    ref_params = dict(ref.gm.named_parameters())
    pairs = [(name, p, ref_params.get(name)) for name, p in params]
    mine = _grads(_loss(low.outputs, loss_fn), [p for _, p, _ in pairs])
    theirs = _grads(_loss(ref.outputs, loss_fn), [r for _, _, r in pairs if r is not None])
    theirs_by_name = dict(zip([name for name, _, r in pairs if r is not None], theirs))
    out = []
    for (name, p, _), g in zip(pairs, mine):
        r = theirs_by_name.get(name)
        if g is None and r is None:
            error = math.nan  # the loss does not depend on it in either run
        else:
            g = torch.zeros_like(p) if g is None else g
            error = rel_error(g, torch.zeros_like(g, dtype=torch.float64) if r is None else r)
        out.append(GradError(name, tuple(p.shape), error, max_abs(r) if r is not None else 0.0))
    return out


def _loss(outputs: Any, loss_fn: Callable[[Any], torch.Tensor] | None) -> torch.Tensor:
    if loss_fn is not None:
        loss = loss_fn(outputs)
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise TypeError(f"amprewrite.compare: loss_fn returned {type(loss).__name__}"
                            f"{tuple(loss.shape) if isinstance(loss, torch.Tensor) else ''}; "
                            "expected a tensor with one element (a scalar loss).")
        return loss.reshape(())
    leaves = [t for t in tree_leaves(outputs) if isinstance(t, torch.Tensor)
              and t.is_floating_point()]
    if not leaves:
        raise ValueError("amprewrite.compare(backward=True): the model returned no floating "
                         "tensor to take a loss of; pass loss_fn=... or backward=False.")
    # Summed in at least fp32: an fp16 sum of a large output would overflow on its own.
    return sum(t.to(torch.promote_types(t.dtype, torch.float32)).sum() for t in leaves)


def _grads(loss: torch.Tensor, params: list[torch.Tensor]) -> list[torch.Tensor | None]:
    if not params or not loss.requires_grad:
        return [None] * len(params)
    return list(torch.autograd.grad(loss, params, allow_unused=True))


# -- checks and bookkeeping ----------------------------------------------------------------------
def _check_args(gm: Any, model: Any, example_inputs: Any, example_kwargs: Any,
                reference_dtype: Any, loss_fn: Any) -> tuple:
    """The example inputs as a tuple, after checking every argument of :func:`compare`."""
    if not isinstance(gm, fx.GraphModule) or CONVERTED_KEY not in gm.meta:
        raise TypeError(f"amprewrite.compare: gm must be the GraphModule amprewrite.convert "
                        f"returned, got {type(gm).__name__}; call "
                        "compare(amprewrite.convert(model, inputs), model, inputs).")
    if not isinstance(model, nn.Module):
        raise TypeError(f"amprewrite.compare: model must be the torch.nn.Module gm was "
                        f"converted from, got {type(model).__name__}")
    if reference_dtype not in (torch.float64, torch.float32):
        raise ValueError(f"amprewrite.compare: reference_dtype={reference_dtype!r}; expected "
                         "torch.float64 (default) or torch.float32")
    if example_kwargs is not None and not isinstance(example_kwargs, dict):
        raise TypeError(f"amprewrite.compare: example_kwargs must be a dict, got "
                        f"{type(example_kwargs).__name__}")
    if loss_fn is not None and not callable(loss_fn):
        raise TypeError(f"amprewrite.compare: loss_fn must be a function of the outputs, got "
                        f"{type(loss_fn).__name__}")
    if isinstance(example_inputs, torch.Tensor):
        return (example_inputs,)
    if not isinstance(example_inputs, tuple):
        raise TypeError(f"amprewrite.compare: example_inputs must be a tuple of positional "
                        f"arguments (or one tensor), got {type(example_inputs).__name__}")
    return example_inputs


def warn_if_random(gm: fx.GraphModule, caller: str = "compare") -> None:
    """Warn, naming them, when ops of ``gm`` draw random numbers (dropout in train mode): a
    converted and a reference run then differ by the draws, not by precision."""
    random = []
    for node in op_nodes(gm):
        op = decision(node).op
        if op in ("dropout", "native_dropout", "feature_dropout"):
            p, train = (list(node.args[1:3]) + [None, None])[:2]
            if train is False or p == 0:  # dropout(x, p, train): identity when not training
                continue
        elif op not in _RANDOM_OPS:
            continue
        random.append(node.name)
    if random:
        warnings.warn(f"amprewrite.{caller}: {', '.join(random)} draw random numbers, which "
                      "differ between the converted and the reference run: their errors and "
                      "everything downstream are meaningless. Pass the model in eval() mode "
                      "(model.eval()).", stacklevel=user_stacklevel())


class _buffers_kept:
    """Puts ``gm``'s buffers back after the block (a training-mode BatchNorm updates its
    running statistics on every forward, and the model shares them)."""

    def __init__(self, gm: fx.GraphModule) -> None:
        self.saved = [(b, b.detach().clone()) for b in gm.buffers()]

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        with torch.no_grad():
            for b, value in self.saved:
                b.copy_(value)
