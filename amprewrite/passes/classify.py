"""ClassifyPass: give every op node a :class:`~amprewrite.graph.meta.Decision`.

The decision says which category the op falls in under the policy and which rule decided
(an override, the model's own autocast region, or the preset table). It does not touch the
graph's structure; :class:`~amprewrite.passes.insert_casts.InsertCastsPass` acts on it.

Before (``gm.code``, symbolic capture)::

    linear = torch._C._nn.linear(x, l_weight, l_bias)
    softmax = torch.nn.functional.softmax(linear, dim = -1, _stacklevel = 3, dtype = None)

After: unchanged code; ``linear.meta["amprewrite"] == Decision(op="linear",
category=LOWER, compute_dtype=torch.bfloat16, rule="default table")`` and softmax's decision
is ``FP32_DTYPE_ARG``.
"""

from __future__ import annotations

import torch
import torch.fx as fx
from torch.fx.passes.infra.pass_base import PassBase, PassResult

from ..capture.facts import REGION_KEY, Region
from ..errors import AmpRewriteError
from ..graph.meta import META_KEY, Decision
from ..graph.queries import attr_at, module_paths
from ..policy.kernels import has_low_kernel
from ..policy.opkey import is_inplace, op_key, overload_key
from ..policy.policy import Policy
from ..policy.tables import SAME_DTYPE_OPS, OpCategory
from .calibrate import range_rule
from .op_nodes import takes_decision

__all__ = ["ClassifyPass"]


def _device_type(node: fx.Node) -> str | None:
    """The device ``node`` computes on, from its value (None where unknown)."""
    val = node.meta.get("val")
    if isinstance(val, (tuple, list)):
        val = next((v for v in val if isinstance(v, torch.Tensor)), None)
    return val.device.type if isinstance(val, torch.Tensor) else None


def _weights_device_type(node: fx.Node) -> str | None:
    """The device ``node`` computes on, from its value or else from the module attributes it
    reads (a norm's weight or running statistics, known without example inputs)."""
    device = _device_type(node)
    gm = node.graph.owning_module
    if device is not None or gm is None:
        return device
    if node.op == "call_module":  # a leaf layer (the symbolic tracer keeps batch norm whole)
        tensors = list(gm.get_submodule(str(node.target)).state_dict().values())
    else:
        tensors = [_attr(gm, str(a.target)) for a in node.all_input_nodes if a.op == "get_attr"]
    return next((t.device.type for t in tensors if isinstance(t, torch.Tensor)), None)


def _attr(gm: fx.GraphModule, qualname: str) -> object:
    return attr_at(gm, qualname, None)


class ClassifyPass(PassBase):
    """Attach a Decision to every call node, per ``policy`` with low dtype ``dtype``."""

    def __init__(self, policy: Policy, dtype: torch.dtype) -> None:
        super().__init__()
        self.policy = policy
        self.dtype = dtype

    def call(self, gm: fx.GraphModule) -> PassResult:
        modified = False
        for node in gm.graph.nodes:
            if not takes_decision(node):
                continue
            new = self.classify(node)
            old = node.meta.get(META_KEY)
            # A second run keeps the record an earlier run (and InsertCastsPass) completed:
            # only a different category or rule is a change.
            if isinstance(old, Decision) and (old.op, old.category, old.rule) == \
                    (new.op, new.category, new.rule):
                continue
            node.meta[META_KEY] = new
            modified = True
        return PassResult(gm, modified)

    def classify(self, node: fx.Node) -> Decision:
        key = op_key(node)
        override = self._override(node, key)
        if override is not None and override[0] is OpCategory.LOWER:
            self._check_kernel(node, key, override[1])
        category, rule = override or self._category(node, key)
        low = self._region_dtype(node) or self.dtype
        if category is OpCategory.LOWER:
            dtype: torch.dtype | None = low
        elif category in (OpCategory.FP32, OpCategory.FP32_DTYPE_ARG,
                          OpCategory.FP32_APPEND_DTYPE):
            dtype = torch.float32
        elif category is OpCategory.PROMOTE:
            dtype = low  # the floor; InsertCastsPass widens it from the input dtypes
        else:
            dtype = None
        rec = Decision(op=key, category=category, compute_dtype=dtype, rule=rule)
        # The user's overrides have the last word; below them, calibrated ranges
        # (convert(calibrate=...)) can move an op to fp32: see passes/calibrate.py.
        return rec if override is not None else range_rule(node, rec, self.policy, self.dtype)

    def _check_kernel(self, node: fx.Node, key: str, rule: str) -> None:
        device = _device_type(node)
        if device is not None and not has_low_kernel(key, device, self.dtype):
            raise AmpRewriteError(
                f"The {rule} lowers {node.format_node()} to {self.dtype}, but {key} has no "
                f"{self.dtype} kernel on {device}: it would fail at run time. Remove the "
                "override (the op then runs in fp32) or run the model on a device that has "
                "the kernel.")

    def _override(self, node: fx.Node, key: str) -> tuple[OpCategory, str] | None:
        """The user's node, module or op override of ``node``, most specific first."""
        policy = self.policy
        override = policy.node_override(node.name)
        if override is not None:
            return override, f"node override {node.name!r}"
        by_module = policy.module_override(module_paths(node))
        if by_module is not None:
            return by_module
        override = policy.op_override(key)
        if override is not None:
            return override, f"op override {key!r}"
        return None

    def _category(self, node: fx.Node, key: str) -> tuple[OpCategory, str]:
        """The rule below the user's overrides: regions, in-place ops, the tables; an op that
        would pass through but needs its sources in its destination's dtype matches them."""
        category, rule = self._table_category(node, key)
        if category is OpCategory.PASSTHROUGH and key.removesuffix("_") in SAME_DTYPE_OPS:
            return OpCategory.MATCH_SELF, f"{key} requires its sources in its destination's dtype"
        return category, rule

    def _table_category(self, node: fx.Node, key: str) -> tuple[OpCategory, str]:
        policy = self.policy
        region = self._region(node)
        if region is not None and not region.enabled:
            return OpCategory.PASSTHROUGH, f"model's autocast({region.device_type!r}, " \
                                           "enabled=False) region"
        if is_inplace(node):
            return OpCategory.PASSTHROUGH, "in-place op (never cast)"
        by_table = policy.table_rule(key, overload_key(node)) or policy.composite_rule(key)
        category, rule = by_table if by_table is not None else policy.unlisted_rule(key)
        if category is OpCategory.FP32:
            mixed = policy.mixed_input_rule(key, _weights_device_type(node))
            if mixed is not None:
                return mixed
        if category in (OpCategory.LOWER, OpCategory.PASSTHROUGH):
            device = _device_type(node)
            if device is not None and not has_low_kernel(key, device, self.dtype):
                dtype = str(self.dtype).removeprefix("torch.")
                return OpCategory.FP32, f"no {dtype} kernel on {device}"
        return category, rule

    def _region(self, node: fx.Node) -> Region | None:
        """The model's own autocast region around ``node``, if it applies under this policy:
        autocast presets honour only regions of their own device (as torch.autocast does);
        the device-independent default policy honours every region."""
        region = node.meta.get(REGION_KEY)
        if region is None:
            return None
        if self.policy.device_type is not None and region.device_type != self.policy.device_type:
            return None
        return region

    def _region_dtype(self, node: fx.Node) -> torch.dtype | None:
        region = self._region(node)
        return region.dtype if region is not None and region.enabled else None
