"""The model's other methods, called on the converted module, compute in mixed precision
(:mod:`amprewrite.module.methods`): a method that runs the model's submodules is captured as
an entry of the converted module's cache at its first call, a submodule the model's code
hands out (``generate``'s ``get_encoder()``) is converted, and a method that cannot be
captured warns once, naming itself and the submodule it ran eagerly. Real models (CLIP's
two towers, T5 and BART's encoder-decoders through ``generate``: greedy, beam, sampled) are
compared with eager ``torch.autocast`` under the CPU preset, bitwise, and the matmuls that
ran are counted: none in fp32 where autocast runs none."""

from __future__ import annotations

import warnings
from typing import Any, Callable

import pytest
import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode

import amprewrite
from amprewrite.module.cache import cache_of

PRESET = amprewrite.Policy.autocast("cpu", torch.bfloat16)

_MATMULS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default,
            torch.ops.aten.baddbmm.default, torch.ops.aten.linear.default}


class MatmulDtypes(TorchDispatchMode):
    """The dtype of every matmul that ran (below autocast: what it computed in)."""

    def __init__(self) -> None:
        super().__init__()
        self.dtypes: list[torch.dtype] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None
                           ) -> Any:
        if func in _MATMULS:
            self.dtypes.append(args[0].dtype)
        return func(*args, **(kwargs or {}))


def fp32_matmuls(run: Callable[[], Any]) -> tuple[Any, int, int]:
    """``run()``'s result, its fp32 matmuls and all its matmuls."""
    with MatmulDtypes() as seen:
        out = run()
    return out, sum(d == torch.float32 for d in seen.dtypes), len(seen.dtypes)


def autocast(run: Callable[[], Any]) -> Callable[[], Any]:
    def under() -> Any:
        with torch.autocast("cpu", torch.bfloat16):
            return run()
    return under


def quiet(run: Callable[[], Any]) -> Callable[[], Any]:
    """Recapture reports (new sizes at each decoding step) are not what these tests check."""
    def silenced() -> Any:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", amprewrite.RecaptureWarning)
            return run()
    return silenced


# -- small models: which methods are captured, and the warning -----------------------------
class TwoTowers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.text = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8))
        self.image = nn.Sequential(nn.Linear(12, 16), nn.ReLU(), nn.Linear(16, 8))
        self.scale = 2.0

    def forward(self, t: torch.Tensor, i: torch.Tensor) -> torch.Tensor:
        return self.text_features(t) @ self.image_features(i).T

    def text_features(self, t: torch.Tensor) -> torch.Tensor:
        return self.text(t) * self.scale

    def image_features(self, i: torch.Tensor) -> torch.Tensor:
        out = self.image(i)
        return out / out.norm(dim=-1, keepdim=True)

    def similarity(self, t: torch.Tensor, i: torch.Tensor) -> torch.Tensor:
        return self.text_features(t) @ self.image_features(i).T  # the method body's matmul

    def gated(self, t: torch.Tensor) -> torch.Tensor:
        h = self.text(t)
        if h.sum() > 0:  # data-dependent: torch.export cannot capture it
            return h
        return -h

    def width(self) -> int:
        return self.text[0].out_features

    def twice(self, t: torch.Tensor, i: torch.Tensor) -> torch.Tensor:
        return self(t, i) * 2  # the converted forward


def _two_towers() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    return TwoTowers().eval(), torch.randn(3, 8), torch.randn(5, 12)


def test_methods_run_converted_bitwise_with_autocast_and_are_entries_of_the_cache() -> None:
    model, t, i = _two_towers()
    gm = amprewrite.convert(model, (t, i), policy=PRESET)
    for name, args in (("text_features", (t,)), ("image_features", (i,)),
                       ("similarity", (t, i))):
        for _ in range(2):  # the first call captures, the second runs the entry
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                out, fp32, total = fp32_matmuls(lambda: getattr(gm, name)(*args))
            expected, expected_fp32, _ = fp32_matmuls(autocast(lambda: getattr(model, name)(*args)))
            assert torch.equal(out, expected) and out.dtype == expected.dtype, name
            assert total > 0 and fp32 == expected_fp32 == 0, (name, fp32, total)
    methods = cache_of(gm).methods
    assert sorted(methods.converted) == ["image_features", "similarity", "text_features"]
    lines = cache_of(gm).describe()
    assert "method similarity: eval mode, group 1, held: at the first call, from its inputs" \
        in lines, lines
    assert "method text_features:" in amprewrite.explain(gm)


def test_methods_that_compute_nothing_with_the_model_are_not_captured() -> None:
    """``width`` reads an attribute, ``twice`` calls the converted forward: neither runs a
    submodule eagerly, so neither is captured, and both return what the model's would."""
    model, t, i = _two_towers()
    gm = amprewrite.convert(model, (t, i), policy=PRESET)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert gm.width() == 16
        out, fp32, _ = fp32_matmuls(lambda: gm.twice(t, i))
    assert torch.equal(out, autocast(lambda: model.twice(t, i))()) and fp32 == 0
    assert cache_of(gm).methods.converted == {}
    assert cache_of(gm).methods.decided == {"width": "plain", "twice": "plain"}


def test_a_method_that_cannot_be_captured_warns_once_naming_it_and_runs_eagerly() -> None:
    model, t, i = _two_towers()
    gm = amprewrite.convert(model, (t, i), policy=PRESET)
    with pytest.warns(UserWarning) as record:
        out = gm.gated(t)
    messages = [str(w.message) for w in record if "gated" in str(w.message)]
    assert len(messages) == 1, messages
    assert messages[0].startswith(
        "amprewrite: TwoTowers.gated, called on the converted module, ran the model's "
        "Sequential (text) eagerly, in fp32, not in mixed precision: it could not be captured")
    assert "amprewrite.convert(model.text, ...)" in messages[0]
    assert torch.equal(out, model.gated(t))  # the model's fp32 result, as said
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once
        gm.gated(t)
    assert any(line.startswith("method gated: runs eagerly, in fp32: ")
               for line in cache_of(gm).describe())


def test_at_o2_a_method_that_runs_a_submodule_eagerly_warns() -> None:
    model, t, i = _two_towers()
    gm = amprewrite.convert(model, (t, i), opt_level="O2")
    with pytest.warns(UserWarning, match=r"TwoTowers.text_features, called on the converted "
                      r"module, ran the model's Sequential \(text\) eagerly, in fp32, not in "
                      r"mixed precision: a module converted at opt_level='O2'"):
        out = gm.text_features(t)
    assert torch.equal(out, model.text_features(t))


def test_a_method_entry_takes_other_sizes_without_another_capture() -> None:
    """Captured at its first call like a module converted without example inputs: its
    sizes are symbolic where the method lets them be, so other batch sizes reuse it."""
    model, t, i = _two_towers()
    gm = amprewrite.convert(model, (t, i), policy=PRESET)
    gm.text_features(t)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for rows in (4, 6, 7):
            x = torch.randn(rows, 8)
            assert torch.equal(gm.text_features(x), autocast(lambda: model.text_features(x))())
    entry = cache_of(gm).methods.converted["text_features"]
    assert len(cache_of(entry).entries) == 1, cache_of(gm).describe()


def test_a_method_entry_follows_the_mode_and_the_models_state() -> None:
    """What the method read of the model (``self.scale``) is guarded as the forward's reads
    are; ``gm.train()`` switches the entry too, whose gradients are eager autocast's."""
    model, t, i = _two_towers()
    gm = amprewrite.convert(model, (t, i), policy=PRESET)
    gm.text_features(t)
    model.scale = 3.0  # the method read it: a new state
    with pytest.warns(amprewrite.RecaptureWarning, match=r"the model's state changed since "
                      r"this TwoTowers.text_features was captured.*scale: 2.0 -> 3.0"):
        out = gm.text_features(t)
    assert torch.equal(out, autocast(lambda: model.text_features(t))())
    gm.train()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", amprewrite.RecaptureWarning)
        gm.text_features(t).square().sum().backward()
    grads = [p.grad.clone() for p in model.text.parameters()]
    model.zero_grad()
    autocast(lambda: model.text_features(t))().square().sum().backward()
    assert all(torch.equal(a, p.grad) for a, p in zip(grads, model.text.parameters()))
    entry = cache_of(gm).methods.converted["text_features"]
    assert entry.training and cache_of(entry).held.modes in ((True,), (False, True))


class FixedLength(nn.Module):
    """A forward that needs its length as a Python number: torch.export fixes it."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * float(x.shape[1])


def test_sizes_the_model_fixes_keep_the_graphs_used_last() -> None:
    """One graph per length, at most ``MAX_STATES``: a new length drops the one used least
    recently (an LRU cache), not the one captured first, so a length a loop keeps using
    stays captured."""
    from amprewrite.module.cache import MAX_STATES

    torch.manual_seed(0)
    model = FixedLength().eval()
    gm = amprewrite.convert(model, (torch.randn(2, 2, 4),), policy=PRESET)

    def call(length: int) -> int:
        """How many captures the call made."""
        x = torch.randn(2, length, 4)
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            out = gm(x)
        assert torch.equal(out, autocast(lambda: model(x))())
        return sum(issubclass(w.category, amprewrite.RecaptureWarning) for w in record)

    lengths = list(range(2, 2 + MAX_STATES))
    assert [call(n) for n in lengths[1:]] == [1] * (MAX_STATES - 1)
    assert call(2) == 0 and call(lengths[-1]) == 0  # the first length, used again
    assert call(20) == 1  # drops the least recently used: length 3, not length 2
    assert call(2) == 0 and call(3) == 1
    assert len({e.group for e in cache_of(gm).entries}) == MAX_STATES


# -- real models ---------------------------------------------------------------------------
transformers = pytest.importorskip("transformers")


def _clip() -> nn.Module:
    text = transformers.CLIPTextConfig(
        vocab_size=99, hidden_size=32, intermediate_size=37, num_hidden_layers=1,
        num_attention_heads=4, max_position_embeddings=32, projection_dim=16,
        bos_token_id=0, eos_token_id=2, pad_token_id=1)
    vision = transformers.CLIPVisionConfig(
        hidden_size=32, intermediate_size=37, num_hidden_layers=1, num_attention_heads=4,
        image_size=16, patch_size=8, projection_dim=16)
    config = transformers.CLIPConfig(text_config=text.to_dict(),
                                     vision_config=vision.to_dict(), projection_dim=16)
    torch.manual_seed(0)
    return transformers.CLIPModel(config).eval()


def _tensor(out: Any) -> torch.Tensor:
    return out if isinstance(out, torch.Tensor) else out.pooler_output


def test_clip_towers_and_forward_bitwise_with_autocast_and_no_fp32_matmul() -> None:
    model = _clip()
    gen = torch.Generator().manual_seed(1)
    ids, pixels = torch.randint(3, 99, (2, 7), generator=gen), torch.randn(2, 3, 16, 16,
                                                                         generator=gen)
    gm = amprewrite.convert(model, (), example_kwargs={"input_ids": ids,
                                                       "pixel_values": pixels}, policy=PRESET)
    calls = {"get_text_features": {"input_ids": ids},
             "get_image_features": {"pixel_values": pixels}}
    for name, kwargs in calls.items():
        out, fp32, total = fp32_matmuls(lambda: getattr(gm, name)(**kwargs))
        expected, expected_fp32, _ = fp32_matmuls(autocast(lambda: getattr(model, name)(**kwargs)))
        assert torch.equal(_tensor(out), _tensor(expected)), name
        assert _tensor(out).dtype == _tensor(expected).dtype == torch.bfloat16
        assert total > 0 and fp32 == expected_fp32 == 0, (name, fp32, total)
    out = gm(input_ids=ids, pixel_values=pixels)
    expected = autocast(lambda: model(input_ids=ids, pixel_values=pixels))()
    assert torch.equal(out.logits_per_image, expected.logits_per_image)
    lines = cache_of(gm).describe()
    assert [line.split(":")[0] for line in lines] == [
        "eval mode, group 1, held", "method get_text_features", "method get_image_features"]


def _t5() -> nn.Module:
    config = transformers.T5Config(
        vocab_size=64, d_model=32, d_kv=8, d_ff=37, num_layers=1, num_decoder_layers=1,
        num_heads=4, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1,
        initializer_factor=8.0)
    torch.manual_seed(0)
    return transformers.T5ForConditionalGeneration(config).eval()


def _bart() -> nn.Module:
    config = transformers.BartConfig(
        vocab_size=64, d_model=32, encoder_layers=1, decoder_layers=1,
        encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=37,
        decoder_ffn_dim=37, max_position_embeddings=64, pad_token_id=1, bos_token_id=0,
        eos_token_id=2, decoder_start_token_id=2, forced_bos_token_id=None,
        forced_eos_token_id=None)
    torch.manual_seed(0)
    return transformers.BartForConditionalGeneration(config).eval()


def _whisper() -> nn.Module:
    config = transformers.WhisperConfig(
        vocab_size=64, d_model=32, encoder_layers=1, decoder_layers=1,
        encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
        decoder_ffn_dim=64, num_mel_bins=16, max_source_positions=16, max_target_positions=32,
        pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=1)
    torch.manual_seed(0)
    model = transformers.WhisperForConditionalGeneration(config).eval()
    model.generation_config.forced_decoder_ids = None
    return model


def _prompt(model: nn.Module) -> torch.Tensor:
    """Token ids, or a Whisper model's log-mel features (16 bins, 32 frames)."""
    gen = torch.Generator().manual_seed(1)
    if isinstance(model, transformers.WhisperForConditionalGeneration):
        return torch.randn(2, 16, 32, generator=gen)
    return torch.randint(3, 64, (2, 6), generator=gen)


GENERATE = {"greedy": {"do_sample": False}, "beam": {"num_beams": 2, "do_sample": False},
            "sampled": {"do_sample": True, "top_k": 8}}


@pytest.mark.parametrize("build", [_t5, _bart, _whisper], ids=["t5", "bart", "whisper"])
def test_encoder_decoder_generate_runs_its_encoder_converted(build: Callable[[], nn.Module]
                                                             ) -> None:
    """``generate`` calls ``self.get_encoder()(...)``, the model's encoder handed out: it
    runs converted (an entry ``get_encoder()``), the decoder through the converted forward;
    tokens and scores are eager autocast's, bitwise, and no matmul runs in fp32. With the KV
    cache (the default) the decoder is called without a cache at the first step and with one
    a step longer at each later one: the second cached step makes the cache's length dynamic
    (an encoder-decoder cache and the encoder's outputs, a ModelOutput, are given to
    torch.export as their flattened children), beam search's batch makes the batch dynamic,
    and the sampled loop captures nothing."""
    model = build()
    gm = amprewrite.convert(model, capture="export", policy=PRESET)
    ids = _prompt(model)
    captures = {}
    for how, options in GENERATE.items():
        def run(module: nn.Module) -> Callable[[], Any]:
            def call() -> Any:
                torch.manual_seed(5)
                return module.generate(ids, max_new_tokens=5, output_scores=True,
                                       return_dict_in_generate=True, **options)
            return call
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            out, fp32, total = fp32_matmuls(run(gm))
        captures[how] = [str(w.message) for w in seen
                         if issubclass(w.category, amprewrite.RecaptureWarning)]
        expected, expected_fp32, _ = fp32_matmuls(autocast(run(model)))
        assert torch.equal(out.sequences, expected.sequences), how
        assert all(torch.equal(a, b) for a, b in zip(out.scores, expected.scores)), how
        assert total > 0 and fp32 == expected_fp32 == 0, (how, fp32, total)
    # first cached step, then the cache's length dynamic; the batch of 2 beams; nothing new
    assert [len(c) for c in captures.values()] == [2, 3, 0], captures
    assert not any("cannot take a symbolic size" in m for c in captures.values() for m in c)
    methods = cache_of(gm).methods
    assert list(methods.converted) == ["get_encoder()"]
    assert cache_of(methods.converted["get_encoder()"]).model is model.get_encoder()
    assert "generate" not in methods.converted and methods.decided["generate"] == "plain"
    assert type(gm.get_encoder()) is type(model.get_encoder())  # the user's call: the model's
