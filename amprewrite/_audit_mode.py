"""The recording half of the auditor: a TorchDispatchMode and the pending statistics.

``_AuditMode.__torch_dispatch__`` runs the op and hands it to :class:`Recorder`, which
computes a handful of reductions per floating output *on the output's device* and keeps them
as tensors. Nothing is read back per op (no ``.item()``, ``.tolist()``, ``bool(tensor)``);
:meth:`Recorder.finish` stacks everything and reads it back with one ``.tolist()`` per device.

Per call the raw statistics vector is (``_RAW``): ``max_abs`` (largest finite |x|),
``min_nz`` (smallest nonzero finite |x|), ``nonfinite`` (inf/NaN count), ``zero`` (zeros,
non-finite values included), ``over`` (finite |x| > 65504 in a wider dtype, or +-inf in an
fp16 output), ``small`` (|x| below fp16's smallest normal, zeros included: underflow is
``small - zero``), and ``in_nonfinite`` (inf/NaN among the op's inputs: an op *produced*
inf/NaN when its output has some and its inputs none).

View and alias ops (``view``, ``t``, ``expand``, ``detach``, …) are not recorded: they compute
nothing new, and their outputs inherit their input's statistics.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry
from torch.utils.weak import WeakIdKeyDictionary

from ._audit_where import Attribution
from ._grad_hist import accumulate

__all__ = ["CallMeta", "Recorder", "_AuditMode", "FP16_MAX", "FP16_TINY"]

FP16_MAX = 65504.0
FP16_TINY = 6.103515625e-05
"""fp16's smallest normal, 2**-14."""
_INF = float("inf")
_ACC = torch.float64
"""Statistics dtype: counts stay exact up to 2**53 elements."""
_RAW = ("max_abs", "min_nz", "nonfinite", "zero", "over", "small", "in_nonfinite")
_COMPACT_EVERY = 64
"""In aggregate mode, pending vectors of one group are folded into one every this many calls."""

_ALIASING = frozenset({torch.ops.aten._unsafe_view.default, torch.ops.aten.lift_fresh.default})
"""Ops that return their input's values under another shape without being views."""

_SHORT = {torch.float16: "f16", torch.bfloat16: "bf16", torch.float32: "f32",
          torch.float64: "f64"}


def dtype_name(dtype: torch.dtype) -> str:
    return _SHORT.get(dtype) or str(dtype).replace("torch.", "")


class CallMeta(NamedTuple):
    """Host-side facts of one op call (known without reading any tensor)."""

    op: str
    node: str | None
    module: str | None
    phase: str
    in_dtypes: tuple[str, ...]
    out_dtype: str | None
    shape: tuple[int, ...]
    cast: bool
    grad_fn: str | None


@dataclasses.dataclass
class Group:
    """One row of the report: a single call, or (aggregate mode) all calls with one key."""

    meta: CallMeta
    first_call: int
    count: int = 0
    flops: int = 0
    nbytes: int = 0
    raw: list[torch.Tensor] = dataclasses.field(default_factory=list)
    """Pending statistics vectors, one per call (still on the device)."""
    acc: torch.Tensor | None = None
    """Aggregate mode: (max_abs, min_nz, nonfinite, zero, over, small, first producer call)."""


# Integer views of the floating formats: |x| as an integer (sign bit cleared) orders like |x|,
# and its top bits are the biased exponent (fp32 and bf16 share fp32's 8-bit exponent).
# Per format: (int dtype, mantissa bits, abs mask, +inf, largest value <= 65504).
_INT_VIEW = {torch.float32: (torch.int32, 23, 0x7FFFFFFF, 0x7F800000, 0x477FE000),
             torch.bfloat16: (torch.int16, 7, 0x7FFF, 0x7F80, 0x477F)}
_BIAS = 127


def exponent_histogram(bits: torch.Tensor, shift: int) -> torch.Tensor:
    """Counts of the biased exponents (0..255) of the integer magnitudes ``bits``."""
    exponent = (bits >> shift).flatten()
    if exponent.device.type == "cpu":
        return torch.bincount(exponent, minlength=256)
    # bincount sizes its output from exponent.max(): a host sync on accelerators.
    hist = torch.zeros(256, dtype=torch.int64, device=exponent.device)
    return hist.index_add_(0, exponent.long(), torch.ones_like(exponent, dtype=torch.int64))


def _output_stats(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(max_abs, min_nz, nonfinite, zero, over, small) of one floating tensor as a float64
    vector, and its exponent histogram (summed into the gradient histogram).

    Everything is computed on the magnitude bits with integer arithmetic (on CPU several
    times faster than float compares): one exponent histogram gives the non-finite, small
    and bf16 overflow counts; shifted/masked integer min and max give the extremes.
    NB: dtypes other than fp32/bf16/fp16 are measured after conversion to fp32.
    """
    x = t if t.dtype in _INT_VIEW else t.float()
    int_dtype, shift, mask, inf_bits, max16_bits = _INT_VIEW[x.dtype]
    sign = 31 if int_dtype == torch.int32 else 15
    bits = x.view(int_dtype) & mask
    hist = exponent_histogram(bits, shift)
    counts = hist.to(_ACC) @ _selector(hist.device)  # (non-finite, < 2**-14, >= 2**16)
    count = torch.count_nonzero
    if t.dtype == torch.float16:
        over = t.numel() - count(bits ^ inf_bits)  # values that became inf in fp16
    elif int_dtype == torch.int32:
        # (max16 - bits) >> 31 is -1 exactly where bits > max16; inf/NaN are not finite.
        over = count((max16_bits - bits) >> sign).to(_ACC) - counts[0]
    else:
        over = counts[2]  # bf16 has no value between 65504 and 2**16
    # (bits - inf) & mask puts finite patterns above all non-finite ones (order kept), so
    # its max is the finite max shifted; (bits - 1) & mask sends 0 to the top for the min.
    extremes = torch.stack([((bits - inf_bits) & mask).amax(),
                            ((bits - 1) & mask).amin()]).to(torch.int32)
    extremes = extremes + _offsets(extremes.device, mask - inf_bits + 1)
    if int_dtype == torch.int16:
        extremes = extremes << 16
    values = extremes.view(torch.float32).to(_ACC)
    # Marks: no finite value -> max -1; no nonzero value (wrapped to -0.0, or inf/NaN) -> inf.
    is_min, marks = _marks(values.device)
    bad = torch.where(is_min, ~(values > 0), ~(values >= 0))
    values = torch.where(bad, marks, values)
    zero = t.numel() - count(bits)
    return torch.cat([values, counts[:1], torch.stack([zero.to(_ACC), over.to(_ACC)]),
                      counts[1:2]]), hist


_SELECT: dict[torch.device, torch.Tensor] = {}
_OFFSETS: dict[tuple[torch.device, int], torch.Tensor] = {}
_MARKS: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}


def _selector(device: torch.device) -> torch.Tensor:
    """(256, 3) 0/1 matrix: exponent histogram -> (non-finite, below fp16's smallest normal
    2**-14 (zeros included), at least 2**16 and finite)."""
    sel = _SELECT.get(device)
    if sel is None:
        sel = torch.zeros(256, 3, dtype=_ACC)
        sel[255, 0] = 1
        sel[:_BIAS - 14, 1] = 1
        sel[_BIAS + 16:255, 2] = 1
        sel = _SELECT[device] = sel.to(device)
    return sel


def _offsets(device: torch.device, rotation: int) -> torch.Tensor:
    off = _OFFSETS.get((device, rotation))
    if off is None:
        off = _OFFSETS[(device, rotation)] = torch.tensor([-rotation, 1], dtype=torch.int32,
                                                          device=device)
    return off


def _marks(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    pair = _MARKS.get(device)
    if pair is None:
        pair = _MARKS[device] = (torch.tensor([False, True], device=device),
                                 torch.tensor([-1.0, _INF], dtype=_ACC, device=device))
    return pair


def _combine(vecs: list[torch.Tensor]) -> torch.Tensor:
    """Statistics of several outputs of one op as one vector."""
    s = torch.stack(vecs)
    return torch.cat([s[:, 0].amax().reshape(1), s[:, 1].amin().reshape(1), s[:, 2:].sum(0)])


class Recorder:
    """Turns op calls into pending device-side statistics, grouped into report rows."""

    def __init__(self, attribution: Attribution, aggregate: bool) -> None:
        self.where = attribution
        self.aggregate = aggregate
        self.groups: list[Group] = []
        self._keys: dict[CallMeta, Group] = {}
        self._nonfinite: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self.calls = 0
        self.grad_hist: dict[torch.device, torch.Tensor] = {}
        self.grad_max: dict[torch.device, torch.Tensor] = {}

    # -- per op --------------------------------------------------------------------------
    def record(self, func: Any, args: tuple, kwargs: dict, out: Any) -> None:
        outs = _tensors(out, [])
        inputs = _tensors(kwargs, _tensors(args, []))
        grad_fn = torch._C._current_autograd_node()
        if grad_fn is None:
            phase, ctx, grad_name = "forward", self.where.forward_context(), None
        else:
            phase, ctx, grad_name = "backward", self.where.backward_context(grad_fn), \
                grad_fn.name()
        if func.is_view or func in _ALIASING or not outs:
            if inputs:  # aliases see the same values
                entry = self._input_entry(inputs[0])
                for t in outs:
                    self._nonfinite[t] = (t._version, entry[1])
            return
        if any(_is_fake(t) for t in outs):
            return
        floating = [t for t in outs if t.is_floating_point() and t.numel()]
        op = func._overloadpacket.__name__
        first = floating[0] if floating else outs[0]
        cast = ctx.cast_node or (op == "_to_copy" and bool(inputs)
                                 and inputs[0].dtype != first.dtype)
        meta = CallMeta(op, ctx.node, ctx.module, phase,
                        tuple(dtype_name(t.dtype) for t in inputs), dtype_name(first.dtype),
                        tuple(first.shape), cast, grad_name)
        # Inputs first: an in-place op's output is its input, whose old statistics count.
        in_entries = [self._input_entry(t, outs) for t in inputs]
        vec = self._stats(floating, in_entries, phase, cast)
        group = self._group(meta)
        group.count += 1
        group.flops += _flops(func, args, kwargs, out)
        if cast:
            group.nbytes += sum(t.numel() * t.element_size() for t in outs)
        if vec is not None:
            if self.aggregate:
                # Slot 6 becomes "this call's index if it produced inf/NaN, else inf", so that
                # folding needs no host values (kernels with scalar arguments only).
                producer = (vec[2] > 0) & (vec[6] == 0)
                vec = torch.cat([vec[:6], torch.where(producer, float(self.calls), _INF)
                                 .reshape(1).to(vec.dtype)])
            group.raw.append(vec)
            if self.aggregate and len(group.raw) >= _COMPACT_EVERY:
                fold(group)
        self.calls += 1

    def _stats(self, floating: list[torch.Tensor], in_entries: list[tuple], phase: str,
               cast: bool) -> torch.Tensor | None:
        if not floating:
            return None
        vecs = []
        for t in floating:
            vec, hist = _output_stats(t)
            vecs.append(vec)
            self._nonfinite[t] = (t._version, vec[2])
            if phase == "backward" and not cast:
                device = t.device
                self.grad_hist[device] = accumulate(self.grad_hist.get(device), hist, vec[3])
                old = self.grad_max.get(device)
                self.grad_max[device] = vec[0] if old is None else torch.maximum(old, vec[0])
        out = vecs[0] if len(vecs) == 1 else _combine(vecs)
        counts = [e[1] for e in in_entries]
        total = counts[0] if len(counts) == 1 else (
            torch.stack([c.to(out.device) for c in counts]).sum() if counts
            else out.new_zeros(()))
        return torch.cat([out, total.to(out.device).reshape(1)])

    def _input_entry(self, t: torch.Tensor, outs: list[torch.Tensor] = ()
                     ) -> tuple[int, torch.Tensor]:
        """(version, non-finite count) of an input, computed now if it was not produced under
        the audit (parameters, user inputs) or was modified in place since.

        NB: a view shares its base's entry, so a slice of a tensor with inf elsewhere counts
        as non-finite: an op is then not blamed, never wrongly blamed."""
        entry = self._nonfinite.get(t)
        if entry is not None and any(o is t for o in outs):
            return entry  # modified in place by this very op: its values before the op
        if entry is None or entry[0] != t._version:
            if t.is_floating_point() or t.is_complex():
                count = torch.count_nonzero(t - t).to(_ACC)  # x - x is NaN only for inf/NaN
            else:
                count = torch.zeros((), dtype=_ACC, device=t.device)
            entry = (t._version, count)
            if not _is_fake(t):
                self._nonfinite[t] = entry
        return entry

    def _group(self, meta: CallMeta) -> Group:
        if not self.aggregate:
            group = Group(meta, self.calls)
            self.groups.append(group)
            return group
        group = self._keys.get(meta)
        if group is None:
            group = self._keys[meta] = Group(meta, self.calls)
            self.groups.append(group)
        return group

    # -- at exit -----------------------------------------------------------------------
    def finish(self) -> tuple[list["GroupStats"], list[float] | None, float | None]:
        """Read every pending statistic back: one ``.tolist()`` per device. Returns the
        statistics per group, the dense gradient histogram and the largest gradient."""
        if self.aggregate:
            for group in self.groups:
                fold(group)
            vecs = [g.acc for g in self.groups]
        else:
            vecs = [g.raw[0] if g.raw else None for g in self.groups]
        devices = {v.device for v in vecs if v is not None} | set(self.grad_hist)
        values: list[list[float] | None] = [None] * len(vecs)
        hist: list[float] | None = None
        grad_max: float | None = None
        for device in devices:
            index = [i for i, v in enumerate(vecs) if v is not None and v.device == device]
            parts = [torch.stack([vecs[i] for i in index]).flatten()] if index else []
            h = self.grad_hist.get(device)
            if h is not None:
                parts += [h.to(_ACC), self.grad_max[device].reshape(1).to(_ACC)]
            flat = torch.cat(parts).tolist()  # the one host sync for this device
            width = len(_RAW)
            for k, i in enumerate(index):
                values[i] = flat[k * width:(k + 1) * width]
            if h is not None:
                tail = flat[len(index) * width:]
                dense, top = tail[:-1], tail[-1]
                hist = dense if hist is None else [a + b for a, b in zip(hist, dense)]
                grad_max = top if grad_max is None else max(grad_max, top)
        stats = [_group_stats(g, v, self.aggregate) for g, v in zip(self.groups, values)]
        return stats, hist, grad_max


class GroupStats(NamedTuple):
    max_abs: float | None
    min_nonzero_abs: float | None
    nonfinite: int
    fp16_overflow: int
    fp16_underflow: int
    producer_call: int | None
    """Index of the first call of this group that produced a non-finite value from finite
    inputs, None if none did."""


def _group_stats(group: Group, row: list[float] | None, aggregate: bool) -> GroupStats:
    if row is None:
        return GroupStats(None, None, 0, 0, 0, None)
    max_abs, min_nz, nonfinite, zero, over, small, last = row
    if aggregate:
        producer = None if last == _INF else int(last)
    else:
        producer = group.first_call if nonfinite and not last else None
    if max_abs < 0:
        max_abs = None  # no finite value at all
    return GroupStats(max_abs, None if min_nz == _INF else min_nz, int(nonfinite), int(over),
                      int(small - zero), producer)


def fold(group: Group) -> None:
    """Fold a group's pending vectors into ``group.acc`` (aggregate mode; device ops only)."""
    if not group.raw:
        return
    s = torch.stack(group.raw if group.acc is None else [group.acc] + group.raw)
    group.acc = torch.cat([s[:, 0].amax().reshape(1), s[:, 1].amin().reshape(1),
                           s[:, 2:6].sum(0), s[:, 6].amin().reshape(1)])
    group.raw = []


def _is_fake(t: torch.Tensor) -> bool:
    return t.device.type == "meta" or isinstance(t, torch._subclasses.FakeTensor)


def _tensors(obj: Any, out: list[torch.Tensor]) -> list[torch.Tensor]:
    """The tensors in (nested lists, tuples and dicts of) op arguments, in order."""
    if isinstance(obj, torch.Tensor):
        out.append(obj)
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            _tensors(item, out)
    elif isinstance(obj, dict):
        for item in obj.values():
            _tensors(item, out)
    return out


def _flops(func: Any, args: tuple, kwargs: dict, out: Any) -> int:
    formula = flop_registry.get(func._overloadpacket)
    if formula is None:
        return 0
    try:
        return int(formula(*args, **kwargs, out_val=out))
    except Exception:  # a formula that does not know this overload: no FLOPs, not an error
        return 0


class _AuditMode(TorchDispatchMode):
    """Runs every op unchanged and hands it to a :class:`Recorder`."""

    def __init__(self, recorder: Recorder) -> None:
        super().__init__()
        self.recorder = recorder

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        # Ops called here go to the next mode on the stack, not back to this one.
        self.recorder.record(func, args, kwargs, out)
        return out
