"""A converted module stays the user's live model: the Python state its capture read
(attributes, configs, which submodule sits where) is checked at each call; a change captures
the model again (warning once, naming what changed; bounded) or, with ``on_change="raise"``,
raises. Never the old output. Each capture path is checked to fire (so that a change in
torch or transformers cannot switch the check off unseen)."""

from __future__ import annotations

import contextlib
import copy
import types
import warnings
from typing import Any, Callable, Iterator

import pytest
import torch
import torch.nn as nn

import amprewrite
from amprewrite.module.cache import MAX_STATES, cache_of
from amprewrite.errors import AmpRewriteError

bf16 = torch.bfloat16
PRESET = amprewrite.Policy.autocast("cpu", bf16)
X = torch.randn(4, 8, generator=torch.Generator().manual_seed(0))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.gate = nn.Linear(8, 8)
        self.use_gate = True
        self.temperature = 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc(x) / self.temperature
        if self.use_gate:
            y = y * torch.sigmoid(self.gate(x))
        if hasattr(self, "extra"):
            y = self.extra(y)
        return y


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = Block()
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.block(x)))


def _model() -> Model:
    torch.manual_seed(0)
    return Model().eval()


def _convert(model: nn.Module, capture: str, opt_level: str = "O1", **options: Any
             ) -> nn.Module:
    inputs = (X,) if capture == "export" else None
    policy = {"policy": PRESET} if opt_level == "O1" else {"dtype": bf16}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return amprewrite.convert(model, inputs, capture=capture, opt_level=opt_level,
                                  **policy, **options)  # type: ignore[arg-type]


def _reference(model: nn.Module, capture: str, opt_level: str) -> torch.Tensor:
    """What the model computes now: autocast (O1, the preset's reference, bitwise), or a fresh
    conversion of a copy of the model as it is now (O2)."""
    with torch.no_grad():
        if opt_level == "O1":
            with torch.autocast("cpu", dtype=bf16):
                return model(X)
        return _convert(copy.deepcopy(model), capture, opt_level)(X)


@contextlib.contextmanager
def _captures_again(*names: str) -> Iterator[None]:
    """The block warns once that the model was captured again, naming ``names``."""
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        yield
    messages = [str(w.message) for w in seen if "captured again" in str(w.message)]
    assert len(messages) == 1, [str(w.message) for w in seen]
    for name in names:
        assert name in messages[0], messages[0]


@contextlib.contextmanager
def _silent() -> Iterator[None]:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        yield


def _set(path: str, value: Any) -> Callable[[nn.Module], None]:
    def change(model: nn.Module) -> None:
        owner, _, name = path.rpartition(".")
        setattr(model.get_submodule(owner), name, value)
    return change


def _new_head(out: int) -> Callable[[nn.Module], None]:
    def change(model: nn.Module) -> None:
        torch.manual_seed(1)
        model.head = nn.Linear(8, out)
    return change


def _add_extra(model: nn.Module) -> None:
    torch.manual_seed(2)
    model.block.extra = nn.Linear(8, 8)


def _forward_on_the_instance(model: nn.Module) -> None:
    block = model.block
    block.forward = types.MethodType(lambda self, x: torch.tanh(self.fc(x)), block)


# (id, change, what the warning names)
CHANGES = [
    ("forward set on a submodule", _forward_on_the_instance,
     "block.forward: set on the instance"),
    ("bool flag", _set("block.use_gate", False), "block.use_gate: True -> False"),
    ("float attribute", _set("block.temperature", 2.0), "block.temperature: 1.0 -> 2.0"),
    ("head replaced, same shape", _new_head(4), "head: replaced (Linear -> Linear)"),
    ("head replaced, other shape", _new_head(3), "head: replaced (Linear -> Linear)"),
    ("submodule added", _add_extra, "block.extra: a submodule added"),
]
CASES = [(c, o) for c in ("export", "symbolic") for o in ("O1", "O2")]


@pytest.mark.parametrize("capture,opt_level", CASES)
@pytest.mark.parametrize("change,named", [c[1:] for c in CHANGES], ids=[c[0] for c in CHANGES])
def test_a_change_of_python_state_is_followed(capture: str, opt_level: str,
                                              change: Callable[[nn.Module], None],
                                              named: str) -> None:
    model = _model()
    gm = _convert(model, capture, opt_level)
    with torch.no_grad():
        before = gm(X)
        assert torch.equal(before, _reference(model, capture, opt_level))
        change(model)
        with _captures_again(named):
            after = gm(X)
        want = _reference(model, capture, opt_level)
        assert after.shape == want.shape and torch.equal(after, want)
        assert not torch.equal(after, before) if after.shape == before.shape else True
        with _silent():
            assert torch.equal(gm(X), want)  # captured once


@pytest.mark.parametrize("capture", ["export", "symbolic"])
def test_a_forward_replaced_on_the_class_or_a_base_is_followed(capture: str) -> None:
    """A class's forward replaced after conversion (a library patching a layer class, a
    notebook redefining it): followed at the next call, bitwise with eager autocast, and put
    back, the first graph again."""

    class Base(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc(x)

    class Layer(Base):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(8, 8)

    torch.manual_seed(0)
    model = nn.Sequential(Layer(), nn.Linear(8, 4)).eval()
    gm = _convert(model, capture)
    original = Base.forward
    with torch.no_grad():
        first = gm(X)
        Base.forward = lambda self, x: torch.sigmoid(self.fc(x))
        with _captures_again("Base.forward: function Base.forward -> function"):
            assert torch.equal(gm(X), _reference(model, capture, "O1"))
        Layer.forward = lambda self, x: self.fc(x) * 3  # a subclass now defines one
        with _captures_again("Layer.forward: set on the instance"):
            assert torch.equal(gm(X), _reference(model, capture, "O1"))
        del Layer.forward
        Base.forward = original
        with _silent():
            assert torch.equal(gm(X), first)


def test_a_forward_set_on_the_root_is_followed_or_refused() -> None:
    """torch.export calls the model as eager does and follows an instance forward; the
    symbolic tracer traces the class's forward, so a capture of a model whose forward is set
    on the instance is refused, naming the fix."""
    model = _model()
    gm = _convert(model, "export")
    model.forward = types.MethodType(lambda self, x: self.head(self.block(x)), model)
    with torch.no_grad(), _captures_again("forward: set on the instance"):
        assert torch.equal(gm(X), _reference(model, "export", "O1"))
    with pytest.raises(AmpRewriteError, match="forward set on the instance.*example_inputs"):
        _convert(model, "symbolic")


@pytest.mark.parametrize("capture", ["export", "symbolic"])
def test_a_state_seen_before_reuses_its_graph(capture: str) -> None:
    model = _model()
    gm = _convert(model, capture)
    with torch.no_grad():
        first = gm(X)
        model.block.use_gate = False
        with _captures_again("block.use_gate"):
            second = gm(X)
        guard = cache_of(gm)
        for _ in range(3):
            model.block.use_gate = True
            with _silent():
                assert torch.equal(gm(X), first)
            model.block.use_gate = False
            with _silent():
                assert torch.equal(gm(X), second)
        assert len(guard.entries) == 2


@pytest.mark.parametrize("capture", ["export", "symbolic"])
def test_on_change_raise_names_the_attribute_and_the_fix(capture: str) -> None:
    model = _model()
    gm = _convert(model, capture, on_change="raise")
    gm(X)
    model.block.temperature = 3.0
    with pytest.raises(AmpRewriteError, match=r"block\.temperature: 1\.0 -> 3\.0.*convert it "
                                              r"again.*on_change='recapture'"):
        gm(X)
    model.block.temperature = 1.0  # back as it was: runs again
    with _silent():
        gm(X)


def test_on_change_is_validated() -> None:
    with pytest.raises(ValueError, match=r"on_change='sometimes' is unknown; expected "
                                         r"'recapture' or 'raise'"):
        amprewrite.convert(_model(), on_change="sometimes")


def test_past_the_bound_a_call_raises() -> None:
    model = _model()
    gm = _convert(model, "symbolic")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for i in range(MAX_STATES - 1):
            model.block.temperature = 2.0 + i
            gm(X)
    model.block.temperature = 100.0
    with pytest.raises(AmpRewriteError, match=rf"after {MAX_STATES} states were captured.*"
                                              r"pass it as an input"):
        gm(X)


@pytest.mark.parametrize("capture", ["export", "symbolic"])
def test_a_tensor_written_straight_into_the_parameters_dict_is_followed(capture: str) -> None:
    """As accelerate's device-map loading does (``module._parameters[name] = t``): the
    converted module reads the model's own dicts, so nothing is captured again."""
    model = _model()
    gm = _convert(model, capture)
    with torch.no_grad():
        gm(X)
        model.head._parameters["weight"] = nn.Parameter(torch.randn(4, 8))
        model.block.fc._buffers  # noqa: B018  (untouched)
        with _silent():
            out = gm(X)
    assert torch.equal(out, _reference(model, capture, "O1"))
    assert gm.get_submodule("head").weight is model.head.weight


def test_a_bias_set_where_the_capture_found_none_is_followed() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8, bias=False))
    gm = _convert(model, "export")
    gm(X)
    model[0].bias = nn.Parameter(torch.ones(8))
    with _captures_again("0.bias: was None, now a tensor"):
        out = gm(X)
    with torch.autocast("cpu", dtype=bf16):
        assert torch.equal(out, model(X))


@pytest.mark.parametrize("capture", ["export", "symbolic"])
def test_state_and_mode_change_together(capture: str) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5))
    model.train()
    gm = _convert(model, capture)
    model[1].p = 0.0  # dropout off, in train mode
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = gm(X)
    with torch.autocast("cpu", dtype=bf16):
        assert torch.equal(out, model(X))
    gm.eval()
    with torch.no_grad(), torch.autocast("cpu", dtype=bf16):
        want = model.eval()(X)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert torch.equal(gm(X), want)


def test_an_hf_config_change_is_followed() -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=2,
                                     num_attention_heads=2, intermediate_size=32,
                                     max_position_embeddings=32)
    torch.manual_seed(0)
    model = transformers.BertModel(config).eval()
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        gm = amprewrite.convert(model, (ids,), policy=PRESET)
    with torch.no_grad():
        assert gm(ids).hidden_states is None
        model.config.output_hidden_states = True
        with _captures_again("config.output_hidden_states: False -> True"):
            out = gm(ids)
        with torch.autocast("cpu", dtype=bf16):
            want = model(ids)
    assert len(out.hidden_states) == 3
    assert all(torch.equal(a, b) for a, b in zip(out.hidden_states, want.hidden_states))


def test_the_model_keeps_its_classes() -> None:
    """The capture notes reads through a subclass of each module's class, for its duration
    only: afterwards, and after a capture that failed, every module has its own class."""
    model = _model()
    classes = [type(m) for m in model.modules()]
    _convert(model, "export")
    assert [type(m) for m in model.modules()] == classes

    class Broken(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            raise RuntimeError("broken forward")

    broken = nn.Sequential(nn.Linear(8, 8), Broken())
    with pytest.raises(Exception):
        amprewrite.convert(broken, (X,))
    assert type(broken[1]) is Broken and type(broken) is nn.Sequential


def test_a_converted_input_refuses_a_change() -> None:
    """``convert(gm)`` rewrites ``gm``'s graph, not the model: it cannot capture a new state,
    so a change raises (never the old output)."""
    model = _model()
    again = _convert(_convert(model, "export"), "export")
    again(X)
    model.block.use_gate = False
    with pytest.raises(AmpRewriteError, match=r"block\.use_gate: True -> False.*cannot capture"):
        again(X)


def test_a_deep_copy_follows_its_own_model() -> None:
    """A copy of the converted module holds a copy of the model, sharing nothing with the
    original: a change to the original model is the original module's alone."""
    model = _model()
    gm = _convert(model, "export")
    before = gm(X)
    copied = copy.deepcopy(gm)
    model.block.use_gate = False
    with _silent():
        assert torch.equal(copied(X), before)
    with _captures_again("block.use_gate"):
        gm(X)


@pytest.mark.parametrize("change,named", [c[1:] for c in CHANGES], ids=[c[0] for c in CHANGES])
def test_the_compile_backend_follows_the_same_changes(change: Callable[[nn.Module], None],
                                                      named: str, fresh_dynamo: None) -> None:
    """``amprewrite.compile`` (Dynamo's guards) follows each change too: the reference."""
    model = _model()
    compiled = amprewrite.compile(model, policy=PRESET, eager=True)
    with torch.no_grad():
        compiled(X)
        change(model)
        out = compiled(X)
        with torch.autocast("cpu", dtype=bf16):
            want = model(X)
    assert out.shape == want.shape and torch.equal(out, want)


def test_the_warning_names_at_most_a_few_changes() -> None:
    model = _model()
    gm = _convert(model, "symbolic")
    gm(X)
    model.block.use_gate, model.block.temperature = False, 0.5
    with _captures_again("block.use_gate: True -> False", "block.temperature: 1.0 -> 0.5"):
        gm(X)


@pytest.mark.parametrize("capture", ["export", "symbolic"])
def test_each_capture_path_sees_the_model_read(capture: str) -> None:
    """The check rests on the capture running the model's own modules: each path must note
    reads of them (a torch that traced a copy would make this fail, and convert warn)."""
    gm = _convert(_model(), capture)
    snapshot = cache_of(gm).snapshot
    names = {item.name for item in snapshot._values}
    assert {"block", "block.use_gate", "block.temperature", "head"} <= names, names
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        amprewrite.convert(_model(), (X,) if capture == "export" else None, policy=PRESET,
                           capture=capture)
