"""The fused fast path of ``nn.MultiheadAttention`` under ``Policy.autocast("cpu")``.

Eager ``nn.MultiheadAttention`` in eval mode runs its fused kernel when nothing needs a
gradient, also under CPU autocast (:mod:`amprewrite.capture.attention`); its composite ops
otherwise. The captured graph holds the composite ops only, so without this step the preset
would compute under ``torch.no_grad()`` what eager computes with gradients, other bits.

For each call the capture recorded as eligible, the step moves the call's ops (after the
other passes: with their casts, but not the casts of the module's weights, which stay in the
forward's weight read) into a sub-graph and calls
:func:`amprewrite.runtime.attention.multi_head_attention` in their place, which runs the
fused kernel where eager would and the sub-graph otherwise.

Before (``Policy.autocast("cpu")``, eval)::

    transpose = torch.transpose(layer_norm, 1, 0)
    transpose_bf16 = transpose.bfloat16()
    linear = torch._C._nn.linear(transpose_bf16, a_in_proj_weight_bf16, a_in_proj_bias_bf16)
    ...
    transpose_5 = torch.transpose(view_6, 1, 0)

After::

    _amp_attention_a = self._amp_attention_a
    multi_head_attention = amprewrite_runtime_attention_multi_head_attention(
        _amp_attention_a, (layer_norm, a_in_proj_weight_bf16, ...), layer_norm,
        a_in_proj_weight_bf16, a_in_proj_bias_bf16, a_out_proj_weight_bf16,
        a_out_proj_bias_bf16, 32, 4, False, True, torch.float32, torch.bfloat16)
"""

from __future__ import annotations


import torch
import torch.fx as fx
import torch.nn as nn

from ..capture.attention import ATTENTION_KEY, AttentionCall
from ..graph.meta import META_KEY, Decision, cast_info
from ..graph.queries import cast_source, module_paths
from ..policy.policy import Policy
from ..policy.tables import OpCategory
from ..runtime.attention import multi_head_attention

__all__ = ["fast_path_attention"]

_CALLS = ("call_function", "call_method", "call_module")
_WEIGHTS = ("in_proj_weight", "in_proj_bias", "out_proj.weight", "out_proj.bias")


def fast_path_attention(gm: fx.GraphModule, policy: Policy, low: torch.dtype) -> bool:
    """Give ``gm``'s eligible attention calls eager's choice of kernel (module docstring);
    only under the CPU autocast preset, whose reference takes it. Whether it changed ``gm``."""
    if policy.preset != "cpu":
        return False
    changed = False
    for call in gm.meta.get(ATTENTION_KEY, ()):
        changed |= _fuse(gm, call, low)
    if changed:
        gm.graph.lint()
        gm.recompile()
    return changed


def _fuse(gm: fx.GraphModule, call: AttentionCall, low: torch.dtype) -> bool:
    graph = gm.graph
    region = [n for n in graph.nodes if n.op in _CALLS and call.path in module_paths(n)
              and not _weight_cast(n)]
    inside = set(region)
    outputs = [n for n in region if any(u not in inside for u in n.users)]
    if len(outputs) != 1 or any(n.meta.get("val") is None for n in region):
        return False  # not one attention output, or dtypes unknown: keep the ops
    inputs = list(dict.fromkeys(a for n in region for a in n.all_input_nodes
                                if a not in inside))
    weights = [_weight(inputs, f"{call.path}.{name}") for name in _WEIGHTS]
    activations = [a for a in inputs if isinstance(a.meta.get("val"), torch.Tensor)
                   and a.op != "get_attr" and cast_info(a) is None]
    if any(w is None for w in weights) or len(activations) != 1 or \
            activations[0].meta["val"].device.type != "cpu":
        return False  # (CPU autocast leaves another device's tensors as they are)
    query = activations[0]
    # NB: eager's fast path wants the query in the dtype of the module's weights (fp32 master
    # weights), not the captured query's: a bf16 query (a LayerNorm or Linear before it under
    # autocast) makes eager decline the fused kernel
    weight_dtype = gm.get_parameter(f"{call.path}.in_proj_weight").dtype
    name = _free_name(gm, "_amp_attention_" + call.path.replace(".", "_"))
    gm.add_submodule(name, _subgraph(region, inputs, outputs[0]).train(gm.training))
    out = outputs[0]
    with graph.inserting_before(out):
        composite = graph.get_attr(name)
        fused = graph.call_function(multi_head_attention, (
            composite, tuple(inputs), query, *weights, call.embed_dim, call.num_heads,
            call.need_weights, call.average_attn_weights, weight_dtype, low))
    fused.meta.update({k: out.meta[k] for k in ("val", "nn_module_stack", "stack_trace")
                       if k in out.meta})
    # NB: passthrough for the other passes: its casts are made (the sub-graph's, and the
    # fused kernel's own, which the call makes as CPU autocast does)
    fused.meta[META_KEY] = Decision(
        op="multi_head_attention", category=OpCategory.PASSTHROUGH, compute_dtype=None,
        rule=f"autocast('cpu'): nn.MultiheadAttention's fused kernel in {_name(low)} where "
             f"eager runs it (eval, no gradient), its ops ({name}) otherwise")
    out.replace_all_uses_with(fused)
    for node in reversed(region):
        graph.erase_node(node)
    return True


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _weight_cast(node: fx.Node) -> bool:
    info = cast_info(node)
    return info is not None and info.weight


def _weight(inputs: list[fx.Node], qualname: str) -> fx.Node | None:
    """The input that is the low-precision cast of the parameter ``qualname``."""
    for a in inputs:
        source = cast_source(a) if _weight_cast(a) else None
        if source is not None and source[0].op == "get_attr" and source[0].target == qualname:
            return a
    return None


def _subgraph(region: list[fx.Node], inputs: list[fx.Node], out: fx.Node) -> fx.GraphModule:
    """The region's ops as a graph of their inputs, returning ``out``'s value."""
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for a in inputs:
        env[a] = graph.placeholder(a.name)
        if "val" in a.meta:
            env[a].meta["val"] = a.meta["val"]
    for node in region:
        env[node] = graph.node_copy(node, lambda a: env[a])
    graph.output(env[out])
    return fx.GraphModule(nn.Module(), graph, class_name="Attention")


def _free_name(gm: fx.GraphModule, name: str) -> str:
    taken, candidate, i = set(dict(gm.named_modules())) | set(gm.__dict__), name, 0
    while candidate in taken:
        i += 1
        candidate = f"{name}_{i}"
    return candidate
