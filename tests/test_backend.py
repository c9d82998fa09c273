"""The torch.compile backend: graph breaks, data-dependent control flow, autocast regions,
training, overrides, dynamic shapes, and one Inductor run."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import amprewrite
from amprewrite import OpCategory, Policy
from amprewrite.graph.meta import decision


pytestmark = pytest.mark.usefixtures("fresh_dynamo")


class Branchy(nn.Module):
    """Data-dependent control flow (a graph break) and an explicit graph break."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(8, 16)
        self.mid = nn.Linear(16, 16)
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.inp(x))
        if h.sum() > 0:              # Python branch on a tensor value: Dynamo splits here
            h = self.mid(h)
        else:
            h = -h
        torch._dynamo.graph_break()
        return torch.log_softmax(self.head(h), dim=-1)


class SelfAutocast(nn.Module):
    """Opens its own fp32 region, as rotary embeddings and loss heads often do."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.proj = nn.Linear(8, 8)
        self.exact = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(x)
        with torch.autocast("cpu", enabled=False):
            y = self.exact(h.float())
        return y


X = torch.randn(4, 8)


def linear_decisions(amp: amprewrite.AmpBackend) -> list[tuple[OpCategory, str]]:
    return [(decision(n).category, decision(n).rule) for gm in amp.graphs
            for n in gm.graph.nodes if decision(n) is not None and decision(n).op == "linear"]


def test_graph_breaks_convert_each_graph() -> None:
    amp = amprewrite.backend(eager=True)
    out = torch.compile(Branchy(), backend=amp)(X)
    assert len(amp.graphs) == 3
    assert linear_decisions(amp) == [(OpCategory.LOWER, "default table")] * 3
    assert out.dtype == torch.float32          # log_softmax upcasts (CUDA AMP rules)
    for gm in amp.graphs:
        assert "_amp_weight_cache" not in gm.code


def test_matches_autocast_bitwise_with_preset_outputs_and_grads() -> None:
    model, reference = Branchy(), Branchy()
    amp = amprewrite.backend(Policy.autocast("cpu"), eager=True)
    out = torch.compile(model, backend=amp)(X)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = reference(X)
    assert out.dtype == expected.dtype == torch.bfloat16
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    out.float().sum().backward()
    expected.float().sum().backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert p.grad.dtype == torch.float32, name
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0, msg=name)


def test_trains_through_graph_breaks() -> None:
    model = Branchy()
    compiled = amprewrite.compile(model, eager=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    target = torch.tensor([0, 1, 2, 3])
    losses = []
    for _ in range(5):
        opt.zero_grad()
        loss = torch.nn.functional.nll_loss(compiled(X), target)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    assert all(p.dtype == torch.float32 for p in model.parameters())


def test_models_own_autocast_region_is_honoured() -> None:
    amp = amprewrite.backend(eager=True)
    out = torch.compile(SelfAutocast(), backend=amp)(X)
    (gm,) = amp.graphs
    assert "autocast" not in gm.code           # region made explicit, nothing entered at run time
    assert linear_decisions(amp) == [
        (OpCategory.LOWER, "default table"),
        (OpCategory.PASSTHROUGH, "model's autocast('cpu', enabled=False) region")]
    assert out.dtype == torch.float32
    model = SelfAutocast()
    torch.testing.assert_close(out, model.exact(model.proj(X).float()), rtol=2e-2, atol=2e-2)


def test_enabled_region_sets_the_dtype() -> None:
    class Half(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            with torch.autocast("cpu", dtype=torch.float16):
                return self.lin(x)

    amp = amprewrite.backend(dtype=torch.bfloat16, eager=True)
    assert torch.compile(Half(), backend=amp)(X).dtype == torch.float16


def test_module_overrides_match_dynamo_module_paths() -> None:
    compiled = amprewrite.compile(Branchy(), policy=Policy().override(keep_fp32=["head"]),
                                  eager=True)
    compiled(X)
    assert [c for c, _ in linear_decisions(compiled.amprewrite_backend)] == [
        OpCategory.LOWER, OpCategory.LOWER, OpCategory.FP32]


def test_module_overrides_in_a_compiled_sequential() -> None:
    # Dynamo names the root of an nn.Sequential "L['fn']", not "L['self']".
    model = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 2))
    compiled = amprewrite.compile(model, policy=Policy().override(keep_fp32=["2"]), eager=True)
    assert compiled(X).dtype == torch.float32
    assert linear_decisions(compiled.amprewrite_backend) == [
        (OpCategory.LOWER, "default table"), (OpCategory.FP32, "module override '2'")]


def test_compile_checks_module_overrides_up_front() -> None:
    with pytest.raises(ValueError, match=r"'haed' \(near: head\)"):
        amprewrite.compile(Branchy(), policy=Policy().override(keep_fp32=["haed"]))


def test_other_batch_sizes_recompile_with_dynamic_shapes() -> None:
    amp = amprewrite.backend(eager=True)
    compiled = torch.compile(SelfAutocast(), backend=amp)
    assert compiled(X).shape == (4, 8)
    assert compiled(torch.randn(7, 8)).shape == (7, 8)
    assert compiled(torch.randn(9, 8)).shape == (9, 8)
    assert len(amp.graphs) == 2               # the static graph, then a dynamic one


def test_explain_a_compiled_model() -> None:
    compiled = amprewrite.compile(Branchy(), eager=True)
    with pytest.raises(ValueError, match="run the compiled model once"):
        amprewrite.explain(compiled)
    compiled(X)
    text = amprewrite.explain(compiled)
    assert text.count("== graph ") == 3
    assert "log_softmax  fp32 (dtype arg)" in text


def test_warns_under_an_outer_autocast() -> None:
    compiled = amprewrite.compile(SelfAutocast(), eager=True)
    with pytest.warns(UserWarning, match=r"torch.autocast\('cpu'\) is active around"), \
            torch.autocast("cpu", dtype=torch.bfloat16):
        compiled(X)


def test_argument_errors() -> None:
    with pytest.raises(ValueError, match="dtype=torch.float64 is not supported"):
        amprewrite.backend(dtype=torch.float64)
    with pytest.raises(TypeError, match="policy must be an amprewrite.Policy"):
        amprewrite.backend(policy="cpu")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="expects a torch.nn.Module"):
        amprewrite.compile(lambda x: x)  # type: ignore[arg-type]


def test_inductor_forward_and_backward() -> None:
    model = SelfAutocast()
    compiled = amprewrite.compile(model, policy=Policy.autocast("cpu"))
    out = compiled(X)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = model(X)
    assert out.dtype == expected.dtype == torch.float32
    torch.testing.assert_close(out, expected)
    out.sum().backward()
    assert model.proj.weight.grad is not None and model.proj.weight.grad.dtype == torch.float32


def test_ops_without_tensor_inputs_stay_fake_in_the_rewrite() -> None:
    """``torch.arange`` in a Dynamo graph has no tensor input to take a fake mode from; its
    recomputed value must still be fake, or an in-place write into a fake tensor fails (the
    token permutation of transformers' MoE layers)."""

    class Permute(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            perm = torch.argsort(x[:, 0])
            inverse = torch.empty_like(perm)
            inverse[perm] = torch.arange(perm.numel())
            return self.lin(x[perm])[inverse]

    torch.manual_seed(0)
    model, x = Permute(), torch.randn(6, 4)
    compiled = amprewrite.compile(model, eager=True, fullgraph=True)
    out = compiled(x)
    with torch.autocast("cpu", torch.bfloat16):
        expected = model(x)
    assert out.dtype == torch.bfloat16 and torch.equal(out, expected)
