"""explain(): the table of decisions, pinned with expecttest (EXPECTTEST_ACCEPT=1 to update)."""

from __future__ import annotations

import json
from collections import Counter

import expecttest
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import amprewrite
from amprewrite import OpCategory, Policy
from amprewrite.explain import explain_records


def _decisions(gm: torch.fx.GraphModule) -> str:
    """explain() without its ``hardware:`` line, which names this machine's CPU (that line is
    tested in test_hardware.py with the probes monkeypatched)."""
    lines = amprewrite.explain(gm).splitlines()
    assert lines[1].startswith("hardware: cpu: "), lines[:2]
    return "\n".join(lines[:1] + lines[2:])


class Small(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8)
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x + self.lin(x))
        return F.softmax(self.head(h), dim=-1)


X = (torch.randn(2, 8),)


class TestExplain(expecttest.TestCase):
    def test_export_default_policy(self) -> None:
        gm = amprewrite.convert(Small(), X)
        self.assertExpectedInline(_decisions(gm), """\
model: Small
policy: default (CUDA AMP rules), low dtype bf16
ops: 2 bf16, 2 fp32, 1 passthrough (5 op nodes)
casts: 6 cast nodes, 4 of weights (kept copies in inference, one cast per forward in training)
  node        op          category          dtype  out   rule           casts
  ----------  ----------  ----------------  -----  ----  -------------  -------------------------------------------------
lin:
  linear      linear      lower             bf16   bf16  default table  x_bf16, lin_weight_bf16, lin_bias_bf16
(top level):
  add         add         passthrough       -      f32   not listed     -
norm:
  layer_norm  layer_norm  fp32              f32    f32   default table  -
head:
  linear_1    linear      lower             bf16   bf16  default table  layer_norm_bf16, head_weight_bf16, head_bias_bf16
(top level):
  softmax     softmax     fp32 (dtype arg)  f32    f32   default table  -
5 op nodes: 2 bf16, 2 f32, 1 passthrough; casts: 6 cast nodes in the graph (0 guarded) after 0 eliminated""")

    def test_overrides_name_the_rule(self) -> None:
        policy = Policy.autocast("cpu").override(ops={"softmax": OpCategory.FP32},
                                                 keep_fp32=["head"])
        gm = amprewrite.convert(Small(), X, policy=policy)
        self.assertExpectedInline(_decisions(gm), """\
model: Small
policy: autocast('cpu') + 2 overrides, low dtype bf16
ops: 1 bf16, 2 fp32, 2 passthrough (5 op nodes)
casts: 3 cast nodes, 2 of weights (kept copies in inference, one cast per forward in training)
  node        op          category     dtype  out   rule                    casts
  ----------  ----------  -----------  -----  ----  ----------------------  --------------------------------------
lin:
  linear      linear      lower        bf16   bf16  cpu table               x_bf16, lin_weight_bf16, lin_bias_bf16
(top level):
  add         add         passthrough  -      f32   not listed              -
norm:
  layer_norm  layer_norm  passthrough  -      f32   not listed              -
head:
  linear_1    linear      fp32         f32    f32   module override 'head'  -
(top level):
  softmax     softmax     fp32         f32    f32   op override 'softmax'   -
5 op nodes: 1 bf16, 2 f32, 2 passthrough; casts: 3 cast nodes in the graph (0 guarded) after 0 eliminated""")

    def test_symbolic_without_inputs_is_guarded(self) -> None:
        gm = amprewrite.convert(Small())
        self.assertExpectedInline(_decisions(gm), """\
model: Small
policy: default (CUDA AMP rules), low dtype bf16
ops: 2 bf16, 2 fp32, 1 passthrough (5 op nodes)
casts: 7 cast nodes, 4 of weights (kept copies in inference, one cast per forward in training)
  node        op          category          dtype  out  rule           casts
  ----------  ----------  ----------------  -----  ---  -------------  -------------------------------------------------
lin:
  linear      linear      lower             bf16   ?    default table  x_bf16, lin_weight_bf16, lin_bias_bf16
(top level):
  add         add         passthrough       -      ?    not listed     -
norm:
  layer_norm  layer_norm  fp32              f32    ?    default table  add_f32
head:
  linear_1    linear      lower             bf16   ?    default table  layer_norm_bf16, head_weight_bf16, head_bias_bf16
(top level):
  softmax     softmax     fp32 (dtype arg)  f32    ?    default table  -
5 op nodes: 2 bf16, 2 f32, 1 passthrough; casts: 7 cast nodes in the graph (3 guarded) after 0 eliminated""")


def test_summary_counts_eliminated_casts() -> None:
    class TwoUses(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.a(x.float()) + self.b(x)   # x.float() is an identity; x cast once

    (rec,) = explain_records(amprewrite.convert(TwoUses(), X))
    assert rec["summary"]["eliminated_by_rule"] == {"duplicate": 1, "identity": 1}
    assert rec["summary"]["casts_eliminated"] == 2
    assert "2 eliminated (duplicate 1, identity 1)" in amprewrite.explain(
        amprewrite.convert(TwoUses(), X))


def test_records_are_json_ready() -> None:
    (rec,) = explain_records(amprewrite.convert(Small(), X))
    again = json.loads(json.dumps(rec))
    assert again["nodes"][0] == {
        "node": "linear", "op": "linear", "category": "lower", "dtype": "bf16", "out": "bf16",
        "rule": "default table", "casts": ["x_bf16", "lin_weight_bf16", "lin_bias_bf16"],
        "guarded": False, "module": "lin", "float": True, "precision": "low"}
    assert again["summary"]["per_dtype"] == {"bf16": 2, "f32": 2, "passthrough": 1}
    assert again["facts"]["ops"] == {"low": 2, "fp32": 2, "passthrough": 1}
    assert Counter(r["precision"] for r in again["nodes"]) == again["facts"]["ops"]
    assert again["facts"]["model"] == "Small" and again["facts"]["cast_nodes"] == 6


class Masked(nn.Module):
    """Float compute and integer/bool plumbing in one module (a causal mask)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        idx = torch.arange(x.shape[-1])
        mask = (idx[None, :] > idx[:, None]).unsqueeze(0)
        h = self.lin(x)
        return (h @ h.transpose(-1, -2)).masked_fill(mask, float("-inf")).softmax(-1)


def test_default_view_folds_plumbing_per_module() -> None:
    gm = amprewrite.convert(Masked(), (torch.randn(2, 8, 8),))
    text = amprewrite.explain(gm)
    lines = text.splitlines()
    assert lines[0] == "model: Masked" and lines[3].startswith("ops: ")
    nodes = {r["node"]: r for r in explain_records(gm)[0]["nodes"]}
    plumbing = [n for n, r in nodes.items() if not r["float"]]
    assert {"arange", "gt", "unsqueeze", "transpose"} <= set(plumbing)
    assert "integer/bool/shape nodes folded" in text
    for name in plumbing:
        assert f"  {name} " not in text
    for name in ("linear", "matmul", "masked_fill", "softmax"):
        assert f"  {name} " in text
    full = amprewrite.explain(gm, all_nodes=True)
    assert all(f"\n{name} " in full for name in nodes) and "folded" not in full
    with pytest.raises(TypeError, match="all_nodes='yes'"):
        amprewrite.explain(gm, all_nodes="yes")


def test_rejects_what_was_not_converted() -> None:
    with pytest.raises(TypeError, match="got Small. Convert the model first"):
        amprewrite.explain(Small())
    with pytest.raises(ValueError, match="was not converted by amprewrite"):
        amprewrite.explain(torch.fx.symbolic_trace(Small()))


class OwnFp32Region(nn.Module):
    """A region the model keeps in fp32 itself: under torch.compile the backend adds a cast
    after the passes (the graph's output back to the dtype Dynamo traced)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        with torch.autocast("cpu", enabled=False):
            h = h.float().exp()
        return self.lin(h)


def test_header_and_footer_count_the_same_casts_on_the_compile_route() -> None:
    """The header's cast nodes and the footer's are one number, the graph's own count of
    our cast nodes, also where the compile backend adds a cast after the passes."""
    import re

    from amprewrite.graph.meta import cast_info
    from amprewrite.graph.subgraphs import nodes_with_bodies

    compiled = amprewrite.compile(OwnFp32Region(), eager=True)
    compiled(torch.randn(2, 8))
    (graph,) = compiled.amprewrite_backend.graphs
    in_graph = sum(cast_info(n) is not None for n in nodes_with_bodies(graph))
    assert in_graph == 5  # x, weight, bias, the exp's output, and the output back to fp32
    text = amprewrite.explain(compiled)
    header = re.search(r"^casts: (\d+) cast nodes, \d+ of weights", text, re.M)
    footer = re.search(r"casts: (\d+) cast nodes in the graph \((\d+) guarded\) after "
                       r"(\d+) eliminated$", text, re.M)
    assert header is not None and footer is not None, text
    assert int(header.group(1)) == int(footer.group(1)) == in_graph
    assert footer.group(2, 3) == ("0", "0")
    (rec,) = explain_records(compiled)
    assert rec["facts"]["cast_nodes"] == rec["summary"]["casts_inserted"] == in_graph
