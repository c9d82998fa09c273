"""Export capture: ``torch.export`` in the AMP regime, made ready for the passes.

**The regime.** Model code often reads a dtype off a tensor at run time: ``x.to(y.dtype)``,
``torch.finfo(scores.dtype).min``, ``dtype=hidden_states.dtype``, ``if h.dtype ==
torch.float16: clamp``. ``torch.export`` runs that Python once and records its result as a
literal. Traced on fp32 tensors, the literal is fp32, while the converted graph computes ``y``
in low precision: the rewrite would keep an fp32 cast (or fill fp32's minimum into a bf16
tensor) where eager autocast follows the real dtype. So the model is traced *under*
``torch.autocast(device, low_dtype)``: every op is still recorded as the model wrote it
(autocast acts below the recording, no cast is recorded), but the fake tensors the Python
code sees carry the dtypes autocast gives them, and so do the recorded literals. The passes
then insert the policy's explicit casts and recompute every dtype.

Before (traced on fp32)::

    to = torch.ops.aten.to.dtype(y, torch.float32)              # y.to(h.dtype)
    masked_fill = torch.ops.aten.masked_fill.Scalar(s, m, -3.4028234663852886e+38)

After (traced in the bf16 regime)::

    to = torch.ops.aten.to.dtype(y, torch.bfloat16)
    masked_fill = torch.ops.aten.masked_fill.Scalar(s, m, -3.3895313892515355e+38)

**Faithful conversions** (:class:`_FaithfulConversions`): ``x.float()`` on an fp32 ``x``
becomes a copy rather than ``x`` itself, and ``x.to(device)`` is recorded without a dtype
(export otherwise records it as ``to(dtype=<x's dtype then>, device=...)``, a cast to the
traced dtype).

**Sub-graphs**: the model's own ``torch.autocast`` regions and ``torch.no_grad()`` /
``enable_grad()`` regions arrive as ``wrap_with_autocast`` / ``wrap_with_set_grad_enabled``
higher-order ops. They are inlined, their nodes tagged with the region (``REGION_KEY``,
``GRAD_KEY``), so that every pass sees one flat graph; a grad region becomes explicit
``torch._C._set_grad_enabled`` calls around its nodes, as in Dynamo's graphs.
"""

from __future__ import annotations

import contextlib
import inspect
import sys
import warnings
from typing import Any, Iterator

import torch
import torch.fx as fx
import torch.nn as nn
import torch.utils._pytree as pytree

from ..errors import AmpRewriteError, user_stacklevel
from ..graph.queries import mutated
from ..graph.subgraphs import inline_body
from ..versions import check_transformers
from .attention import ATTENTION_KEY, AttentionCall, AttentionCalls, has_attention
from .checkpoints import CheckpointSites
from .custom_functions import custom_functions_in
from .layerdrop import DecidedDraws
from .facts import GRAD_KEY, LIFTED_CONSTANTS, REGION_KEY, TRACED_IN_FP32, Region
from .guards import fast_input_guards
from .logs import partial_graph_line, without_partial_graphs
from .keywords import named_keywords

__all__ = ["capture_export", "dynamic_dims", "dynamic_shapes", "DynamicDims", "Regime",
           "autocast_regime"]

Regime = tuple[str, torch.dtype]
"""``(device_type, low dtype)`` of the ``torch.autocast`` a model is traced under."""


def capture_export(model: nn.Module, args: tuple, kwargs: dict[str, Any] | None, *,
                   regime: Regime | None, dynamic: bool = True,
                   faithful: bool = True, varying: DynamicDims = frozenset()) -> fx.GraphModule:
    """Capture ``model`` with ``torch.export`` (non-strict).

    Args:
        regime: trace under ``torch.autocast(*regime)`` (see the module docstring); None
            traces the model as it is (opt level O0). If the model cannot be traced under
            autocast, it is traced without, with a warning.
        dynamic: dynamic dimensions where the model allows them, so that the converted
            module accepts other batch sizes and lengths; False keeps the example's shapes.
        faithful: record dtype conversions and device moves as eager runs them (see
            :class:`_FaithfulConversions`); off for O0, which keeps the graph as exported.
        varying: dimensions to make dynamic besides the default ones (:func:`dynamic_shapes`).
    """
    shapes = dynamic_shapes(model, args, kwargs, varying) if dynamic else None
    try:
        ep, attention = _export(model, args, kwargs, shapes, regime, faithful)
    except Exception as exc:
        if regime is None:
            raise _capture_error(model, exc) from exc
        try:
            ep, attention = _export(model, args, kwargs, shapes, None, faithful)
        except Exception:
            raise _capture_error(model, exc) from exc
        warnings.warn(
            f"amprewrite: {type(model).__name__} could not be traced under "
            f"torch.autocast{regime} ({type(exc).__name__}: {_first_line(exc)}); it was traced "
            "in fp32, so dtypes the model reads off its tensors (x.to(y.dtype), "
            "torch.finfo(x.dtype)) are recorded as fp32.", stacklevel=user_stacklevel())
        regime = None
    unlifted = ep.module()
    gm = fx.GraphModule(unlifted, unlifted.graph, class_name=type(model).__name__)
    gm.meta[TRACED_IN_FP32] = regime is None
    # NB: not ep.constants, which holds the model's non-persistent buffers too
    gm.meta[LIFTED_CONSTANTS] = frozenset(ep.graph_signature.lifted_tensor_constants)
    gm.meta[ATTENTION_KEY] = attention
    fast_input_guards(gm)
    _inline_regions(gm)
    _drop_dtype_assertions(gm)
    if faithful:
        _restore_mutated_aliases(gm)
    gm.graph.eliminate_dead_code()
    gm.recompile()
    gm.train(model.training)
    return gm


@contextlib.contextmanager
def autocast_regime(device_type: str, dtype: torch.dtype) -> Iterator[None]:
    """``torch.autocast(device_type, dtype)``, also for a model on fake CUDA tensors on a
    machine without a GPU, where ``torch.autocast("cuda")`` disables itself: what its enter
    and exit do, minus that check. The fake tensors then carry the dtypes the real AutocastCUDA
    kernels give them, as on a GPU."""
    enabled, low = torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type)
    torch.set_autocast_enabled(device_type, True)
    torch.set_autocast_dtype(device_type, dtype)
    torch.autocast_increment_nesting()
    try:
        yield
    finally:
        if torch.autocast_decrement_nesting() == 0:
            torch.clear_autocast_cache()
        torch.set_autocast_enabled(device_type, enabled)
        torch.set_autocast_dtype(device_type, low)


def _export(model: nn.Module, args: tuple, kwargs: dict[str, Any] | None, shapes: Any,
            regime: Regime | None, faithful: bool
            ) -> tuple[torch.export.ExportedProgram, tuple[AttentionCall, ...]]:
    """The exported program, and the attention calls eager may run fused
    (:mod:`.attention`)."""
    _register_hf_caches(model)
    args, kwargs = _fresh_aliases((args, kwargs or {}))
    checkpoints = CheckpointSites()
    attention = AttentionCalls(model) if has_attention(model) else None
    with contextlib.ExitStack() as stack:
        stack.enter_context(DecidedDraws())
        stack.enter_context(checkpoints)
        if attention is not None:
            stack.enter_context(attention)
        if faithful:
            stack.enter_context(_FaithfulConversions())
        if regime is not None:
            stack.enter_context(autocast_regime(*regime))
        shapes = stack.enter_context(named_keywords(model, kwargs, shapes))
        with without_partial_graphs():
            ep = torch.export.export(model, args, kwargs, dynamic_shapes=shapes,
                                     strict=False)
    if checkpoints.sites:
        warnings.warn(
            f"amprewrite: {type(model).__name__} calls torch.utils.checkpoint (at "
            f"{'; '.join(checkpoints.sites)}). torch.export records a checkpointed function "
            "as ordinary ops, so the converted module keeps its activations for backward "
            "instead of recomputing them: values and gradients are unchanged, memory is as "
            "without checkpointing. To keep checkpointing, convert with "
            "amprewrite.compile(model), or convert the checkpointed blocks and call "
            "checkpoint() on the converted blocks (docs/distributed.md).",
            stacklevel=user_stacklevel())
    functions = custom_functions_in(ep.graph)
    if functions:
        names = ", ".join(sorted(functions))
        warnings.warn(
            f"amprewrite: {type(model).__name__} calls custom torch.autograd.Function(s) "
            f"{names}. torch.export records the ops of their forward, so autograd "
            "differentiates those ops instead of calling their own backward: gradients through "
            "them can differ from the model's (outputs do not). To keep them whole, convert "
            "with amprewrite.compile(model), whose capture keeps a Function's backward.",
            stacklevel=user_stacklevel())
    return ep, attention.recorded() if attention is not None else ()


def _fresh_aliases(inputs: Any) -> Any:
    """``inputs`` with every tensor replaced by a new tensor object on the same memory (one per
    tensor: an input passed twice stays one).

    NB: torch.export marks the tensors it traces with dynamic dimensions
    (``_dynamo_weak_dynamic_indices``), and a failed export leaves the marks on them: the
    user's tensors would carry them into their own ``torch.compile`` calls, and the static
    export that follows a failed dynamic one would trace dynamic dimensions again (slowly,
    and failing the same way)."""
    made: dict[int, torch.Tensor] = {}

    def alias(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in made:
            fresh = t.detach()
            made[id(t)] = fresh.requires_grad_() if t.requires_grad else fresh
        return made[id(t)]

    return torch.utils._pytree.tree_map_only(torch.Tensor, alias, inputs)


def _register_hf_caches(model: nn.Module) -> None:
    """Let torch.export flatten transformers' KV-cache objects (``DynamicCache``...), which a
    model with ``use_cache=True`` returns; transformers ships the registration."""
    if "transformers" not in sys.modules:
        return
    check_transformers()
    try:
        from transformers.exporters.exporter_dynamo import (
            register_cache_pytrees_for_model,
        )
    except ImportError:  # transformers before its exporters package
        try:
            from transformers.integrations.executorch import (
                register_dynamic_cache_export_support,
            )
        except ImportError:
            return
        register_dynamic_cache_export_support()
        return
    register_cache_pytrees_for_model(model)


def _first_line(exc: BaseException) -> str:
    return str(exc).splitlines()[0] if str(exc) else ""


def _capture_error(model: nn.Module, exc: BaseException) -> AmpRewriteError:
    line = partial_graph_line(exc)
    where = f"The model's line it stopped at: {line}\n" if line else ""
    return AmpRewriteError(
        f"torch.export could not capture {type(model).__name__}: {type(exc).__name__}: "
        f"{_first_line(exc)}\n{where}"
        "Models with data-dependent control flow or graph breaks convert with "
        "amprewrite.compile(model) (a torch.compile backend) instead.")


def dynamic_dims(x: torch.Tensor) -> range:
    """The dimensions of an example input that the capture makes dynamic where the model lets
    them vary: every one (batch, sequence, features) of an integer tensor and of a floating
    one of up to 3 dimensions; none of a floating tensor of 4 or more (images, video,
    volumes), whose capture keeps the example's sizes, batch included.

    NB: symbolic sizes of an image cost more than they give. torch.export then reasons about
    every size expression the model computes from them (strided convolutions and pooling,
    padding, window partitions, an LSTM over rows), which takes 2 to 5 times as long as a
    static export even with the batch alone dynamic (torch 2.14: 2.6x for a segmentation
    MobileNet, 4.5x for Sequencer2d), and the passes after it run on symbolic sizes too. A
    vision model runs at the resolution it was built for; a call with another batch size
    raises, naming the argument (convert for that size, or use ``amprewrite.compile``)."""
    return range(x.dim() if x.dim() <= 3 or not x.is_floating_point() else 0)


DynamicDims = frozenset  # of (input name, dimension), named as graph/inputs.py names inputs
"""Dimensions to capture symbolic beyond :func:`dynamic_dims`: those a call was seen to vary
(automatic dynamic sizes, :mod:`amprewrite.module.cache`)."""


def dynamic_shapes(model: nn.Module, args: tuple, kwargs: dict[str, Any] | None,
                   varying: DynamicDims = frozenset()) -> Any:
    """torch.export's ``dynamic_shapes`` for the example inputs, keyed by the forward's
    parameter names, so that a ``*args`` forward (a PEFT model's) takes them too; None where
    no dimension is dynamic.

    Positional inputs get :func:`dynamic_dims`; keyword inputs keep the example's sizes at the
    first capture (they are often a whole batch of a trainer, masks included, and a static
    export of them is faster), and every input gets the dimensions in ``varying``: the ones a
    call was seen to change. NB: an input bound to a ``**kwargs`` parameter keeps its sizes:
    torch.export's input check of such a forward can name inputs by paths its own check
    function does not define (``NameError: name 'L'`` at the first call, torch 2.14)."""
    auto = torch.export.Dim.AUTO
    dynamic = False

    def spec(x: Any, name: str, default: bool) -> Any:
        nonlocal dynamic
        if isinstance(x, torch.Tensor):
            dims = {d for n, d in varying if n == name and d < x.dim()}
            if default:
                dims.update(dynamic_dims(x))
            dynamic = dynamic or len(dims) > 0
            return {i: auto for i in sorted(dims)}
        if type(x) in (list, tuple):
            return type(x)(spec(v, f"{name}[{i}]", default) for i, v in enumerate(x))
        if type(x) is dict:
            return {k: spec(v, f"{name}[{k!r}]", default) for k, v in x.items()}
        if type(x) in pytree.SUPPORTED_NODES:
            # a registered class (transformers' caches, a ModelOutput such as the
            # encoder_outputs of an encoder-decoder's decode step, a dict subclass):
            # torch.export takes the shapes of its flattened children, and of a registered
            # class among them (an encoder-decoder cache's two caches) its flattened children
            # again, never the class rebuilt; each tensor named by pytree's keys for it
            names = iter([name + pytree.keystr(path)
                          for path, _ in pytree.tree_flatten_with_path(x)[0]])
            return children(x, names, default)
        if isinstance(x, (list, tuple)):
            return type(x)(spec(v, f"{name}[{i}]", default) for i, v in enumerate(x))
        if isinstance(x, dict):
            return {k: spec(v, f"{name}[{k!r}]", default) for k, v in x.items()}
        return None

    def children(x: Any, names: Any, default: bool) -> Any:
        if x is None:
            return None
        if type(x) in (list, tuple):
            return type(x)(children(v, names, default) for v in x)
        if type(x) is dict:
            return {k: children(v, names, default) for k, v in x.items()}
        node = pytree.SUPPORTED_NODES.get(type(x))
        if node is not None:
            return children(node.flatten_fn(x)[0], names, default)
        leaf = next(names)
        return spec(x, leaf, default) if isinstance(x, torch.Tensor) else None

    if kwargs and not varying:
        return None
    kwargs = kwargs or {}
    try:
        signature = inspect.signature(model.forward)
        bound = signature.bind(*args, **kwargs)
    except (TypeError, ValueError):
        if kwargs:
            return None
        shapes: Any = tuple(spec(a, f"args[{i}]", True) for i, a in enumerate(args))
    else:
        positional = signature.bind_partial(*args).arguments.keys()
        shapes = {}
        for name, value in bound.arguments.items():
            if signature.parameters[name].kind is inspect.Parameter.VAR_KEYWORD:
                shapes[name] = {k: None for k in value}
            else:
                shapes[name] = spec(value, name, name in positional and not kwargs)
    return shapes if dynamic else None


# ---------------------------------------------------------------------------------------------
# conversions as eager runs them
class _FaithfulConversions(torch.overrides.TorchFunctionMode):
    """Record dtype conversions and device moves as eager runs them.

    * ``x.float()`` / ``x.to(dtype)`` on an ``x`` that already has that dtype is recorded as
      a copy (``_to_copy``). NB: in eager such a call returns ``x`` itself, and export, which
      follows tensors by identity, would route every later use of ``x`` through the
      conversion node; once AMP gives ``x`` another dtype, those uses would change precision.
      EliminateCastsPass removes the copies that stay identities.
    * ``x.to(device)`` (no dtype) is recorded as ``aten.to.dtype_layout(x, device=...)``
      without a dtype, so it keeps whatever dtype ``x`` has at run time. Export would record
      the traced dtype, a cast in disguise.
    """

    _METHODS = {torch.Tensor.float: torch.float32, torch.Tensor.half: torch.float16,
                torch.Tensor.bfloat16: torch.bfloat16, torch.Tensor.double: torch.float64}

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.Tensor.to and args and isinstance(args[0], torch.Tensor):
            moved = _device_move(args, kwargs)
            if moved is not None:
                return moved
        dtype = self._METHODS.get(func)
        if dtype is None and func is torch.Tensor.to:
            dtype = _plain_dtype_conversion(args, kwargs)
        if dtype is not None and len(args) == (1 if func is not torch.Tensor.to else 2) and \
                isinstance(args[0], torch.Tensor) and args[0].dtype == dtype:
            return torch.ops.aten._to_copy.default(args[0], dtype=dtype)
        return func(*args, **kwargs)


def _device_move(args: tuple, kwargs: dict[str, Any]) -> torch.Tensor | None:
    """``x.to(device[, non_blocking])`` without a dtype, as a dtype-less ``aten.to``."""
    if len(args) > 1 and isinstance(args[1], torch.Tensor):
        return None  # x.to(other): other's dtype too
    try:
        device, dtype, non_blocking, memory_format = torch._C._nn._parse_to(*args[1:], **kwargs)
    except Exception:
        return None  # not a form we understand: let Tensor.to raise or run as written
    if dtype is not None or device is None or memory_format is not None or \
            kwargs.get("copy", False):
        return None
    return torch.ops.aten.to.dtype_layout(args[0], device=device, non_blocking=non_blocking)


def _plain_dtype_conversion(args: Any, kwargs: Any) -> torch.dtype | None:
    if len(args) == 2 and isinstance(args[1], torch.dtype) and not kwargs:
        return args[1]
    return None


def _restore_mutated_aliases(gm: fx.GraphModule) -> None:
    """Undo :class:`_FaithfulConversions`' copies where the copy is written in place.

    ``y = x.float(); y.add_(1)`` on an fp32 ``x`` mutates ``x`` in eager (``y`` *is* ``x``).
    Such a conversion becomes ``aten.to.dtype`` again, which returns its input itself when
    the dtypes match at run time, as eager does, and a copy when AMP changed the input's dtype,
    as eager under autocast does.
    """

    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target is not torch.ops.aten._to_copy.default \
                or set(node.kwargs) != {"dtype"} or len(node.args) != 1:
            continue
        source = node.args[0].meta.get("val") if isinstance(node.args[0], fx.Node) else None
        dtype = node.kwargs["dtype"]
        if isinstance(source, torch.Tensor) and source.dtype == dtype and mutated(node):
            node.target = torch.ops.aten.to.dtype
            node.args, node.kwargs = (node.args[0], dtype), {}


# ---------------------------------------------------------------------------------------------
# graph clean-up
def _all_graphs(gm: fx.GraphModule) -> Iterator[fx.GraphModule]:
    """``gm`` and the sub-GraphModules its higher-order ops call (``torch.cond`` branches)."""
    yield gm
    for child in gm.children():
        if isinstance(child, fx.GraphModule):
            yield from _all_graphs(child)


def _drop_dtype_assertions(gm: fx.GraphModule) -> None:
    """Export records the dtypes it saw as ``_assert_tensor_metadata`` checks; after
    conversion those dtypes change by design, so the checks go, in sub-graphs too."""
    for graph_module in _all_graphs(gm):
        for node in list(graph_module.graph.nodes):
            if node.op == "call_function" and node.target in (
                    torch.ops.aten._assert_tensor_metadata.default,):
                graph_module.graph.erase_node(node)
        if graph_module is not gm:
            graph_module.recompile()


_AUTOCAST_HOP = torch.ops.higher_order.wrap_with_autocast
_GRAD_HOP = torch.ops.higher_order.wrap_with_set_grad_enabled


def _inline_regions(gm: fx.GraphModule) -> None:
    """Replace each ``wrap_with_autocast(device, dtype, enabled, cache, submod, *xs)`` and
    ``wrap_with_set_grad_enabled(enabled, submod, *xs)`` node by the submodule's nodes,
    tagged with their region (innermost wins), so that the passes see and honour the model's
    own regions: an autocast region decides the op's rule (no autocast is entered at run
    time), a grad region is kept as ``torch._C._set_grad_enabled`` calls around its nodes."""
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target not in (_AUTOCAST_HOP, _GRAD_HOP):
            continue
        if node.target is _AUTOCAST_HOP:
            device_type, dtype, enabled, _cache, submod_node, *operands = node.args
            tag = (REGION_KEY, Region(device_type, dtype if enabled else None, bool(enabled)))
        else:
            enabled, submod_node, *operands = node.args
            tag = (GRAD_KEY, bool(enabled))
        _inline_regions(getattr(gm, submod_node.target))
        graph = gm.graph
        if tag[0] == GRAD_KEY:
            with graph.inserting_before(node):
                previous = graph.call_function(torch.is_grad_enabled)
                graph.call_function(torch._C._set_grad_enabled, (tag[1],))
            with graph.inserting_after(node):
                graph.call_function(torch._C._set_grad_enabled, (previous,))
        inline_body(gm, node, submod_node, operands, tag)
