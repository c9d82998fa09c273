"""The torch.compile backend: graph breaks, data-dependent control flow, autocast regions,
training, overrides, dynamic shapes, and one Inductor run."""

from __future__ import annotations

import warnings

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


PRESET = Policy.autocast("cpu", torch.bfloat16)


def _assert_grads_equal(model: nn.Module, reference: nn.Module) -> None:
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert p.grad.dtype == torch.float32, name
        assert torch.equal(p.grad, q.grad), name


def test_matches_autocast_bitwise_with_preset_outputs_and_grads() -> None:
    model, reference = Branchy(), Branchy()
    out = amprewrite.compile(model, policy=PRESET, eager=True)(X)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = reference(X)
    assert out.dtype == expected.dtype == torch.bfloat16
    assert torch.equal(out, expected)
    out.float().sum().backward()
    expected.float().sum().backward()
    _assert_grads_equal(model, reference)


def test_the_preset_backend_inside_its_own_autocast() -> None:
    """``torch.compile(backend=...)`` called under the autocast the preset mirrors: that
    autocast is the regime (no warning), the result autocast's."""
    model, reference = Branchy(), Branchy()
    compiled = torch.compile(model, backend=amprewrite.backend(PRESET, eager=True))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = compiled(X)
            expected = reference(X)
    assert not [w for w in caught if "amprewrite" in str(w.message)]
    assert out.dtype == torch.bfloat16 and torch.equal(out, expected)


SEEN: list[tuple[torch.dtype, bool]] = []


@torch._dynamo.disable
def _between_graphs(h: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Model code Dynamo does not trace: it runs between two rewritten graphs."""
    SEEN.append((h.dtype, torch.is_autocast_enabled("cpu")))
    return torch.nn.functional.conv2d(h, weight, padding=1)


class ConvBreakConv(nn.Module):
    """A convolution in each graph and one in the Python between them, on the first graph's
    output and an fp32 weight."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Conv2d(3, 8, 3, padding=1)
        self.mid = nn.Parameter(torch.randn(8, 8, 3, 3) * 0.1)
        self.b = nn.Conv2d(8, 4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(_between_graphs(self.a(x).relu(), self.mid)).mean((2, 3))


IMAGES = torch.randn(2, 3, 12, 12, generator=torch.Generator().manual_seed(0))


def test_python_between_graphs_runs_as_under_autocast_with_the_preset() -> None:
    """The code between graphs gets what eager autocast gives it (bf16), runs under
    autocast (its convolution casts the fp32 weight), and hands the next graph autocast's
    values: outputs and gradients bitwise."""
    model, reference = ConvBreakConv(), ConvBreakConv()
    SEEN.clear()
    out = amprewrite.compile(model, policy=PRESET, eager=True)(IMAGES)
    assert SEEN == [(torch.bfloat16, True)]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = reference(IMAGES)
    assert out.dtype == expected.dtype == torch.bfloat16
    assert torch.equal(out, expected)
    out.float().sum().backward()
    expected.float().sum().backward()
    _assert_grads_equal(model, reference)


def test_python_between_graphs_gets_the_traced_dtypes_with_other_policies() -> None:
    """Under the default policy the code between graphs runs without autocast, on the
    dtypes Dynamo traced it with: each graph casts its low-precision outputs back."""
    model = ConvBreakConv()
    SEEN.clear()
    compiled = amprewrite.compile(model, eager=True)
    out = compiled(IMAGES)
    assert SEEN == [(torch.float32, False)]
    first, last = compiled.amprewrite_backend.graphs
    assert [decision(n).category for n in first.graph.nodes
            if decision(n) is not None and decision(n).op == "conv2d"] == [OpCategory.LOWER]
    assert "relu_traced = relu.float()" in first.code
    assert out.dtype == torch.float32       # mean of a bf16 convolution, traced in fp32
    fp32 = ConvBreakConv()(IMAGES)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        autocast = ConvBreakConv()(IMAGES).float()
    assert 0 < (out - fp32).abs().max() <= 2 * (autocast - fp32).abs().max()
    out.sum().backward()
    assert model.a.weight.grad is not None and model.a.weight.grad.dtype == torch.float32


class OwnRegionAcrossABreak(nn.Module):
    """A graph break inside the model's own ``autocast(enabled=False)`` block."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.c = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        with torch.autocast("cpu", enabled=False):
            h = self.b(h.float()).relu()
            torch._dynamo.graph_break()
            h = self.b(h)
        return self.c(h)


def test_the_models_own_region_across_a_break_under_the_preset() -> None:
    model, reference = OwnRegionAcrossABreak(), OwnRegionAcrossABreak()
    out = amprewrite.compile(model, policy=PRESET, eager=True)(X)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = reference(X)
    assert out.dtype == torch.bfloat16 and torch.equal(out, expected)
    out.float().sum().backward()
    expected.float().sum().backward()
    _assert_grads_equal(model, reference)


class SharedHead(nn.Module):
    """One head applied to several feature levels, as detection heads are."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.stem = nn.Linear(8, 8)
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.stem(x)
        levels = [h, h[:2] * 2, h[1:].relu()]
        return torch.cat([self.head(level) for level in levels])


def test_a_weight_used_several_times_gets_one_cast_under_the_preset() -> None:
    """autocast caches the cast of a parameter: the head's three uses share one bf16 copy,
    whose gradients add up in bf16 before the one cast back. So do the graph's."""
    model, reference = SharedHead(), SharedHead()
    compiled = amprewrite.compile(model, policy=PRESET, eager=True)
    out = compiled(X)
    (gm,) = compiled.amprewrite_backend.graphs
    weight = [n for n in gm.graph.nodes if n.op == "placeholder" and "head" in n.name
              and "weight" in n.name]
    assert len(weight) == 1 and len(weight[0].users) == 1
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = reference(X)
    assert torch.equal(out, expected)
    out.float().square().sum().backward()
    expected.float().square().sum().backward()
    _assert_grads_equal(model, reference)


@torch.library.custom_op("amprewrite_backend_test::fp32_only", mutates_args=())
def fp32_only(x: torch.Tensor) -> torch.Tensor:
    """A library kernel without a low-precision path, as torchvision's roi_align on a CPU."""
    if x.dtype != torch.float32:
        raise RuntimeError(f"fp32_only not implemented for {x.dtype}")
    return x.sin()


@fp32_only.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


torch.library.register_autocast("amprewrite_backend_test::fp32_only", "cpu", torch.float32)


class WithLibraryOp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(fp32_only(self.a(x)))


@pytest.mark.parametrize("policy", [PRESET, Policy()], ids=["preset", "default"])
def test_a_library_op_runs_under_its_own_autocast_kernel(policy: Policy) -> None:
    """The op's AutocastCPU kernel (registered by its library) casts its input to fp32;
    the rewritten graph calls the op inside autocast, so that kernel runs as in eager."""
    model = WithLibraryOp()
    compiled = amprewrite.compile(model, policy=policy, eager=True)
    out = compiled(X)
    (gm,) = compiled.amprewrite_backend.graphs
    assert "fp32_only_under_autocast(linear)" in "".join(gm.code.split())  # wrapped or not
    (rec,) = [decision(n) for n in gm.graph.nodes
              if decision(n) is not None and "fp32_only" in decision(n).op]
    assert "its own AutocastCPU kernel" in rec.rule
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = WithLibraryOp()(X)
    if policy is PRESET:
        assert torch.equal(out, expected)
    else:
        torch.testing.assert_close(out, expected.float(), rtol=0, atol=0)


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


def test_explain_names_the_model_and_its_weights() -> None:
    """Dynamo lifts the weights to inputs: explain still names the model, counts the weight
    casts and names each after its weight, as for a converted module."""
    model = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 4))
    compiled = amprewrite.compile(model, eager=True)
    compiled(X)
    text = amprewrite.explain(compiled)
    assert "model: Sequential\n" in text
    assert "casts: 6 cast nodes, 4 of weights " in text
    assert "_0_weight_bf16, _0_bias_bf16" in text and "_2_weight_bf16, _2_bias_bf16" in text
    assert "parameters" not in text and "l_fn" not in text
    converted = amprewrite.explain(amprewrite.convert(model, (X,)))
    assert "_0_weight_bf16, _0_bias_bf16" in converted and "4 of weights" in converted


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
    compiled = amprewrite.compile(model, policy=PRESET, eager=True, fullgraph=True)
    out = compiled(x)
    with torch.autocast("cpu", torch.bfloat16):
        expected = model(x)
    assert out.dtype == torch.bfloat16 and torch.equal(out, expected)


class AttentionPool(nn.Module):
    """A learned query attending over a sequence: ``F.multi_head_attention_forward``, which
    Dynamo records as one call."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.query = nn.Parameter(torch.randn(1, 1, 16))
        self.attn = nn.MultiheadAttention(16, 2, batch_first=True)
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = self.query.expand(x.shape[0], -1, -1)
        return self.head(self.attn(q, x, x, need_weights=False)[0].squeeze(1))


def test_attention_kept_whole_by_dynamo_runs_as_under_autocast() -> None:
    """Its projections and matmuls run in bf16 inside the call, as eager autocast runs them:
    outputs and every gradient bitwise under the preset (not in fp32 as a passthrough)."""
    model, reference = AttentionPool(), AttentionPool()
    x = torch.randn(2, 5, 16)
    compiled = amprewrite.compile(model, policy=PRESET, eager=True)
    out = compiled(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = reference(x)
    assert torch.equal(out, expected)
    out.float().sum().backward()
    expected.float().sum().backward()
    _assert_grads_equal(model, reference)
    rules = [decision(n).rule for gm in compiled.amprewrite_backend.graphs
             for n in gm.graph.nodes if decision(n) is not None
             and decision(n).op == "multi_head_attention_forward"]
    assert rules == ["kept whole by Dynamo, its ops under autocast('cpu', torch.bfloat16)"]
    # the default policy: the same call under autocast, the output handed back in fp32
    torch._dynamo.reset()
    out = amprewrite.compile(AttentionPool(), eager=True)(x)
    assert out.dtype == torch.float32
    assert (out - reference(x)).abs().max() < 0.05


def test_grouped_query_decoder_trains_bitwise_with_the_preset() -> None:
    """A tiny HF Llama with two query heads per key/value head: the loss and every gradient
    as autocast gives them. The reference runs the model's Python as Dynamo does: older
    transformers (5.17) build an explicit causal mask and repeat the key/value heads while
    Dynamo traces, where eager passes no mask to sdpa, so there eager autocast itself differs
    from autocast under ``torch.compile`` (13 of 21 gradients, in the last bits)."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2,
                                      vocab_size=128)
    torch.manual_seed(0)
    model, reference = transformers.LlamaForCausalLM(config), transformers.LlamaForCausalLM(config)
    reference.load_state_dict(model.state_dict())
    ids = torch.randint(0, 128, (2, 8))
    loss = amprewrite.compile(model, policy=PRESET, eager=True)(input_ids=ids, labels=ids).loss
    if tuple(int(p) for p in transformers.__version__.split(".")[:2]) < (5, 24):
        reference = torch.compile(reference, backend="eager")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = reference(input_ids=ids, labels=ids).loss
    assert torch.equal(loss, expected)
    loss.backward()
    expected.backward()
    _assert_grads_equal(model, reference)
