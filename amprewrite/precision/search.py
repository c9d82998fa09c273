"""``search``: the fewest ops to keep in fp32 for the output to stay within a tolerance.

One shadow run (:mod:`amprewrite.precision.shadow`) ranks the op nodes that compute or
produce the low dtype by the error each *adds* (first: those whose exact output overflows the
low dtype). The search then converts and runs the model with the worst ``k`` of them
overridden to fp32, for ``k = 1, 2, 4, …`` until the output is within ``tol``
of the fp64 reference, bisects between the last ``k`` that failed and the first that passed,
and finally drops every chosen node the output turns out not to need. Each conversion and
run counts against ``max_runs``.

Example: a model with a Linear whose outputs overflow fp16 and a mean the policy forces into
fp16 (``tests/test_search.py``)::

    >>> result = amprewrite.search(model, (x, y), tol=1e-2, policy=policy,
    ...                            dtype=torch.float16)
    >>> result.nodes, result.runs, result.error
    (('linear', 'mean'), 4, 0.000105...)
    >>> gm = amprewrite.convert(model, (x, y), policy=result.policy)

NB: the search assumes that moving more ops to fp32 does not make the output worse, which
holds in practice but is not guaranteed; the pruning step re-checks every node it keeps.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import warnings
from typing import Any, Callable

import torch
import torch.fx as fx
import torch.nn as nn

from ..convert import convert, resolve_dtype
from ..errors import AmpRewriteError, user_stacklevel
from ..graph.meta import CONVERTED_KEY, decision
from ..policy.policy import Policy
from ..policy.tables import OpCategory
from .compare import node_errors, warn_if_random
from .shadow import op_nodes, record, reference_module, rel_error

__all__ = ["search", "SearchResult", "Trial", "ToleranceNotReached"]

_FP32 = (OpCategory.FP32, OpCategory.FP32_DTYPE_ARG, OpCategory.FP32_APPEND_DTYPE)


@dataclasses.dataclass(frozen=True)
class Trial:
    """One conversion and run: the nodes overridden to fp32, the error it reached, why."""

    nodes: tuple[str, ...]
    error: float
    passed: bool
    step: str


@dataclasses.dataclass
class SearchResult:
    """What :func:`search` found. ``policy`` is the start policy plus ``nodes`` as fp32 node
    overrides (and the low dtype), ready for ``amprewrite.convert(model, inputs,
    policy=result.policy)``; ``error`` is its output's error; ``runs`` counts conversions and
    runs, the first being the shadow run."""

    policy: Policy
    nodes: tuple[str, ...]
    runs: int
    error: float
    tol: float
    start_error: float
    history: list[Trial]

    def table(self) -> str:
        """Every run of the search, in order."""
        from tabulate import tabulate

        rows = [(i + 1, t.step, _names(t.nodes), _sci(t.error), "yes" if t.passed else "no")
                for i, t in enumerate(self.history)]
        return tabulate(rows, headers=["run", "step", "fp32 nodes", "error", "within tol"],
                        disable_numparse=True)

    def summary(self) -> str:
        return (f"{len(self.nodes)} node{'s' if len(self.nodes) != 1 else ''} to fp32: "
                f"{', '.join(self.nodes) or '(none)'}; error {_sci(self.start_error)} -> "
                f"{_sci(self.error)} (tol {self.tol:g}) in {self.runs} runs")

    def to_dict(self) -> dict[str, Any]:
        return {"nodes": list(self.nodes), "runs": self.runs, "error": self.error,
                "tol": self.tol, "start_error": self.start_error,
                "history": [{**dataclasses.asdict(t), "nodes": list(t.nodes)}
                            for t in self.history]}

    def __str__(self) -> str:
        return self.summary() + "\n\n" + self.table()


def _names(nodes: tuple[str, ...], limit: int = 6) -> str:
    shown = ", ".join(nodes[:limit])
    return (shown + f", … (+{len(nodes) - limit})" if len(nodes) > limit else shown) or "-"


def _sci(x: float) -> str:
    return "0" if x == 0 else "inf" if math.isinf(x) else f"{x:.2e}"


class _OutOfRuns(Exception):
    pass


class ToleranceNotReached(AmpRewriteError):
    """:func:`search` could not bring the output within ``tol``; the message says how close
    it came and what to change."""


class _Trials:
    """Converts and runs ``model`` with a set of fp32 node overrides, counting the runs and
    remembering every result (a set is never run twice)."""

    def __init__(self, model: nn.Module, inputs: tuple, kwargs: dict[str, Any] | None,
                 start: Policy, tol: float, metric: Callable[[Any, Any], float] | None,
                 max_runs: int) -> None:
        self.model, self.inputs, self.kwargs, self.start = model, inputs, kwargs, start
        self.tol, self.metric, self.max_runs = tol, metric, max_runs
        self.history: list[Trial] = []
        self.seen: dict[frozenset[str], float] = {}
        self.reference: Any = None  # the fp64 outputs, set by the first run

    def policy(self, nodes: tuple[str, ...]) -> Policy:
        return self.start.override(nodes={n: OpCategory.FP32 for n in nodes}) if nodes \
            else self.start

    def error(self, outputs: Any) -> float:
        if self.metric is None:
            return rel_error(outputs, self.reference)
        value = self.metric(outputs, self.reference)
        if not isinstance(value, numbers.Real) and not (isinstance(value, torch.Tensor)
                                                       and value.numel() == 1):
            raise TypeError(f"amprewrite.search: metric(out, ref) returned "
                            f"{type(value).__name__}; expected a float (smaller is better)")
        value = float(value)
        return math.inf if math.isnan(value) else value

    def note(self, nodes: tuple[str, ...], error: float, step: str) -> bool:
        self.seen[frozenset(nodes)] = error
        self.history.append(Trial(nodes, error, error <= self.tol, step))
        return error <= self.tol

    def passes(self, nodes: tuple[str, ...], step: str) -> bool:
        """Whether the model with ``nodes`` in fp32 is within ``tol`` (one run if new)."""
        key = frozenset(nodes)
        if key in self.seen:
            return self.seen[key] <= self.tol
        if len(self.history) >= self.max_runs:
            raise _OutOfRuns

        gm = convert(self.model, self.inputs, example_kwargs=self.kwargs,
                     policy=self.policy(nodes))
        with torch.no_grad():
            out = gm(*self.inputs, **(self.kwargs or {}))
        return self.note(nodes, self.error(out), step)

    def best(self) -> Trial:
        return min(self.history, key=lambda t: (t.error, len(t.nodes)))


def _start(model: nn.Module, inputs: tuple, kwargs: dict[str, Any] | None,
           trials: _Trials, shadow: bool) -> tuple[list[str], dict[str, float]]:
    """Run 1: the start policy, with the fp64 reference beside it. Returns the nodes that
    compute or produce the low dtype (graph order) and, with ``shadow``, each one's priority:
    the error it adds, or inf where its exact output overflows the low dtype.

    NB: a node fed an overflowed value adds nothing to an inf, so its added error alone
    would hide that it overflows too once its producer is fixed; its headroom does not.
    """

    gm = convert(model, inputs, example_kwargs=kwargs, policy=trials.start)
    warn_if_random(gm, "search")
    low = gm.meta[CONVERTED_KEY][1]
    capture = "export" if hasattr(gm, "_in_spec") else "symbolic"
    ref_gm, ref_args, ref_kwargs = reference_module(model, inputs, kwargs, torch.float64,
                                                    capture)
    low_run = record(gm, inputs, kwargs)
    ref_run = record(ref_gm, ref_args, ref_kwargs)
    trials.reference = ref_run.outputs
    trials.note((), trials.error(low_run.outputs), "start" + (" (shadow run)" if shadow else ""))
    candidates = [n.name for n in op_nodes(gm) if _computes_low(n, low_run.values.get(n), low)]
    priority = {}
    if shadow:
        rows, _ = node_errors(low_run, ref_run, low)
        priority = {r.node: math.inf if r.headroom < 0 else r.added for r in rows}
    return candidates, priority


def _computes_low(node: fx.Node, value: Any, low: torch.dtype) -> bool:
    """Whether an fp32 override of ``node`` can change anything: it is not fp32 already, and
    computes in or returns the low dtype."""
    rec = decision(node)
    if rec.category in _FP32:
        return False
    return rec.compute_dtype == low or (isinstance(value, torch.Tensor) and value.dtype == low)


def search(model: nn.Module, example_inputs: Any, *, tol: float, policy: Policy | None = None,
           dtype: torch.dtype | None = None,
           metric: Callable[[Any, Any], float] | None = None, max_runs: int = 32,
           example_kwargs: dict[str, Any] | None = None) -> SearchResult:
    """The fewest op nodes to override to fp32 for ``model``'s converted output to be within
    ``tol`` of its fp64 reference (module docstring).

    Args:
        model, example_inputs, example_kwargs: as for :func:`amprewrite.convert` (one tensor
            is taken as ``(tensor,)``). The search runs on these inputs only.
        tol: the largest acceptable error.
        policy, dtype: where the search starts (default ``Policy()``; dtype as ``convert``).
        metric: ``metric(out, ref) -> float``, the error of the converted model's output
            ``out`` against the fp64 output ``ref`` (same structure); default: the largest
            relative error ``max|out - ref| / max|ref|`` over the floating outputs.
        max_runs: conversions and runs allowed, the shadow run included.

    Raises ``AmpRewriteError`` when ``tol`` is not reached, saying what was; warns and returns
    a policy that meets ``tol`` if ``max_runs`` ran out while pruning it.
    """
    trials = _trials(model, example_inputs, tol, policy, dtype, metric, max_runs,
                     example_kwargs)
    candidates, priority = _start(model, trials.inputs, trials.kwargs, trials, shadow=True)
    if trials.history[0].passed:
        return _result(trials, ())
    ranked = sorted((n for n in candidates if priority.get(n, 0.0) > 0),
                    key=lambda n: (-priority[n], candidates.index(n)))
    try:
        k = _smallest_prefix(trials, ranked)
    except _OutOfRuns:
        raise _not_reached(trials, "max_runs ran out") from None
    chosen = tuple(ranked[:k])
    try:
        chosen = _prune(trials, chosen)
    except _OutOfRuns:
        chosen = _best_passing(trials)
        warnings.warn(f"amprewrite.search: max_runs={max_runs} ran out while pruning; the "
                      f"policy meets tol with {len(chosen)} fp32 nodes, possibly more than "
                      "needed. Pass a larger max_runs for the smallest set.",
                      stacklevel=user_stacklevel())
    return _result(trials, chosen)


def _smallest_prefix(trials: _Trials, ranked: list[str]) -> int:
    """The smallest ``k`` whose top-``k`` nodes in fp32 pass: ``k = 1, 2, 4, …``, then a
    bisection between the last failing and the first passing ``k``."""
    failing, k = 0, 1  # the start policy (k = 0) failed
    while True:
        k = min(k, len(ranked))
        if k == failing:  # every candidate is in fp32 and it still fails
            raise _not_reached(trials, f"with all {len(ranked)} candidate nodes in fp32")
        if trials.passes(tuple(ranked[:k]), f"top {k}"):
            break
        failing, k = k, 2 * k
    passing = k
    while passing - failing > 1:
        mid = (failing + passing) // 2
        if trials.passes(tuple(ranked[:mid]), f"top {mid}"):
            passing = mid
        else:
            failing = mid
    return passing


def _prune(trials: _Trials, chosen: tuple[str, ...]) -> tuple[str, ...]:
    """Drop every node of ``chosen`` (a passing ranked prefix) that the output does not need,
    trying the least harmful first. The last node is needed: the prefix without it failed,
    and dropping more cannot help (fp32 only removes error)."""
    for name in reversed(chosen[:-1]):
        without = tuple(n for n in chosen if n != name)
        if trials.passes(without, f"without {name}"):
            chosen = without
    return chosen


def _best_passing(trials: _Trials) -> tuple[str, ...]:
    return min((t for t in trials.history if t.passed), key=lambda t: len(t.nodes)).nodes


def _result(trials: _Trials, nodes: tuple[str, ...]) -> SearchResult:
    return SearchResult(trials.policy(nodes), nodes, len(trials.history),
                        trials.seen[frozenset(nodes)], trials.tol, trials.history[0].error,
                        list(trials.history))


def _not_reached(trials: _Trials, how: str) -> ToleranceNotReached:
    best = trials.best()
    with torch.no_grad():  # how far fp32 itself is from fp64: no tol below that can be met
        fp32 = trials.error(trials.model(*trials.inputs, **(trials.kwargs or {})))
    return ToleranceNotReached(
        f"amprewrite.search: tol={trials.tol:g} was not reached ({how}, {len(trials.history)} "
        f"runs): the best error was {_sci(best.error)}, with "
        f"{_names(best.nodes) if best.nodes else 'no override'} in fp32; the model in fp32 "
        f"is {_sci(fp32)} from the fp64 reference. Pass a larger tol (above the fp32 error), "
        "a larger max_runs, or a start policy that keeps more ops in fp32 "
        "(Policy().override(ops=..., keep_fp32=[...])).")


def _trials(model: Any, example_inputs: Any, tol: Any, policy: Any, dtype: Any, metric: Any,
            max_runs: Any, example_kwargs: Any) -> _Trials:
    """Check the arguments of :func:`search` and set up its runs."""

    if not isinstance(model, nn.Module):
        raise TypeError(f"amprewrite.search expects a torch.nn.Module, got "
                        f"{type(model).__name__}")
    inputs = (example_inputs,) if isinstance(example_inputs, torch.Tensor) else example_inputs
    if not isinstance(inputs, tuple):
        raise TypeError(f"amprewrite.search: example_inputs must be a tuple of positional "
                        f"arguments (or one tensor), got {type(example_inputs).__name__}")
    if isinstance(tol, bool) or not isinstance(tol, numbers.Real) or not tol > 0:
        raise ValueError(f"amprewrite.search: tol={tol!r}; expected a positive number, the "
                         "largest acceptable error (e.g. tol=1e-2)")
    if isinstance(max_runs, bool) or not isinstance(max_runs, int) or max_runs < 2:
        raise ValueError(f"amprewrite.search: max_runs={max_runs!r}; expected an int >= 2 "
                         "(the shadow run and at least one check)")
    if metric is not None and not callable(metric):
        raise TypeError(f"amprewrite.search: metric must be a function metric(out, ref) -> "
                        f"float, got {type(metric).__name__}")
    policy = Policy() if policy is None else policy
    if not isinstance(policy, Policy):
        raise TypeError(f"amprewrite.search: policy must be an amprewrite.Policy, got "
                        f"{type(policy).__name__}")
    # The dtype goes into the policy, so that convert(model, inputs, policy=result.policy)
    # converts exactly as the search did.
    start = dataclasses.replace(policy, dtype=resolve_dtype(model, policy, dtype))
    return _Trials(model, inputs, example_kwargs, start, float(tol), metric, max_runs)


# -- the baseline: bisection without a ranking -------------------------------------------------
def _bisect(model: nn.Module, example_inputs: Any, *, tol: float, policy: Policy | None = None,
            dtype: torch.dtype | None = None,
            metric: Callable[[Any, Any], float] | None = None, max_runs: int = 256,
            example_kwargs: dict[str, Any] | None = None) -> SearchResult:
    """:func:`search` without the shadow run's ranking: delta debugging (QuickXplain) over the
    candidate nodes in graph order. The baseline that the ranking's run count is measured
    against; same arguments and result."""
    trials = _trials(model, example_inputs, tol, policy, dtype, metric, max_runs,
                     example_kwargs)
    candidates, _ = _start(model, trials.inputs, trials.kwargs, trials, shadow=False)
    if trials.history[0].passed:
        return _result(trials, ())
    if not trials.passes(tuple(candidates), "all candidates"):
        raise _not_reached(trials, f"with all {len(candidates)} candidate nodes in fp32")
    return _result(trials, tuple(_needed(trials, (), False, tuple(candidates))))


def _needed(trials: _Trials, fixed: tuple[str, ...], fixed_changed: bool,
            candidates: tuple[str, ...]) -> tuple[str, ...]:
    """The nodes of ``candidates`` that ``fixed`` needs to pass, given that ``fixed +
    candidates`` passes (Junker's QuickXplain)."""
    if fixed_changed and trials.passes(fixed, "bisect"):
        return ()
    if len(candidates) == 1:
        return candidates
    left, right = candidates[:len(candidates) // 2], candidates[len(candidates) // 2:]
    from_right = _needed(trials, fixed + left, True, right)
    from_left = _needed(trials, fixed + from_right, bool(from_right), left)
    return from_left + from_right
