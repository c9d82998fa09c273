"""The recording half of the auditor: a TorchDispatchMode and the pending statistics.

``_AuditMode.__torch_dispatch__`` runs the op and hands it to :class:`Recorder`, which
computes a handful of reductions per floating output *on the output's device*
(:mod:`amprewrite.audit.stats`) and keeps them as tensors. Nothing is read back per op (no
``.item()``, ``.tolist()``, ``bool(tensor)``); :meth:`Recorder.finish` stacks everything and
reads it back with one ``.tolist()`` per device.

Per call the raw statistics vector is (``_RAW``): ``max_abs`` (largest finite |x|),
``min_nz`` (smallest nonzero finite |x|), ``nonfinite`` (inf/NaN count), ``zero`` (exact
zeros), ``over`` (finite |x| > 65504 in a wider dtype, or +-inf in an fp16 output), ``small``
(|x| below fp16's smallest normal, zeros included: underflow is ``small - zero``),
``mask`` (mask sentinels ``±finfo(dtype).max``, left out of ``max_abs`` and ``over``),
``has_nan``, and ``in_nonfinite`` / ``in_nan`` for the op's inputs. An op *produced* inf/NaN
when its output has some and its inputs none, or when it made NaN from NaN-free inputs (a
softmax over an all ``-inf`` row: the ``-inf`` were intended, the NaN is the bug).

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

from .fp8 import Fp8Recorder, is_scaled_mm
from .grad_hist import accumulate
from .stats import STAT_DTYPE, has_nan, output_stats
from .where import Attribution

__all__ = ["CallMeta", "Recorder", "_AuditMode", "FP16_MAX", "FP16_TINY", "writes_mask_value"]

FP16_MAX = 65504.0
FP16_TINY = 6.103515625e-05
"""fp16's smallest normal, 2**-14."""
_INF = float("inf")
_ACC = STAT_DTYPE
HALF_GRADIENTS = (torch.float16, torch.bfloat16)
"""Backward outputs in these dtypes make the gradient histogram (see ``_add_gradient``)."""
_RAW = ("max_abs", "min_nz", "nonfinite", "zero", "over", "small", "mask", "has_nan",
        "in_nonfinite", "in_nan")
_COMPACT_EVERY = 64
"""In aggregate mode, pending vectors of one group are folded into one every this many calls."""

_ALIASING = frozenset({torch.ops.aten._unsafe_view.default, torch.ops.aten.lift_fresh.default})
"""Ops that return their input's values under another shape without being views."""
_UNINITIALIZED = frozenset(getattr(torch.ops.aten, n) for n in (
    "empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided"))
"""Ops whose output is uninitialized memory: no statistics (they would be garbage)."""
_MASK_WRITERS = frozenset({"masked_fill", "masked_fill_", "where", "full", "full_like",
                           "new_full", "fill", "fill_", "scalar_tensor"})
"""Ops that write a given value: an inf or ``finfo.max`` they write is a mask, on purpose."""


def writes_mask_value(op: str, args: tuple, kwargs: dict) -> bool:
    """Whether ``op`` writes a mask sentinel given as a number (±inf, ±finfo(dtype).max of a
    floating dtype): ``masked_fill(mask, -inf)``, ``full(..., finfo.min)``."""
    if op not in _MASK_WRITERS:
        return False
    values = [a for a in list(args) + list(kwargs.values()) if isinstance(a, float)]
    return any(abs(v) == _INF or abs(v) in _SENTINELS for v in values)


_SENTINELS = frozenset(torch.finfo(d).max for d in
                       (torch.float16, torch.bfloat16, torch.float32, torch.float64))

def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float16`` -> ``"float16"``."""
    return str(dtype).replace("torch.", "")


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
    mask_fill: bool = False


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
    """Aggregate mode: (max_abs, ..., has_nan, first producer call)."""


def _combine(vecs: list[torch.Tensor]) -> torch.Tensor:
    """Statistics of several outputs of one op as one vector."""
    s = torch.stack(vecs)
    return torch.cat([s[:, 0].amax().reshape(1), s[:, 1].amin().reshape(1), s[:, 2:7].sum(0),
                      s[:, 7].amax().reshape(1)])


class Recorder:
    """Turns op calls into pending device-side statistics, grouped into report rows."""

    def __init__(self, attribution: Attribution, aggregate: bool) -> None:
        self.where = attribution
        self.aggregate = aggregate
        self.groups: list[Group] = []
        self._keys: dict[CallMeta, Group] = {}
        self._nonfinite: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self.calls = 0
        self.failures: list[str] = []
        """One line per op call that could not be recorded (the user's step went on)."""
        self.grad_hist: dict[torch.device, torch.Tensor] = {}
        self.grad_max: dict[torch.device, torch.Tensor] = {}
        self.grad_nonfinite: dict[torch.device, torch.Tensor] = {}
        self.grad_dtypes: set[torch.dtype] = set()
        """The low dtypes of the backward values the gradient histogram counts."""
        self.fp8 = Fp8Recorder()
        """Scales, amax and saturation of the fp8 matmuls (``_scaled_mm``)."""

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
        # aten.to may alias, but it converts when the dtypes differ.
        converts = bool(inputs and outs) and outs[0].dtype != inputs[0].dtype
        if (func.is_view or func in _ALIASING) and not converts or not outs:
            if inputs:  # aliases compute nothing and see their input's values
                entry = self._input_entry(inputs[0])
                for t in outs:
                    self._nonfinite[t] = (_version(t), entry[1], entry[2])
            return
        if any(_is_fake(t) for t in outs):
            return
        # NB: fp8 tensors are scaled to reach their range's edge on purpose: their amax,
        # saturation and zeros are recorded per fp8 matmul (.fp8), not as fp16 range risks.
        floating = [t for t in outs if t.is_floating_point() and t.numel()
                    and t.layout == torch.strided and t.element_size() > 1]
        op = func._overloadpacket.__name__
        first = floating[0] if floating else outs[0]
        cast = ctx.cast_node or (op in ("_to_copy", "to") and converts)
        mask_fill = writes_mask_value(op, args, kwargs)
        meta = CallMeta(op, ctx.node, ctx.module, phase,
                        tuple(dtype_name(t.dtype) for t in inputs), dtype_name(first.dtype),
                        tuple(first.shape), cast, grad_name, mask_fill)
        if is_scaled_mm(func):
            self.fp8.record(meta, args, kwargs)
        # Inputs first: an in-place op's output is its input, whose old statistics count.
        in_entries = [self._input_entry(t, outs) for t in inputs]
        if func._overloadpacket in _UNINITIALIZED:
            floating = []
            for t in outs:
                zero = torch.zeros((), dtype=_ACC, device=t.device)
                self._nonfinite[t] = (_version(t), zero, zero)
        # NB: an op without floating inputs (full, scalar_tensor, arange) that makes inf
        # does so on purpose (attention masks): it is a source, never blamed as a producer;
        # so is one that writes a given inf (masked_fill(mask, -inf)).
        constant = mask_fill or not any(t.is_floating_point() or t.is_complex() for t in inputs)
        vec = self._stats(floating, in_entries, phase, constant)
        group = self._group(meta)
        group.count += 1
        group.flops += _flops(func, args, kwargs, out)
        if cast:
            group.nbytes += sum(t.numel() * t.element_size() for t in outs)
        if vec is not None:
            if self.aggregate:
                # Slot 6 becomes "this call's index if it produced inf/NaN, else inf", so that
                # folding needs no host values (kernels with scalar arguments only).
                producer = ((vec[2] > 0) & (vec[8] == 0)) | ((vec[7] > 0) & (vec[9] == 0))
                vec = torch.cat([vec[:8], torch.where(producer, float(self.calls), _INF)
                                 .reshape(1).to(vec.dtype)])
            group.raw.append(vec)
            if self.aggregate and len(group.raw) >= _COMPACT_EVERY:
                fold(group)
        self.calls += 1

    def _stats(self, floating: list[torch.Tensor], in_entries: list[tuple], phase: str,
               constant: bool) -> torch.Tensor | None:
        if not floating:
            return None
        vecs = []
        for t in floating:
            vec, hist = output_stats(t)
            vecs.append(vec)
            self._nonfinite[t] = (_version(t), vec[2], vec[7])
            if phase == "backward" and t.dtype in HALF_GRADIENTS:
                self._add_gradient(t, vec, hist)
        out = vecs[0] if len(vecs) == 1 else _combine(vecs)
        if constant:  # counts as "inputs had inf": never an inf producer
            inputs = torch.stack([out.new_ones(()), out.new_zeros(())])
        elif len(in_entries) == 1:
            inputs = torch.stack(in_entries[0][1:])
        else:
            inputs = torch.stack([torch.stack(e[1:]).to(out.device)
                                  for e in in_entries]).sum(0)
        return torch.cat([out, inputs.to(out.device)])

    def _add_gradient(self, t: torch.Tensor, vec: torch.Tensor, hist: torch.Tensor) -> None:
        """Count a backward value that the low dtype holds into the gradient histogram.

        NB: only fp16 and bf16 outputs count, casts included (a cast to fp16 in the backward
        is where a gradient first has to fit in fp16). An fp32 output of a backward op is
        either an internal of the formula (rsqrt's backward computes ``pow(x, -1.5)``, huge
        on a zero row) or a gradient in fp32 (the loss's own, a master weight's): neither is
        held in fp16, so neither limits the loss scale."""
        device = t.device
        self.grad_dtypes.add(t.dtype)
        self.grad_hist[device] = accumulate(self.grad_hist.get(device), hist, vec[3])
        old = self.grad_max.get(device)
        self.grad_max[device] = vec[0] if old is None else torch.maximum(old, vec[0])
        old = self.grad_nonfinite.get(device)
        self.grad_nonfinite[device] = vec[2] if old is None else old + vec[2]

    def _input_entry(self, t: torch.Tensor, outs: list[torch.Tensor] = ()
                     ) -> tuple[int, torch.Tensor, torch.Tensor]:
        """(version, non-finite count, has NaN) of an input, computed now if it was not
        produced under the audit (parameters, user inputs) or was modified in place since.

        NB: a view shares its base's entry, so a slice of a tensor with inf elsewhere counts
        as non-finite: an op is then not blamed, never wrongly blamed."""
        entry = self._nonfinite.get(t)
        if entry is not None and any(o is t for o in outs):
            return entry  # modified in place by this very op: its values before the op
        if entry is None or entry[0] != _version(t):
            if t.is_floating_point():
                v = t if t.element_size() > 1 else t.to(_ACC)  # fp8 has no arithmetic
                count = torch.count_nonzero(v - v).to(_ACC)  # x - x is NaN only for inf/NaN
                nan = has_nan(v).to(_ACC)
            elif t.is_complex():
                count = torch.count_nonzero(t - t).to(_ACC)
                nan = torch.isnan(t).any().to(_ACC)
            else:
                count = nan = torch.zeros((), dtype=_ACC, device=t.device)
            entry = (_version(t), count, nan)
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
    def finish(self) -> tuple[list["GroupStats"], list[float] | None, float | None, int]:
        """Read every pending statistic back: one ``.tolist()`` per device. Returns the
        statistics per group, the dense gradient histogram, the largest finite gradient and
        the count of non-finite ones."""
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
        grad_nonfinite = 0
        for device in devices:
            index = [i for i, v in enumerate(vecs) if v is not None and v.device == device]
            parts = [torch.stack([vecs[i] for i in index]).flatten()] if index else []
            h = self.grad_hist.get(device)
            if h is not None:
                parts += [h.to(_ACC), self.grad_max[device].reshape(1).to(_ACC),
                          self.grad_nonfinite[device].reshape(1).to(_ACC)]
            flat = torch.cat(parts).tolist()  # the one host sync for this device
            width = len(_RAW) - (1 if self.aggregate else 0)
            for k, i in enumerate(index):
                values[i] = flat[k * width:(k + 1) * width]
            if h is not None:
                tail = flat[len(index) * width:]
                dense, top, bad = tail[:-2], tail[-2], tail[-1]
                hist = dense if hist is None else [a + b for a, b in zip(hist, dense)]
                grad_max = top if grad_max is None else max(grad_max, top)
                grad_nonfinite += int(bad)
        stats = [_group_stats(g, v, self.aggregate) for g, v in zip(self.groups, values)]
        return stats, hist, grad_max, grad_nonfinite


class GroupStats(NamedTuple):
    max_abs: float | None
    min_nonzero_abs: float | None
    nonfinite: int
    fp16_overflow: int
    fp16_underflow: int
    mask_values: int
    producer_call: int | None
    """Index of the first call of this group that produced a non-finite value from finite
    inputs, None if none did."""


def _group_stats(group: Group, row: list[float] | None, aggregate: bool) -> GroupStats:
    if row is None:
        return GroupStats(None, None, 0, 0, 0, 0, None)
    max_abs, min_nz, nonfinite, zero, over, small, mask, nan = row[:8]
    if aggregate:
        producer = None if row[8] == _INF else int(row[8])
    else:
        in_nonfinite, in_nan = row[8:]
        made = (nonfinite and not in_nonfinite) or (nan and not in_nan)
        producer = group.first_call if made else None
    if max_abs < 0:
        max_abs = None  # no finite value at all
    return GroupStats(max_abs, None if min_nz == _INF else min_nz, int(nonfinite), int(over),
                      int(small - zero), int(mask), producer)


def fold(group: Group) -> None:
    """Fold a group's pending vectors into ``group.acc`` (aggregate mode; device ops only)."""
    if not group.raw:
        return
    s = torch.stack(group.raw if group.acc is None else [group.acc] + group.raw)
    group.acc = torch.cat([s[:, 0].amax().reshape(1), s[:, 1].amin().reshape(1),
                           s[:, 2:7].sum(0), s[:, 7].amax().reshape(1),
                           s[:, 8].amin().reshape(1)])
    group.raw = []


def _version(t: torch.Tensor) -> int:
    # NB: inference tensors have no version counter; in-place changes to them go unseen.
    return -1 if t.is_inference() else t._version


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
        try:
            self.recorder.record(func, args, kwargs, out)
        except Exception as exc:  # noqa: BLE001 -- the audit must never break the user's step
            self.recorder.failures.append(f"{func}: {type(exc).__name__}: {exc}")
        return out
