"""convert(): argument errors, the user's model left untouched, graph structure, guarded casts."""

from __future__ import annotations

import copy
import re

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from _graphs import weight_casts

import amprewrite
from amprewrite import AmpRewriteError, OpCategory, Policy
from amprewrite.graph.meta import cast_info, decision


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.norm = nn.LayerNorm(16)
        self.fc2 = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.gelu(self.fc1(x))
        return F.softmax(self.fc2(self.norm(h)), dim=-1)


def _casts(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    return [n for n in gm.graph.nodes if cast_info(n) is not None]


# -- errors -----------------------------------------------------------------------------------
def test_rejects_non_module() -> None:
    with pytest.raises(TypeError, match="expects a torch.nn.Module, got function"):
        amprewrite.convert(lambda x: x)


def test_rejects_bad_dtype() -> None:
    with pytest.raises(ValueError, match=r"dtype=torch.float32 is not supported; expected "
                                         r"torch.float16 or torch.bfloat16"):
        amprewrite.convert(MLP(), dtype=torch.float32)


def test_rejects_list_example_inputs() -> None:
    with pytest.raises(TypeError, match=r"example_inputs must be a tuple .* got list.*"
                                        r"example_inputs=\(x,\)"):
        amprewrite.convert(MLP(), [torch.randn(2, 8)])


def test_rejects_unknown_capture() -> None:
    with pytest.raises(ValueError, match="capture='jit' is unknown; expected one of 'auto', "
                                         "'symbolic', 'export'"):
        amprewrite.convert(MLP(), capture="jit")


def test_export_capture_without_inputs_waits_for_the_first_call() -> None:
    gm = amprewrite.convert(MLP(), capture="export")
    assert amprewrite.explain(gm).startswith("not captured yet")


def test_rejects_non_policy() -> None:
    with pytest.raises(TypeError, match="policy must be an amprewrite.Policy, got dict"):
        amprewrite.convert(MLP(), policy={"linear": "fp16"})


class DataDependent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:  # Python control flow on a tensor value
            return self.fc(x)
        return -x


def test_untraceable_model_names_the_construct_and_the_fix() -> None:
    with pytest.raises(AmpRewriteError) as info:
        amprewrite.convert(DataDependent())
    message = str(info.value)
    assert "symbolic tracing of DataDependent failed" in message
    assert "control flow" in message and "example_inputs" in message
    assert "torch.export" in message


def test_data_dependent_control_flow_fails_in_one_error_without_torchs_graph_dumps(
        capfd: pytest.CaptureFixture[str]) -> None:
    """torch.export prints the partial graph of a data-dependent failure to stderr at each
    nested wrapper and each retry (8 dumps, about 80 lines); the conversion prints none,
    names the model's line in its error, and passes on what the model itself printed."""
    import sys

    class Branchy(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            print("model says hi", file=sys.stderr)
            if x.sum() > 0:
                return self.fc(x)
            return x

    with pytest.raises(AmpRewriteError) as info:
        amprewrite.convert(Branchy(), (torch.randn(3, 4),))
    message = str(info.value)
    assert message.startswith("torch.export could not capture Branchy: "
                              "GuardOnDataDependentSymNode")
    assert re.search(r"The model's line it stopped at: .*test_convert\.py:\d+ in forward, "
                     r"code: if x\.sum\(\) > 0:", message)
    assert "amprewrite.compile(model)" in message
    out, err = capfd.readouterr()
    assert (out + err).count("def forward") == 0
    assert "torch.ops.aten" not in out + err
    assert err.count("model says hi") >= 1  # the model's own output is not swallowed


def test_banned_op_under_cuda_preset() -> None:
    class BCE(nn.Module):
        def forward(self, p: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
            return F.binary_cross_entropy(p, t)

    args = (torch.rand(4), torch.rand(4))
    with pytest.raises(AmpRewriteError, match="binary_cross_entropy_with_logits"):
        amprewrite.convert(BCE(), policy=Policy.autocast("cuda", torch.float16),
                           capture="symbolic")
    # The default policy runs it in fp32 instead of refusing (what CPU autocast does).
    gm = amprewrite.convert(BCE(), args)
    node = next(n for n in gm.graph.nodes if decision(n) and decision(n).op ==
                "binary_cross_entropy")
    assert decision(node).category is OpCategory.FP32
    assert gm(*args).dtype == torch.float32


def test_policy_validation() -> None:
    with pytest.raises(ValueError, match=r"'sofmax' \(did you mean 'softmax'"):
        Policy().override(ops={"sofmax": OpCategory.FP32})
    with pytest.raises(TypeError, match="expected an OpCategory member"):
        Policy().override(ops={"softmax": "fp32"})
    with pytest.raises(ValueError, match="expected 'cpu' or 'cuda'"):
        Policy.autocast("mps")


# -- the user's model is never modified --------------------------------------------------------
@pytest.mark.parametrize("capture", ["symbolic", "export"])
@pytest.mark.parametrize("training", [True, False])
def test_model_untouched_and_parameters_shared(capture: str, training: bool) -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Dropout(0.1), nn.Linear(8, 2))
    model.train(training)
    before = copy.deepcopy(model.state_dict())
    inputs = (torch.randn(4, 8),) if capture == "export" else None
    gm = amprewrite.convert(model, inputs, capture=capture)
    after = model.state_dict()
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) and before[k].dtype == after[k].dtype
               for k in before)
    assert model.training is training
    assert gm.training is training
    # fp32 master weights: the very same Parameter objects.
    for name, param in model.named_parameters():
        assert gm.get_parameter(name) is param
        assert param.dtype == torch.float32
    # state_dict round trip: the converted module saves and loads the model's keys.
    gm.load_state_dict(gm.state_dict())
    assert set(gm.state_dict()) <= set(model.state_dict())


class WithUnsavedTensors(nn.Module):
    """A non-persistent buffer (as Hugging Face's rotary ``inv_freq``) and a tensor literal
    in the forward, which torch.export lifts into a buffer of its graph."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.register_buffer("inv_freq", torch.ones(4), persistent=False)
        self.register_buffer("offset", torch.zeros(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) * self.inv_freq + self.offset + torch.tensor([0.5])


@pytest.mark.parametrize("capture,opt_level", [("symbolic", "O1"), ("export", "O0"),
                                               ("export", "O1"), ("export", "O2"),
                                               ("export", "O3")])
def test_state_dict_has_the_models_keys_only(capture: str, opt_level: str) -> None:
    model = WithUnsavedTensors()
    inputs = (torch.randn(2, 4),) if capture == "export" else None
    gm = amprewrite.convert(model, inputs, capture=capture, opt_level=opt_level,
                            dtype=None if opt_level == "O0" else torch.bfloat16)
    assert set(gm.state_dict()) == set(model.state_dict()) == {"fc.weight", "fc.bias",
                                                                "offset"}
    gm.load_state_dict(model.state_dict())  # strict, both ways
    WithUnsavedTensors().load_state_dict(gm.state_dict())
    again = amprewrite.convert(gm, inputs, capture=capture)  # a converted module, converted
    assert set(again.state_dict()) == set(model.state_dict())


def test_eval_on_converted_module_switches_the_models_flags() -> None:
    """The converted module's submodules are the model's: ``gm.eval()`` switches them, as
    ``torch.compile``'s module switches its model."""
    model = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8))
    gm = amprewrite.convert(model)
    gm.eval()
    assert not model.training and not model[1].training
    assert gm.get_submodule("0") is model[0]  # (a layer kept whole runs a copy: its mode)
    assert not gm.training
    x = torch.randn(4, 8)
    with torch.no_grad():
        # eval mode uses the running statistics: same as the model in eval mode.
        expected = model.eval()(x.bfloat16().float())
    model.train()
    assert gm(x).dtype == torch.bfloat16
    assert expected.shape == gm(x).shape


def test_optimizer_on_model_trains_converted_module() -> None:
    model = MLP()
    gm = amprewrite.convert(model, (torch.randn(2, 8),))
    x = torch.randn(2, 8)
    out_before = gm(x).detach()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    gm(x).float().pow(2).sum().backward()
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in model.parameters())
    opt.step()
    assert not torch.equal(out_before, gm(x).detach())


# -- structure ---------------------------------------------------------------------------------
def test_code_shows_every_cast() -> None:
    gm = amprewrite.convert(MLP(), (torch.randn(2, 8),), dtype=torch.float16)
    code = gm.code
    assert "x_f16 = x.half()" in code  # x.to(torch.float16), without parsing overloads
    # every parameter is one name of the forward's first statement (the fp32 weight, or its
    # kept fp16 copy where no gradient is needed), and its cast one line that says so
    assert re.search(r"\n    [ (]fc1_weight, +# f32\[16, 8\] or its kept f16 copy\n", code)
    assert ") = self._amp_weights.fetch(cache=self._amp_weight_cache)\n" in code
    assert "fc1_weight_f16 = fc1_weight.half()  # f16[16, 8] kept copy or autograd cast" in code
    # layer_norm runs in fp32 (CUDA rules): its fp16 input is cast up.
    assert "torch.layer_norm(gelu_f32" in code
    # softmax upcasts internally, autocast's fp32_set_opt_dtype: no separate cast kernel.
    assert "torch.softmax(linear_1, -1, dtype = torch.float32)" in code
    # fc1 weight+bias, fc2 weight+bias, x, gelu->fp32, layer_norm->fp16.
    assert len(_casts(gm)) == 7
    assert gm(torch.randn(3, 8)).dtype == torch.float32


def test_weight_used_twice_is_cast_once() -> None:
    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Linear(8, 8, bias=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.emb(x) @ self.emb.weight

    for inputs in [None, (torch.randn(2, 8),)]:
        gm = amprewrite.convert(Tied(), inputs)
        weight_casts = [n for n in _casts(gm) if cast_info(n).weight]
        assert len(weight_casts) == 1


def test_shared_vs_per_use_activation_casts() -> None:
    class Fanout(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.q, self.k, self.v = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.q(x) + self.k(x) + self.v(x)

    inputs = (torch.randn(2, 8),)
    shared = amprewrite.convert(Fanout(), inputs)
    per_use = amprewrite.convert(Fanout(), inputs, policy=Policy.autocast("cpu"))
    activation = lambda gm: [n for n in _casts(gm) if not cast_info(n).weight]  # noqa: E731
    assert len(activation(shared)) == 1
    assert len(activation(per_use)) == 3  # autocast casts x once per consumer


def test_never_casts_int_fp64_or_inplace() -> None:
    class Mixed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(10, 8)
            self.fc = nn.Linear(8, 8)
            self.register_buffer("scale", torch.full((8,), 2.0, dtype=torch.float64))

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            h = self.fc(self.emb(ids))
            h.mul_(2)
            return h * self.scale

    ids = torch.randint(0, 10, (2, 3))
    gm = amprewrite.convert(Mixed(), (ids,))
    cast_inputs = {n.args[0].name for n in _casts(gm) if not cast_info(n).weight}
    assert "ids" not in cast_inputs
    assert {name for name, _ in weight_casts(gm)} == {"fc.weight", "fc.bias"}  # never scale
    mul_ = next(n for n in gm.graph.nodes if decision(n) and decision(n).op == "mul_")
    assert decision(mul_).category is OpCategory.PASSTHROUGH
    out = gm(ids)
    assert out.dtype == torch.float64  # bf16 * fp64 promotes, as in eager


# -- dtypes unknown: guarded casts -------------------------------------------------------------
def test_guarded_casts_without_example_inputs() -> None:
    gm = amprewrite.convert(MLP())
    assert "guarded_cast(x, torch.bfloat16" in gm.code
    assert "fp32_if_eligible" in gm.code  # softmax's dtype decided at run time
    assert gm(torch.randn(2, 8)).dtype == torch.float32
    # The guard is autocast's eligibility rule: fp64, integer and other-device tensors pass.
    from amprewrite.runtime.functions import guarded_cast

    for value in (torch.randn(2, dtype=torch.float64), torch.arange(3), 1.5):
        assert guarded_cast(value, torch.bfloat16) is value
    assert guarded_cast(torch.randn(2), torch.bfloat16, "cuda").dtype == torch.float32
    assert guarded_cast(torch.randn(2), torch.bfloat16, "cpu").dtype == torch.bfloat16


def test_guarded_and_static_agree_bitwise() -> None:
    model = MLP()
    x = torch.randn(5, 8)
    guarded = amprewrite.convert(model, capture="symbolic")
    static = amprewrite.convert(model, (x,), capture="symbolic")
    exported = amprewrite.convert(model, (x,))
    assert torch.equal(guarded(x), static(x))
    assert torch.equal(static(x), exported(x))


# -- the model's own autocast regions ----------------------------------------------------------
class Rotary(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        with torch.autocast("cpu", enabled=False):
            angles = h.float() @ torch.ones(8, 8)  # must stay fp32
        return h + angles


@pytest.mark.parametrize("inputs", [None, (torch.randn(2, 8),)])
def test_autocast_disabled_region_is_honoured(inputs: tuple | None) -> None:
    model = Rotary()
    gm = amprewrite.convert(model, inputs, policy=Policy.autocast("cpu"))
    matmuls = [n for n in gm.graph.nodes if decision(n) and decision(n).op == "matmul"]
    assert len(matmuls) == 1
    assert decision(matmuls[0]).category is OpCategory.PASSTHROUGH
    assert "enabled=False" in decision(matmuls[0]).rule
    x = torch.randn(2, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = model(x)
    out = gm(x)
    assert out.dtype == expected.dtype == torch.float32
    assert torch.equal(out, expected)


class AliasMutation(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x * 2
        y = h.float()  # fp32 already: eager returns h itself
        y.add_(1)  # ... so this writes into h
        return h + 0


@pytest.mark.parametrize("capture", ["symbolic", "export"])
def test_mutating_a_same_dtype_conversion_mutates_its_input(capture: str) -> None:
    x = torch.randn(3)
    gm = amprewrite.convert(AliasMutation(), (x,), policy=Policy.autocast("cpu"), capture=capture)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = AliasMutation()(x)
    assert torch.equal(gm(x), expected)
    assert torch.equal(expected, x * 2 + 1)


# -- idempotence -------------------------------------------------------------------------------
@pytest.mark.parametrize("inputs", [None, (torch.randn(2, 8),)])
def test_converting_twice_inserts_nothing(inputs: tuple | None) -> None:
    gm = amprewrite.convert(MLP(), inputs, capture="symbolic")
    again = amprewrite.convert(gm, inputs, capture="symbolic")
    count = lambda g: sum(1 for n in g.graph.nodes  # noqa: E731
                          if n.op in ("call_method", "call_function") and
                          (n.target in ("to", "cast") or getattr(n.target, "__name__", "")
                           == "guarded_cast"))
    assert count(again) == count(gm)
    x = torch.randn(2, 8)
    assert torch.equal(gm(x), again(x))


def test_passes_report_unmodified_on_second_run() -> None:
    from amprewrite.passes.pipeline import amp_passes

    gm = amprewrite.convert(MLP(), (torch.randn(2, 8),))
    policy, dtype = gm.meta["amprewrite_policy"]
    for p in amp_passes(policy, dtype):
        assert p(gm).modified is False, type(p).__name__


def test_the_schedule_reports_unmodified_on_second_run() -> None:
    from amprewrite.passes.pipeline import amp_passes, run_in_order, run_passes, speed_passes

    model, x = MLP(), torch.randn(2, 8)
    gm = amprewrite.convert(model, (x,), opt_level="O0")
    assert run_in_order(speed_passes(), gm) is False
    gm = amprewrite.convert(model, (x,))
    policy, dtype = gm.meta["amprewrite_policy"]
    assert run_in_order(amp_passes(policy, dtype), gm) is False
    out = gm(x)
    code = gm.code
    run_passes(gm, policy, dtype)  # the whole schedule again: the same graph
    assert gm.code == code and torch.equal(gm(x), out)


def test_dynamic_shapes_fall_back_to_static_with_a_warning(monkeypatch) -> None:
    """Some ATen meta kernels reject symbolic sizes (swin's ``constant_pad_nd``): the passes
    then fail on the dynamic-shape capture, and convert exports again with static shapes."""
    import amprewrite.passes.insert_casts as insert

    real = insert.fake_run

    def rejects_symbolic_sizes(gm, node):
        vals = [a.meta.get("val") for a in node.all_input_nodes]
        if "softmax" in str(node.target) and any(
                isinstance(v, torch.Tensor) and any(isinstance(s, torch.SymInt) for s in v.shape)
                for v in vals):
            raise RuntimeError("SymIntArrayRef expected to contain only concrete integers")
        return real(gm, node)

    monkeypatch.setattr(insert, "fake_run", rejects_symbolic_sizes)
    model = nn.Sequential(nn.Linear(4, 4), nn.Softmax(-1))
    x = torch.randn(3, 4)
    with pytest.warns(UserWarning, match="could not be converted with dynamic shapes.*"
                                         "one graph per size"):
        gm = amprewrite.convert(model, (x,))
    assert torch.equal(gm(x), amprewrite.convert(model, (x,), capture="symbolic")(x))
    placeholder = next(n for n in gm.graph.nodes if n.op == "placeholder")
    assert all(isinstance(s, int) for s in placeholder.meta["val"].shape)


class _Pixels(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv, self.fc = nn.Conv2d(3, 4, 3, stride=2), nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.conv(x).mean((2, 3)))


class _Tokens(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed, self.fc = nn.Embedding(10, 4), nn.Linear(4, 2)

    def forward(self, ids: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        return self.fc(self.embed(ids) + features)


def test_images_keep_their_sizes_and_sequences_stay_dynamic() -> None:
    """A floating input of 4 or more dimensions (images, video) is captured with its sizes,
    batch included (symbolic image sizes cost export 2 to 5 times its static time); token
    ids and (batch, length, features) tensors keep dynamic dimensions."""
    from amprewrite.capture.export import dynamic_dims

    pixels = torch.randn(2, 3, 9, 9)
    assert list(dynamic_dims(pixels)) == [] and list(dynamic_dims(pixels.long())) == [0, 1, 2, 3]
    gm = amprewrite.convert(_Pixels(), (pixels,))
    placeholder = next(n for n in gm.graph.nodes if n.op == "placeholder")
    assert tuple(placeholder.meta["val"].shape) == (2, 3, 9, 9)
    # another batch size makes the batch dynamic once (a partial last batch)
    with pytest.warns(amprewrite.RecaptureWarning, match="x dimension 0 dynamic"):
        assert gm(torch.cat([pixels, pixels[:1]])).shape[0] == 3

    ids, features = torch.randint(0, 10, (2, 5)), torch.randn(2, 5, 4)
    gm = amprewrite.convert(_Tokens(), (ids, features))
    longer = torch.randint(0, 10, (3, 7)), torch.randn(3, 7, 4)
    with torch.autocast("cpu", torch.bfloat16):
        want = _Tokens()(*longer)
    assert torch.equal(gm(*longer), want)


def test_torch_export_never_sees_the_users_tensors(monkeypatch) -> None:
    """torch.export marks the tensors it traces with dynamic dimensions, and a failed export
    leaves the marks: the capture hands it new tensor objects on the same memory (one per
    tensor), so the user's tensors stay unmarked and a static export after a failed
    dynamic one is static."""
    seen: list[torch.Tensor] = []
    real = torch.export.export

    def spy(model, args, kwargs=None, **options):
        seen.extend(args)
        return real(model, args, kwargs, **options)

    monkeypatch.setattr(torch.export, "export", spy)
    ids, features = torch.randint(0, 10, (2, 5)), torch.randn(2, 5, 4, requires_grad=True)
    amprewrite.convert(_Tokens(), (ids, features))
    assert len(seen) == 2 and seen[0] is not ids and seen[1] is not features
    assert seen[0].data_ptr() == ids.data_ptr() and seen[1].data_ptr() == features.data_ptr()
    assert seen[1].requires_grad and seen[1].is_leaf and vars(features) == {}


def test_an_input_on_the_meta_device_is_named_with_the_fix() -> None:
    """A meta input beside real weights (or real inputs beside a meta model) fails deep in a
    layer ("Input type (float) and bias type (c10::BFloat16) ..."): convert names the input,
    the devices and the fix instead."""
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU())
    meta_x = torch.randn(1, 3, 8, 8, device="meta")
    with pytest.raises(AmpRewriteError, match=r"example_inputs\[0\] is a torch.float32 tensor "
                       r"of shape \(1, 3, 8, 8\) on the 'meta' device, but Sequential's "
                       r"parameters and buffers are on cpu\..*torch.randn\(1, 3, 8, 8, "
                       r"device='cpu'\)") as info:
        amprewrite.convert(model, (meta_x,))
    assert "control flow" not in str(info.value) and "bias type" not in str(info.value)
    with pytest.raises(AmpRewriteError, match=r"example_kwargs\['input'\] is .* 'meta' device"):
        amprewrite.convert(model, (), example_kwargs={"input": meta_x})
    with pytest.raises(AmpRewriteError, match=r"on the 'cpu' device, but Sequential's "
                       r"parameters and buffers are on meta\..*model.to_empty"):
        amprewrite.convert(model.to("meta"), (torch.randn(1, 3, 8, 8),))
    gm = amprewrite.convert(model, (meta_x,))  # all on meta: shapes and dtypes only
    assert gm(meta_x).shape == (1, 4, 6, 6)


class _Mlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc1, self.fc2 = nn.Linear(4, 4), nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


class _MaskedScores(nn.Module):
    """``mask`` only meets ops that run in whatever dtype arrives: float64 is fine there."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.fc(x) + mask


def test_a_float64_input_where_fp32_was_captured_raises_as_the_model_does() -> None:
    """Eager and torch.autocast raise for float64 features meeting an fp32 weight; the
    converted module must not round them to bf16 and return a result."""
    model, x = _Mlp(), torch.randn(3, 4)
    gm = amprewrite.convert(model, (x,))
    with pytest.raises(RuntimeError, match="mat1 and mat2 must have the same dtype"):
        model(x.double())
    with torch.autocast("cpu", torch.bfloat16), \
            pytest.raises(RuntimeError, match="mat1 and mat2 must have the same dtype"):
        model(x.double())
    with pytest.raises(AmpRewriteError) as info:
        gm(x.double())
    message = str(info.value)
    assert "x: captured for float32 of shape (any, 4), called with float64 of shape (3, 4)" \
        in message
    assert "float64 is never cast by torch.autocast" in message
    assert "pass x.float(), or convert with float64 example inputs" in message
    assert "argument 0 of the converted module's forward is a torch.float64 tensor" in \
        str(info.value.__cause__)
    assert gm(x).dtype == torch.bfloat16  # the module still works for the captured dtype
    import pickle

    for clone in (copy.deepcopy(gm), pickle.loads(pickle.dumps(gm))):
        assert clone._guards_fn._no_float64 == frozenset({0})


def test_float64_stays_allowed_where_the_model_takes_it() -> None:
    """A model converted from a float64 example runs in float64; an input that only meets
    dtype-following ops computes in float64 as the model does; O2 casts every floating
    input at the entry, as Apex does."""
    x = torch.randn(3, 4, dtype=torch.float64)
    model = _Mlp().double()
    gm = amprewrite.convert(model, (x,))
    torch.testing.assert_close(gm(x), model(x), rtol=0, atol=0)
    assert gm._guards_fn._no_float64 == frozenset()

    masked = _MaskedScores()
    gm = amprewrite.convert(masked, (x.float(), x.float()))
    assert gm._guards_fn._no_float64 == frozenset({0})
    assert gm(x.float(), x).dtype == masked(x.float(), x).dtype == torch.float64
    with pytest.raises(AmpRewriteError, match=r"x: captured for float32 .* called with float64"):
        gm(x, x)

    o2 = amprewrite.convert(_Mlp(), (x.float(),), opt_level="O2")
    with torch.no_grad():
        assert o2(x).dtype == torch.float32


@pytest.mark.parametrize("capture", ["export", "symbolic", "compile"])
def test_code_starts_with_the_forward(capture: str) -> None:
    """torch.fx writes three blank lines above ``def forward``; the converted code starts
    with the code, and torch.fx's line bookkeeping moves up with it."""
    x = torch.randn(2, 8)
    if capture == "compile":
        compiled = amprewrite.compile(MLP(), eager=True)
        compiled(x)
        (gm,) = compiled.amprewrite_backend.graphs
    else:
        gm = amprewrite.convert(MLP(), (x,), capture=capture)
    assert gm.code.startswith("def forward(self, "), repr(gm.code[:40])
    assert gm.code == gm._code.lstrip("\n")  # torch.fx's own text, which its pickling joins
    if capture != "compile":
        assert copy.deepcopy(gm).code == gm.code
