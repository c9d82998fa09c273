"""Activation checkpoints in Dynamo graphs: converted inside, and still recomputed.

Dynamo records ``torch.utils.checkpoint.checkpoint(block, h, use_reentrant=False)`` as a
``tag_activation_checkpoint`` higher-order op whose body is a child GraphModule. The passes
see one flat graph, so the body is inlined first, each of its nodes tagged with its region
(``CHECKPOINT_KEY``); after the passes, each region's nodes, with the casts inserted only for
them, move back into a body called by the same op with the same arguments. Backward then
recomputes the converted body, casts included, as eager checkpointing under autocast does.

Before the passes (Dynamo's graph)::

    h = torch._C._nn.linear(l_x_, l_w_in, l_b_in)
    tag_activation_checkpoint = torch.ops.higher_order.tag_activation_checkpoint(
        wrap_body_0, h, l_w1, l_b1, use_reentrant = False)
    h_1 = tag_activation_checkpoint[0]

After (``wrap_body_0``'s code: ``l_w1_bf16 = l_w1.to(torch.bfloat16); ...;
linear = torch._C._nn.linear(h, l_w1_bf16, l_b1_bf16); ...``)::

    h = torch._C._nn.linear(l_x__bf16, l_w_in_bf16, l_b_in_bf16)
    tag_activation_checkpoint = torch.ops.higher_order.tag_activation_checkpoint(
        wrap_body_0, h, l_w1, l_b1, use_reentrant = False)
    getitem = tag_activation_checkpoint[0]

A checkpoint nested in another joins the outer one. Where the passes leave a region's nodes
in pieces that one call cannot compute, the region stays inlined, with a warning: values and
gradients are unchanged, its activations are kept for backward.

**torch.export** (``convert`` with example inputs) has no such op: non-strict export runs
``checkpoint``'s Python and records the checkpointed function's ops as ordinary nodes, so
the converted module keeps their activations for backward and recomputes nothing. That
costs memory without a sign, so :class:`CheckpointSites` watches the trace for it: an op
called while ``checkpoint``'s saved-tensor hooks are the innermost ones (what non-reentrant
checkpointing, the default of PyTorch and transformers, installs) runs inside a checkpoint,
and the first Python frame outside torch is where the model called it. The capture warns,
naming those places and the two ways to keep checkpointing.
"""

from __future__ import annotations

import dataclasses
import sys
import warnings
from typing import Any

import torch
import torch.fx as fx

from ..errors import user_stacklevel
from ..graph.meta import cast_info
from ..graph.queries import cast_source
from ..graph.subgraphs import NotConvex, inline_body, outline
from .facts import CHECKPOINT_KEY

__all__ = ["CheckpointRegion", "inline_checkpoints", "outline_checkpoints", "CheckpointSites"]

CHECKPOINT_HOP = torch.ops.higher_order.tag_activation_checkpoint


@dataclasses.dataclass
class CheckpointRegion:
    """What an inlined checkpoint call needs to be made again: its body's name, keyword
    arguments (``use_reentrant``, ``context_fn``, ...) and the call node's metadata."""

    name: str
    kwargs: dict[str, Any]
    meta: dict[str, Any]


def inline_checkpoints(gm: fx.GraphModule) -> list[CheckpointRegion]:
    """Inline every ``tag_activation_checkpoint`` of ``gm`` (nested ones too), tagging the
    nodes with the index of their outermost region in the returned list."""
    regions: list[CheckpointRegion] = []
    while True:
        node = next((n for n in gm.graph.nodes
                     if n.op == "call_function" and n.target is CHECKPOINT_HOP), None)
        if node is None:
            return regions
        index = node.meta.get(CHECKPOINT_KEY)
        if index is None:
            index = len(regions)
            regions.append(CheckpointRegion(str(node.args[0].target), dict(node.kwargs),
                                            {k: node.meta[k] for k in ("stack_trace",
                                                                        "nn_module_stack")
                                             if k in node.meta}))
        body, *operands = node.args
        inline_body(gm, node, body, operands, (CHECKPOINT_KEY, index))


def outline_checkpoints(gm: fx.GraphModule, regions: list[CheckpointRegion]) -> None:
    """Move each region's nodes, and the casts that feed only them, back into a body called
    by ``tag_activation_checkpoint`` with the region's keyword arguments."""
    for index, region in enumerate(regions):
        members = _members(gm, index)
        if not members:
            continue  # the passes left nothing to compute (an identity block)
        try:
            outline(gm, members, region.name,
                    lambda graph, body, inputs, region=region: _call(graph, body, inputs,
                                                                     region))
        except NotConvex:
            warnings.warn(
                f"amprewrite.backend: the activation checkpoint {region.name} could not be "
                "kept after conversion, so its activations are stored for backward instead "
                "of recomputed (values and gradients are unchanged). Checkpoint the "
                "converted blocks instead: see docs/distributed.md.", stacklevel=user_stacklevel())
            for node in members:  # left inlined: plain nodes of the graph from now on
                node.meta.pop(CHECKPOINT_KEY, None)
    gm.recompile()


def _members(gm: fx.GraphModule, index: int) -> list[fx.Node]:
    """The region's nodes, and every cast whose users are all in the region (the passes
    insert a cast before its consumer without the consumer's region tag)."""
    members = {n for n in gm.graph.nodes if n.meta.get(CHECKPOINT_KEY) == index}
    for node in reversed(gm.graph.nodes):
        if node in members or CHECKPOINT_KEY in node.meta or not node.users:
            continue
        if (cast_info(node) is not None or cast_source(node) is not None) \
                and all(u in members for u in node.users):
            members.add(node)
    return [n for n in gm.graph.nodes if n in members]


def _call(graph: fx.Graph, body: fx.Node, inputs: tuple[fx.Node, ...],
          region: CheckpointRegion) -> fx.Node:
    call = graph.call_function(CHECKPOINT_HOP, (body, *inputs), dict(region.kwargs))
    call.meta.update(region.meta)
    return call


class CheckpointSites(torch.overrides.TorchFunctionMode):
    """While active, collects where the traced model calls ``torch.utils.checkpoint``
    (non-reentrant) as ``"file:line in function"`` strings in :attr:`sites`. Every call runs
    unchanged; the check is one read of the innermost saved-tensor hooks per torch call."""

    def __init__(self) -> None:
        super().__init__()
        self.sites: list[str] = []
        self._hooks: list[Any] = []  # NB: the objects, not ids: ids are reused after a free

    def __torch_function__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        # NB: export traces torch.cond's branches with Dynamo, which traces this mode too:
        # it folds is_dynamo_compiling to True and never sees the C call. (is_compiling
        # would not do: it is True for the whole export.)
        hooks = None if torch.compiler.is_dynamo_compiling() else \
            torch._C._autograd._top_saved_tensors_default_hooks(True)
        if hooks is not None and _is_checkpoint_hook(hooks[0]) \
                and not any(h is hooks[0] for h in self._hooks):
            self._hooks.append(hooks[0])
            site = _call_site()
            if site is not None and site not in self.sites:
                self.sites.append(site)
        return func(*args, **(kwargs or {}))

    def __exit__(self, *exc: Any) -> Any:
        self._hooks.clear()  # they hold the trace's checkpoint frames
        return super().__exit__(*exc)


def _is_checkpoint_hook(pack_hook: Any) -> bool:
    return getattr(pack_hook, "__module__", None) == "torch.utils.checkpoint" \
        and getattr(pack_hook, "__qualname__", "").startswith("_checkpoint_hook.")


TORCH_DIR = torch.__file__.rsplit("/", 1)[0] + "/"
"""Frames in files under it are torch's own, never the user's."""
_CHECKPOINT_FILE = TORCH_DIR + "utils/checkpoint.py"


def _call_site() -> str | None:
    """The innermost frame outside torch above ``torch/utils/checkpoint.py`` on the stack."""
    frame = sys._getframe(1)
    while frame is not None and frame.f_code.co_filename != _CHECKPOINT_FILE:
        frame = frame.f_back
    while frame is not None and (frame.f_code.co_filename.startswith(TORCH_DIR)
                                 or frame.f_code.co_filename.startswith("<")
                                 or frame.f_code.co_filename.endswith("/functools.py")):
        frame = frame.f_back
    if frame is None:
        return None
    return f"{frame.f_code.co_filename}:{frame.f_lineno} in {frame.f_code.co_name}"
