"""The shadow run behind :func:`amprewrite.compare` and :func:`amprewrite.search`.

A converted graph and a high-precision reference of the same computation run side by side,
node for node, each in a ``torch.fx.Interpreter`` that records every node's output. The
reference is the model's fp64 deep copy converted with ``opt_level="O0"``: the same capture,
so the same node names, and no casts. Matching is by node name, checked by op and shape: a
node the converted graph has alone (its casts, the weight fetch, ops a pass decomposed) has
no reference and is evaluated from the converted run's own values.

Three numbers per op node, for ``linear_1 = linear(relu, b_weight_f16, b_bias_f16)``:

* **error**: its recorded output against the reference's ``linear_1``;
* **added**: the node run on the reference's inputs as the converted graph would hand them
  over (``relu`` rounded to the fp16 it has there; ``b.weight`` through the node's own cast
  ``b_weight_f16``), against the exact op on those same inputs in fp64: the rounding of its
  own casts, its own arithmetic and its output, and nothing from upstream;
* **inherited**: the exact op run on the inputs the converted graph actually gave it (before
  the node's own casts), against the reference: upstream error carried through.

To first order ``error ≈ added + inherited``; a node that computes exactly (``relu``, a
reshape) adds 0. NB: a node without a reference is run again on ideal inputs wherever a node
downstream needs its value, so its own rounding counts toward that node's added error.
"""

from __future__ import annotations

import copy
import math
import operator
from typing import Any, Iterator

import torch
import torch.fx as fx
import torch.nn as nn
from torch.utils._pytree import tree_flatten, tree_leaves, tree_map

from ..convert import convert
from ..capture.guards import is_input_guards
from ..graph.meta import cast_info, decision
from ..passes.calibrate import finite_max_abs
from ..runtime.weight_table import is_fetch

__all__ = ["Run", "record", "reference_module", "NodeNumbers", "node_numbers", "rel_error",
           "headroom_bits", "flat_inputs", "op_nodes", "max_abs", "match"]


def rel_error(value: Any, ref: Any) -> float:
    """Normwise relative error, ``max|value - ref| / max|ref|`` over the floating tensors of
    two outputs (paired in pytree order); ``inf`` where ``value`` has an inf or NaN that the
    reference has not.

    >>> rel_error(torch.tensor([1.0, 2.0]), torch.tensor([1.0, 2.5], dtype=torch.float64))
    0.2
    """
    worst = 0.0
    pairs = list(zip(_floating(value), _floating(ref)))
    if len(pairs) != len(_floating(ref)):
        return math.inf  # the outputs do not even have the same tensors
    for x, r in pairs:
        if x.shape != r.shape:
            return math.inf
        x, r = x.detach().double(), r.detach().to(x.device).double()
        # Equal values (incl. the same inf, or NaN where the reference is NaN too) agree.
        agree = (x == r) | (torch.isnan(x) & torch.isnan(r))
        gap = (x - r).abs().nan_to_num(nan=math.inf, posinf=math.inf)
        diff = torch.where(agree, torch.zeros_like(x), gap)
        top = diff.max().item() if diff.numel() else 0.0
        if top == 0.0:
            continue
        finite = r[torch.isfinite(r)].abs()
        scale = finite.max().item() if finite.numel() else 0.0
        worst = max(worst, top / scale if scale > 0 else math.inf)
    return worst


def max_abs(value: Any) -> float:
    """Largest finite ``|x|`` over the floating tensors of ``value`` (0.0 if none)."""
    peak = finite_max_abs(value)
    return 0.0 if peak is None else peak.item()


def headroom_bits(largest: float, low: torch.dtype) -> float:
    """``log2(finfo(low).max / largest)``: how many doublings ``largest`` can take before it
    overflows ``low``; negative: it already does.

    >>> round(headroom_bits(1024.0, torch.float16), 2)
    5.998
    """
    if largest == 0.0:
        return math.inf
    return math.log2(torch.finfo(low).max / largest)


def _floating(value: Any) -> list[torch.Tensor]:
    return [t for t in tree_leaves(value) if isinstance(t, torch.Tensor)
            and t.is_floating_point()]


# -- running a graph, recording every node -------------------------------------------------------
class _Recorder(fx.Interpreter):
    """Runs a graph and keeps a detached copy of every node's output, by node.

    NB: copies, not the values: a later in-place op (a KV-cache write) must not change what
    was recorded, and the recorded values must not keep the autograd graph alive.
    """

    def __init__(self, gm: fx.GraphModule) -> None:
        super().__init__(gm)
        self.values: dict[fx.Node, Any] = {}

    def run_node(self, n: fx.Node) -> Any:
        out = super().run_node(n)
        if n.op != "output":
            self.values[n] = _detached_copy(out)
        return out


def _detached_copy(value: Any) -> Any:
    return tree_map(lambda t: t.detach().clone() if isinstance(t, torch.Tensor) else t, value)


class Run:
    """One recorded run: ``values`` (node → output), ``outputs`` (the structured output, live:
    with autograd history when run with grad) and the graph it ran."""

    def __init__(self, gm: fx.GraphModule, values: dict[fx.Node, Any], outputs: Any) -> None:
        self.gm, self.values, self.outputs = gm, values, outputs
        self.by_name = {n.name: n for n in values}
        self.evaluate = _Evaluator(gm)
        """``evaluate(node, {input node: value})``: one node run again on other inputs."""


def flat_inputs(gm: fx.GraphModule, args: tuple, kwargs: dict[str, Any] | None) -> list[Any]:
    """The values of ``gm``'s placeholders, in order, for positional ``args`` and ``kwargs``:
    flattened with the graph's input spec (torch.export), else by placeholder name."""
    spec = getattr(gm, "_in_spec", None)
    if spec is not None:
        from torch.fx._pytree import tree_flatten_spec

        return list(tree_flatten_spec((list(args), dict(kwargs or {})), spec))
    names = [str(n.target) for n in gm.graph.find_nodes(op="placeholder")]
    extra = [(kwargs or {})[name] for name in names[len(args):] if name in (kwargs or {})]
    return [*args, *extra]


def record(gm: fx.GraphModule, args: tuple, kwargs: dict[str, Any] | None,
           grad: bool = False) -> Run:
    """Run ``gm`` on ``args``/``kwargs`` node by node, recording every node's output."""
    recorder = _Recorder(gm)
    with torch.set_grad_enabled(grad):
        flat = recorder.run(*flat_inputs(gm, args, kwargs), enable_io_processing=False)
    return Run(gm, recorder.values, gm.graph.process_outputs(flat))


def reference_module(model: nn.Module, args: tuple, kwargs: dict[str, Any] | None,
                     dtype: torch.dtype, capture: str) -> tuple[fx.GraphModule, tuple, dict]:
    """``model``'s deep copy in ``dtype``, converted with ``opt_level="O0"`` (no casts, the
    node names of any other conversion of ``model`` by the same capture), and the example
    inputs with their floating tensors in ``dtype``."""

    def widen(t: Any) -> Any:
        return t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t

    twin = copy.deepcopy(model).to(dtype)
    ref_args, ref_kwargs = tree_map(widen, tuple(args)), tree_map(widen, dict(kwargs or {}))
    gm = convert(twin, ref_args, example_kwargs=ref_kwargs or None, opt_level="O0",
                 capture=capture)
    return gm, ref_args, ref_kwargs


# -- per node numbers ----------------------------------------------------------------------------
def op_nodes(gm: fx.GraphModule) -> Iterator[fx.Node]:
    """The op nodes of a converted graph: those with a decision, less torch.export's guard."""
    for node in gm.graph.nodes:
        if decision(node) is not None and not is_input_guards(node):
            yield node


def match(node: fx.Node, ref: Run) -> fx.Node | None:
    """The reference node of ``node``: the same name, op and output shape; None if absent.

    NB: names come from the capture, which is the same for both graphs; the op and shape
    checks catch a graph a pass changed (a decomposed op shifts the numbering after it).
    """
    other = ref.by_name.get(node.name)
    if other is None or other.op != node.op or other.target != node.target:
        return None
    mine, theirs = node.meta.get("val"), other.meta.get("val")
    if isinstance(mine, torch.Tensor) and isinstance(theirs, torch.Tensor) and \
            tuple(mine.shape) != tuple(theirs.shape):
        return None
    return other


class NodeNumbers:
    """error / added / inherited of one op node (module docstring), and its reference output."""

    def __init__(self, error: float, added: float, inherited: float, ref: Any) -> None:
        self.error, self.added, self.inherited, self.ref = error, added, inherited, ref


def node_numbers(node: fx.Node, low: Run, ref: Run) -> NodeNumbers | None:
    """The numbers of one op node of ``low.gm``; None without a reference or a float output."""
    other = match(node, ref)
    if other is None or not _floating(low.values.get(node)):
        return None
    memo: dict[fx.Node, Any] = {}
    fed = {a: _ideal(a, low, ref, memo) for a in node.all_input_nodes}
    rounded, actual = {}, {}
    for a in other.all_input_nodes:
        exact, mine = ref.values[a], low.by_name.get(a.name)
        if mine is None or match(mine, ref) is not a:  # a weight: exact in both graphs
            rounded[a] = actual[a] = exact
            continue
        # The input as its producer delivered it in the converted graph (fp16, say): that
        # rounding is the producer's. The node's own casts then apply on top, in `fed`.
        rounded[a] = _like(_like(exact, low.values[mine]), exact)
        actual[a] = _like(low.values[mine], exact)
    with torch.no_grad():
        added = rel_error(low.evaluate(node, fed), ref.evaluate(other, rounded))
        inherited = rel_error(ref.evaluate(other, actual), ref.values[other])
    return NodeNumbers(rel_error(low.values[node], ref.values[other]), added, inherited,
                       ref.values[other])


def _is_cast(a: fx.Node) -> bool:
    """A cast node of ours, or an item of one (a guarded promote casts a list at once)."""
    if cast_info(a) is not None:
        return True
    return a.op == "call_function" and a.target is operator.getitem and \
        isinstance(a.args[0], fx.Node) and cast_info(a.args[0]) is not None


def _ideal(a: fx.Node, low: Run, ref: Run, memo: dict[fx.Node, Any]) -> Any:
    """What input ``a`` would hold if everything upstream were exact: a node with a reference
    takes its reference value in ``a``'s dtype here; a cast, or another node the reference
    lacks, runs again on ideal inputs; the weight fetch and other reads keep their values
    (parameters have no upstream)."""
    if a in memo:
        return memo[a]
    other = match(a, ref) if not _is_cast(a) else None
    if other is not None:
        value = _like(ref.values[other], low.values[a])
    elif a.op in ("call_function", "call_method", "call_module") and not is_fetch(a):
        value = low.evaluate(a, {b: _ideal(b, low, ref, memo) for b in a.all_input_nodes})
    else:
        value = low.values[a]
    memo[a] = value
    return value


def _like(ref: Any, low: Any) -> Any:
    """``ref`` in the dtypes (and device) of ``low``, tensor by tensor; ``low`` itself where
    their structures differ.

    >>> _like(torch.tensor([1/3], dtype=torch.float64), torch.zeros(1, dtype=torch.float16))
    tensor([0.3333], dtype=torch.float16)
    """
    ref_leaves, ref_spec = tree_flatten(ref)
    low_leaves, low_spec = tree_flatten(low)
    if ref_spec != low_spec:
        return low
    out = [r.to(device=l.device, dtype=l.dtype) if isinstance(r, torch.Tensor)
           and isinstance(l, torch.Tensor) and r.shape == l.shape else l
           for r, l in zip(ref_leaves, low_leaves)]
    return ref_spec.unflatten(out)


class _Evaluator(fx.Interpreter):
    """Runs one node of a graph on given input values (copies: in-place ops stay local)."""

    def __call__(self, node: fx.Node, inputs: dict[fx.Node, Any]) -> Any:
        self.env = {n: _detached_copy(v) for n, v in inputs.items()}
        try:
            return self.run_node(node)
        finally:
            self.env = {}
