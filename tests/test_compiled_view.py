"""``amprewrite.compile(model)`` reads as the model: its tensors' names, its forward's
signature, and the model's methods running the compiled forward, where ``torch.compile``'s
module renames every key ``_orig_mod.*``, shows ``(*args, **kwargs)`` and runs ``generate``
eagerly; HF ``Trainer`` with a padding collator trains it as it trains the model."""

from __future__ import annotations

import inspect
import pathlib
import warnings

import pytest
import torch

import amprewrite

transformers = pytest.importorskip("transformers")

PRESET = amprewrite.Policy.autocast("cpu", torch.bfloat16)

pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def _llama() -> torch.nn.Module:
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval()


def test_names_and_signature_are_the_models() -> None:
    model = _llama()
    compiled = amprewrite.compile(model, policy=PRESET, eager=True)
    assert list(compiled.state_dict()) == list(model.state_dict())
    assert [n for n, _ in compiled.named_parameters()] == \
        [n for n, _ in model.named_parameters()]
    assert inspect.signature(compiled.forward) == inspect.signature(model.forward)
    state = {k: v + 1 for k, v in model.state_dict().items()}
    compiled.load_state_dict(state)  # the model's keys load
    assert torch.equal(model.model.norm.weight, state["model.norm.weight"])
    assert compiled.config is model.config  # what torch.compile's module already forwards
    holder = torch.nn.ModuleDict({"lm": compiled})  # a LightningModule holding it
    assert list(holder.state_dict()) == [f"lm.{k}" for k in model.state_dict()]
    holder.load_state_dict({f"lm.{k}": v - 1 for k, v in state.items()})  # its checkpoint
    assert torch.equal(model.model.norm.weight, state["model.norm.weight"] - 1)


def test_generate_runs_the_compiled_forward_and_gives_eager_autocasts_tokens() -> None:
    """The model's ``generate`` runs with the compiled module as ``self``: its prefill and
    decode calls go through the backend (graphs are captured), and the tokens are eager
    autocast's at two prompt lengths."""
    model = _llama()
    compiled = amprewrite.compile(model, policy=PRESET, eager=True)
    for length in (6, 9):
        ids = torch.randint(0, 64, (1, length), generator=torch.Generator().manual_seed(length))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            tokens = compiled.generate(ids, max_new_tokens=4, do_sample=False)
            with torch.autocast("cpu", torch.bfloat16):
                expected = model.generate(ids, max_new_tokens=4, do_sample=False)
        assert tokens.shape == (1, length + 4) and torch.equal(tokens, expected), length
    assert compiled.amprewrite_backend.graphs, "generate never ran the compiled forward"


def test_trainer_with_a_padding_collator_matches_autocast_bitwise(tmp_path: pathlib.Path
                                                                 ) -> None:
    """Trainer's defaults (``remove_unused_columns`` reads the forward's signature), a length
    that changes at every batch and a partial last batch: the loss and every weight equal
    ``bf16=True``'s on the eager model."""
    from test_hf_trainer import _model, _pad, _Ragged

    model, twin = _model(), _model()
    compiled = amprewrite.compile(model, policy=PRESET, eager=True)

    def train(m: torch.nn.Module, out: str, bf16: bool) -> float:
        args = transformers.TrainingArguments(
            output_dir=str(tmp_path / out), per_device_train_batch_size=4, num_train_epochs=1,
            report_to=[], use_cpu=True, bf16=bf16, save_strategy="no", logging_strategy="no",
            dataloader_num_workers=0, seed=0, disable_tqdm=True)
        return transformers.Trainer(model=m, args=args, train_dataset=_Ragged(),
                                    data_collator=_pad).train().training_loss

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loss = train(compiled, "compiled", bf16=False)
    assert loss == train(twin, "autocast", bf16=True)
    for (name, p), q in zip(model.named_parameters(), twin.parameters()):
        assert torch.equal(p, q), name
