"""FoldConstantsPass: subgraphs that compute the same value on every call (index tables built
from literals, as BEiT builds its relative position index) run once, at conversion; values
that are written from outside, read before a write, returned, random, too large, or read off
a buffer stay computed per call."""

from __future__ import annotations

import re

import sys
from pathlib import Path

import pytest
import torch
import torch.fx as fx
import torch.nn as nn

import amprewrite
from amprewrite.capture.facts import LIFTED_CONSTANTS
from amprewrite.passes import fold_constants
from amprewrite.passes.fold_constants import FoldConstantsPass

aten = torch.ops.aten
BF16 = amprewrite.Policy.autocast("cpu", torch.bfloat16)


def targets(gm: fx.GraphModule) -> list:
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


def folded_attrs(gm: fx.GraphModule) -> list[str]:
    """The constants the pass stored (a converted module reads them with its weights)."""
    return sorted(name for name in [*vars(gm), *gm._buffers] if name.startswith("folded_"))


def grads(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() for p in model.parameters()]


def check_same_as_autocast(model: nn.Module, gm: nn.Module, *inputs: torch.Tensor) -> None:
    """Outputs and parameter gradients bitwise equal to torch.autocast's, on two calls (a
    second call sees the stored constants as the first did)."""
    for x in inputs:
        model.zero_grad()
        with torch.autocast("cpu", torch.bfloat16):
            expected = model(x)
        expected.float().sum().backward()
        expected_grads = grads(model)
        model.zero_grad()
        got = gm(x)
        got.float().sum().backward()
        assert got.dtype == expected.dtype and torch.equal(got, expected)
        for a, b in zip(grads(model), expected_grads):
            assert torch.equal(a, b)


class RelativeBias(nn.Module):
    """A relative position bias as BEiT computes it: an index table built from ``arange``,
    in-place arithmetic on ``select`` views and a ``torch.tensor`` literal, every call."""

    def __init__(self, window: int = 3, heads: int = 2) -> None:
        super().__init__()
        self.window = window
        self.distances = (2 * window - 1) ** 2 + 1
        self.table = nn.Parameter(torch.randn(self.distances, heads))

    def index(self) -> torch.Tensor:
        w = self.window
        coords = torch.stack(torch.meshgrid(torch.arange(w), torch.arange(w), indexing="ij"))
        coords = coords.flatten(1)
        relative = (coords[:, :, None] - coords[:, None, :]).permute(1, 2, 0).contiguous()
        relative[:, :, 0] += w - 1
        relative[:, :, 1] += w - 1
        relative[:, :, 0] *= 2 * w - 1
        index = torch.zeros(w * w + 1, w * w + 1, dtype=torch.long)
        index[1:, 1:] = relative.sum(-1)
        index[0, :] = torch.tensor(self.distances - 1)
        return index

    def forward(self) -> torch.Tensor:
        n = self.window ** 2 + 1
        return self.table[self.index().view(-1)].view(n, n, -1).permute(2, 0, 1)


class Attention(nn.Module):
    def __init__(self, features: int = 8, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(features, 3 * features)
        self.bias = RelativeBias(heads=heads)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, f = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        scores = q @ k.transpose(-1, -2) + self.bias()
        return (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, n, f) + x


class Encoder(nn.Module):
    def __init__(self, layers: int = 2) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.Sequential(*(Attention() for _ in range(layers)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


def tokens(batch: int = 2, seed: int = 1) -> torch.Tensor:
    return torch.randn(batch, 10, 8, generator=torch.Generator().manual_seed(seed))


def test_an_index_table_built_every_call_is_computed_once() -> None:
    model = Encoder()
    plain = torch.export.export(model, (tokens(),)).module()
    for op in (aten.arange.default, aten.meshgrid.indexing, aten.zeros.default,
               aten.copy_.default, aten.add_.Tensor, aten.mul_.Tensor):
        assert op in targets(plain)
    gm = amprewrite.convert(model, (tokens(),), policy=BF16)
    for op in (aten.arange.default, aten.meshgrid.indexing, aten.zeros.default,
               aten.copy_.default, aten.add_.Tensor, aten.mul_.Tensor, aten.select.int,
               aten.lift_fresh_copy.default):
        assert op not in targets(gm), op
    assert aten.index.Tensor in targets(gm)  # the parameter is still read per call
    # both layers build the same table: it is stored once
    [name] = folded_attrs(gm)
    table = getattr(gm, name)
    assert table.dtype == torch.long and table.shape == (100,)
    assert torch.equal(table, model.layers[0].bias.index().view(-1))
    # read by indexing, ``layers_0_bias_table[folded_view_1]``: one per layer
    reads = [line for line in gm.code.splitlines() if re.search(r"= \w+\[folded_\w+\]", line)]
    assert len(reads) == 2
    check_same_as_autocast(model, gm, tokens(), tokens(batch=3, seed=2))


def test_folding_leaves_state_dict_and_parameters_alone() -> None:
    model = Encoder()
    gm = amprewrite.convert(model, (tokens(),), policy=BF16)
    assert set(gm.state_dict()) == set(model.state_dict())
    assert {id(p) for p in gm.parameters()} == {id(p) for p in model.parameters()}
    assert not any("folded" in name for name, _ in gm.named_buffers())


def test_opt_levels_fold_too() -> None:
    model = Encoder()
    for level in ("O2", "O3", "O0"):  # O0's module is the one run below
        gm = amprewrite.convert(model, (tokens(),), opt_level=level,
                                dtype=None if level == "O0" else torch.bfloat16)
        assert aten.meshgrid.indexing not in targets(gm), level
        assert len(folded_attrs(gm)) == 1, level
    with torch.no_grad():
        assert torch.equal(gm(tokens(batch=3)), model(tokens(batch=3)))


def test_the_pass_is_idempotent() -> None:
    gm = amprewrite.convert(Encoder(), (tokens(),), policy=BF16)
    code = gm.code
    assert FoldConstantsPass()(gm).modified is False
    assert gm.code == code


class WrittenFromOutside(nn.Module):
    """A constant buffer that an input-dependent value is written into."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        acc = torch.zeros(4)
        acc[0] = x.sum()
        return x + acc


class ReadBeforeWrite(nn.Module):
    """A constant read by the input's op before a later (constant) in-place write."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        c = torch.zeros(4)
        early = x + c
        c.add_(1)
        return early * c


class ReturnsConstant(nn.Module):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x * 2, torch.arange(4)


class Random(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.rand(4)


@pytest.mark.parametrize("model", [WrittenFromOutside(), ReadBeforeWrite()],
                         ids=["written-from-outside", "read-before-write"])
def test_a_constant_that_changes_during_a_call_stays_per_call(model: nn.Module) -> None:
    gm = amprewrite.convert(model, (torch.ones(3, 4),), policy=BF16)
    assert aten.zeros.default in targets(gm)
    assert folded_attrs(gm) == []
    for x in (torch.ones(3, 4), torch.full((3, 4), 2.0)):
        assert torch.equal(gm(x), model(x))


def test_a_returned_constant_is_fresh_on_every_call() -> None:
    gm = amprewrite.convert(ReturnsConstant(), (torch.ones(2, 4),), policy=BF16)
    assert aten.arange.start_step in targets(gm) or aten.arange.default in targets(gm)
    _, first = gm(torch.ones(2, 4))
    first.add_(10)  # the caller owns what it got
    _, second = gm(torch.ones(2, 4))
    assert torch.equal(second, torch.arange(4))


def test_random_ops_stay_per_call() -> None:
    gm = amprewrite.convert(Random(), (torch.zeros(4),), policy=BF16)
    assert folded_attrs(gm) == []
    assert not torch.equal(gm(torch.zeros(4)), gm(torch.zeros(4)))


def test_a_buffer_is_state_not_a_constant() -> None:
    class Scaled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("scale", torch.ones(4))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * (self.scale * 2)

    model = Scaled()
    gm = amprewrite.convert(model, (torch.ones(4),), policy=BF16)
    assert folded_attrs(gm) == []
    model.scale.fill_(3.0)  # shared with the converted module
    assert torch.equal(gm(torch.ones(4)), torch.full((4,), 6.0))


class LiteralScale(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) * (torch.tensor([1.0, 2.0, 3.0]) * 2)


def test_a_value_from_an_exported_literal_moves_with_the_module() -> None:
    x = torch.randn(2, 3)
    gm = amprewrite.convert(LiteralScale(), (x,), policy=BF16)
    # torch.export lifted the literal as a buffer, so its folded product is one too ...
    assert folded_attrs(gm) == ["folded_mul"]
    assert "folded_mul" not in gm.state_dict()
    gm.to("meta")
    # ... and goes where .to() sends the module, as the literal itself would have
    assert gm(x.to("meta")).device.type == "meta"


def test_a_value_from_a_plain_attribute_stays_one() -> None:
    """A constant from a plain attribute (a stored constant of an earlier conversion) is kept
    as one, which .to() leaves where it is."""
    root = nn.Module()
    root.table = torch.arange(3.0)
    graph = fx.Graph()
    x = graph.placeholder("x")
    doubled = graph.call_function(aten.mul.Tensor, (graph.get_attr("table"), 2))
    graph.output(graph.call_function(aten.add.Tensor, (x, doubled)))
    gm = fx.GraphModule(root, graph)
    del gm._buffers["table"]  # fx.GraphModule registers every tensor it copies as a buffer
    gm.table = root.table
    assert FoldConstantsPass()(gm).modified is True
    assert folded_attrs(gm) == ["folded_mul_tensor"] and not gm._buffers
    assert torch.equal(gm(torch.zeros(3)), torch.tensor([0.0, 2.0, 4.0]))


def test_a_value_over_the_size_limit_stays_per_call(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fold_constants, "MAX_FOLDED_BYTES", 99)
    model = Encoder()
    gm = amprewrite.convert(model, (tokens(),), policy=BF16)
    # the 100-entry int64 table (800 bytes) is built per call again ...
    assert aten.zeros.default in targets(gm)
    # ... from the smaller constants before it
    assert aten.meshgrid.indexing not in targets(gm)
    check_same_as_autocast(model, gm, tokens())


def test_a_literal_the_graph_writes_to_is_not_folded() -> None:
    """A graph that adds to its own attribute in place is stateful: each call adds again."""
    root = nn.Module()
    root.counter = torch.zeros(2)
    graph = fx.Graph()
    x = graph.placeholder("x")
    counter = graph.get_attr("counter")
    bumped = graph.call_function(aten.add_.Tensor, (counter, 1))
    graph.output(graph.call_function(aten.add.Tensor, (x, bumped)))
    gm = fx.GraphModule(root, graph)
    gm.meta[LIFTED_CONSTANTS] = frozenset({"counter"})  # a literal, as torch.export marks them
    assert FoldConstantsPass()(gm).modified is False
    assert torch.equal(gm.counter, torch.zeros(2))  # the pass did not run the write on it
    assert torch.equal(gm(torch.zeros(2)), torch.ones(2))
    assert torch.equal(gm(torch.zeros(2)), torch.full((2,), 2.0))


def test_nothing_folds_on_fake_values() -> None:
    root = nn.Module()
    graph = fx.Graph()
    x = graph.placeholder("x")
    table = graph.call_function(aten.arange.default, (4,), {"dtype": torch.float32})
    graph.output(graph.call_function(aten.add.Tensor, (x, table)))
    gm = fx.GraphModule(root, graph)
    with torch._subclasses.fake_tensor.FakeTensorMode():
        assert FoldConstantsPass()(gm).modified is False
    assert FoldConstantsPass()(gm).modified is True  # real values: folded
    assert torch.equal(gm(torch.ones(4)), torch.arange(1.0, 5.0))


sys.path.insert(0, str(Path(__file__).parent / "models"))


def test_a_converted_beit_builds_no_index_table_per_call() -> None:
    pytest.importorskip("transformers")
    import _hf_zoo

    arch = _hf_zoo.arch("beit")
    model = arch.build()
    args, kwargs = arch.example()
    gm = amprewrite.convert(model, args, example_kwargs=kwargs, policy=BF16)
    for op in (aten.arange.default, aten.meshgrid.indexing, aten.copy_.default,
               aten.fill_.Tensor, aten.add_.Tensor, aten.mul_.Tensor):
        assert op not in targets(gm), op
    with torch.no_grad(), torch.autocast("cpu", torch.bfloat16):
        expected = arch.output(model(*args, **kwargs))
    with torch.no_grad():
        assert torch.equal(arch.output(gm(*args, **kwargs)), expected)
