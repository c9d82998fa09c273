"""Library ops that bring their own autocast kernel, run under it in a rewritten graph.

Some libraries register an autocast kernel for their C++ ops (torchvision's ``roi_align``
and ``nms``: cast the floating inputs to fp32, run, cast the result back to the input's
dtype). No table of ours lists them, and a rewritten graph runs with autocast off (its
casts are explicit), so such an op would meet the low dtype its CPU kernel refuses
("roi_align_forward_kernel not implemented for 'BFloat16'"), where eager autocast runs its
own kernel. Each call is therefore made through :class:`UnderOwnAutocast`, which enters the
autocast that eager would have active around that one call. Before::

    roi_align = torch.ops.torchvision.roi_align(features_bf16, rois, 0.03125, 7, 7, 2, False)

After::

    roi_align = roi_align_under_autocast(features_bf16, rois, 0.03125, 7, 7, 2, False)

``F.multi_head_attention_forward``, which Dynamo records as one call, runs the same way: its
projections and batched matmuls are lowered by autocast inside it, where no cast around the
call reaches (:data:`_KEPT_WHOLE`).

The wrapper keeps the op's name for the policy (``callable_key`` reads ``_opoverload``), and
the passes compute its output dtype by running it, autocast kernel included, on fake
tensors: the op's own kernel decides its dtypes, bit for bit as under eager autocast.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.fx as fx

from ..graph.meta import META_KEY, decision

__all__ = ["UnderOwnAutocast", "own_autocast_kernel", "wrap_own_autocast_kernels",
           "describe_own_autocast_kernels"]

_KEYS = {"cpu": "AutocastCPU", "cuda": "AutocastCUDA"}
_OURS = ("aten", "prims")


def _op_name_of(target: Any) -> str:
    if isinstance(target, torch._ops.OpOverload):
        return target.name()
    if isinstance(target, torch._ops.OpOverloadPacket):
        return target._qualified_op_name
    return getattr(target, "__name__", type(target).__name__)


def _op_name(node: fx.Node) -> str | None:
    """``"namespace::name[.overload]"`` of an op call (Dynamo records the packet,
    ``torch.ops.torchvision.roi_align``; export the overload); None for anything else."""
    if node.op != "call_function" or not isinstance(
            node.target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return None
    return _op_name_of(node.target)


_KEPT_WHOLE = (torch.nn.functional.multi_head_attention_forward,)
"""Python composites that Dynamo records as one call instead of inlining them: eager autocast
lowers the ops inside them (the projections, the batched matmuls), which no cast around the
call can reproduce, so they too run under autocast, their ops as autocast runs them."""


def own_autocast_kernel(node: fx.Node) -> tuple[str, str] | None:
    """``(device type, dispatch key)`` when ``node`` calls another library's op that has an
    autocast kernel, or a composite of :data:`_KEPT_WHOLE`, on the one device of its floating
    inputs; else None."""
    kept_whole = node.op == "call_function" and node.target in _KEPT_WHOLE
    name = _op_name(node)
    if not kept_whole and (name is None or name.split("::")[0] in _OURS):
        return None
    devices = {v.device.type for v in (a.meta.get("val") for a in node.all_input_nodes)
               if isinstance(v, torch.Tensor) and v.is_floating_point()}
    if len(devices) != 1:
        return None
    device = devices.pop()
    key = _KEYS.get(device)
    if key is None or not (kept_whole or
                           torch._C._dispatch_has_kernel_for_dispatch_key(name, key)):
        return None
    return device, key


class UnderOwnAutocast:
    """``op`` called inside ``torch.autocast(device_type, dtype)``, so that its library's
    autocast kernel runs (see the module docstring)."""

    def __init__(self, op: Any, device_type: str, dtype: torch.dtype, key: str) -> None:
        self._opoverload = op
        self.device_type = device_type
        self.dtype = dtype
        self.key = key
        op_name = _op_name_of(op).split("::")[-1].split(".")[0]
        self.__name__ = f"{op_name}_under_autocast"
        self.__module__ = __name__

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with torch.autocast(self.device_type, dtype=self.dtype):
            return self._opoverload(*args, **kwargs)

    def __repr__(self) -> str:
        return (f"UnderOwnAutocast({_op_name_of(self._opoverload)}, {self.device_type!r}, "
                f"{self.dtype})")


def wrap_own_autocast_kernels(gm: fx.GraphModule, dtype: torch.dtype,
                              device_type: str | None) -> int:
    """Call each library op with its own autocast kernel through :class:`UnderOwnAutocast`
    of ``dtype`` on its device; only on ``device_type`` when given (the device a preset
    casts on). Run before the passes, so that they see the dtypes that kernel gives.
    Returns how many calls were wrapped."""
    wrapped = 0
    for node in gm.graph.nodes:
        found = own_autocast_kernel(node)
        if found is None or (device_type is not None and found[0] != device_type):
            continue
        node.target = UnderOwnAutocast(node.target, found[0], dtype, found[1])
        wrapped += 1
    if wrapped:
        gm.recompile()
    return wrapped


def describe_own_autocast_kernels(gm: fx.GraphModule) -> None:
    """Name the kernel in the decision records of the wrapped calls (``explain()``): the
    policy leaves them as they come, their own autocast kernel decides."""
    for node in gm.graph.nodes:
        target = node.target
        rec = decision(node)
        if isinstance(target, UnderOwnAutocast) and rec is not None:
            what = "kept whole by Dynamo, its ops" if target._opoverload in _KEPT_WHOLE \
                else f"its own {target.key} kernel"
            node.meta[META_KEY] = dataclasses.replace(
                rec, rule=f"{what} under autocast({target.device_type!r}, {target.dtype})")
