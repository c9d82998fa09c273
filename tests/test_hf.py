"""HF transformers (tiny random configs, no download): BertModel and GPT2Model through the
export path and the torch.compile backend, against fp32 and torch.autocast."""

from __future__ import annotations

import functools
from typing import Any, Callable

import pytest
import torch
import torch.nn as nn

import amprewrite
from amprewrite import Policy

transformers = pytest.importorskip("transformers")


def bert(attn: str = "eager") -> nn.Module:
    config = transformers.BertConfig(
        vocab_size=128, hidden_size=64, num_hidden_layers=1, num_attention_heads=4,
        intermediate_size=128, max_position_embeddings=64, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0, attn_implementation=attn)
    torch.manual_seed(0)
    return transformers.BertModel(config).eval()


def gpt2(attn: str = "eager", layers: int = 1) -> nn.Module:
    config = transformers.GPT2Config(
        vocab_size=128, n_embd=64, n_layer=layers, n_head=4, n_positions=64, use_cache=False,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, attn_implementation=attn,
        bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    return transformers.GPT2Model(config).eval()


def inputs(name: str) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 128, (2, 16), generator=gen)
    if name == "bert":  # one padded sequence exercises the attention mask
        mask = torch.ones(2, 16, dtype=torch.long)
        mask[1, 11:] = 0
        return ids, mask
    return (ids,)


MODELS: dict[str, Callable[..., nn.Module]] = {"bert": bert, "gpt2": gpt2}


def hidden(out: Any) -> torch.Tensor:
    return out["last_hidden_state"] if not isinstance(out, torch.Tensor) else out


def max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


@functools.lru_cache(maxsize=None)
def reference(name: str, attn: str = "eager") -> tuple[torch.Tensor, torch.Tensor]:
    model, args = MODELS[name](attn), inputs(name)
    with torch.no_grad():
        fp32 = hidden(model(*args))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            autocast = hidden(model(*args))
    return fp32, autocast


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield


def run(name: str, path: str, policy: Policy, attn: str = "eager") -> torch.Tensor:
    model, args = MODELS[name](attn), inputs(name)
    if path == "export":
        converted = amprewrite.convert(model, args, policy=policy, dtype=torch.bfloat16)
    else:
        converted = amprewrite.compile(model, policy=policy, dtype=torch.bfloat16, eager=True)
    with torch.no_grad():
        return hidden(converted(*args))


@pytest.mark.parametrize("path", ["export", "compile"])
@pytest.mark.parametrize("name", ["bert", "gpt2"])
def test_default_policy_within_2x_autocast_error(name: str, path: str) -> None:
    fp32, autocast = reference(name)
    out = run(name, path, Policy())
    err, err_autocast = max_err(out, fp32), max_err(autocast, fp32)
    print(f"{name} {path}: amprewrite max err {err:.3g}, autocast {err_autocast:.3g}")
    assert 0 < err <= 2 * err_autocast   # > 0: the model really ran in bf16


@pytest.mark.parametrize("path", ["export", "compile"])
@pytest.mark.parametrize("name", ["bert", "gpt2"])
def test_autocast_preset_matches_autocast(name: str, path: str) -> None:
    _, autocast = reference(name)
    out = run(name, path, Policy.autocast("cpu"))
    assert out.dtype == autocast.dtype
    torch.testing.assert_close(out, autocast, rtol=0, atol=0)


def test_sdpa_attention() -> None:
    fp32, autocast = reference("gpt2", "sdpa")
    out = run("gpt2", "export", Policy(), attn="sdpa")
    assert 0 < max_err(out, fp32) <= 2 * max_err(autocast, fp32)
    out = run("gpt2", "compile", Policy.autocast("cpu"), attn="sdpa")
    torch.testing.assert_close(out, autocast, rtol=0, atol=0)


@pytest.mark.parametrize("name, path", [("bert", "export"), ("gpt2", "export"),
                                        ("gpt2", "compile")])
def test_trains_like_autocast(name: str, path: str) -> None:
    """Gradients of the converted model equal autocast's under the preset, bit for bit."""
    model, twin, args = MODELS[name]().train(), MODELS[name]().train(), inputs(name)
    if path == "export":
        converted = amprewrite.convert(model, args, policy=Policy.autocast("cpu"))
    else:
        converted = amprewrite.compile(model, policy=Policy.autocast("cpu"), eager=True)
    hidden(converted(*args)).float().pow(2).mean().backward()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = hidden(twin(*args))
    out.float().pow(2).mean().backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert len(grads) > 10
    for n, q in twin.named_parameters():
        if n in grads:
            assert grads[n].dtype == torch.float32
            torch.testing.assert_close(grads[n], q.grad, rtol=0, atol=0, msg=n)


def test_keep_fp32_on_a_transformer_block() -> None:
    model, args = gpt2(layers=2), inputs("gpt2")  # one block of two kept in fp32
    policy = Policy().override(keep_fp32=["h.1.mlp"])
    gm = amprewrite.convert(model, args, policy=policy)
    text = amprewrite.explain(gm)
    assert text.count("module override 'h.1.mlp'") >= 2      # c_fc and c_proj (addmm)
    assert text.count("linear  ") + text.count("addmm  ") >= 8
    with torch.no_grad():
        assert hidden(gm(*args)).dtype == torch.float32


# -- what transformers 5.25 changed under the capture -----------------------------------------
def test_packed_position_ids_match_autocast() -> None:
    """transformers 5.25 passes ``position_ids`` to the attention-mask builders of encoders
    (BERT), which read a packed batch (positions restarting at 0) as separate sequences. The
    capture sees the mask that eager builds: bitwise with autocast, packed or not, with and
    without an attention mask."""
    model = bert()
    ids = torch.randint(0, 128, (1, 10), generator=torch.Generator().manual_seed(2))
    packed = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 0, 1, 2]])
    for kwargs in ({"position_ids": packed},
                   {"position_ids": packed, "attention_mask": torch.ones_like(ids)}):
        gm = amprewrite.convert(model, (ids,), example_kwargs=kwargs,
                                policy=Policy.autocast("cpu"))
        with torch.no_grad():
            got = gm(ids, **kwargs).last_hidden_state
            with torch.autocast("cpu", dtype=torch.bfloat16):
                want = model(ids, **kwargs).last_hidden_state
            plain = model(ids).last_hidden_state
        assert torch.equal(got, want), sorted(kwargs)
        assert not torch.equal(want.float(), plain)  # the positions reached the model


def test_a_deprecated_keyword_in_the_signature_is_not_an_input() -> None:
    """transformers 5.25 adds a deprecated keyword (``past_key_values``, renamed ``cache``) to
    the signature of some models' functions (MBart, Pegasus, Blenderbot, M2M100) so that
    code reading ``inspect.signature`` keeps passing it; the capture binds the forward's
    keywords by signature, and must not take it for an input."""
    config = transformers.MBartConfig(
        vocab_size=64, d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64,
        max_position_embeddings=32, dropout=0.0, pad_token_id=1)
    torch.manual_seed(0)
    model = transformers.MBartForConditionalGeneration(config).eval()
    ids = torch.randint(3, 64, (2, 8), generator=torch.Generator().manual_seed(3))
    decoder_ids = torch.randint(3, 64, (2, 5), generator=torch.Generator().manual_seed(4))
    gm = amprewrite.convert(model, (ids,), example_kwargs={"decoder_input_ids": decoder_ids},
                            policy=Policy.autocast("cpu"))
    with torch.no_grad():
        got = gm(ids, decoder_input_ids=decoder_ids).logits
        with torch.autocast("cpu", dtype=torch.bfloat16):
            want = model(ids, decoder_input_ids=decoder_ids).logits
    assert torch.equal(got, want)
