"""A converted module as a drop-in for the model in the loops people run: inputs whose sizes
change at every call (automatic dynamic sizes), Python scalars, the model's signature and
attributes, threads, modes active at the call, saving, parametrizations, hooks, and a
forward that writes its own state. Each case is compared with eager ``torch.autocast``
under the CPU preset, bitwise."""

from __future__ import annotations

import copy
import io
import threading
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.nn.utils.prune
from torch.utils._python_dispatch import TorchDispatchMode

import amprewrite
from _versions import TORCH_RELEASE
from amprewrite import AmpRewriteError, RecaptureWarning

PRESET = amprewrite.Policy.autocast("cpu", torch.bfloat16)


class Tokens(nn.Module):
    """A token model called with keywords, as a trainer calls it (``model(**batch)``)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(50, 16)
        self.lin = nn.Linear(16, 50)
        self.loss_type = "ForCausalLM"

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                labels: torch.Tensor | None = None) -> torch.Tensor:
        h = self.lin(self.emb(input_ids))
        if attention_mask is not None:
            h = h * attention_mask[..., None]
        logits = h.float()
        if labels is None:
            return logits
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten())

    def helper(self, input_ids: torch.Tensor) -> torch.Tensor:
        """A method of the model that calls its forward (as HF ``generate`` does)."""
        return self(input_ids=input_ids)


def _batch(length: int, rows: int = 2, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed * 100 + length)
    ids = torch.randint(0, 50, (rows, length), generator=g)
    return {"input_ids": ids, "attention_mask": torch.ones(rows, length), "labels": ids}


def _eager(model: nn.Module, *args: object, **kwargs: object) -> torch.Tensor:
    with torch.autocast("cpu", torch.bfloat16):
        return model(*args, **kwargs)


def _recaptures(caught: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in caught if issubclass(w.category, RecaptureWarning)]


def _train_lengths(module: nn.Module, model: nn.Module, twin: nn.Module,
                   lengths: list[int]) -> None:
    """Steps of ``module`` (which trains ``model``) on batches of each length, each loss and
    gradient bitwise with ``twin``'s under eager autocast."""
    for step, length in enumerate(lengths):
        loss = module(**_batch(length, seed=step))
        ref = _eager(twin, **_batch(length, seed=step))
        assert torch.equal(loss, ref), length
        loss.backward()
        ref.backward()
        for (name, p), q in zip(model.named_parameters(), twin.parameters()):
            assert torch.equal(p.grad, q.grad), (length, name)
        model.zero_grad()
        twin.zero_grad()


@pytest.mark.parametrize("route", ["keywords", "first_call"])
def test_twenty_lengths_train_bitwise_with_one_recapture(route: str) -> None:
    """A padding collator's batches: 20 sequence lengths, the loss and every gradient bitwise
    with autocast, and at most one recapture (the length made dynamic), never an error."""
    torch.manual_seed(0)
    model, twin = Tokens(), Tokens()
    twin.load_state_dict(model.state_dict())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if route == "keywords":
            gm = amprewrite.convert(model, (), example_kwargs=_batch(7), policy=PRESET)
        else:
            gm = amprewrite.convert(model, capture="export", policy=PRESET)
        _train_lengths(gm, model, twin, [7, 5, 9] + list(range(10, 27)))
    recaptures = _recaptures(caught)
    assert len(recaptures) == 1, recaptures
    assert "input_ids dimension 1" in recaptures[0] and "dynamic" in recaptures[0]
    listed = amprewrite.explain(gm).split("graphs kept, oldest first:")[1]
    assert "input_ids dimension 1" in listed and listed.count("\n  ") == 1  # it replaced
    # the first graph


@pytest.mark.usefixtures("fresh_dynamo")
def test_the_same_loop_under_amprewrite_compile() -> None:
    """``amprewrite.compile`` (Dynamo's guards and automatic dynamic sizes) on the padding
    collator's lengths: bitwise with autocast, losses and gradients, in two graphs."""
    torch.manual_seed(0)
    model, twin = Tokens(), Tokens()
    twin.load_state_dict(model.state_dict())
    compiled = amprewrite.compile(model, policy=PRESET, eager=True)
    torch._dynamo.utils.counters.clear()
    _train_lengths(compiled, model, twin, [7, 5, 9] + list(range(10, 20)))
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 2


class CNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3)
        self.bn = nn.BatchNorm2d(8)
        self.fc = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.bn(self.conv(x)).relu().mean((2, 3)))


def test_a_partial_last_batch_of_images() -> None:
    """Images keep their sizes at the first capture (fast); a DataLoader of 10 samples in
    batches of 4 ends with a batch of 2, which makes the batch dimension dynamic once."""
    torch.manual_seed(0)
    model, twin = CNN().train(), CNN().train()
    twin.load_state_dict(model.state_dict())
    data = torch.utils.data.TensorDataset(torch.randn(10, 3, 8, 8))
    loader = torch.utils.data.DataLoader(data, batch_size=4)
    gm = amprewrite.convert(model, (torch.randn(4, 3, 8, 8),), policy=PRESET)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for epoch in range(2):
            for (x,) in loader:
                out, ref = gm(x), _eager(twin, x)
                assert out.shape[0] == x.shape[0] and torch.equal(out, ref), epoch
                out.float().sum().backward()
                ref.float().sum().backward()
    assert len(_recaptures(caught)) == 1
    for (name, p), q in zip(model.named_parameters(), twin.parameters()):
        assert torch.equal(p.grad, q.grad), name
    assert torch.equal(model.bn.running_mean, twin.bn.running_mean)


class Temperature(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
        return self.lin(x) / temperature


def test_a_changed_python_scalar_is_captured_again() -> None:
    model, x = Temperature(), torch.randn(2, 4)
    gm = amprewrite.convert(model, (x, 1.0), policy=PRESET)
    with pytest.warns(RecaptureWarning, match=r"temperature: captured for 1.0, called with 0.5"):
        out = gm(x, 0.5)
    assert torch.equal(out, _eager(model, x, 0.5))
    assert torch.equal(gm(x, 1.0), _eager(model, x, 1.0))  # the first graph, kept


def test_a_changed_python_scalar_raises_with_on_change_raise() -> None:
    model, x = Temperature(), torch.randn(2, 4)
    gm = amprewrite.convert(model, (x, 1.0), on_change="raise")
    with pytest.raises(AmpRewriteError, match=r"temperature: captured for 1.0, called with 0.5"):
        gm(x, 0.5)


def test_a_recapture_can_be_made_an_error_through_its_warning() -> None:
    model = Tokens()
    gm = amprewrite.convert(model, (), example_kwargs=_batch(7))
    with warnings.catch_warnings():
        warnings.simplefilter("error", RecaptureWarning)
        with pytest.raises(RecaptureWarning, match="dynamic"):
            gm(**_batch(9))


def test_the_signature_is_the_models() -> None:
    """``inspect.signature(gm.forward)`` of a module captured at its first call is the model's
    forward's, not ``(*args, **kwargs)``: HF ``Trainer`` drops the
    columns it does not name, and passes loss kwargs to a forward that takes ``**kwargs``."""
    import inspect

    model = Tokens()
    for gm in (amprewrite.convert(model, capture="export", policy=PRESET),):
        assert inspect.signature(gm.forward) == inspect.signature(model.forward)
        ids = _batch(7)["input_ids"]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RecaptureWarning)
            out = gm(input_ids=ids)  # fewer arguments than captured: captured for them
        assert torch.equal(out, _eager(model, input_ids=ids))


def test_the_models_attributes_and_methods_are_the_converted_modules() -> None:
    """What libraries read off the module (``loss_type``, ``config``...) is the model's at
    every moment; a method of the model runs with the converted module as ``self``, so one
    that calls ``self(...)`` (as HF ``generate`` does) runs the converted forward."""
    model = Tokens()
    ids = _batch(7)["input_ids"]
    for gm in (amprewrite.convert(model, capture="export", policy=PRESET),
               amprewrite.convert(model, (), example_kwargs=_batch(7), policy=PRESET)):
        assert gm.loss_type == "ForCausalLM"
        model.loss_type = "other"
        assert gm.loss_type == "other"
        gm.loss_type = "ForCausalLM"  # written through to the model
        assert model.loss_type == "ForCausalLM"
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RecaptureWarning)
            out = gm.helper(ids)
        assert out.dtype == torch.float32 and torch.equal(out, _eager(model, input_ids=ids))
        copied = copy.deepcopy(gm)
        assert copied.loss_type == "ForCausalLM"
        assert copied.helper.__func__.__wrapped__ is Tokens.helper  # wrapped: .methods
        with pytest.raises(AttributeError, match="no_such_attribute"):
            gm.no_such_attribute
    assert not hasattr(nn.Linear(2, 2), "helper")  # other modules' classes are left alone


class _Overriding(Tokens):
    """A model class that overrides ``nn.Module.train`` and ``to``, as ``PreTrainedModel``
    does; each records the module it ran on."""

    ran_on: list[nn.Module] = []

    def train(self, mode: bool = True) -> nn.Module:
        _Overriding.ran_on.append(self)
        return super().train(mode)

    def to(self, *args: object, **kwargs: object) -> nn.Module:
        _Overriding.ran_on.append(self)
        return super().to(*args, **kwargs)


def test_the_models_class_is_a_base_and_graph_modules_come_first() -> None:
    """``isinstance(gm, type(model))`` (what ``Trainer`` asks before ``save_pretrained``),
    also for a deep copy; where the model's class overrides ``nn.Module``, the converted
    module keeps the GraphModule's (its ``train`` switches graphs). A class of torch's own is
    not a base: torch takes its layers by class, and a converted module is not the layer."""
    model = _Overriding()
    gm = amprewrite.convert(model, (), example_kwargs=_batch(7), policy=PRESET)
    assert isinstance(gm, _Overriding) and isinstance(gm, Tokens)
    mro = type(gm).__mro__
    assert mro.index(torch.fx.GraphModule) < mro.index(_Overriding) < mro.index(nn.Module)
    gm.eval()
    gm.to(torch.float32)
    assert not any(m is gm for m in _Overriding.ran_on)
    assert not gm.training and not model.training
    with torch.no_grad():
        assert torch.equal(gm(**_batch(7)), _eager(model, **_batch(7)))
    copied = copy.deepcopy(gm)
    assert isinstance(copied, _Overriding) and not isinstance(_Overriding(), type(gm))
    seq = nn.Sequential(nn.Linear(4, 4))
    assert not isinstance(amprewrite.convert(seq, (torch.randn(2, 4),)), nn.Sequential)


def test_an_attribute_the_model_gets_after_conversion_is_the_converted_modules() -> None:
    """``model.x = ...`` after ``convert`` (a library's marker, a flag a trainer sets) reads
    on the converted module, as the model's at every moment; a method set on the model
    instance is refused: it is bound to the model and would run its fp32 forward."""
    model = Tokens()
    gm = amprewrite.convert(model, (), example_kwargs=_batch(7), policy=PRESET)
    with pytest.raises(AttributeError, match="is_parallelizable"):
        gm.is_parallelizable
    model.is_parallelizable = True
    assert gm.is_parallelizable is True
    model.is_parallelizable = False
    assert gm.is_parallelizable is False and getattr(gm, "is_parallelizable", None) is False
    model.predict = model.helper.__get__(model)  # bound to the model
    with pytest.raises(AttributeError, match="run the model's own forward in fp32"):
        gm.predict
    assert torch.equal(gm.lin.weight, model.lin.weight)  # tensors and children come first
    with torch.no_grad():
        assert torch.equal(gm(**_batch(7)), _eager(model, **_batch(7)))


class Flagged(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.scale = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * (2.0 if self.scale else 3.0)


def test_two_threads_calling_while_a_flag_flips_are_both_right_with_one_capture() -> None:
    model, x = Flagged(), torch.randn(2, 4)
    gm = amprewrite.convert(model, (x,), policy=PRESET)
    model.scale = False
    results: list[torch.Tensor] = []
    errors: list[BaseException] = []
    start = threading.Barrier(2)

    def call() -> None:
        try:
            start.wait()
            results.append(gm(x))
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        threads = [threading.Thread(target=call) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert not errors, errors
    ref = _eager(model, x)
    assert len(results) == 2 and all(torch.equal(r, ref) for r in results)
    assert len(_recaptures(caught)) == 1
    assert type(model.lin.weight) is nn.Parameter  # the model's tensors are real
    assert torch.equal(model(x), F.linear(x, model.lin.weight, model.lin.bias) * 3.0)


class _Ops(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.fake = 0
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        from torch._subclasses.fake_tensor import FakeTensor

        leaves = torch.utils._pytree.tree_leaves((args, kwargs))
        self.fake += any(isinstance(t, FakeTensor) for t in leaves)
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def test_a_capture_at_the_call_runs_outside_the_callers_modes() -> None:
    """The first call of a module captured then, and the first call after a change of state,
    inside ``amprewrite.audit()`` or a user's dispatch mode: the capture runs outside them,
    which see the call as eager shows it (no fake tensors), and return."""
    model, x = Flagged(), torch.randn(2, 4)
    gm = amprewrite.convert(model, capture="export", policy=PRESET)
    with amprewrite.audit() as report:
        out = gm(x)
    assert torch.equal(out, _eager(model, x))
    assert "addmm" in report.table()
    model.scale = False
    mode = _Ops()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RecaptureWarning)
        with mode:
            out = gm(x)
    assert torch.equal(out, _eager(model, x))
    assert mode.fake == 0 and any("addmm" in op for op in mode.ops)


def test_saving_leaves_the_module_following_its_model() -> None:
    model, x = Flagged().train(), torch.randn(2, 4)
    model.drop = nn.Dropout(0.0)
    gm = amprewrite.convert(model, (x,), policy=PRESET)
    buffer = io.BytesIO()
    torch.save(gm, buffer)
    saved = _eager(model, x)
    model.scale = False
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RecaptureWarning)
        assert torch.equal(gm.eval()(x), _eager(model.eval(), x))
        assert torch.equal(gm.train()(x), _eager(model.train(), x))
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert torch.equal(loaded(x), saved)  # the copy: the model as it was saved


@pytest.mark.parametrize("capture", ["export", "symbolic"])
@pytest.mark.parametrize("change", ["weight_norm", "spectral_norm", "parametrization",
                                    "prune"])
def test_parametrizations_and_pruning_added_after_conversion_are_followed(
        change: str, capture: str) -> None:
    torch.manual_seed(0)
    model, x = CNN().eval(), torch.randn(2, 3, 8, 8)
    gm = amprewrite.convert(model, (x,) if capture == "export" else None, policy=PRESET)
    if change == "weight_norm":
        torch.nn.utils.parametrizations.weight_norm(model.fc)
    elif change == "spectral_norm":
        torch.nn.utils.parametrizations.spectral_norm(model.fc)
    elif change == "parametrization":
        class Half(nn.Module):
            def forward(self, w: torch.Tensor) -> torch.Tensor:
                return w * 0.5

        torch.nn.utils.parametrize.register_parametrization(model.fc, "weight", Half())
    else:
        torch.nn.utils.prune.l1_unstructured(model.fc, "weight", amount=0.5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if change == "spectral_norm" and capture == "symbolic":
            # its power iteration branches on tensors: the new capture refuses, saying so
            with pytest.raises(AmpRewriteError, match="symbolic tracing of CNN failed"):
                gm(x)
            return
        out = gm(x)
    assert torch.equal(out, _eager(model, x))


def test_a_global_module_hook_is_reported_and_sees_no_helper_of_ours() -> None:
    model, x = CNN().eval(), torch.randn(2, 3, 8, 8)
    gm = amprewrite.convert(model, (x,))
    seen: list[str] = []
    handle = torch.nn.modules.module.register_module_forward_hook(
        lambda module, args, out: seen.append(type(module).__name__))
    try:
        with pytest.warns(UserWarning, match="global module forward hook"):
            gm(x)
    finally:
        handle.remove()
    assert seen == ["CNN"]


class Counting(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.steps = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.steps += 1
        return self.lin(x) * min(1.0, self.steps / 10)


def test_a_forward_that_writes_its_own_state_is_refused_and_the_model_left_as_it_was() -> None:
    model = Counting()
    with pytest.raises(AmpRewriteError, match=r"steps: 0 -> 1.*amprewrite.compile"):
        amprewrite.convert(model, (torch.randn(2, 4),))
    assert model.steps == 0 and type(model) is Counting


def test_hf_generate_with_a_kv_cache_runs_the_converted_forward() -> None:
    """``gm.generate`` (the model's method, with the converted module as ``self``): a prefill
    call, then decode calls whose KV cache grows, at two prompt lengths; the tokens are eager
    autocast's, and the cache's length is made dynamic once: one graph for every decode
    step, and the prefills' (whose length the second prompt makes dynamic; torch 2.11 keeps
    the prompt's length fixed, one prefill graph per length), not one per length (a prefill
    is compared with the prefill's graph, not the decode steps' held last:
    cache.GraphCache._hold_nearest; the
    keywords ``generate`` passes to the ``**kwargs`` of the forward are named for torch.export,
    :mod:`amprewrite.capture.keywords`)."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    gm = amprewrite.convert(model, capture="export", policy=PRESET)
    for length in (6, 9):
        ids = torch.randint(0, 64, (1, length), generator=torch.Generator().manual_seed(length))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            tokens = gm.generate(ids, max_new_tokens=6, do_sample=False)
            with torch.autocast("cpu", torch.bfloat16):
                expected = model.generate(ids, max_new_tokens=6, do_sample=False)
        assert tokens.shape == (1, length + 6) and torch.equal(tokens, expected), length
    cache = amprewrite.module.cache.cache_of(gm)

    def takes_a_cache(entry: amprewrite.module.cache.Entry) -> bool:
        """A decode step's graph: its inputs hold the KV cache."""
        specs = entry.graph(gm).meta[amprewrite.graph.inputs.INPUTS_KEY]
        return any(spec.name.startswith(("cache[", "past_key_values[")) for spec in specs)

    decode = [e for e in cache.entries if takes_a_cache(e)]
    prefill = [e for e in cache.entries if e not in decode]
    assert len(decode) == 1, cache.describe()
    # measured: one on 2.13 and 2.14, one per prompt length on 2.11 (2.12 not measured)
    assert len(prefill) in ((1,) if TORCH_RELEASE >= (2, 13) else (1, 2)), cache.describe()
    assert "forward" not in model.__dict__  # the forward presented to torch.export is gone


def test_the_mode_follows_the_models_switches() -> None:
    """``model.eval()`` / ``model.train()`` switch the converted module at its next call, as
    ``gm.eval()`` / ``gm.train()`` do; ``gm.eval()`` switches the model too, whose modules are
    the converted module's (as ``torch.compile``'s module switches its model), and a flag set
    on the converted module alone (as Lightning restores flags) stays its own until the model
    switches again."""
    torch.manual_seed(0)
    model, x = CNN().train(), torch.randn(4, 3, 8, 8)
    gm = amprewrite.convert(model, (x,), policy=PRESET)
    model.eval()
    out = gm(x)
    assert not gm.training and torch.equal(out, _eager(model, x))  # running statistics
    model.train()
    before = model.bn.running_mean.clone()
    gm(x)
    assert gm.training and not torch.equal(model.bn.running_mean, before)  # batch statistics
    gm.eval()
    assert not model.training and not model.bn.training and gm.bn is model.bn
    gm.training = True  # set by hand, as Lightning restores flags
    gm(x)
    assert gm.training
