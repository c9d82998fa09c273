"""``amprewrite.lint(gm)``: static checks of a converted graph for known fp16/bf16 pitfalls.

Each finding names the node and gives a fix. Rules:

* ``fill-overflow``: a constant that overflows the dtype it meets (``masked_fill(m, -1e9)``
  or ``torch.finfo(torch.float32).min``, which capture bakes in even when the model wrote
  ``torch.finfo(x.dtype).min``, in an op that runs in fp16 or whose result is cast to fp16).
  fp16 fills raise; arithmetic gives -inf and a fully masked row ``softmax = NaN``.
* ``eps-underflow``: an epsilon below the low dtype's smallest normal (``x + 1e-8``,
  ``eps=1e-12``) in an op that runs in fp16: it rounds to zero or a subnormal and no longer
  guards the division or square root after it.
* ``matmul-alignment``: an fp16/bf16 matmul or convolution with a reduction or output
  dimension that is not a multiple of 8 (tensor cores need it), weighted by its share of the
  graph's low-precision FLOPs. Given only for a module on CUDA (or ``device="cuda"``): the
  advice is about tensor cores, which a CPU does not have.
* ``fp16-param-grad``: an fp16 parameter that requires grad; ``GradScaler.unscale_`` refuses
  fp16 gradients ("Attempting to unscale FP16 gradients").

Lints read dtypes and shapes from ``node.meta["val"]`` (convert with example inputs); without
them only the rules that need no shapes run.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Iterator

import torch
import torch.fx as fx

from ..graph.meta import CONVERTED_KEY, cast_info, decision
from ..graph.queries import attr_at, cast_source
from ..policy.opkey import op_key
from ..runtime.weight_table import entry_nodes

__all__ = ["lint", "Lint"]

_LOW = (torch.float16, torch.bfloat16)
_EPS_OPS = frozenset({"add", "sub", "rsub", "clamp", "clamp_min", "clip", "maximum", "max",
                      "layer_norm", "native_layer_norm", "rms_norm", "group_norm",
                      "native_group_norm", "batch_norm", "instance_norm", "normalize",
                      "__add__", "__radd__", "__sub__", "iadd"})
_MATMULS = frozenset({"linear", "matmul", "mm", "bmm", "addmm", "baddbmm", "addbmm"})
_CONVS = frozenset({"conv1d", "conv2d", "conv3d", "convolution", "_convolution",
                    "conv_transpose1d", "conv_transpose2d", "conv_transpose3d"})


@dataclasses.dataclass(frozen=True)
class Lint:
    """One finding: the rule, the node it concerns, what is wrong and how to fix it."""

    rule: str
    node: str
    message: str
    fix: str
    flops_share: float | None = None
    """``matmul-alignment`` only: this node's share of the graph's fp16/bf16 matmul FLOPs."""

    def __str__(self) -> str:
        return f"[{self.rule}] {self.node}: {self.message}\n    fix: {self.fix}"


def lint(gm: fx.GraphModule, *, grad_scaler: bool | None = None,
         device: torch.device | str | None = None) -> list[Lint]:
    """Check a GraphModule made by :func:`amprewrite.convert` for fp16/bf16 pitfalls.

    Args:
        gm: the converted module.
        grad_scaler: whether gradients will go through ``torch.amp.GradScaler`` (checks fp16
            parameters that require grad); default: when the graph's low dtype is fp16.
        device: the device the module will run on, which decides the advice that depends on
            it (``matmul-alignment`` is CUDA's); default: the device of its parameters, else
            of its example inputs, else the CPU.

    Returns:
        A list of :class:`Lint`, each printable; empty when nothing was found.
    """
    meta = getattr(gm, "meta", None)
    if not isinstance(gm, fx.GraphModule) or not isinstance(meta, dict) \
            or CONVERTED_KEY not in meta:
        what = "a GraphModule not made by amprewrite.convert" if isinstance(gm, fx.GraphModule) \
            else type(gm).__name__
        raise TypeError(
            f"amprewrite.lint expects a GraphModule returned by amprewrite.convert, got {what}; "
            "convert first: amprewrite.lint(amprewrite.convert(model, example_inputs=(x,)))")
    _, low = meta[CONVERTED_KEY]
    if grad_scaler is None:
        grad_scaler = low == torch.float16
    out = list(_constants(gm))
    if advice_device(gm, device) == "cuda":
        out += _alignment(gm)
    if grad_scaler:
        out += _fp16_params(gm)
    return out


# -- helpers -------------------------------------------------------------------------------
def advice_device(gm: fx.GraphModule, device: torch.device | str | None = None) -> str:
    """The device type :func:`lint` gives its advice for: ``device``'s, else that of ``gm``'s
    parameters (or buffers), else that of its example inputs, else ``"cpu"``."""
    if device is not None:
        try:
            return torch.device(device).type
        except (RuntimeError, TypeError):
            raise ValueError(f"amprewrite.lint: device={device!r} is not a device; pass "
                             "'cuda', 'cpu' or a torch.device") from None
    for t in (*gm.parameters(), *gm.buffers()):
        return t.device.type
    for node in gm.graph.find_nodes(op="placeholder"):
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor):
            return val.device.type
    return "cpu"


def _op(node: fx.Node) -> str:
    return op_key(node)


def _dtype(node: fx.Node) -> torch.dtype | None:
    """The dtype ``node`` computes in: its output dtype, else its decision's compute dtype."""
    info = cast_info(node)
    if info is not None:
        return info.dtype
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor):
        return val.dtype
    rec = decision(node)
    return rec.compute_dtype if rec is not None else None


def _scalars(node: fx.Node) -> Iterator[tuple[str, float]]:
    for i, a in enumerate(node.args):
        if isinstance(a, float):
            yield f"argument {i}", a
    for k, a in node.kwargs.items():
        if isinstance(a, float):
            yield k, a


def _becomes_inf(value: float, dtype: torch.dtype) -> bool:
    # Exact: rounds the constant as the cast would (fp32's min rounds to -inf in bf16 too).
    return bool(torch.tensor(value, dtype=torch.float64).to(dtype).isinf())


def _low_consumer(node: fx.Node) -> torch.dtype | None:
    """The low dtype a fp32 result is cast to by a direct user, if any."""

    for user in node.users:
        src = cast_source(user)
        if src is not None and src[0] is node and src[1] in _LOW:
            return src[1]
    return None


def _torch_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _name(dtype: torch.dtype) -> str:
    return {torch.float16: "fp16", torch.bfloat16: "bf16"}.get(dtype, str(dtype))


def _constants(gm: fx.GraphModule) -> Iterator[Lint]:
    for node in gm.graph.nodes:
        if not node.op.startswith("call") or cast_info(node) is not None:
            continue
        dtype = _dtype(node)
        target = dtype if dtype in _LOW else _low_consumer(node)
        if target is None:
            continue
        op = _op(node)
        for where, value in _scalars(node):
            if math.isfinite(value) and _becomes_inf(value, target):
                ran = "runs in" if dtype == target else "is cast to"
                low = _name(target)
                yield Lint(
                    "fill-overflow", node.name,
                    f"{op} uses the constant {value:g} ({where}), which overflows {low} "
                    f"(this op {ran} {low}): fills raise 'value cannot be converted to type "
                    f"... without overflow', arithmetic makes it {'-inf' if value < 0 else 'inf'}"
                    " and a fully masked softmax row NaN.",
                    f"fill with a value that fits {low} (torch.finfo(torch.{_torch_name(target)})"
                    f".min, or -1e4); NB: torch.finfo(x.dtype).min is captured as fp32's. Or "
                    f"keep the op in fp32: Policy().override(nodes={{{node.name!r}: "
                    "OpCategory.FP32})")
            elif (dtype in _LOW and (op in _EPS_OPS or where == "eps")
                  and 0 < abs(value) < torch.finfo(dtype).tiny):
                tiny = torch.finfo(dtype).tiny
                yield Lint(
                    "eps-underflow", node.name,
                    f"{op} adds the epsilon {value:g} ({where}) in {_name(dtype)}, below its "
                    f"smallest normal {tiny:.3g}: it "
                    f"{'rounds to 0' if _becomes_zero(value, dtype) else 'becomes subnormal'}"
                    " and no longer guards the division or square root after it.",
                    f"run this op in fp32: Policy().override(nodes={{{node.name!r}: "
                    f"OpCategory.FP32}}), or use an epsilon >= {tiny:.3g}")


def _becomes_zero(value: float, dtype: torch.dtype) -> bool:
    return bool(torch.tensor(value, dtype=torch.float64).to(dtype) == 0)


def _shape(a: Any) -> tuple[int, ...] | None:
    val = a.meta.get("val") if isinstance(a, fx.Node) else None
    if not isinstance(val, torch.Tensor):
        return None
    try:
        return tuple(int(d) for d in val.shape)
    except Exception:  # symbolic sizes: no static alignment check
        return None


def _weight_shape(gm: fx.GraphModule, a: Any) -> tuple[int, ...] | None:
    shape = _shape(a)
    if shape is not None or not isinstance(a, fx.Node):
        return shape
    # A weight cast: _amp_weight_cache.cast(w, dtype), or a get_attr.
    src = cast_source(a)
    node = src[0] if src is not None else a
    if isinstance(node, fx.Node) and node.op == "get_attr":
        obj = attr_at(gm, str(node.target), None)
        return tuple(obj.shape) if isinstance(obj, torch.Tensor) else None
    return _shape(node)


def _mnk(gm: fx.GraphModule, node: fx.Node, op: str) -> tuple[dict[str, int], int] | None:
    """Named dimensions to check and the FLOPs of a matmul/conv node."""
    args = node.args
    if op in _CONVS:
        x, w = _shape(args[0]), _weight_shape(gm, args[1]) if len(args) > 1 else None
        if x is None or w is None:
            return None
        out_val = node.meta.get("val")
        out_numel = out_val.numel() if isinstance(out_val, torch.Tensor) else 0
        transposed = "transpose" in op
        c_in, c_out = (w[0], w[1]) if transposed else (w[1], w[0])
        return {"in_channels": int(c_in), "out_channels": int(c_out)}, \
            2 * int(out_numel) * int(math.prod(w[1:]))
    if op in ("addmm", "baddbmm", "addbmm"):
        args = args[1:]
    a, b = (_shape(args[0]), _weight_shape(gm, args[1])) if len(args) > 1 else (None, None)
    if a is None or b is None or not a or not b:
        return None
    if op == "linear":
        k, n = a[-1], b[0]
    else:
        k, n = a[-1], b[-1] if len(b) > 1 else 1
    m = math.prod(a[:-1]) if len(a) > 1 else 1
    batch = math.prod(b[:-2]) if op != "linear" and len(b) > 2 and len(a) <= 2 else 1
    return {"K": int(k), "N": int(n)}, 2 * int(m) * int(n) * int(k) * int(batch)


def _alignment(gm: fx.GraphModule) -> list[Lint]:
    found = []
    total = 0
    for node in gm.graph.nodes:
        op = _op(node) if node.op.startswith("call") else ""
        if op not in _MATMULS and op not in _CONVS:
            continue
        rec = decision(node)
        dtype = rec.compute_dtype if rec is not None and rec.compute_dtype else _dtype(node)
        if dtype not in _LOW:
            continue
        dims = _mnk(gm, node, op)
        if dims is None:
            continue
        named, flops = dims
        total += flops
        bad = {k: v for k, v in named.items() if v % 8}
        if bad:
            found.append((node, op, dtype, bad, flops))
    out = []
    for node, op, dtype, bad, flops in sorted(found, key=lambda f: -f[4]):
        share = flops / total if total else 0.0
        dims = ", ".join(f"{k}={v}" for k, v in bad.items())
        pads = ", ".join(f"{k}={-(-v // 8) * 8}" for k, v in bad.items())
        out.append(Lint(
            "matmul-alignment", node.name,
            f"{_name(dtype)} {op} with {dims} (not a multiple of 8): tensor cores are not used "
            f"at full rate; {share:.1%} of this graph's fp16/bf16 matmul/conv FLOPs.",
            f"pad to {pads} (e.g. the vocabulary or hidden size), or ignore if its FLOP share "
            f"is small", share))
    return out


def _fp16_params(gm: fx.GraphModule) -> list[Lint]:
    users = entry_nodes(gm)
    out = []
    for name, p in gm.named_parameters():
        if p.dtype == torch.float16 and p.requires_grad:
            out.append(Lint(
                "fp16-param-grad", users.get(name, name),
                f"parameter {name} is fp16 and requires grad: GradScaler.unscale_ raises "
                "'Attempting to unscale FP16 gradients', and fp16 master weights lose small "
                "updates.",
                "keep parameters fp32 (do not call model.half() before convert; amprewrite "
                "casts weights per op), or freeze it: p.requires_grad_(False)"))
    return out
