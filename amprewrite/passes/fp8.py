"""Fp8LinearPass: the linear layers a policy's fp8 rules select become fp8 matmuls.

Runs after :class:`InsertCastsPass` under ``Policy.fp8(...)`` (the bf16 policy plus
:class:`amprewrite.policy.fp8.Fp8Rules`). Each selected ``linear`` node (weight a parameter,
op classified ``lower``) is replaced by explicit steps, all functions of
:mod:`amprewrite.runtime.fp8`: the amax of the input and of the fp32 master weight, a scale
from each (computed on the device: no host sync), the e4m3 quantisation of each, the scaled
matmul with a bf16 output, the autograd node whose backward runs the two gradient matmuls
in fp8 (e5m2 gradient), and the bias added in bf16. The input is quantised from the value
the bf16 cast read (one rounding, not two), and one quantisation of a value is shared by
every linear that reads it (q, k and v projections). The bf16 casts nobody reads any more
are left to :class:`EliminateCastsPass` (dead casts).

Linears the rules skip keep their bf16 decision, with the reason in its ``fp8`` field
(``"fp8 skipped: last linear"``), which ``explain()`` appends to the rule.

Before (``Policy.fp8()``'s bf16 rules; export capture)::

    x_bf16 = x.to(torch.bfloat16)
    fc_weight_bf16 = _amp_weight_cache.cast(fc_weight, torch.bfloat16)
    fc_bias_bf16 = _amp_weight_cache.cast(fc_bias, torch.bfloat16)
    linear = torch.ops.aten.linear.default(x_bf16, fc_weight_bf16, fc_bias_bf16)

After::

    fc_bias_bf16 = _amp_weight_cache.cast(fc_bias, torch.bfloat16)
    x_amax = amprewrite_runtime_fp8_amax(x)
    x_scale = amprewrite_runtime_fp8_scale(x_amax, torch.float8_e4m3fn)
    x_e4m3 = amprewrite_runtime_fp8_quantize(x, x_scale, torch.float8_e4m3fn)
    fc_weight_amax = amprewrite_runtime_fp8_amax(fc_weight)
    fc_weight_scale = amprewrite_runtime_fp8_scale(fc_weight_amax, torch.float8_e4m3fn)
    fc_weight_e4m3 = amprewrite_runtime_fp8_quantize(fc_weight, fc_weight_scale, torch.float8_e4m3fn)
    linear_scaled_mm = amprewrite_runtime_fp8_scaled_mm(x_e4m3, fc_weight_e4m3, x_scale, fc_weight_scale, torch.bfloat16, pad_to = 16)
    linear_fp8_grad = amprewrite_runtime_fp8_fp8_linear_grad(linear_scaled_mm, x, fc_weight, x_e4m3, x_scale, fc_weight_e4m3, fc_weight_scale, pad_to = 16)
    linear_bias = torch.add(linear_fp8_grad, fc_bias_bf16)

Every scaled matmul, forward and backward, is valid for CUDA's ``torch._scaled_mm`` whatever
the token count: ``pad_to = 16`` pads the shared dimension and the output columns with zeros
where they are not multiples of 16 (:func:`amprewrite.runtime.fp8.scaled_mm_2d`).

NB: only ``linear`` nodes are rewritten; a model that calls ``x @ w.t()`` on a parameter
itself, or a capture that lowered ``linear`` to ``addmm`` (``run_decompositions``), keeps
those matmuls in bf16.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch
import torch.fx as fx
from torch.fx.passes.infra.pass_base import PassBase, PassResult

from ..capture.facts import GRAD_KEY
from ..graph.fake import fake_run
from ..graph.meta import META_KEY, Fp8Step, cast_info, decision
from ..graph.queries import attr_at, cast_source, module_paths
from ..policy.fp8 import Fp8Rules, fp8_verdict
from ..policy.policy import Policy
from ..policy.tables import OpCategory
from ..runtime import fp8 as rt

__all__ = ["Fp8LinearPass"]

class Fp8LinearPass(PassBase):
    """Replace the fp8-eligible ``linear`` nodes with explicit fp8 steps (see module doc)."""

    def __init__(self, policy: Policy) -> None:
        super().__init__()
        self.rules: Fp8Rules | None = policy.fp8_rules

    def call(self, gm: fx.GraphModule) -> PassResult:
        if self.rules is None:
            return PassResult(gm, False)
        self.gm, self.graph = gm, gm.graph
        self.shared: dict[fx.Node, tuple[fx.Node, fx.Node]] = {}
        linears = [n for n in gm.graph.nodes if (d := decision(n)) is not None
                   and d.op == "linear"]
        modified = False
        for i, node in enumerate(linears):
            rec = decision(node)
            assert rec is not None
            if rec.category is not OpCategory.LOWER or rec.fp8:
                continue
            position = "first" if i == 0 else "last" if i == len(linears) - 1 else None
            weight = self._weight(node)
            if weight is None:
                ok, why = False, "fp8 skipped: weight is not a parameter"
            else:
                ok, why = fp8_verdict(self.rules, self._path(node, weight),
                                      tuple(self._attr(weight).shape), position)
            if ok:
                self._rewrite(node, weight, why)  # type: ignore[arg-type]
            else:
                node.meta[META_KEY] = dataclasses.replace(rec, fp8=why)
            modified = True
        return PassResult(gm, modified)

    # -- what a linear reads ---------------------------------------------------------------
    def _attr(self, node: fx.Node) -> Any:
        return attr_at(self.gm, str(node.target))

    def _weight(self, node: fx.Node) -> fx.Node | None:
        """The ``get_attr`` of the linear's fp32 master weight (behind its bf16 cast)."""
        arg = node.args[1] if len(node.args) > 1 else node.kwargs.get("weight")
        if isinstance(arg, fx.Node) and cast_info(arg) is not None:
            arg = cast_source(arg)[0]  # type: ignore[index]
        if not (isinstance(arg, fx.Node) and arg.op == "get_attr"):
            return None
        value = self._attr(arg)
        ok = isinstance(value, torch.nn.Parameter) and value.dtype == torch.float32 \
            and value.dim() == 2
        return arg if ok else None

    @staticmethod
    def _path(node: fx.Node, weight: fx.Node) -> str:
        paths = module_paths(node)
        return paths[-1] if paths else str(weight.target).rpartition(".")[0]

    @staticmethod
    def _source(x: fx.Node) -> fx.Node:
        """An activation behind our own bf16 cast is quantised from the value it cast."""
        info = cast_info(x)
        if info is not None and not info.weight:
            src = cast_source(x)
            if src is not None and isinstance(src[0], fx.Node):
                return src[0]
        return x

    # -- the rewrite -------------------------------------------------------------------------
    def _rewrite(self, node: fx.Node, weight: fx.Node, rule: str) -> None:
        x = self._source(node.args[0])  # type: ignore[arg-type]
        bias = node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
        with self.graph.inserting_before(node):
            x_scale, x_q = self._quantized(x, node)
            w_scale, w_q = self._quantized(weight, node)
            # pad_to: CUDA's shape rules for every scaled matmul (runtime.fp8.scaled_mm_2d)
            pad = {"pad_to": rt.CUDA_MULTIPLE}
            mm = self._new(rt.scaled_mm, (x_q, w_q, x_scale, w_scale, torch.bfloat16),
                           f"{node.name}_scaled_mm", node, Fp8Step("matmul", torch.bfloat16, rule),
                           pad)
            out = self._new(rt.fp8_linear_grad, (mm, x, weight, x_q, x_scale, w_q, w_scale),
                            f"{node.name}_fp8_grad", node, Fp8Step("grad", None), pad)
            if bias is not None:
                out = self._new(torch.add, (out, bias), f"{node.name}_bias", node,
                                Fp8Step("bias", torch.bfloat16))
        node.replace_all_uses_with(out)
        self.graph.erase_node(node)

    def _quantized(self, value: fx.Node, near: fx.Node) -> tuple[fx.Node, fx.Node]:
        """``(scale, e4m3)`` nodes of ``value``, made once per value."""
        if value not in self.shared:
            # NB: right after the value, so that every linear reading it can share them; a
            # weight's before its (first) linear; an input's after the last input.
            if value.op == "get_attr":
                ctx = self.graph.inserting_before(near)
            elif value.op == "placeholder":
                ctx = self.graph.inserting_after(list(self.graph.find_nodes(op="placeholder"))[-1])
            else:
                ctx = self.graph.inserting_after(value)
            with ctx:
                a = self._new(rt.amax, (value,), f"{value.name}_amax", near,
                              Fp8Step("amax", None))
            with self.graph.inserting_after(a):
                s = self._new(rt.scale, (a, rt.E4M3), f"{value.name}_scale", near,
                              Fp8Step("scale", rt.E4M3))
            with self.graph.inserting_after(s):
                q = self._new(rt.quantize, (value, s, rt.E4M3), f"{value.name}_e4m3", near,
                              Fp8Step("quantize", rt.E4M3))
            self.shared[value] = (s, q)
        return self.shared[value]

    def _new(self, target: Callable, args: tuple, name: str, near: fx.Node,
             step: Fp8Step, kwargs: dict[str, Any] | None = None) -> fx.Node:
        node = self.graph.create_node("call_function", target, args, kwargs, name=name)
        node.meta[META_KEY] = step
        for key in ("nn_module_stack", "stack_trace", GRAD_KEY):
            if key in near.meta:
                node.meta[key] = near.meta[key]
        if all("val" in a.meta for a in node.all_input_nodes if a.op != "get_attr"):
            try:
                node.meta["val"] = fake_run(self.gm, node)
            except Exception:  # no fake values for this graph: dtypes are not needed here
                pass
        return node
