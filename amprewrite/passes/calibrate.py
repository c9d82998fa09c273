"""Range-based fallback: ops whose values would overflow the low dtype compute in fp32.

``convert(model, example_inputs, dtype=torch.float16, calibrate=[(args, kwargs), ...])``
first runs the captured, not yet rewritten graph in fp32 on every calibration input
(:func:`record_ranges`) and stores each node's largest finite |x| under
``node.meta[RANGE_KEY]`` (see :mod:`amprewrite.graph.meta`). Classification then applies
:func:`range_rule`: an op that would compute in the low dtype and whose output or any input exceeds
``finfo(low).max / 2**policy.range_headroom_bits`` computes in fp32 instead.

Before (fp16, ``Linear(4, 4)`` whose output reaches 1e5 on the calibration data)::

    node    op      category  dtype  out  rule           casts
    linear  linear  lower     f16    f16  default table  x_f16, _0_weight_f16, _0_bias_f16

After::

    node    op      category  dtype  out  rule                               casts
    linear  linear  fp32      f32    f32  range: max |x| 1.0e+05 > fp16 max  -

Precedence: the user's node, module and op overrides win over the range rule (the user has
the last word); the range rule wins over the preset's tables, ``register_op`` registrations
and the model's own autocast regions. In-place ops are never moved (a cast would break the
alias they write through). Nodes the run did not see, or that produce no floating tensor
(shapes, indices), are left alone. Infinite and NaN values are not counted: a value that is
already infinite in fp32 does not get finite by computing in fp32.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx
from torch.fx._pytree import tree_flatten_spec
from torch.utils._pytree import tree_leaves, tree_map

from ..capture.converted import is_converted
from ..graph.meta import RANGE_KEY, Decision, max_abs
from ..policy.opkey import is_inplace
from ..policy.policy import Policy
from ..policy.tables import OpCategory
from .decompose import DecomposeCompositesPass

__all__ = ["CalibrationInput", "check_calibrate", "record_ranges", "range_rule", "finite_max_abs"]

CalibrationInput = tuple[tuple, dict]
"""One calibration input: ``(args, kwargs)``, as the model is called: ``model(*args, **kwargs)``."""

_LOW = (torch.float16, torch.bfloat16)
_SHORT = {torch.float16: "fp16", torch.bfloat16: "bf16"}
# Categories whose op may compute in the low dtype: LOWER always, PROMOTE at its low floor,
# PASSTHROUGH and MATCH_SELF whenever a low value reaches it (``h * h`` on a fp16 ``h``).
_MOVABLE = (OpCategory.LOWER, OpCategory.PROMOTE, OpCategory.PASSTHROUGH, OpCategory.MATCH_SELF)
_FORM = ("expected (args, kwargs) with args a tuple and kwargs a dict, or a non-empty list of "
         "them, e.g. calibrate=((x,), {}) or calibrate=[((x1,), {}), ((x2,), {})]")


# -- the argument ------------------------------------------------------------------------------
def check_calibrate(calibrate: Any, model: Any, opt_level: str) -> list[CalibrationInput] | None:
    """Validate ``convert(calibrate=...)``; the inputs as a list of ``(args, kwargs)``.

    A bare tuple of positional arguments is refused rather than guessed at: ``(x, y)`` and
    ``((x,), {})`` would be ambiguous for a model whose first argument is a tuple.
    """
    if calibrate is None:
        return None
    if opt_level != "O1":
        raise ValueError(
            f"amprewrite.convert: calibrate=... was given with opt_level={opt_level!r}; the range "
            "fallback applies to opt_level='O1' only: O0 computes everything in fp32 already, and "
            "O2/O3 compute every op in the low dtype by design (O3 holds no fp32 weights at "
            "all). Use opt_level='O1' with calibrate=..., or keep overflowing modules in fp32 "
            "with Policy().override(keep_fp32=[...]) under O1.")
    if is_converted(model):
        raise ValueError(
            "amprewrite.convert: calibrate=... needs the original model, not a GraphModule "
            "amprewrite already converted (its graph holds casts): call "
            "convert(model, example_inputs, calibrate=...) on the nn.Module itself.")
    items = calibrate if isinstance(calibrate, list) else [calibrate]
    if not items:
        raise ValueError(f"amprewrite.convert: calibrate=[] holds no input; {_FORM}.")
    return [_check_item(item, i if isinstance(calibrate, list) else None)
            for i, item in enumerate(items)]


def _check_item(item: Any, index: int | None) -> CalibrationInput:
    where = "calibrate" if index is None else f"calibrate[{index}]"
    if isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], tuple) and \
            isinstance(item[1], dict):
        return item
    if isinstance(item, torch.Tensor):
        got = f"a Tensor of shape {tuple(item.shape)}"
        hint = " For one tensor x write ((x,), {})."
    elif isinstance(item, tuple):
        got = f"a tuple of {len(item)} ({', '.join(type(v).__name__ for v in item)})"
        hint = " A tuple of positional arguments (x, y) is written ((x, y), {})."
    else:
        got, hint = f"a {type(item).__name__}", ""
    raise TypeError(f"amprewrite.convert: {where} is {got}; {_FORM}.{hint}")


# -- the calibration run -----------------------------------------------------------------------
def record_ranges(gm: fx.GraphModule, inputs: list[CalibrationInput], policy: Policy) -> None:
    """Run ``gm`` in fp32 on every input and store each node's largest finite |x| (over all
    inputs; over every floating tensor of a tuple output) as ``node.meta[RANGE_KEY]``.

    Composites are split first (as the passes would split them) so that the pieces the
    classification sees are the ones measured. No gradient is recorded; the buffers a
    training-mode forward updates (batch-norm statistics) and the RNG state are put back, so
    the model that shares them is not changed.
    """
    DecomposeCompositesPass(policy)(gm)
    peaks: dict[fx.Node, torch.Tensor] = {}
    buffers = [(b, b.detach().clone()) for b in gm.buffers()]
    try:
        with torch.no_grad(), torch.random.fork_rng():
            for index, (args, kwargs) in enumerate(inputs):
                flat = _flat_inputs(gm, args, kwargs, index)
                try:
                    _RangeRecorder(gm, peaks).run(*flat, enable_io_processing=False)
                except Exception as exc:
                    raise ValueError(
                        f"amprewrite.convert: calibrate[{index}] could not run through the "
                        f"captured graph ({type(exc).__name__}: {str(exc).splitlines()[0]}). "
                        "Calibration inputs are called like the model and must match "
                        "example_inputs in structure, dtypes and any dimension the capture "
                        "kept static.") from exc
    finally:
        with torch.no_grad():
            for buffer, value in buffers:
                buffer.copy_(value)
    for node in gm.graph.nodes:
        node.meta.pop(RANGE_KEY, None)
    for device_peaks in _by_device(peaks).values():
        nodes, values = zip(*device_peaks)
        for node, value in zip(nodes, torch.stack(values).tolist()):  # one read-back
            node.meta[RANGE_KEY] = float(value)


def _by_device(peaks: dict[fx.Node, torch.Tensor]) -> dict[torch.device, list]:
    out: dict[torch.device, list] = {}
    for node, value in peaks.items():
        out.setdefault(value.device, []).append((node, value))
    return out


def _flat_inputs(gm: fx.GraphModule, args: tuple, kwargs: dict, index: int) -> list[Any]:
    """The values of ``gm``'s placeholders, in order, for ``gm(*args, **kwargs)``."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    info = getattr(gm.graph._codegen, "pytree_info", None)
    if info is not None and info.in_spec is not None:  # torch.export: (args, kwargs) pytree
        try:
            _check_signature(info.in_spec, args, kwargs)
            flat = tree_flatten_spec((args, kwargs), info.in_spec)
        except Exception as exc:
            raise ValueError(
                f"amprewrite.convert: calibrate[{index}] does not have the structure of "
                f"example_inputs/example_kwargs ({type(exc).__name__}: {exc}); pass the same "
                "positional arguments and keyword names as the example.") from exc
        if len(flat) == len(placeholders):
            return flat
        raise ValueError(f"amprewrite.convert: calibrate[{index}] gives {len(flat)} inputs, "
                         f"the captured graph takes {len(placeholders)}; match example_inputs.")
    return _bind_by_name(placeholders, args, kwargs, index)


def _check_signature(spec: Any, args: tuple, kwargs: dict) -> None:
    """The argument count and keyword names of the export (``flatten_spec`` reads the keys
    it knows and would ignore an extra one)."""
    if spec.type is not tuple or spec.num_children != 2:
        return
    n_args, names = spec.child(0).num_children, list(spec.child(1).context)
    if len(args) != n_args or sorted(kwargs) != sorted(names):
        raise TypeError(f"{len(args)} positional argument(s) and keywords {sorted(kwargs)}, "
                        f"the export took {n_args} and {sorted(names)}")


def _bind_by_name(placeholders: list[fx.Node], args: tuple, kwargs: dict,
                  index: int) -> list[Any]:
    """Symbolic capture: positional arguments first, then keywords by parameter name, then
    the parameters' defaults."""
    names = [str(n.target) for n in placeholders]
    unknown = sorted(set(kwargs) - set(names[len(args):]))
    if len(args) > len(names) or unknown:
        raise ValueError(
            f"amprewrite.convert: calibrate[{index}] passes {len(args)} positional argument(s) "
            f"and keywords {sorted(kwargs)}; the model's forward takes ({', '.join(names)}).")
    values = list(args)
    for node in placeholders[len(args):]:
        if node.target in kwargs:
            values.append(kwargs[node.target])
        elif node.args:
            values.append(node.args[0])  # the parameter's default
        else:
            raise ValueError(f"amprewrite.convert: calibrate[{index}] gives no value for the "
                             f"forward's argument {node.target!r}.")
    return values


class _RangeRecorder(fx.Interpreter):
    """Run a captured graph in fp32 and keep, per node, the largest finite |x| it produced.

    The run is widened to fp32: low-precision tensors and dtype literals (``to(x,
    torch.bfloat16)``, which export records when it traces in the AMP regime) become fp32,
    so values are measured as an fp32 model computes them, before any overflow.
    NB: an in-place op on a widened low-precision tensor writes to the widened copy.
    """

    def __init__(self, gm: fx.GraphModule, peaks: dict[fx.Node, torch.Tensor]) -> None:
        super().__init__(gm)
        self.peaks = peaks

    def run_node(self, n: fx.Node) -> Any:
        with self._set_current_node(n):
            args, kwargs = tree_map(_widen, self.fetch_args_kwargs_from_env(n))
            result = getattr(self, n.op)(n.target, args, kwargs)
        if n.op != "output":
            peak = finite_max_abs(result)
            if peak is not None:
                old = self.peaks.get(n)
                self.peaks[n] = peak if old is None else torch.maximum(old, peak)
        return result


def _widen(value: Any) -> Any:
    if isinstance(value, torch.Tensor) and value.dtype in _LOW:
        return value.float()
    if isinstance(value, torch.dtype) and value in _LOW:
        return torch.float32
    return value


def finite_max_abs(value: Any) -> torch.Tensor | None:
    """max |x| over the finite values of the floating tensors in ``value``, as a 0-dim fp64
    tensor on their device (no host sync); None without a non-empty floating tensor."""
    peak = None
    for t in tree_leaves(value):
        if not isinstance(t, torch.Tensor) or not t.is_floating_point() or t.numel() == 0:
            continue
        a = t.detach().abs()
        a = torch.where(torch.isfinite(a), a, 0).amax().double()
        peak = a if peak is None else torch.maximum(peak, a.to(peak.device))
    return peak


# -- the rule ----------------------------------------------------------------------------------
def range_rule(node: fx.Node, rec: Decision, policy: Policy, dtype: torch.dtype) -> Decision:
    """``rec``, or an fp32 decision if the calibrated values of ``node`` would overflow the
    low dtype it would compute in. ClassifyPass calls it only for decisions no user override
    made (see the module docstring for the precedence)::

        range_rule(linear, Decision("linear", LOWER, torch.float16, "default table"), ...)
        # -> Decision("linear", FP32, torch.float32, "range: max |x| 1.0e+05 > fp16 max")
    """
    own = max_abs(node)
    if own is None or rec.category not in _MOVABLE or policy.preset in ("O2", "O3") \
            or is_inplace(node):
        return rec
    low = rec.compute_dtype if rec.compute_dtype in _LOW else dtype
    if low not in _LOW:
        return rec
    peak = max([own, *(v for v in map(max_abs, node.all_input_nodes) if v is not None)])
    bits = policy.range_headroom_bits
    if peak <= torch.finfo(low).max / 2 ** bits:
        return rec
    limit = f"{_SHORT[low]} max" + (f" / 2^{bits}" if bits else "")
    return Decision(op=rec.op, category=OpCategory.FP32, compute_dtype=torch.float32,
                    rule=f"range: max |x| {peak:.1e} > {limit}")
