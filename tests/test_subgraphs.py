"""Moving nodes into a child GraphModule and back (``amprewrite.graph.subgraphs``): the
checkpoint regions of the compile backend rest on it."""

from __future__ import annotations

import operator

import pytest
import torch
import torch.fx as fx

from amprewrite.graph.subgraphs import NotConvex, inline_body, nodes_with_bodies, outline

_WRAP = torch.ops.higher_order.tag_activation_checkpoint


def _graph(code) -> fx.GraphModule:
    """A GraphModule from a function of (x, w) traced symbolically."""
    return fx.symbolic_trace(code)


def _call(graph: fx.Graph, body: fx.Node, inputs: tuple[fx.Node, ...]) -> fx.Node:
    return graph.call_function(_WRAP, (body, *inputs), {"use_reentrant": False})


def _nodes(gm: fx.GraphModule, *names: str) -> list[fx.Node]:
    by_name = {n.name: n for n in gm.graph.nodes}
    return [by_name[n] for n in names]


def test_outline_then_inline_gives_back_the_values():
    def f(x, w):
        a = x @ w
        b = torch.relu(a)
        c = b * 2
        return c + x, a

    x, w = torch.randn(3, 3), torch.randn(3, 3)
    want = f(x, w)
    gm = _graph(f)
    call = outline(gm, _nodes(gm, "matmul", "relu", "mul"), "body", _call)
    gm.graph.lint()
    gm.recompile()
    assert [n.op for n in gm.body.graph.nodes].count("placeholder") == 2
    # mul (read by add) and matmul (returned) leave the body; relu stays inside
    assert len(call.users) == 2
    assert all(u.target is operator.getitem for u in call.users)
    for got, expected in zip(gm(x, w), want):
        assert torch.equal(got, expected)

    body_node = call.args[0]
    inline_body(gm, call, body_node, list(call.args[1:]), ("tag", 7))
    gm.graph.lint()
    gm.recompile()
    assert not hasattr(gm, "body")
    assert [n.meta.get("tag") for n in gm.graph.nodes if n.op == "call_function"
            and n.target is not operator.add] == [7, 7, 7]
    for got, expected in zip(gm(x, w), want):
        assert torch.equal(got, expected)


def test_outline_moves_a_user_that_sat_among_the_members():
    def f(x, w):
        a = x @ w
        b = a.sum()          # outside the region, yet placed between its members
        c = torch.relu(a)
        return c, b

    x, w = torch.randn(3, 3), torch.randn(3, 3)
    gm = _graph(f)
    outline(gm, _nodes(gm, "matmul", "relu"), "body", _call)
    gm.graph.lint()  # topological order holds: sum now follows the call
    gm.recompile()
    for got, expected in zip(gm(x, w), f(x, w)):
        assert torch.equal(got, expected)


def test_outline_refuses_a_region_that_reads_its_own_outside_user():
    def f(x, w):
        a = x @ w
        b = a.sum()          # outside, reads a member ...
        c = a * b            # ... and a member reads it: no single call computes a and c
        return c

    gm = _graph(f)
    before = gm.code
    with pytest.raises(NotConvex):
        outline(gm, _nodes(gm, "matmul", "mul"), "body", _call)
    assert gm.code == before and not hasattr(gm, "body")


def test_nodes_with_bodies_walks_into_children_where_they_are_called():
    def f(x, w):
        return torch.relu(x @ w) + 1

    gm = _graph(f)
    outline(gm, _nodes(gm, "matmul", "relu"), "body", _call)
    names = [n.name for n in nodes_with_bodies(gm) if n.op == "call_function"]
    assert names[:2] == ["matmul", "relu"]  # the body's, where its get_attr stood
    assert names[2] == "tag_activation_checkpoint"
