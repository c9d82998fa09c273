"""convert(calibrate=...): the range-based fallback to fp32, on planted values."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import amprewrite
from amprewrite import OpCategory, Policy
from amprewrite.explain import explain_records
from amprewrite.graph.meta import decision, max_abs
from amprewrite.passes.classify import ClassifyPass

pytestmark = pytest.mark.filterwarnings("ignore:amprewrite.convert. (fp16|bf16) on cpu")

F16 = torch.float16
X = torch.ones(2, 4)            # fc1's output is 4 * fc1_scale exactly
SMALL = torch.full((2, 4), 0.01)


class Planted(nn.Module):
    """``fc2(relu(fc1(x))) + fc3(x)``: on ``X``, fc1 and relu reach ``4 * scale`` (1e5 by
    default, past fp16's 65504), fc2 scales it back to ~80, fc3 and the add stay small."""

    def __init__(self, scale: float = 2.5e4) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc1, self.fc2, self.fc3 = nn.Linear(4, 8), nn.Linear(8, 2), nn.Linear(4, 2)
        with torch.no_grad():
            self.fc1.weight.fill_(scale)
            self.fc1.bias.zero_()
            self.fc2.weight.fill_(1e-4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x))) + self.fc3(x)


def moved(gm: torch.fx.GraphModule) -> dict[str, str]:
    """Node name -> rule, for the nodes the range rule put in fp32."""
    return {r["node"]: r["rule"] for r in explain_records(gm)[0]["nodes"]
            if r["rule"].startswith("range:")}


def node(gm: torch.fx.GraphModule, name: str) -> torch.fx.Node:
    return next(n for n in gm.graph.nodes if n.name == name)


def test_overflow_becomes_finite_and_close_to_fp32() -> None:
    model = Planted()
    plain = amprewrite.convert(model, (X,), dtype=F16)
    assert torch.isinf(plain(X)).all()  # the fp16 linear overflows: the premise
    gm = amprewrite.convert(model, (X,), dtype=F16, calibrate=((X,), {}))
    out = gm(X)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.float(), model(X), rtol=2e-3, atol=0.0)


def test_exactly_the_overflowing_nodes_move() -> None:
    gm = amprewrite.convert(Planted(), (X,), dtype=F16, calibrate=((X,), {}))
    rule = "range: max |x| 1.0e+05 > fp16 max"
    # fc1 produces 1e5, relu takes and produces it, fc2 takes it; fc3 and the add never see it.
    assert moved(gm) == {"linear": rule, "relu": rule, "linear_1": rule}
    for name in moved(gm):
        assert decision(node(gm, name)).compute_dtype == torch.float32
        assert node(gm, name).meta["val"].dtype == torch.float32
    assert decision(node(gm, "linear_2")).category is OpCategory.LOWER
    assert node(gm, "linear_2").meta["val"].dtype == F16
    assert max_abs(node(gm, "linear")) == 1e5
    assert max_abs(node(gm, "linear_2")) < 10


def test_rule_text_in_explain() -> None:
    gm = amprewrite.convert(Planted(), (X,), dtype=F16, calibrate=((X,), {}))
    lines = {line.split()[0]: line for line in amprewrite.explain(gm).splitlines() if line}
    assert lines["linear"].split()[1:5] == ["linear", "fp32", "f32", "f32"]
    assert "range: max |x| 1.0e+05 > fp16 max" in lines["linear"]
    assert "default table" in lines["linear_2"]


def test_bf16_range_moves_nothing() -> None:
    model = Planted()
    plain = amprewrite.convert(model, (X,), dtype=torch.bfloat16)
    gm = amprewrite.convert(model, (X,), dtype=torch.bfloat16, calibrate=((X,), {}))
    assert moved(gm) == {}
    assert explain_records(gm)[0]["nodes"] == explain_records(plain)[0]["nodes"]
    assert torch.equal(gm(X), plain(X))


def test_headroom_bits() -> None:
    model = Planted(scale=1e4)  # fc1 reaches 4e4: inside fp16, beyond half of it (32752)
    assert moved(amprewrite.convert(model, (X,), dtype=F16, calibrate=((X,), {}))) == {}
    gm = amprewrite.convert(model, (X,), dtype=F16, calibrate=((X,), {}),
                            policy=Policy(range_headroom_bits=1))
    rule = "range: max |x| 4.0e+04 > fp16 max / 2^1"
    assert moved(gm) == {"linear": rule, "relu": rule, "linear_1": rule}


def test_list_takes_the_max_over_all_inputs() -> None:
    model = Planted()
    small_only = amprewrite.convert(model, (X,), dtype=F16, calibrate=[((SMALL,), {})])
    assert moved(small_only) == {}
    assert max_abs(node(small_only, "linear")) == pytest.approx(1e3)
    for inputs in ([((SMALL,), {}), ((X,), {})], [((X,), {}), ((SMALL,), {})]):
        gm = amprewrite.convert(model, (X,), dtype=F16, calibrate=inputs)
        assert set(moved(gm)) == {"linear", "relu", "linear_1"}
        assert max_abs(node(gm, "linear")) == 1e5


def test_symbolic_capture() -> None:
    model = Planted()
    gm = amprewrite.convert(model, dtype=F16, calibrate=((), {"x": X}))
    assert set(moved(gm)) == {"linear", "relu", "linear_1"}
    torch.testing.assert_close(gm(X).float(), model(X), rtol=2e-3, atol=0.0)


def test_overrides_win_and_a_second_classification_changes_nothing() -> None:
    policy = Policy().override(nodes={"linear": OpCategory.LOWER}, keep_fp32=["fc3"])
    gm = amprewrite.convert(Planted(), (X,), dtype=F16, calibrate=((X,), {}), policy=policy)
    assert decision(node(gm, "linear")).rule == "node override 'linear'"
    assert decision(node(gm, "linear_2")).rule == "module override 'fc3'"
    assert set(moved(gm)) == {"relu", "linear_1"}
    assert not ClassifyPass(policy, F16)(gm).modified
    again = amprewrite.convert(gm, dtype=F16, policy=policy)  # ranges live in node meta
    assert moved(again) == moved(gm)


def test_inf_in_fp32_is_not_counted() -> None:
    class Masked(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.softmax(x.masked_fill(x > 1, float("-inf")), -1)

    x = torch.tensor([[0.5, 2.0, -3.0]])
    gm = amprewrite.convert(Masked(), (x,), dtype=F16, calibrate=((x,), {}))
    assert max_abs(node(gm, "masked_fill")) == 3.0
    assert moved(gm) == {}


class WithBatchNorm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin, self.bn, self.drop = nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Dropout(0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.bn(self.lin(x)))


@pytest.mark.parametrize("capture", ["export", "symbolic"])
def test_model_state_and_rng_unchanged(capture: str) -> None:
    model = WithBatchNorm().train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x = torch.randn(8, 4) * 3 + 1
    example = (x,) if capture == "export" else None
    rng = torch.get_rng_state()
    amprewrite.convert(model, example, dtype=F16, capture=capture,
                       calibrate=[((x,), {}), ((x * 2,), {})])
    assert torch.equal(torch.get_rng_state(), rng)
    after = model.state_dict()
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert all(p.grad is None for p in model.parameters())
    assert model.training


def test_bad_calibrate_values() -> None:
    model = Planted()
    bad_type = [
        (X, "calibrate is a Tensor of shape (2, 4)"),
        ((X,), "calibrate is a tuple of 1 (Tensor)"),
        ((X, X), "A tuple of positional arguments (x, y) is written ((x, y), {})"),
        (((X,), None), "calibrate is a tuple of 2 (tuple, NoneType)"),
        ([((X,), {}), X], "calibrate[1] is a Tensor"),
        ({"x": X}, "calibrate is a dict"),
    ]
    for value, message in bad_type:
        with pytest.raises(TypeError, match=_escaped(message)):
            amprewrite.convert(model, (X,), dtype=F16, calibrate=value)
    bad_value = [
        ([], "calibrate=[] holds no input"),
        (((torch.ones(2, 5),), {}), "calibrate[0] could not run through the captured graph"),
        (((X,), {"y": X}), "calibrate[0] does not have the structure of example_inputs"),
    ]
    for value, message in bad_value:
        with pytest.raises(ValueError, match=_escaped(message)):
            amprewrite.convert(model, (X,), dtype=F16, calibrate=value)
    with pytest.raises(ValueError, match=_escaped("keywords ['y']; the model's forward takes (x)")):
        amprewrite.convert(model, dtype=F16, calibrate=((X,), {"y": X}))


@pytest.mark.parametrize("level", ["O0", "O2", "O3"])
def test_other_opt_levels_refuse_calibrate(level: str) -> None:
    with pytest.raises(ValueError, match="range fallback applies to opt_level='O1' only"):
        amprewrite.convert(Planted(), (X,), opt_level=level, calibrate=((X,), {}),
                           dtype=None if level == "O0" else F16)


def test_converted_module_and_bad_headroom_refused() -> None:
    gm = amprewrite.convert(Planted(), (X,), dtype=F16)
    with pytest.raises(ValueError, match="needs the original model"):
        amprewrite.convert(gm, calibrate=((X,), {}))
    for bits in (-1, 16, 1.5, True):
        with pytest.raises(ValueError, match=_escaped(f"range_headroom_bits={bits!r}")):
            Policy(range_headroom_bits=bits)


def _escaped(text: str) -> str:
    import re

    return re.escape(text)
