"""Moving nodes between a graph and the sub-graphs of its higher-order ops.

Captures hand over some of a model's structure as higher-order ops whose body is a child
GraphModule (``wrap_with_autocast``, ``wrap_with_set_grad_enabled``,
``tag_activation_checkpoint``). The passes work on one flat graph, so a body is *inlined*:
its nodes are copied into the parent, each tagged with a meta key that says where it came
from. A region that must exist again at run time (a checkpoint, which recomputes its body
in backward) is *outlined* after the passes: its tagged nodes, with the casts the passes
inserted for them, move back into a new child GraphModule called by the same op.

Inline (the parent of a body ``wrap_body_0(h, w) = linear(h, w)``)::

    tag_activation_checkpoint = torch.ops.higher_order.tag_activation_checkpoint(
        wrap_body_0, h, w, use_reentrant=False)
    h_1 = tag_activation_checkpoint[0]

becomes ``linear = torch._C._nn.linear(h, w)`` with ``linear.meta[key] = index`` and
``h_1``'s users reading ``linear``; outlining the tagged nodes (after a cast was inserted
before ``linear``) gives back the first form, with a body ``w_bf16 = w.to(torch.bfloat16);
linear = torch._C._nn.linear(h, w_bf16)``.
"""

from __future__ import annotations

import operator
from typing import Any, Callable, Iterator

import torch.fx as fx

from ..errors import AmpRewriteError

__all__ = ["inline_body", "outline", "NotConvex", "nodes_with_bodies"]


def nodes_with_bodies(gm: fx.GraphModule) -> Iterator[fx.Node]:
    """``gm``'s nodes in order, with the nodes of each child GraphModule (a checkpoint's
    body) in place of the ``get_attr`` that reads it: what runs, in the order it runs."""
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            child = getattr(gm, str(node.target), None)  # a dotted weight path gives None
            if isinstance(child, fx.GraphModule):
                yield from nodes_with_bodies(child)
                continue
        yield node


def inline_body(gm: fx.GraphModule, node: fx.Node, body: fx.Node, operands: list[Any],
                tag: tuple[str, Any]) -> None:
    """Replace the higher-order op ``node`` by the nodes of its body (``body``, the
    ``get_attr`` of a child GraphModule) called on ``operands``, each tagged
    ``meta[tag[0]] = tag[1]`` unless it already carries the key (an inner region's tag
    wins). ``node``'s ``node[i]`` users read the i-th output; the child is dropped."""
    sub = getattr(gm, str(body.target))
    with gm.graph.inserting_before(node):
        outputs = _copy_nodes(gm, sub, str(body.target), operands, tag)
    _replace_tuple_uses(node, outputs)
    gm.graph.erase_node(node)
    if not body.users:
        gm.graph.erase_node(body)
        delattr(gm, str(body.target))


def _copy_nodes(gm: fx.GraphModule, sub: fx.GraphModule, prefix: str, operands: list[Any],
                tag: tuple[str, Any]) -> Any:
    """Copy ``sub``'s nodes before the insertion point of ``gm``; return its outputs."""
    placeholders = [n for n in sub.graph.nodes if n.op == "placeholder"]
    env: dict[fx.Node, Any] = dict(zip(placeholders, operands))
    outputs: Any = None
    for sub_node in sub.graph.nodes:
        if sub_node.op == "placeholder":
            continue
        if sub_node.op == "output":
            outputs = fx.node.map_arg(sub_node.args[0], lambda n: env[n])
            continue
        if sub_node.op == "get_attr":
            name = f"{prefix}_{sub_node.target}"
            setattr(gm, name, getattr(sub, str(sub_node.target)))
            new = gm.graph.get_attr(name)
        else:
            new = gm.graph.node_copy(sub_node, lambda n: env[n])
        new.meta = dict(sub_node.meta)
        new.meta.setdefault(*tag)
        env[sub_node] = new
    return outputs


def _replace_tuple_uses(node: fx.Node, outputs: Any) -> None:
    """Point the ``node[i]`` users of a tuple-returning region at its i-th output."""
    outs = outputs if isinstance(outputs, (tuple, list)) else (outputs,)
    for user in list(node.users):
        if user.op != "call_function" or user.target is not operator.getitem:
            raise AmpRewriteError(
                f"cannot inline {node.format_node()}: its result is used whole by "
                f"{user.format_node()}, not item by item. Convert with "
                "amprewrite.compile(model) instead.")
        user.replace_all_uses_with(outs[user.args[1]])
        node.graph.erase_node(user)


_VALUE_KEYS = ("val", "example_value", "tensor_meta")
"""What a node moved across a body's boundary keeps: its value, not decisions about it."""


class NotConvex(Exception):
    """The nodes to outline are not one piece: a node outside them lies on a path from one of
    them to another, so no single call can compute them."""


def outline(gm: fx.GraphModule, members: list[fx.Node], name: str,
            make_call: Callable[[fx.Graph, fx.Node, tuple[fx.Node, ...]], fx.Node]) -> fx.Node:
    """Move ``members`` (in graph order) into a new child GraphModule ``gm.<name>`` and
    compute them by one call that ``make_call(graph, body_node, inputs)`` inserts (a
    higher-order op taking the body's ``get_attr`` and its inputs). The call returns a tuple:
    each member used outside is read back with ``call[i]``. Returns the call node.

    Raises :class:`NotConvex` (the graph untouched) where a non-member depends on a member
    and a member depends on it in turn."""
    graph = gm.graph
    inside = set(members)
    order = {n: i for i, n in enumerate(graph.nodes)}
    last = max(members, key=order.__getitem__)
    later = _users_before(members, inside, order, order[last])
    if any(_depends_on(m, set(later), order) for m in members):
        raise NotConvex(name)
    inputs: list[fx.Node] = []
    for member in members:
        for arg in member.all_input_nodes:
            if arg not in inside and arg not in inputs:
                inputs.append(arg)
    outputs = [m for m in members if any(u not in inside for u in m.users)]

    body = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for arg in inputs:
        env[arg] = body.placeholder(arg.name)
        env[arg].meta = {k: v for k, v in arg.meta.items() if k in _VALUE_KEYS}
    for member in members:
        env[member] = body.node_copy(member, env.__getitem__)
        env[member].meta = dict(member.meta)
    body.output(tuple(env[o] for o in outputs))
    setattr(gm, name, fx.GraphModule(gm, body, class_name=name))

    with graph.inserting_after(last):
        body_node = graph.get_attr(name)
    with graph.inserting_after(body_node):
        call = make_call(graph, body_node, tuple(inputs))
    anchor = call
    for i, out in enumerate(outputs):
        with graph.inserting_after(anchor):
            item = graph.call_function(operator.getitem, (call, i))
        item.meta = {k: v for k, v in out.meta.items()
                     if k in _VALUE_KEYS + ("stack_trace", "nn_module_stack")}
        for user in list(out.users):
            if user not in inside:
                user.replace_input_with(out, item)
        anchor = item
    for node in later:  # users that sat among the members now follow the call
        anchor.append(node)
        anchor = node
    for member in reversed(members):
        graph.erase_node(member)
    return call


def _users_before(members: list[fx.Node], inside: set[fx.Node], order: dict[fx.Node, int],
                  end: int) -> list[fx.Node]:
    """Non-members placed before ``end`` that depend on a member, in graph order."""
    found: set[fx.Node] = set()
    stack = [u for m in members for u in m.users if u not in inside]
    while stack:
        node = stack.pop()
        if node in found or order[node] > end:
            continue
        found.add(node)
        stack.extend(u for u in node.users if u not in inside)
    return sorted(found, key=order.__getitem__)


def _depends_on(node: fx.Node, targets: set[fx.Node], order: dict[fx.Node, int]) -> bool:
    """Whether ``node`` reads (transitively) any of ``targets``."""
    if not targets:
        return False
    first = min(order[t] for t in targets)
    seen: set[fx.Node] = set()
    stack = list(node.all_input_nodes)
    while stack:
        arg = stack.pop()
        if arg in targets:
            return True
        if arg in seen or order[arg] < first:
            continue
        seen.add(arg)
        stack.extend(arg.all_input_nodes)
    return False
