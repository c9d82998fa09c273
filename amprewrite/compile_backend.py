"""A ``torch.compile`` backend that rewrites every graph Dynamo captures.

Dynamo splits a model at graph breaks and at data-dependent Python control flow; each piece
arrives here as a torch-level GraphModule with fake-tensor ``meta["example_value"]``. Each one
is rewritten by the same passes as :func:`amprewrite.convert` and then handed to Inductor, or
run eagerly with ``eager=True``. Python between the graphs runs as written, so models that
neither ``symbolic_trace`` nor ``torch.export`` can capture still convert and train::

    compiled = amprewrite.compile(model)                       # one line
    compiled = torch.compile(model, backend=amprewrite.backend(dtype=torch.bfloat16))

What that Python sees (:mod:`amprewrite.capture.graph_breaks`): under a
``Policy.autocast(device, dtype)`` preset, ``amprewrite.compile`` calls the model inside that
``torch.autocast``, so the code between graphs runs as in eager autocast and each graph runs
with autocast off (its casts are explicit): bitwise autocast's, across graph breaks. Under
other policies, each graph casts its floating outputs back to the dtypes Dynamo traced.

What changes against ``convert``:

* Parameters arrive as graph inputs (placeholders), not ``get_attr`` nodes, so their casts are
  plain ``.to(dtype)`` nodes (autograd-tracked; Inductor fuses them into their consumers).
* ``with torch.autocast(...)`` blocks of the model appear as ``_enter_autocast`` /
  ``_exit_autocast`` nodes. The nodes between them are tagged with the region (as the symbolic
  and export captures do) and the enter/exit nodes are dropped: the region's rule is now
  explicit in the graph, and no autocast is entered at run time.
* ``torch.utils.checkpoint`` calls appear as ``tag_activation_checkpoint`` ops with a body
  graph; the body is converted with the graph around it and stays a checkpoint region, so
  backward recomputes it, casts included (:mod:`amprewrite.capture.checkpoints`).
* Parameters are cast once per graph (torch.autocast's cache), and library ops with their own
  autocast kernel run under it (:mod:`amprewrite.capture.own_autocast`).
* Node names are those of each Dynamo graph: read them from ``explain(b.graphs[i])``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import fnmatch
import warnings
from typing import Any, Callable, Sequence

import torch
import torch.fx as fx
import torch.nn as nn

from .compiled_view import view_of
from .capture.checkpoints import inline_checkpoints, outline_checkpoints
from .capture.graph_breaks import (ambient_autocast, regime_available, regime_of,
                                   restore_traced_dtypes, traced_output_dtypes, under_regime,
                                   without_autocast)
from .capture.own_autocast import describe_own_autocast_kernels, wrap_own_autocast_kernels
from .capture.facts import GRAD_KEY, REGION_KEY, TRACED_IN_FP32, Region
from .convert import resolve_dtype
from .errors import user_stacklevel
from .graph.codegen import recompile_with_bindings
from .graph.meta import META_KEY, cast_info, decision
from .hardware import model_device, warn_if_slow
from .passes.eliminate_casts import cast_report
from .passes.pipeline import run_passes
from .policy.policy import Policy, check_low_dtype, default_low_dtype
from .runtime.weight_cache import CACHE_ATTR

__all__ = ["backend", "compile", "AmpBackend"]

_ENTER = torch.amp.autocast_mode._enter_autocast
_EXIT = torch.amp.autocast_mode._exit_autocast


class AmpBackend:
    """The Dynamo backend returned by :func:`backend`; keeps every graph it rewrote.

    Attributes:
        policy: the policy every graph is rewritten with.
        dtype: the low dtype; None picks fp16 for graphs with CUDA inputs, else bf16.
        eager: run the rewritten graphs as Python instead of compiling them with Inductor.
        graphs: the rewritten GraphModules, in capture order (``amprewrite.explain`` each).
    """

    def __init__(self, policy: Policy, dtype: torch.dtype | None, eager: bool) -> None:
        self.policy = policy
        self.dtype = dtype
        self.eager = eager
        self.graphs: list[fx.GraphModule] = []

    def __repr__(self) -> str:
        return (f"amprewrite.backend({self.policy.summary()}, dtype={self.dtype}, "
                f"eager={self.eager}): {len(self.graphs)} graph(s) rewritten")

    def __call__(self, gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable:
        low = self._low_dtype(example_inputs)
        regime = regime_of(self.policy.preset, low)
        ambient = ambient_autocast()
        in_regime = regime is not None and ambient == {regime[0]: regime[1]}
        if ambient and not in_regime:
            device = next(iter(ambient))
            warnings.warn(
                f"amprewrite.backend: torch.autocast({device!r}) is active around the "
                f"compiled model, so autocast casts on top of amprewrite's explicit casts "
                f"({self.policy.summary()}). Call the compiled model outside torch.autocast, "
                "or use the Policy.autocast preset of that autocast.", stacklevel=user_stacklevel())
        checkpoints = inline_checkpoints(gm)
        self._rewrite(gm, low, ambient, regime[0] if in_regime else None)
        outline_checkpoints(gm, checkpoints)
        self.graphs.append(gm)
        if self.eager:
            _readable_code(gm, ambient)
            compiled: Callable = gm.forward
        else:
            from torch._inductor.compile_fx import compile_fx

            with contextlib.ExitStack() as stack:
                for device in ambient if in_regime else ():
                    stack.enter_context(torch.autocast(device, enabled=False))
                compiled = compile_fx(gm, list(example_inputs))
            # NB: after Inductor traced it: Inductor gets torch.fx's graph module as Dynamo
            # made it; the readable code is what ``graphs[i]`` shows.
            _readable_code(gm, ambient)
        return without_autocast(compiled, regime[0]) if in_regime else compiled

    def _rewrite(self, gm: fx.GraphModule, low: torch.dtype, ambient: dict[str, torch.dtype],
                 regime_device: str | None) -> None:
        """Run the passes on Dynamo's graph ``gm``, traced under the ``ambient`` autocast;
        ``regime_device``: the device of the preset's autocast when that is the ambient one
        (:mod:`amprewrite.capture.graph_breaks`)."""
        _adopt_example_values(gm)
        traced = traced_output_dtypes(gm)
        _tag_autocast_regions(gm)
        gm.meta.pop(META_KEY, None)
        # In the regime, Dynamo ran the model's Python under the preset's autocast (the
        # dtypes it read off tensors are autocast's); otherwise in fp32.
        gm.meta[TRACED_IN_FP32] = regime_device is None
        with contextlib.ExitStack() as stack:
            # NB: the backend runs inside a tracing context whose fake mode is not the one
            # of the graph's example values; the passes must re-run nodes in the values'
            # own mode, and with autocast off: they compute the dtypes of explicit casts.
            stack.enter_context(torch._guards.tracing(None))
            for device in ambient:
                stack.enter_context(torch.autocast(device, enabled=False))
            if regime_device is not None or not ambient:
                wrap_own_autocast_kernels(gm, low, regime_device or self.policy.device_type)
            run_passes(gm, self.policy, low)
            describe_own_autocast_kernels(gm)
            _plain_weight_casts(gm)
            _share_leaf_casts(gm)
            if not ambient:
                restore_traced_dtypes(gm, traced)
        _publish_example_values(gm)

    def _low_dtype(self, example_inputs: Sequence[Any]) -> torch.dtype:
        if self.dtype is not None:
            return self.dtype
        if self.policy.dtype is not None:
            return self.policy.dtype
        on_cuda = any(isinstance(x, torch.Tensor) and x.is_cuda for x in example_inputs)
        return default_low_dtype("cuda" if on_cuda else "cpu")


def backend(policy: Policy | None = None, dtype: torch.dtype | None = None, *,
            eager: bool = False) -> AmpBackend:
    """A ``torch.compile`` backend that converts each captured graph to mixed precision.

    Args:
        policy: op precision rules; default :class:`Policy()` (CUDA AMP rules everywhere).
            Module overrides match the qualified names of ``model.named_modules()``; node
            overrides match node names of the Dynamo graphs (see ``backend.graphs``).
        dtype: torch.float16 or torch.bfloat16; default: the policy's, else fp16 for graphs
            whose inputs are on CUDA and bf16 otherwise.
        eager: run each rewritten graph eagerly instead of compiling it with Inductor
            (fast to start; useful to debug and on machines without a C++ compiler).

    Returns:
        An :class:`AmpBackend`: pass it as ``torch.compile(model, backend=...)``; its
        ``graphs`` list holds every rewritten graph for ``amprewrite.explain``.
    """
    if policy is None:
        policy = Policy()
    if not isinstance(policy, Policy):
        raise TypeError(f"amprewrite.backend: policy must be an amprewrite.Policy, got "
                        f"{type(policy).__name__}")
    if dtype is not None:
        check_low_dtype(dtype, "amprewrite.backend")
    if not isinstance(eager, bool):
        raise TypeError(f"amprewrite.backend: eager must be True or False, got {eager!r}")
    return AmpBackend(policy, dtype, eager)


def compile(model: nn.Module, *, policy: Policy | None = None, dtype: torch.dtype | None = None,
            eager: bool = False, dynamic: bool | None = None,
            fullgraph: bool = False) -> nn.Module:
    """``torch.compile(model, backend=amprewrite.backend(...))`` in one line.

    Module overrides of ``policy`` are checked against ``model.named_modules()`` here, so a
    misspelt name fails now rather than matching nothing. ``dynamic`` and ``fullgraph`` are
    passed to ``torch.compile``. The compiled module reads as the model: its ``state_dict``
    keys, its forward's signature, and the model's methods (``generate``), which run the
    compiled forward (:mod:`amprewrite.compiled_view`). The backend is
    ``compiled.amprewrite_backend``; its
    ``graphs`` fill in as the model runs. With a ``Policy.autocast(device, dtype)`` preset the
    compiled model is called inside that ``torch.autocast``, so the Python between its graphs
    runs as under eager autocast (:mod:`amprewrite.capture.graph_breaks`).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"amprewrite.compile expects a torch.nn.Module, got "
                        f"{type(model).__name__}; for functions use torch.compile(fn, "
                        "backend=amprewrite.backend()).")
    policy = policy if policy is not None else Policy()
    amp = backend(policy, dtype, eager=eager)
    if amp.dtype is None:
        amp.dtype = resolve_dtype(model, policy, None)
    warn_if_slow(model_device(model, None, None), amp.dtype)
    _check_module_overrides(model, policy)
    compiled = torch.compile(model, backend=amp, dynamic=dynamic, fullgraph=fullgraph)
    regime = regime_of(policy.preset, amp.dtype)
    if regime is not None and regime_available(regime):
        # The preset mirrors torch.autocast: the model's Python between graphs runs under it,
        # as in eager autocast (amprewrite.capture.graph_breaks).
        compiled.forward = under_regime(compiled.forward, regime)
    # NB: object.__setattr__, not setattr: the compiled wrapper forwards nn.Module attributes.
    object.__setattr__(compiled, "amprewrite_backend", amp)
    return view_of(compiled, model)


def _readable_code(gm: fx.GraphModule, ambient: dict[str, torch.dtype]) -> None:
    """``gm`` recompiled by the code generator of converted modules (proven bindings, the
    layout of :mod:`amprewrite.graph.layout`): lines wrapped to the formatter's width, a
    dtype and shape comment per floating value, ``print_readable()`` equal to ``gm.code``.
    Dynamo calls a graph with positional arguments only, so its parameters take their
    placeholders' names (``l_x_``, not ``L_x_`` and a line ``l_x_ = L_x_``).

    Before::

        def forward(self, L_self_modules_fc_parameters_weight_ : torch.nn.parameter.Parameter, L_x_ : torch.Tensor):
            l_self_modules_fc_parameters_weight_ = L_self_modules_fc_parameters_weight_
            l_x_ = L_x_
            ...
            linear = torch._C._nn.linear(l_x__bf16, l_self_modules_fc_parameters_weight__bf16);  l_x__bf16 = l_self_modules_fc_parameters_weight__bf16 = None

    After::

        def forward(self, l_self_modules_fc_parameters_weight_, l_x_):
            ...
            linear = torch.nn.functional.linear(l_x__bf16,  # bf16[2, 10]
                                                l_self_modules_fc_parameters_weight__bf16)
    """
    with contextlib.ExitStack() as stack:
        # NB: the proofs of the bindings run the ops on the graph's fake values, in their own
        # mode and with autocast off, as the passes do (AmpBackend._rewrite).
        stack.enter_context(torch._guards.tracing(None))
        for device in ambient:
            stack.enter_context(torch.autocast(device, enabled=False))
        recompile_with_bindings(gm, positional=True)
        for _, module in gm.named_modules():
            if module is not gm and isinstance(module, fx.GraphModule):
                recompile_with_bindings(module)  # a checkpoint's body


def _check_module_overrides(model: nn.Module, policy: Policy) -> None:
    names = [q for q, _ in model.named_modules() if q]
    unmatched = [p for p, _ in policy.module_overrides
                 if not any(fnmatch.fnmatchcase(q, p) for q in names)]
    if unmatched:
        raise ValueError(
            f"Policy module overrides match no module of {type(model).__name__}: "
            + "; ".join(f"{p!r} (near: {', '.join(difflib.get_close_matches(p, names, 3)) or '-'})"
                        for p in unmatched)
            + ". Use qualified names as in model.named_modules(), globs allowed.")


# ---------------------------------------------------------------------------------------------
# Dynamo graph → the metadata contract of the passes, and back
def _adopt_example_values(gm: fx.GraphModule) -> None:
    """Dynamo keeps fake values under ``example_value``; the passes read ``val``. Nodes
    without a value (grad-mode switches, autocast enter/exit) get None: not a tensor."""
    for node in gm.graph.nodes:
        if node.op != "output":
            node.meta["val"] = node.meta.get("example_value")


def _publish_example_values(gm: fx.GraphModule) -> None:
    """Inductor's graph passes read ``example_value``: keep it in step with the new dtypes."""
    for node in gm.graph.nodes:
        if node.op != "output" and node.meta.get("val") is not None:
            node.meta["example_value"] = node.meta["val"]


def _tag_autocast_regions(gm: fx.GraphModule) -> None:
    """Tag the nodes inside the model's own ``torch.autocast`` blocks with their Region and
    drop the enter/exit nodes (the passes make the region's rule explicit)."""
    stack: list[Region] = []
    markers: list[fx.Node] = []
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target is _ENTER:
            device_type, dtype, enabled = (list(node.args) + [None, None, True])[:3]
            enabled = bool(enabled)
            if enabled and dtype is None:
                dtype = torch.get_autocast_dtype(device_type)
            stack.append(Region(device_type, dtype if enabled else None, enabled))
            markers.append(node)
        elif node.op == "call_function" and node.target is _EXIT:
            if stack:
                stack.pop()
            markers.append(node)
        elif stack and node.op != "output":
            node.meta[REGION_KEY] = stack[-1]
    for node in reversed(markers):
        for user in list(node.users):  # exit nodes use enter nodes; nothing else uses either
            if user not in markers:
                raise ValueError(f"amprewrite.backend: autocast marker {node.format_node()} "
                                 f"is used by {user.format_node()}; expected only "
                                 "_exit_autocast to use it.")
        gm.graph.erase_node(node)


def _share_leaf_casts(gm: fx.GraphModule) -> None:
    """One cast per graph input and dtype where the input is a leaf fp32 tensor that
    requires grad (a parameter, as Dynamo passes them): torch.autocast caches exactly those
    casts, so a weight used several times (a detection head applied to every feature level)
    gets one low-precision copy whose gradients add up in the low dtype before the one cast
    back, and per-use casts would round differently. Parameters that ``convert`` reads as
    ``get_attr`` get this from InsertCastsPass; here they arrive as placeholders.

    Before::

        w_bf16 = w.to(torch.bfloat16);  conv_a = torch.conv2d(a, w_bf16)
        w_bf16_1 = w.to(torch.bfloat16);  conv_b = torch.conv2d(b, w_bf16_1)

    After::

        w_bf16 = w.to(torch.bfloat16);  conv_a = torch.conv2d(a, w_bf16)
        conv_b = torch.conv2d(b, w_bf16)
    """
    first: dict[tuple[fx.Node, torch.dtype, Any], fx.Node] = {}
    merged = False
    for node in list(gm.graph.nodes):
        info = cast_info(node)
        if info is None or info.guarded or node.op != "call_method" or node.target != "to":
            continue
        source = node.args[0]
        val = source.meta.get("val") if isinstance(source, fx.Node) else None
        if source.op != "placeholder" or not isinstance(val, torch.Tensor) or \
                val.dtype != torch.float32 or not val.requires_grad or not val.is_leaf:
            continue
        key = (source, info.dtype, node.meta.get(GRAD_KEY))
        if key not in first:
            first[key] = node
            continue
        for user in node.users:
            rec = decision(user)
            if rec is not None and node.name in rec.casts:
                user.meta[META_KEY] = dataclasses.replace(rec, casts=tuple(
                    first[key].name if c == node.name else c for c in rec.casts))
        node.replace_all_uses_with(first[key])
        gm.graph.erase_node(node)
        cast_report(gm).eliminated["duplicate"] += 1  # explain() counts it as the pass's own
        merged = True
    if merged:
        gm.graph.lint()
        gm.recompile()


def _plain_weight_casts(gm: fx.GraphModule) -> None:
    """Casts of ``get_attr`` tensors go through a cache object in ``convert``'s graphs; under
    Dynamo (constants only) they must be plain ``.to(dtype)`` nodes that Inductor can trace."""
    cache_nodes = [n for n in gm.graph.nodes if n.op == "get_attr" and n.target == CACHE_ATTR]
    for cache in cache_nodes:
        for user in list(cache.users):
            _, value, dtype = user.args
            user.target = "to"
            user.args = (value, dtype)
        gm.graph.erase_node(cache)
    if cache_nodes:
        delattr(gm, CACHE_ATTR)
        gm.recompile()
