"""DecomposeCompositesPass: split unlisted composite ops the way autocast meets them.

Autocast wraps an op only if it is listed; an unlisted op with a ``CompositeImplicitAutograd``
kernel (``einsum``, ``inner``, ``cross_entropy_loss``, ``gru_cell``, …) falls through and runs
its kernel, whose calls go through autocast one by one. The first listed op on each path is
cast, and its own inside runs with autocast off. So under CUDA autocast ``torch.inner(x, w)``
meets ``tensordot`` (a promote op: fp32 inputs stay fp32), and ``F.cross_entropy`` runs
``log_softmax(x, 1, dtype=x.dtype)`` in the input's dtype, then ``nll_loss`` in fp32. A graph
node for the whole op would run it in one dtype.

This pass replaces such a node by what its op calls, one level down
(:func:`amprewrite.graph.composites.one_level`), when, and only when, a listed op lies on the
way down; pieces that are unlisted composites themselves are split the same way in turn. The
other passes then treat the pieces as autocast does. Composites that reach no listed op stay
whole, so ``gm.code`` keeps its readable torch-level calls.

Before (``Policy.autocast("cuda")``)::

    cross_entropy = torch.nn.functional.cross_entropy(linear, targets)

After (then the casts of the other passes)::

    log_softmax = torch.ops.aten.log_softmax.int(linear, 1, torch.bfloat16)
    nll_loss = torch.ops.aten.nll_loss.default(log_softmax, targets, None, 1, -100)

**Dtypes first.** What a composite calls can depend on its inputs' dtypes
(``cross_entropy_loss`` passes ``dtype=x.dtype`` to ``log_softmax``), and those are known only
once the ops before it are decided and cast. So a composite is split only when every node it
depends on has been decided and cast; until then it is marked
:class:`~amprewrite.graph.meta.PendingSplit`, no pass casts around it, and
:func:`amprewrite.passes.pipeline.run_passes` runs this pass, ClassifyPass and InsertCastsPass
again until none is pending (one more round per level of nesting).

**Mixed dtypes.** Autocast casts at the listed piece, so the op whole may refuse what its
pieces take (``einsum`` of a bf16 query and an fp32 table: its ``bmm`` wants one dtype).
Such an op is traced on its inputs promoted to one dtype, and its pieces' values are computed
again on the real ones under the ``torch.autocast`` the preset mirrors; the passes after this
one then cast at the listed piece, as autocast does.

**Without dtypes** (no example inputs), only torch Python functions the policy knows autocast
splits (its composite table: ``F.normalize``) are split, into their own code traced
symbolically (:func:`amprewrite.graph.composites.python_body`); other composites stay whole
and run by the composite table's rule.
"""

from __future__ import annotations

import contextlib
import operator
import warnings
from typing import Any

import torch
import torch.fx as fx
from torch.fx.passes.infra.pass_base import PassBase, PassResult

from ..capture.facts import REGION_KEY
from ..errors import user_stacklevel
from ..graph.fake import fake_run
from ..graph.composites import is_composite, one_level, python_body
from ..graph.meta import META_KEY, PIECES_KEY, PendingSplit, decision, pending_split
from ..policy.opkey import is_inplace, op_key, overload_key
from ..policy.policy import Policy
from ..policy.tables import OpCategory
from .op_nodes import takes_decision
from .propagation import mirrored_autocast_at

__all__ = ["DecomposeCompositesPass"]

_KEPT_META = ("nn_module_stack", "stack_trace", "source_fn_stack", REGION_KEY)
_MAX_DEPTH = 8
"""How many levels down a composite is searched for a listed op (ATen nests about 4 deep)."""


class DecomposeCompositesPass(PassBase):
    """Split unlisted composite ops into what they call, down to the first listed ops."""

    def __init__(self, policy: Policy) -> None:
        super().__init__()
        self.policy = policy
        self._reach: dict[Any, bool] = {}
        """Signatures (:func:`_signature`) whose split reaches no listed op: kept whole, not
        traced again. NB: a trace costs tens of milliseconds (make_fx), and a vision model
        holds a hundred batch norms of a few shapes."""
        self._pieces: dict[Any, frozenset[str]] = {}
        """The op names each of those is made of (``node.meta[PIECES_KEY]``, which tells
        InsertCastsPass that re-running the node can give no other dtype)."""
        self._warned: set[str] = set()

    def call(self, gm: fx.GraphModule) -> PassResult:
        static = all("val" in n.meta for n in gm.graph.nodes if n.op == "placeholder")
        modified = self._split_static(gm) if static else self._split_guarded(gm)
        if modified:
            gm.graph.lint()
            gm.recompile()
        return PassResult(gm, modified)

    # -- with dtypes -----------------------------------------------------------------------
    def _split_static(self, gm: fx.GraphModule) -> bool:
        settled: set[fx.Node] = set()
        self._gone: set[fx.Node] = set()
        modified = False
        for node in list(gm.graph.nodes):
            if node in self._gone:  # erased by a split (the items of a multi-output op)
                continue
            ready = all(a in settled for a in node.all_input_nodes)
            if self._candidate(node):
                modified |= self._visit(gm, node, ready, settled)
                if node in self._gone:
                    continue
            if ready and _decided(node):
                settled.add(node)
        return modified

    def _visit(self, gm: fx.GraphModule, node: fx.Node, ready: bool,
               settled: set[fx.Node]) -> bool:
        """Split ``node`` (if its inputs are settled), mark it pending (if not), or leave it
        whole (if it reaches no listed op). Whether the graph changed."""
        was_pending = pending_split(node) is not None
        key = _signature(node)
        sub = one_level(node) if self._reach.get(key, True) else None
        autocast = self._autocast(node) if sub is None and key not in self._reach else None
        if autocast is not None:  # a piece rejects mixed dtypes that autocast would cast
            sub = one_level(node, one_dtype=True)
        one_dtype = autocast is not None and sub is not None
        symbolic = sub is not None and _bakes_sizes(node, sub)
        if symbolic:  # traced on the example's sizes, it would hold them: trace them symbolic
            sub = one_level(node, symbolic=True, one_dtype=one_dtype)
        if sub is None or not self._reaches(sub):
            if sub is None and key not in self._reach:
                self._warn_if_reaches_listed(node)
            if sub is not None:
                self._pieces[key] = frozenset(op_key(n) for n in sub.graph.nodes
                                              if n.op == "call_function")
            if key in self._pieces:
                node.meta[PIECES_KEY] = self._pieces[key]
            self._reach[key] = False  # whole: not traced again on later rounds
            if was_pending:
                del node.meta[META_KEY]
            return was_pending
        if not ready:
            node.meta[META_KEY] = PendingSplit(op_key(node))
            return not was_pending
        pieces = _inline(gm, node, sub, self._gone, rerun=symbolic or one_dtype,
                         autocast=autocast)
        if pieces is None:
            if was_pending:
                del node.meta[META_KEY]
            return was_pending
        # Pieces that read only settled values (the op a torch-level call reaches, which
        # takes the call's own inputs) are split at once; the others once decided and cast.
        for piece in pieces:
            if self._candidate(piece):
                self._visit(gm, piece, all(a in settled for a in piece.all_input_nodes),
                            settled)
        return True

    def _autocast(self, node: fx.Node) -> torch.autocast | None:
        """``torch.autocast`` as the preset mirrors it, where ``node``'s floating inputs mix
        dtypes on the preset's device: the pieces of its split are then run under it to learn
        their dtypes (a listed piece casts its inputs, as the passes after this one will)."""
        dtypes = {v.dtype for v in (a.meta.get("val") for a in node.all_input_nodes)
                  if isinstance(v, torch.Tensor) and v.is_floating_point()}
        return mirrored_autocast_at(self.policy, node) if len(dtypes) > 1 else None

    def _candidate(self, node: fx.Node) -> bool:
        if node.op not in ("call_function", "call_method") or is_inplace(node):
            return False
        if not takes_decision(node) and pending_split(node) is None:
            return False  # a cast, an fp8 step, export's input guard
        if not isinstance(node.meta.get("val"), torch.Tensor) and not _tensor_tuple(node):
            return False
        if any(not isinstance(a.meta.get("val"), torch.Tensor) for a in node.all_input_nodes):
            return False
        if not any(v.is_floating_point() for v in _tensor_vals(node)):
            return False  # autocast touches floating tensors only: nothing to split for
        return self._unlisted(node) and is_composite(node)

    def _unlisted(self, node: fx.Node) -> bool:
        region = node.meta.get(REGION_KEY)
        if region is not None and not region.enabled:
            return False  # the model's own enabled=False region: nothing is autocast
        key = op_key(node)
        return self.policy.table_rule(key, overload_key(node)) is None and \
            self.policy.op_override(key) is None

    def _reaches(self, sub: fx.GraphModule, depth: int = 0) -> bool:
        """Whether a listed op lies on the way down ``sub``'s composites."""
        for n in sub.graph.nodes:
            if n.op != "call_function" or not isinstance(n.target, torch._ops.OpOverload):
                continue
            if self._listed(n):
                return True
            if depth >= _MAX_DEPTH or is_inplace(n) or not self._unlisted(n) or \
                    not is_composite(n):
                continue
            key = _signature(n)
            if key not in self._reach:
                inner = one_level(n)
                self._reach[key] = inner is not None and self._reaches(inner, depth + 1)
            if self._reach[key]:
                return True
        return False

    def _warn_if_reaches_listed(self, node: fx.Node) -> None:
        """A node that cannot be traced on its own fake inputs (an ATen kernel that rejects
        symbolic sizes, as ``aten.lstm`` does under export's dynamic shapes): trace it on
        concrete sizes only to tell the user when it stays whole where autocast would not."""
        if node.name in self._warned:
            return
        sub = one_level(node, concrete=True)
        if sub is None or not self._reaches(sub):
            return
        self._warned.add(node.name)
        listed = sorted({op_key(n) for n in sub.graph.nodes if self._listed(n)}) or \
            [f"pieces of {op_key(node)}"]
        warnings.warn(
            f"amprewrite: {node.format_node()} could not be split into its ATen pieces "
            f"(its kernel rejects symbolic sizes), so it runs whole in the dtype that "
            f"reaches it; torch.autocast would run its {', '.join(listed)} per the "
            f"policy. Results may differ from torch.autocast for this op.",
            stacklevel=user_stacklevel())

    def _listed(self, node: fx.Node) -> bool:
        if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
            return False
        rule = self.policy.table_rule(op_key(node), overload_key(node))
        return rule is not None and rule[0] is not OpCategory.PASSTHROUGH

    # -- without dtypes --------------------------------------------------------------------
    def _split_guarded(self, gm: fx.GraphModule) -> bool:
        modified = False
        work = list(gm.graph.nodes)
        while work:
            node = work.pop(0)
            key = op_key(node) if node.op == "call_function" else ""
            if not key or self.policy.composite_rule(key) is None or not self._unlisted(node):
                continue
            body = python_body(node)
            if body is None or not any(self._listed_torch_level(n, key) for n in body.nodes):
                continue
            pieces = _inline(gm, node, body, set())
            if pieces is not None:
                work[:0] = pieces
                modified = True
        return modified

    def _listed_torch_level(self, node: fx.Node, whole: str) -> bool:
        """A piece of a torch-level split that some rule lists (its table, or its composite
        table: a torch-level call of a composite is decided as a whole), other than the op
        that was split (``F.pairwise_distance`` calls ``torch.pairwise_distance``)."""
        if node.op not in ("call_function", "call_method") or op_key(node) == whole:
            return False
        key = op_key(node)
        rule = self.policy.table_rule(key, overload_key(node)) or \
            self.policy.composite_rule(key)
        return rule is not None and rule[0] is not OpCategory.PASSTHROUGH


def _decided(node: fx.Node) -> bool:
    """Whether ``node``'s dtype is final: a placeholder, an attribute, a cast, or an op that
    ClassifyPass decided (and so InsertCastsPass cast); not a piece of a split that no pass
    has seen yet, nor a composite waiting to be split."""
    if node.op in ("placeholder", "get_attr"):
        return True
    if pending_split(node) is not None:
        return False
    return not takes_decision(node) or decision(node) is not None


def _tensor_vals(node: fx.Node) -> list[torch.Tensor]:
    """The tensors ``node`` reads and makes (their fake values)."""
    out = node.meta.get("val")
    made = list(out) if isinstance(out, (tuple, list)) else [out]
    return [v for v in [*(a.meta.get("val") for a in node.all_input_nodes), *made]
            if isinstance(v, torch.Tensor)]


def _bakes_sizes(node: fx.Node, sub: fx.GraphModule) -> bool:
    """Whether ``sub`` (traced on the size hints of ``node``'s inputs) holds one of their
    dynamic sizes as a number: its split would compute for the example's size only (a
    ``narrow`` of length 8 where the sequence may be any length). NB: a small dimension
    index equal to a hint by chance also counts; the op then stays whole, as before any
    split."""
    hints = {int(s.node.hint) for v in _tensor_vals(node) for s in v.shape
             if isinstance(s, torch.SymInt) and s.node.hint is not None}
    if not hints:
        return False
    for n in sub.graph.nodes:
        for arg in torch.utils._pytree.tree_leaves((n.args, n.kwargs)):
            if type(arg) is int and arg in hints:
                return True
    return False


def _signature(node: fx.Node) -> tuple:
    """What the decomposition of ``node``'s op can depend on: the op, its arguments, each
    tensor as its dtype, rank, device and autograd flag (not its sizes: decompositions of one
    op that reach a listed op at some sizes only are not known to exist), and its autocast
    region."""
    def like(a: Any) -> Any:
        val = a.meta.get("val") if isinstance(a, fx.Node) else a
        if isinstance(val, torch.Tensor):
            return ("tensor", val.dtype, val.dim(), val.device.type, val.requires_grad)
        return ("node",) if isinstance(a, fx.Node) else a

    return (node.op, node.target, repr(fx.node.map_aggregate(node.args, like)),
            repr(fx.node.map_aggregate(node.kwargs, like)), node.meta.get(REGION_KEY))


def _tensor_tuple(node: fx.Node) -> bool:
    val = node.meta.get("val")
    return isinstance(val, (tuple, list)) and all(isinstance(v, torch.Tensor) for v in val)


def _inline(gm: fx.GraphModule, node: fx.Node, sub: fx.GraphModule | fx.Graph,
            gone: set[fx.Node], rerun: bool = False,
            autocast: torch.autocast | None = None) -> list[fx.Node] | None:
    """Replace ``node`` by the nodes of ``sub`` (its placeholders are ``node``'s inputs) and
    add the nodes erased to ``gone``; the new nodes, or None where ``node``'s tuple output is
    used whole. ``rerun``: the new nodes' values are computed on ``gm``'s fake values (``sub``
    was traced with sizes or dtypes of its own), not copied from ``sub``; under ``autocast``
    if given."""
    graph = gm.graph
    sub_graph = sub.graph if isinstance(sub, fx.GraphModule) else sub
    output = next(n for n in sub_graph.nodes if n.op == "output")
    results = output.args[0]
    multi = isinstance(results, (tuple, list))
    if multi and not all(u.op == "call_function" and u.target is operator.getitem
                         for u in node.users):
        return None  # a tuple used whole: keep the node rather than rebuild the tuple
    env: dict[fx.Node, Any] = dict(zip([n for n in sub_graph.nodes if n.op == "placeholder"],
                                       node.all_input_nodes))
    kept = {k: node.meta[k] for k in _KEPT_META if k in node.meta}
    pieces = []
    with graph.inserting_before(node):
        for sub_node in sub_graph.nodes:
            if sub_node.op in ("placeholder", "output"):
                continue
            if sub_node.op == "get_attr":  # a constant the decomposition made
                name = f"_decomposed_{node.name}_{sub_node.target}"
                setattr(gm, name, getattr(sub, str(sub_node.target)))
                new = graph.create_node("get_attr", name)
            else:
                new = graph.node_copy(sub_node, lambda n: env[n])
                pieces.append(new)
            new.meta = {**kept, **{k: v for k, v in sub_node.meta.items()
                                   if k in ("val", "tensor_meta") and not rerun}}
            if rerun and new.op != "get_attr":
                with autocast or contextlib.nullcontext():
                    new.meta["val"] = fake_run(gm, new)
            env[sub_node] = new
    mapped = fx.node.map_arg(results, lambda n: env[n])
    if multi:
        for user in list(node.users):
            user.replace_all_uses_with(mapped[user.args[1]])
            graph.erase_node(user)
            gone.add(user)
    else:
        node.replace_all_uses_with(mapped)
    graph.erase_node(node)
    gone.add(node)
    return pieces
