"""The code generator of converted modules: ATen ops called through torch's Python bindings,
not ``torch.ops``, in code laid out to be read.

:func:`recompile_with_bindings` regenerates ``gm.forward`` with each ``torch.ops.aten`` call
replaced by the binding of torch's Python API proven to run the *same* ATen op
(:mod:`.bindings`: ``torch.layer_norm``, ``torch.nn.functional.linear``, ``x.view(...)``),
laid out by :mod:`.layout`. The graph keeps its ``OpOverload`` targets (every pass,
``explain`` and ``lint`` read those); only the generated code changes. The generator is the
graph's own (``graph._codegen``), so ``gm.recompile()`` and ``gm.print_readable()`` write the
same code; :func:`plain_codegen` gives torch.fx's back.

Before::

    layer_norm = torch.ops.aten.layer_norm.default(add, [8], w, b, 1e-05, False)
    add = torch.ops.aten.add.Tensor(view, layer_norm)

After::

    layer_norm = torch.layer_norm(add, [8], w, b, 1e-05, False)  # f32[s0, 8]
    add = torch.add(view, layer_norm)  # f32[s0, 8]

**Casts.** A cast node ``x.to(torch.bfloat16)`` is generated as ``x.bfloat16()``: the same
op, without the overload resolution of ``Tensor.to`` (:data:`CAST_METHODS`). So is a
parameter cast, ``_amp_weight_cache.cast(w, torch.bfloat16)``, where the forward's weight
read already handed over the cached copy (:mod:`amprewrite.runtime.weight_table`): the
method returns a tensor already in its dtype as it is, and a parameter that needs a
gradient is cast where it is used, with autograd, as the cache's ``cast`` would.

**Arguments.** An exported module's forward starts by flattening its arguments against the
input spec, ``x, = fx_pytree.tree_flatten_spec(([x], {}), self._in_spec)``, which for
positional tensor arguments binds each name to itself (3.5 µs per call). That line is left
out where it is such an identity (:class:`_DirectArgumentsCodeGen`).
"""

from __future__ import annotations

import operator
import warnings
from typing import Any

import torch
import torch.fx as fx
from torch.fx.graph import _PyTreeCodeGen
from torch._guards import detect_fake_mode

from ..errors import user_stacklevel
from ..runtime.functions import CAST_METHODS
from ..runtime.weight_cache import CACHE_ATTR
from ..runtime.weight_table import handed_cast_dtype
from .bindings import Index, Method, Subscript, binding_for
from .layout import WIDTH, CodeLayout
from .wrapping import wrap, wrap_def

__all__ = ["recompile_with_bindings", "plain_codegen"]


def recompile_with_bindings(gm: fx.GraphModule, *,
                            positional: bool = False) -> fx.GraphModule:
    """Give ``gm``'s graph the code generator of converted modules (proven bindings in place
    of ``torch.ops.aten`` calls, the layout of :mod:`.layout`) and recompile it. The
    generator stays the graph's: ``gm.recompile()`` and ``gm.print_readable()`` write the
    same code. A graph with a code generator of its own (another library's) keeps it.

    ``positional``: the forward is only ever called with positional arguments (a Dynamo
    graph), so its parameters take the names of their placeholders: ``def forward(self,
    l_x_)`` in place of ``def forward(self, L_x_):`` and a line ``l_x_ = L_x_`` per
    argument."""
    readable = _readable_codegen(gm.graph._codegen)
    if readable is not None:
        readable.positional = positional
        gm.graph._codegen = readable
        # NB: on the module's own class (torch.fx makes one per GraphModule): no other
        # module's code changes
        type(gm).code = _READABLE_CODE
    gm.recompile()
    return gm


def _code_from_its_first_line(gm: fx.GraphModule) -> str:
    """``gm.code`` from ``def forward`` on: torch.fx writes blank lines above it, which its
    own pickling needs (it joins its import lines and the code), so the generated code
    (``gm._code``) keeps them and only the text people read goes without."""
    return fx.GraphModule.code.fget(gm).lstrip("\n")  # type: ignore[attr-defined]


_READABLE_CODE = property(_code_from_its_first_line,
                          doc="The converted module's generated code, from its first line.")


def plain_codegen(graph: fx.Graph) -> None:
    """Give ``graph`` torch.fx's own code generator back (a converted graph copied for the
    passes, which work on torch.fx's code)."""
    codegen = graph._codegen
    if isinstance(codegen, _ReadableCode):
        plain = object.__new__(_PyTreeCodeGen if isinstance(codegen, _PyTreeCodeGen)
                               else fx.graph.CodeGen)
        plain.__dict__.update(codegen.__dict__)
        graph._codegen = plain


class _ReadableCode:
    """What the code generators of converted graphs add to torch.fx's: while the code is
    generated, each node with a proven binding calls it (the graph keeps its
    ``OpOverload``), and :class:`~.layout.CodeLayout` lays the text out. ``verbose``
    (``print_readable``) writes the same code: its annotations are the layout's comments."""

    _body_transformer: Any
    positional: bool = False  # parameters named as their placeholders (recompile_with_bindings)

    def _gen_python_code(self, nodes: Any, root_module: str, namespace: Any,
                         **kwargs: Any) -> Any:
        if kwargs.get("record_func"):  # the profiler's markers around each node: torch.fx's
            return super()._gen_python_code(  # type: ignore[misc]
                nodes, root_module, namespace, **kwargs)
        kwargs["verbose"] = False
        order = list(nodes)
        swapped, weight_casts, indexing = _swap_bindings(order, self.positional)
        previous = self._body_transformer
        self._body_transformer = _Transformer(
            CodeLayout(order, root_module, frozenset(weight_casts), namespace,
                       frozenset(indexing)), previous)
        try:
            return super()._gen_python_code(  # type: ignore[misc]
                nodes, root_module, namespace, **kwargs)
        finally:
            self._body_transformer = previous
            for node, op, target, args, node_kwargs, kind in swapped:  # the graph keeps its ops
                node.op, node.target, node.args, node.kwargs, node.type = \
                    op, target, args, node_kwargs, kind


    def gen_fn_def(self, free_vars: list[str], maybe_return_annotation: str, *,
                   expanded_def: bool = False) -> str:
        """torch.fx's ``def forward(...):`` and argument bindings, each binding wrapped as
        the body is (an exported forward's ``fx_pytree.tree_flatten_spec(...)``), the
        parameters filled into lines (a Dynamo graph's)."""
        prologue = super().gen_fn_def(  # type: ignore[misc]
            free_vars, maybe_return_annotation, expanded_def=expanded_def)
        lines = []
        for line in prologue.split("\n"):
            body = line[4:] if line.startswith("    ") else None
            if body is not None and len(line) > WIDTH:
                lines += [f"    {part}" for part in wrap(body, WIDTH - 4)]
            else:
                lines += wrap_def(line, WIDTH)
        return "\n".join(lines)


class _Transformer:
    """The layout, then a body transformer set before (``graph.on_generate_code``); on a
    failure of the layout, torch.fx's own text, with a warning."""

    def __init__(self, layout: CodeLayout, then: Any) -> None:
        self.layout, self.then = layout, then

    def __call__(self, body: list[str]) -> list[str]:
        try:
            laid_out = self.layout(list(body))
        except Exception as exc:  # never lose the code over its layout
            warnings.warn(f"amprewrite: the converted code could not be laid out "
                          f"({type(exc).__name__}: {exc}); gm.code shows torch.fx's layout, "
                          "which runs the same", stacklevel=user_stacklevel())
            laid_out = body
        return self.then(laid_out) if self.then is not None else laid_out


class _ReadableCodeGen(_ReadableCode, fx.graph.CodeGen):
    pass


def _readable_codegen(codegen: Any) -> Any:
    """``codegen`` as the readable generator of its kind, sharing its state; None where it
    is of a kind not known here."""
    if isinstance(codegen, _ReadableCode):
        return codegen
    kind = {fx.graph.CodeGen: _ReadableCodeGen, _PyTreeCodeGen: _ReadablePyTreeCodeGen,
            }.get(type(codegen))
    if kind is None:
        return None
    readable = object.__new__(kind)
    readable.__dict__.update(codegen.__dict__)
    return readable


def _swap_bindings(nodes: list[fx.Node], positional: bool = False
                   ) -> tuple[list[tuple[Any, ...]], set[fx.Node], set[fx.Node]]:
    """Point each node with a proven binding at it; returns what to restore, the parameter
    casts generated as the dtype's method (:func:`_cast_method`) and the slices generated
    as indexing (:class:`_Index`). ``positional``: each placeholder without a default
    names its parameter (:func:`recompile_with_bindings`)."""
    swapped: list[tuple[fx.Node, str, Any, tuple, dict, Any]] = []
    weight_casts: set[fx.Node] = set()
    indexing: set[fx.Node] = set()
    vals = [n.meta.get("val") for n in nodes if n.op == "placeholder"]
    mode = detect_fake_mode(torch.utils._pytree.tree_leaves(vals))
    for node in nodes:
        cast = _cast_method(node)
        if cast is not None:
            if node.op == "call_method" and node.target == "cast":
                weight_casts.add(node)
            swapped.append((node, node.op, node.target, node.args, node.kwargs, node.type))
            node.op, node.target, node.args = "call_method", cast[0], (cast[1],)
            continue
        if node.type is not None and node.op in ("placeholder", "output"):
            # NB: the symbolic tracer's annotations (``x : _torch_Tensor_``) say nothing the
            # comments do not; the module's signature is the model's (model_view)
            swapped.append((node, node.op, node.target, node.args, node.kwargs, node.type))
            node.type = None
            if positional and _renamable(node):
                node.target = node.name
            continue
        if positional and _renamable(node):
            swapped.append((node, node.op, node.target, node.args, node.kwargs, node.type))
            node.target = node.name
            continue
        binding = binding_for(node, mode)
        if binding is not None:
            swapped.append((node, node.op, node.target, node.args, node.kwargs, node.type))
            if isinstance(binding, Method):
                node.op, node.target = "call_method", str(binding)
            elif isinstance(binding, Index):
                x, dim, *bounds = Index.wrapped(node)  # type: ignore[misc]
                index = binding.index(dim, x.meta["val"].dim(), *bounds)
                node.target, node.args = operator.getitem, (x, index)
                indexing.add(node)
            elif isinstance(binding, Subscript):
                x = node.args[0]
                index = binding.index(Subscript.indices(node), x.meta["val"].dim())
                node.target, node.args = operator.getitem, (x, index)
                indexing.add(node)
            else:
                node.target = binding
    return swapped, weight_casts, indexing


def _renamable(node: fx.Node) -> bool:
    """A placeholder of a plain parameter (no ``*``, no default) named otherwise than its
    node."""
    return node.op == "placeholder" and not node.args and isinstance(node.target, str) and \
        node.target.isidentifier() and node.target != node.name


class _DirectArgumentsCodeGen(_PyTreeCodeGen):
    """An exported forward's code without the flattening of its arguments where that binds
    each placeholder to the argument of the same name: positional arguments that are each one
    tensor (a leaf of the input spec), no keyword arguments."""

    def gen_var_bindings(self, fn_args: list[str], free_vars: list[str],
                         expanded_def: bool) -> str:
        names = [v.split(":")[0].split("#")[0].strip() for v in free_vars]  # no annotations
        if list(fn_args) == names and _positional_leaves(self.pytree_info.in_spec, len(names)):
            return ""
        return super().gen_var_bindings(fn_args, free_vars, expanded_def)


class _ReadablePyTreeCodeGen(_ReadableCode, _DirectArgumentsCodeGen):
    pass


def _positional_leaves(spec: Any, n: int) -> bool:
    """Whether the input spec ``spec`` is ``(args, {})`` with ``n`` positional arguments that
    are each a leaf."""
    if spec.type is not tuple or spec.num_children != 2:
        return False
    args, kwargs = spec.child(0), spec.child(1)
    return args.type is tuple and kwargs.type is dict and kwargs.num_children == 0 and \
        args.num_children == n and all(args.child(i).is_leaf() for i in range(n))


def _cast_method(node: fx.Node) -> tuple[str, fx.Node] | None:
    """The dtype's own method and its input, for a cast node generated as that method call:
    a cast of a tensor to a dtype, ``x.to(dtype)`` or ``aten.to.dtype(x, dtype)`` (what
    ``x.to(dtype)`` and ``x.bfloat16()`` both dispatch), and a parameter cast
    ``_amp_weight_cache.cast(w, dtype)`` of a weight that the forward's read hands over as
    the cached copy where the cast needs no gradient (``w.bfloat16()`` then returns that
    copy, and casts with autograd where it is needed)."""
    if node.kwargs or len(node.args) < 2 or not isinstance(node.args[-1], torch.dtype):
        return None
    if (node.op == "call_method" and node.target == "to"
            or node.op == "call_function" and node.target is torch.ops.aten.to.dtype) and \
            len(node.args) == 2 and isinstance(node.args[0], fx.Node) and \
            isinstance(node.args[0].meta.get("val"), torch.Tensor):
        # NB: only for a known tensor: symbolic capture records ``.to(dtype)`` of any object
        # that has one (a user's batch class), which need not have ``.bfloat16()``.
        x, dtype = node.args
    elif node.op == "call_method" and node.target == "cast" and len(node.args) == 3 and \
            getattr(node.args[0], "target", None) == CACHE_ATTR and \
            handed_cast_dtype(node.args[1]) is node.args[2]:
        _, x, dtype = node.args
    else:
        return None
    method = CAST_METHODS.get(dtype)
    return None if method is None else (method, x)
