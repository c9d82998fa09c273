"""The first lines of ``explain``, ``audit`` and ``demo``: what was converted, on what, how.

Collection (:func:`graph_facts`, :func:`count_forward_casts`: plain dicts) is apart from
presentation (:func:`summary_lines`). Example (the demo's Llama)::

    model: LlamaLogits
    hardware: cpu: AVX2 (no avx512_bf16, no AMX); no fast bf16 kernels here
    policy: default (CUDA AMP rules), low dtype bf16
    ops: 10 bf16, 8 fp32, 99 passthrough (117 op nodes)
    casts: 14 cast nodes, 8 of weights (kept copies in inference, one cast per forward in training)
    cast kernels in one forward: 15, torch.autocast's on the same input: 18
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Callable

import torch
import torch.fx as fx
import torch.nn as nn

from .cast_count import count_casts
from .capture.converted import CONVERTED_KEY, MODEL_KEY
from .capture.guards import is_input_guards
from .graph.meta import cast_info, decision
from .graph.subgraphs import nodes_with_bodies
from .hardware import describe, model_device, slow_reason
from .passes.opt_levels import OPT_LEVEL_KEY
from .policy.policy import Policy
from .policy.tables import OpCategory

__all__ = ["graph_facts", "count_forward_casts", "summary_lines", "precision_of",
           "short_dtype"]


def short_dtype(dtype: Any) -> str:
    """``torch.bfloat16`` → ``"bf16"``; other dtypes by their torch name; None → ``"-"``."""
    if not isinstance(dtype, torch.dtype):
        return "-"
    names = {torch.float16: "f16", torch.bfloat16: "bf16", torch.float32: "f32",
             torch.float64: "f64", torch.int64: "i64", torch.int32: "i32", torch.bool: "bool",
             torch.float8_e4m3fn: "e4m3", torch.float8_e5m2: "e5m2"}
    return names.get(dtype, str(dtype).replace("torch.", ""))


def precision_of(node: fx.Node, low: torch.dtype) -> str | None:
    """``"low"``, ``"fp32"`` or ``"passthrough"``: what an op node computes in (None for
    nodes without a decision)."""
    rec = decision(node)
    if rec is None or is_input_guards(node):
        return None
    if rec.category == OpCategory.LOWER or rec.compute_dtype == low:
        return "low"
    if rec.category == OpCategory.FP32 or rec.compute_dtype == torch.float32:
        return "fp32"
    return "passthrough"


def policy_of(gm: fx.GraphModule) -> tuple[Policy, torch.dtype] | None:
    """The policy and low dtype ``gm`` was converted with: O1's, or the rules of opt level
    O2/O3 (None for O0, which decides nothing, and for modules amprewrite did not convert)."""
    if CONVERTED_KEY in gm.meta:
        return gm.meta[CONVERTED_KEY]
    level = gm.meta.get(OPT_LEVEL_KEY)
    if level is None or level.dtype is None:
        return None
    return Policy(preset=level.level, dtype=level.dtype), level.dtype


def graph_facts(gm: fx.GraphModule) -> dict[str, Any]:
    """What a converted graph is, as plain data: model, hardware, policy, ops per precision,
    cast nodes and how many of them cast weights."""
    policy, low = policy_of(gm)  # type: ignore[misc]  # callers pass converted graphs
    inputs = tuple(n.meta.get("val") for n in gm.graph.find_nodes(op="placeholder"))
    device = model_device(gm, inputs, None)
    nodes = list(nodes_with_bodies(gm))
    ops = Counter(p for p in (precision_of(n, low) for n in nodes) if p is not None)
    casts = [info for info in map(cast_info, nodes) if info is not None]
    return {"model": gm.meta.get(MODEL_KEY, type(gm).__name__),
            "hardware": describe(device), "fast_low_dtype": slow_reason(device, low) is None,
            "policy": policy.summary(), "low_dtype": short_dtype(low),
            "ops": {k: ops.get(k, 0) for k in ("low", "fp32", "passthrough")},
            "cast_nodes": len(casts), "weight_cast_nodes": sum(c.weight for c in casts)}


def count_forward_casts(model: nn.Module, call: Callable[[], Any], inputs: tuple,
                        kwargs: dict[str, Any] | None, dtype: torch.dtype) -> dict[str, int]:
    """Cast kernels of one forward: ``call()`` (the converted model) and ``model`` under
    ``torch.autocast`` on the same input, counted by :class:`~amprewrite.cast_count.CastCounter`
    (exact on any machine). Runs with gradients, as a training forward does."""
    device = model_device(model, inputs, kwargs)
    ours = count_casts(call)

    def autocast_forward() -> Any:
        with torch.autocast(device.type, dtype=dtype):
            return model(*inputs, **(kwargs or {}))

    return {"converted": ours.kernels, "autocast": count_casts(autocast_forward).kernels}


def summary_lines(facts: dict[str, Any], casts: dict[str, int] | None = None) -> list[str]:
    """The summary as text lines (:func:`graph_facts` and, if measured, the cast kernels of
    :func:`count_forward_casts`)."""
    low = facts["low_dtype"]
    slow = "" if facts["fast_low_dtype"] else \
        f"; no fast {low} kernels here, expect it slower than fp32"
    ops = facts["ops"]
    lines = [f"casts: {facts['cast_nodes']} cast nodes, {facts['weight_cast_nodes']} of "
             "weights (kept copies in inference, one cast per forward in training)"]
    if casts is not None:
        lines.append(f"cast kernels in one forward: {casts['converted']}, torch.autocast's on "
                     f"the same input: {casts['autocast']}")
    return [f"model: {facts['model']}",
            f"hardware: {facts['hardware']}{slow}",
            f"policy: {facts['policy']}, low dtype {low}",
            f"ops: {ops['low']} {low}, {ops['fp32']} fp32, {ops['passthrough']} passthrough "
            f"({sum(ops.values())} op nodes)", *lines]
