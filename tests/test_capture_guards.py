"""torch.export's input-shape check runs as a plain call in a converted module's forward and
through torch.export's own wrapper under Dynamo."""

from __future__ import annotations

import copy
import re

import pytest
import torch
import torch.fx as fx
import torch.nn as nn

import amprewrite
from amprewrite.capture.guards import InputGuards, fast_input_guards


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.fc(x))


def _converted() -> fx.GraphModule:
    return amprewrite.convert(Net(), (torch.randn(2, 8),),
                              policy=amprewrite.Policy.autocast("cpu", torch.bfloat16))


def test_the_check_is_called_without_the_dynamo_wrapper() -> None:
    gm = _converted()
    guards = gm._guards_fn
    assert isinstance(guards, InputGuards)
    assert "self._guards_fn(x)" in gm.code
    calls: list[tuple] = []
    check = guards._check
    guards._check = lambda *args: calls.append(args) or check(*args)
    guards._traced = lambda *args: pytest.fail("the Dynamo-wrapped check ran eagerly")
    x = torch.randn(5, 8)
    out = gm(x)
    assert len(calls) == 1 and calls[0][0] is x
    with torch.autocast("cpu", torch.bfloat16):
        assert torch.equal(out, Net()(x))


def test_a_wrong_shape_fails_with_exports_message() -> None:
    gm = _converted()
    with pytest.raises(amprewrite.AmpRewriteError, match=r"x: captured for .* \(any, 8\)") as info:
        gm(torch.randn(2, 9))
    # the call's error names the argument; export's own check is its cause
    assert isinstance(info.value.__cause__, AssertionError)
    assert re.search(r"Guard failed: x\.size\(\)\[1\] == 8", str(info.value.__cause__))


def test_the_call_survives_dead_code_elimination_and_copies() -> None:
    gm = _converted()
    gm.graph.eliminate_dead_code()
    gm.recompile()
    assert [n.target for n in gm.graph.nodes if n.op == "call_module"] == ["_guards_fn"]
    clone = copy.deepcopy(gm)
    assert isinstance(clone._guards_fn, InputGuards)
    with pytest.raises(amprewrite.AmpRewriteError) as info:
        clone(torch.randn(2, 9))
    assert "Guard failed" in str(info.value.__cause__)
    fast_input_guards(clone)  # idempotent
    assert isinstance(clone._guards_fn, InputGuards)


@pytest.mark.usefixtures("fresh_dynamo")
def test_under_dynamo_the_wrapped_check_is_traced() -> None:
    gm = _converted()
    traced = gm._guards_fn._traced
    seen: list[bool] = []

    def spy(*args: torch.Tensor) -> None:
        seen.append(torch.compiler.is_dynamo_compiling())
        return traced(*args)

    gm._guards_fn._traced = spy
    x = torch.randn(3, 8)
    out = torch.compile(gm, backend="eager")(x)
    assert seen and all(seen)  # called while Dynamo traced, never at run time
    assert torch.equal(out, gm(x))


def test_an_unknown_guard_module_is_left_alone() -> None:
    gm = _converted()

    class Other(nn.Module):
        _is_impure = True

        def forward(self, *args: torch.Tensor) -> None:
            torch._assert(args[0].size()[1] == 8, "Guard failed")

    other = Other()
    gm._guards_fn = other
    fast_input_guards(gm)
    assert gm._guards_fn is other


class Ids(nn.Module):
    """Token ids and features: an integer and a floating input."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed, self.fc = nn.Embedding(10, 8), nn.Linear(8, 8)

    def forward(self, ids: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return self.embed(ids) + self.fc(x)


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_an_integer_tensor_where_a_float_was_captured_raises(opt_level: str) -> None:
    """The model itself raises for int64 features (its linear meets an fp32 weight); the
    converted module must not cast them to bf16 and return a result. Another floating dtype
    is fine (float64 only at O2: see test_convert's float64 tests), and so is another
    integer dtype."""
    model = Ids()
    ids, x = torch.randint(0, 10, (2, 3)), torch.randn(2, 3, 8)
    gm = amprewrite.convert(model, (ids, x), opt_level=opt_level)
    assert gm._guards_fn._floating == (False, True)
    with pytest.raises(RuntimeError, match="mat1 and mat2 must have the same dtype"):
        model(ids, x.long())
    with torch.no_grad():
        with pytest.raises(amprewrite.AmpRewriteError,
                           match=r"x: captured for float32 of shape \(any, any, 8\), called "
                                 r"with int64 of shape \(2, 3, 8\)") as info:
            gm(ids, x.long())
        assert "argument 1 of the converted module's forward is a torch.int64 tensor" in \
            str(info.value.__cause__)
        with pytest.raises(amprewrite.AmpRewriteError,
                           match=r"ids: captured for int64 .* called with float32"):
            gm(ids.float(), x)
        assert gm(ids.int(), x.half()).dtype == gm(ids, x).dtype
        if opt_level == "O2":  # its entry casts every floating input, float64 too
            assert gm(ids.int(), x.double()).dtype == gm(ids, x).dtype


def test_the_dtype_kinds_survive_copies_and_pickles() -> None:
    import pickle

    gm = amprewrite.convert(Ids(), (torch.randint(0, 10, (2, 3)), torch.randn(2, 3, 8)))
    for clone in (copy.deepcopy(gm), pickle.loads(pickle.dumps(gm))):
        guards = clone._guards_fn
        assert isinstance(guards, InputGuards) and guards._floating == (False, True)
        with pytest.raises(amprewrite.AmpRewriteError, match="torch.int64 tensor"):
            guards(torch.zeros(2, 3, dtype=torch.long), torch.zeros(2, 3, 8, dtype=torch.long))
