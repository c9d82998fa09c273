"""The ATen op sequence a model runs under CUDA autocast, forward and backward, read on fake
CUDA tensors (no GPU): the oracle of bitwise parity with ``torch.autocast("cuda")``.

Two graphs that run the same ATen ops on the same dtypes in the same order compute the same
bits on one device. The sequence of ``(op, input dtypes, output dtype)`` is read in two steps:

1. **Forward, on fake CUDA.** ``make_fx`` traces the model under CUDA autocast (the real
   ``AutocastCUDA`` kernels decide the casts, see ``_fake_cuda``), and the converted module
   with autocast off, both on fake CUDA tensors with the parameters as graph inputs. The
   graphs hold backend ATen ops (composites already split, casts as ``_to_copy``).
2. **Backward, replayed on meta.** Autograd cannot run on fake CUDA tensors (building a
   gradient node asks for a CUDA device), and autocast plays no part in the backward: each
   op's derivative formula depends on the op and the dtypes it saw, not on the device. So
   each forward graph is replayed on meta tensors, parameters requiring grad, and the
   backward of its outputs (seeded with ones) is run; a dispatch mode records every op of
   the replay, forward then backward.

What is compared is what can change a bit: ops that read or write a floating tensor and, in
the forward, depend on the inputs or parameters (ops on constants alone, which
FoldConstantsPass computes once, and dead ops are left out), and a lossless round trip
(``x.float().to(x.dtype)``, which EliminateCastsPass removes) counts as nothing.

NB: autocast caches the low-precision cast of a parameter (an fp32 leaf that requires grad)
for the whole region; parameters cannot require grad on fake CUDA, so the autocast forward
graph casts them once per use and ``_cache_parameter_casts`` merges those casts, as the cache
would have. NB: the replay differentiates the recorded forward ops, so the backward of a
custom ``torch.autograd.Function`` is not its own but that of the ops its forward ran.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
from typing import Any, Callable

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
from _fake_cuda import cuda_autocast, fake_cuda
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map

__all__ = ["OpCall", "FakeCudaModel", "autocast_sequence", "converted_sequence",
           "sequence_diff", "CUDA_BUILD_ONLY"]

CUDA_BUILD_ONLY = pytest.mark.skipif(
    torch.version.cuda is None,
    reason="fake CUDA tensors need a torch built with CUDA support: a CPU-only build cannot "
           "index them or record their autograd graph (the CUDA builds run these without a "
           "GPU)")

_DTYPES = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16",
           torch.float64: "f64", torch.int64: "i64", torch.int32: "i32", torch.bool: "b8",
           torch.uint8: "u8", torch.int8: "i8"}


@dataclasses.dataclass(frozen=True)
class OpCall:
    """One ATen call: the op, its tensor inputs' dtypes, its tensor outputs' dtypes."""

    op: str
    inputs: tuple[torch.dtype, ...]
    outputs: tuple[torch.dtype, ...]
    phase: str
    """``"forward"`` or ``"backward"``."""

    def __str__(self) -> str:
        ins = ", ".join(_DTYPES.get(d, str(d)) for d in self.inputs)
        outs = ", ".join(_DTYPES.get(d, str(d)) for d in self.outputs)
        return f"{self.phase[:3]} {self.op}({ins}) -> {outs}"


@dataclasses.dataclass
class FakeCudaModel:
    """A model whose parameters and buffers are fake CUDA tensors (none requires grad), with
    its example inputs on fake CUDA, all in one ``FakeTensorMode``."""

    model: nn.Module
    inputs: tuple[Any, ...]
    kwargs: dict[str, Any]
    mode: FakeTensorMode
    leaves: Callable[[Any], list[torch.Tensor]]
    """The output tensors of a forward's result, in a fixed order."""

    @classmethod
    def of(cls, model: nn.Module, inputs: tuple[Any, ...], kwargs: dict[str, Any] | None = None,
           leaves: Callable[[Any], list[torch.Tensor]] | None = None) -> "FakeCudaModel":
        """``model`` moved to fake CUDA in place (build a fresh one per call)."""
        mode = FakeTensorMode(allow_non_fake_inputs=True)
        model = model.requires_grad_(False)
        model._apply(lambda t: fake_cuda(mode, t))
        return cls(model, fake_cuda(mode, inputs), fake_cuda(mode, kwargs or {}), mode,
                   leaves or _tensor_leaves)

    def state(self, module: nn.Module) -> dict[str, torch.Tensor]:
        """``module``'s parameters and buffers by name (those of ``self.model``, shared)."""
        return {**dict(module.named_parameters(remove_duplicate=False)),
                **dict(module.named_buffers(remove_duplicate=False))}

    def parameter_names(self) -> set[str]:
        return {n for n, p in self.model.named_parameters(remove_duplicate=False)
                if p.is_floating_point()}


def _tensor_leaves(out: Any) -> list[torch.Tensor]:
    return [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]


def _forward_graph(fake: FakeCudaModel, module: nn.Module,
                   context: Callable[[], Any]) -> tuple[fx.GraphModule, list[str]]:
    """``module``'s forward as an ATen graph of (state..., inputs...) on fake CUDA."""
    state = fake.state(module)
    names = list(state)
    n = len(names)

    def forward(*flat: Any) -> Any:
        with context():
            out = torch.func.functional_call(
                module, dict(zip(names, flat[:n])), flat[n:], fake.kwargs, tie_weights=False)
        return fake.leaves(out)

    args = [*state.values(), *[x for x in fake.inputs]]
    with fake.mode:
        gm = make_fx(forward, tracing_mode="real")(*args)
    # Ops whose results nothing reads (integer index arithmetic a mask function computes and
    # drops) compute no bit of the result; torch.export drops them.
    gm.graph.eliminate_dead_code()
    gm.recompile()
    return gm, names


def _cache_parameter_casts(gm: fx.GraphModule, parameters: list[fx.Node],
                           low: torch.dtype) -> None:
    """Merge the casts of one parameter to ``low``: autocast's cast cache (module NB)."""
    for param in parameters:
        first: dict[tuple, fx.Node] = {}
        for user in list(param.users):
            if user.target is not torch.ops.aten._to_copy.default or \
                    user.kwargs.get("dtype") is not low:
                continue
            key = (user.args, tuple(sorted(user.kwargs.items(), key=str)))
            if key in first:
                user.replace_all_uses_with(first[key])
                gm.graph.erase_node(user)
            else:
                first[key] = user
    gm.recompile()


class _Recorder(TorchDispatchMode):
    """Records the ops that touch floating tensors. In the forward, only ops of nodes that
    depend on the inputs or parameters (``counted``): a computation on constants alone (a
    causal mask built from ``arange``) is folded by FoldConstantsPass into its value."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[OpCall] = []
        self.phase = "forward"
        self.counted = True

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        ins = tuple(t.dtype for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor))
        outs = tuple(t.dtype for t in tree_leaves(out) if isinstance(t, torch.Tensor))
        # NB: an op on integers and booleans alone (index arithmetic, masks) rounds nothing.
        if self.counted and any(d.is_floating_point for d in ins + outs):
            self.calls.append(OpCall(f"{func.overloadpacket.__name__}.{func._overloadname}",
                                     ins, outs, self.phase))
        return out


def _on_meta(x: Any) -> Any:
    if isinstance(x, torch.device) and x.type == "cuda":
        return torch.device("meta")
    if isinstance(x, torch.Tensor) and x.device.type != "meta":
        return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="meta")
    return x


class _MetaReplay(fx.Interpreter):
    """Runs an ATen graph of fake CUDA tensors on meta tensors instead, telling ``recorder``
    which nodes depend on the graph's inputs."""

    def __init__(self, gm: fx.GraphModule, recorder: _Recorder) -> None:
        super().__init__(gm)
        self.recorder = recorder
        self.variable: set[fx.Node] = set()

    def run_node(self, n: fx.Node) -> Any:
        if n.op == "placeholder" or any(a in self.variable for a in n.all_input_nodes):
            self.variable.add(n)
        if n.op == "get_attr":
            return tree_map(_on_meta, super().run_node(n))
        if n.op in ("call_function", "call_method"):
            args, kwargs = self.fetch_args_kwargs_from_env(n)
            args, kwargs = tree_map(_on_meta, (args, kwargs))
            self.recorder.counted = n in self.variable
            try:
                if n.op == "call_method":
                    return getattr(args[0], str(n.target))(*args[1:], **kwargs)
                return n.target(*args, **kwargs)
            finally:
                self.recorder.counted = True
        return super().run_node(n)


def _replay(gm: fx.GraphModule, names: list[str], grads: set[str],
            fake: FakeCudaModel) -> list[OpCall]:
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    values = [n.meta["val"] for n in placeholders]
    flat = []
    for i, v in enumerate(values):
        t = _on_meta(v)
        if i < len(names) and names[i] in grads:
            t.requires_grad_(True)
        flat.append(t)
    recorder = _Recorder()
    with recorder:
        outs = [o for o in _MetaReplay(gm, recorder).run(*flat)
                if isinstance(o, torch.Tensor)]
        needing = [o for o in outs if o.requires_grad]
        leaves = [t for t in flat if t.requires_grad]
        recorder.phase = "backward"
        if needing:
            torch.autograd.grad(needing, leaves, [torch.ones_like(o) for o in needing],
                                allow_unused=True)
    return recorder.calls


def _drop_lossless_round_trips(gm: fx.GraphModule) -> None:
    """``x.float().to(x.dtype)`` of a low-precision ``x`` is ``x``, bit for bit, forward and
    backward: EliminateCastsPass removes such chains by design, so they are not compared."""
    to_copy = torch.ops.aten._to_copy.default
    for node in list(gm.graph.nodes):
        if node.target is not to_copy or set(node.kwargs) != {"dtype"}:
            continue
        up = node.args[0]
        if not isinstance(up, fx.Node) or up.target is not to_copy or \
                set(up.kwargs) != {"dtype"} or up.kwargs["dtype"] is not torch.float32:
            continue
        source = up.args[0]
        if isinstance(source, fx.Node) and source.meta["val"].dtype is node.kwargs["dtype"] \
                and node.kwargs["dtype"] in (torch.float16, torch.bfloat16):
            node.replace_all_uses_with(source)
            gm.graph.erase_node(node)
    gm.graph.eliminate_dead_code()
    gm.recompile()


def autocast_sequence(fake: FakeCudaModel, low: torch.dtype) -> list[OpCall]:
    """The ops ``fake.model`` runs under ``torch.autocast("cuda", low)``, forward and
    backward (parameters requiring grad)."""
    gm, names = _forward_graph(fake, fake.model, lambda: cuda_autocast(low))
    grads = fake.parameter_names()
    params = [n for n, name in zip(gm.graph.nodes, names) if name in grads]
    _cache_parameter_casts(gm, params, low)
    _drop_lossless_round_trips(gm)
    return _replay(gm, names, grads, fake)


def converted_sequence(fake: FakeCudaModel, converted: nn.Module) -> list[OpCall]:
    """The ops the converted module runs, forward and backward (autocast off)."""
    gm, names = _forward_graph(fake, converted, contextlib.nullcontext)
    return _replay(gm, names, fake.parameter_names(), fake)


def sequence_diff(got: list[OpCall], want: list[OpCall], context: int = 3) -> str:
    """A unified diff of two op sequences (``want``: autocast's), empty when equal."""
    return "\n".join(difflib.unified_diff([str(c) for c in want], [str(c) for c in got],
                                          "torch.autocast('cuda')", "converted", n=context,
                                          lineterm=""))
