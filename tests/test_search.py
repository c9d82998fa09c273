"""``amprewrite.search``: the fewest fp32 overrides for a tolerance, on a planted model whose
two culprits are known, against plain bisection's run count."""

from __future__ import annotations

import copy
import dataclasses
import math

import pytest
import torch
import torch.nn as nn

import amprewrite
from amprewrite import AmpRewriteError, OpCategory, Policy
from amprewrite.explain import explain_records
from amprewrite.precision.search import _bisect
from amprewrite.precision.shadow import rel_error

TOL = 1e-2


class Planted(nn.Module):
    """Two planted problems in fp16, among ops that are fine in fp16:

    * ``linear`` (``self.big``): outputs up to ~1.6e5 overflow fp16 to inf; the LayerNorm
      after it would bring them back to O(1) in fp32;
    * ``mean`` of ``y * 4000``, values up to ~1.6e4 that cancel to a mean of 1: the start
      policy forces it into fp16, whose input rounding (spacing up to 8) costs ~2e-2.
    """

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.big, self.norm = nn.Linear(16, 16), nn.LayerNorm(16)
        self.trunk = nn.Sequential(nn.Linear(16, 16), nn.GELU(), nn.Linear(16, 16), nn.GELU(),
                                   nn.Linear(16, 16))
        self.head = nn.Linear(16, 4)
        with torch.no_grad():
            self.big.weight.mul_(1e5)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.head(self.trunk(self.norm(self.big(x))))
        return h + (y * 4000).mean(-1, keepdim=True)


def planted_inputs() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(4, 16, generator=g), torch.randn(4, 1024, generator=g)
    return x, y - y.mean(-1, keepdim=True) + 2.5e-4


START = Policy().override(ops={"mean": OpCategory.LOWER})


@pytest.fixture(scope="module")
def planted() -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    return Planted(), planted_inputs()


@pytest.fixture(scope="module")
def found(planted) -> amprewrite.SearchResult:
    model, inputs = planted
    return amprewrite.search(model, inputs, tol=TOL, policy=START, dtype=torch.float16)


@pytest.fixture(scope="module")
def bisected(planted) -> amprewrite.SearchResult:
    model, inputs = planted
    return _bisect(model, inputs, tol=TOL, policy=START, dtype=torch.float16)


def test_finds_exactly_the_two_planted_nodes(found: amprewrite.SearchResult) -> None:
    assert sorted(found.nodes) == ["linear", "mean"]
    assert found.start_error == math.inf and found.error <= TOL
    assert found.runs == len(found.history) and found.history[0].step == "start (shadow run)"
    # Ranked by added error: the overflow (inf) first, the mean (~2e-2) second.
    assert [t.nodes for t in found.history[1:3]] == [("linear",), ("linear", "mean")]
    assert dict(found.policy.node_overrides) == {"linear": OpCategory.FP32,
                                                 "mean": OpCategory.FP32}
    assert found.policy.op_overrides == START.op_overrides
    assert found.policy.dtype == torch.float16


def test_policy_converts_within_tol(planted, found: amprewrite.SearchResult) -> None:
    model, inputs = planted
    gm = amprewrite.convert(model, inputs, policy=found.policy)
    wide = tuple(t.double() for t in inputs)
    with torch.no_grad():
        out = gm(*inputs)
        ref = amprewrite.convert(copy.deepcopy(model).double(), wide, opt_level="O0")(*wide)
    assert rel_error(out, ref) == pytest.approx(found.error) and found.error <= TOL
    dtypes = {r["node"]: r["dtype"] for r in explain_records(gm)[0]["nodes"]}
    assert dtypes["linear"] == dtypes["mean"] == "f32"
    assert [dtypes[f"linear_{i}"] for i in range(1, 5)] == ["f16"] * 4  # the rest stays fp16


def test_ranked_search_needs_fewer_runs_than_bisection(found, bisected) -> None:
    assert sorted(bisected.nodes) == sorted(found.nodes)
    assert found.runs < bisected.runs
    assert found.runs == 4  # shadow run, top 1, top 2, top 2 without the overflow


def test_no_override_when_the_start_policy_is_within_tol() -> None:
    torch.manual_seed(0)
    model, x = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4)), torch.randn(2, 8)
    result = amprewrite.search(model, x, tol=TOL, policy=START, dtype=torch.float16)
    assert result.nodes == () and result.runs == 1 and 0 < result.error < TOL
    assert result.policy == dataclasses.replace(START, dtype=torch.float16)


def test_custom_metric(planted) -> None:
    """An absolute-error metric that tolerates the mean's ~3e-2: only the overflow matters."""
    model, inputs = planted

    def max_abs_error(out: torch.Tensor, ref: torch.Tensor) -> float:
        return (out.double() - ref).abs().max().item()

    result = amprewrite.search(model, inputs, tol=0.1, policy=START, dtype=torch.float16,
                               metric=max_abs_error)
    assert result.nodes == ("linear",) and result.error < 0.1
    assert "1 node to fp32: linear" in result.summary()


def test_unreachable_tol_says_what_was_reached() -> None:
    torch.manual_seed(0)
    model, x = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4)), torch.randn(2, 8)
    with pytest.raises(AmpRewriteError, match=r"tol=1e-12 was not reached \(with all 2 "
                                              r"candidate nodes in fp32, 3 runs\): the best "
                                              r"error was .* the model in fp32 is .*e-0"):
        amprewrite.search(model, x, tol=1e-12, dtype=torch.float16)


def test_max_runs(planted) -> None:
    model, inputs = planted
    with pytest.raises(AmpRewriteError, match="max_runs ran out, 2 runs.*best error was "
                                              "1.5.e-02, with linear in fp32"):
        amprewrite.search(model, inputs, tol=TOL, policy=START, dtype=torch.float16,
                          max_runs=2)
    with pytest.warns(UserWarning, match="ran out while pruning"):
        result = amprewrite.search(model, inputs, tol=TOL, policy=START,
                                   dtype=torch.float16, max_runs=3)
    assert sorted(result.nodes) == ["linear", "mean"] and result.runs == 3


def test_table(found: amprewrite.SearchResult) -> None:
    lines = found.table().splitlines()
    assert lines[0].split() == ["run", "step", "fp32", "nodes", "error", "within", "tol"]
    assert lines[-1].split()[-1] == "no" and lines[-2].split()[-1] == "yes"
    assert str(found).startswith("2 nodes to fp32: linear, mean; error inf -> ")
    assert found.to_dict()["runs"] == found.runs


@pytest.mark.parametrize("kwargs, error", [
    ({"tol": 0}, "tol=0; expected a positive number"),
    ({"tol": "1e-2"}, "tol='1e-2'"),
    ({"tol": 1e-2, "max_runs": 1}, "max_runs=1; expected an int >= 2"),
    ({"tol": 1e-2, "metric": "rel"}, "metric must be a function"),
    ({"tol": 1e-2, "policy": "fp32"}, "policy must be an amprewrite.Policy, got str"),
])
def test_bad_arguments(kwargs: dict, error: str) -> None:
    with pytest.raises((TypeError, ValueError), match=error):
        amprewrite.search(nn.Linear(2, 2), (torch.randn(1, 2),), **kwargs)
