"""A HuggingFace model with labels (the loss inside the model), trained converted: a plain
loop and ``transformers.Trainer``, each bitwise equal to the same training under
torch.autocast with the CPU autocast preset; the Trainer's checkpoints, its best-model reload
and ``save_model`` give directories ``from_pretrained`` loads, as for the model."""

from __future__ import annotations

import dataclasses
import inspect
import json
import pathlib
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")  # Trainer needs it

import amprewrite  # noqa: E402

PRESET = amprewrite.Policy.autocast("cpu", torch.bfloat16)


def _model() -> torch.nn.Module:
    config = transformers.GPT2Config(
        vocab_size=64, n_embd=32, n_layer=1, n_head=2, n_positions=32, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config).train()


def _batch(i: int) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, 64, (4, 12), generator=torch.Generator().manual_seed(i))
    return {"input_ids": ids, "labels": ids}


def _convert(model: torch.nn.Module) -> torch.nn.Module:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return amprewrite.convert(model, (), example_kwargs=_batch(0), policy=PRESET)


def test_plain_loop_with_labels_matches_autocast_bitwise() -> None:
    model, twin = _model(), _model()
    gm = _convert(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)  # the masters: shared with gm
    twin_opt = torch.optim.AdamW(twin.parameters(), lr=1e-2)
    for step in range(3):
        loss = gm(**_batch(step)).loss
        with torch.autocast("cpu", dtype=torch.bfloat16):
            twin_loss = twin(**_batch(step)).loss
        assert loss.dtype == torch.float32 and torch.equal(loss, twin_loss), step
        for o, l in ((opt, loss), (twin_opt, twin_loss)):
            l.backward()
            o.step()
            o.zero_grad()
    for (name, p), q in zip(model.named_parameters(), twin.parameters()):
        assert torch.equal(p, q), name


class _Batches(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 12

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = torch.randint(0, 64, (12,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": ids}


def _train(model: torch.nn.Module, out: pathlib.Path, bf16: bool, accumulate: int = 1,
           batch: int = 4) -> float:
    args = transformers.TrainingArguments(
        output_dir=str(out), per_device_train_batch_size=batch, max_steps=3, report_to=[],
        gradient_accumulation_steps=accumulate,
        use_cpu=True, bf16=bf16, save_strategy="no", logging_strategy="no",
        dataloader_num_workers=0, seed=0, disable_tqdm=True)
    return transformers.Trainer(model=model, args=args, train_dataset=_Batches()).train() \
        .training_loss


def test_trainer_on_the_converted_module_matches_its_own_bf16_amp(tmp_path: pathlib.Path
                                                                  ) -> None:
    """``Trainer(model=gm)`` (no ``bf16=True``: the casts are in the graph) trains the
    original model's parameters exactly as ``Trainer(model, bf16=True)`` (torch.autocast)
    does; ``model.save_pretrained`` then saves the trained weights."""
    model, twin = _model(), _model()
    gm = _convert(model)
    loss = _train(gm, tmp_path / "converted", bf16=False)
    twin_loss = _train(twin, tmp_path / "autocast", bf16=True)
    assert loss == twin_loss
    before = _model().state_dict()
    changed = [k for k, v in model.state_dict().items() if not torch.equal(v, before[k])]
    assert changed, "the converted module trained nothing"
    for (name, p), q in zip(model.named_parameters(), twin.parameters()):
        assert torch.equal(p, q), name
    model.save_pretrained(tmp_path / "saved")
    loaded = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "saved")
    for name, value in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], value), name


def test_trainer_evaluation_after_fused_steps_sees_the_trained_weights(tmp_path: pathlib.Path
                                                                      ) -> None:
    """Trainer's default optimizer is fused AdamW, whose steps move no version counter, and
    its evaluation runs under ``no_grad``: the evaluated loss is the trained model's, equal
    to the eager model's loss under torch.autocast (lr 5e-2, so that stale weights would
    give another loss)."""
    model = _model()
    gm = _convert(model)
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=4, per_device_eval_batch_size=4,
        max_steps=3, learning_rate=5e-2, report_to=[], use_cpu=True, save_strategy="no",
        logging_strategy="no", eval_strategy="steps", eval_steps=2, dataloader_num_workers=0,
        seed=0, disable_tqdm=True)
    assert args.optim == "adamw_torch_fused"
    trainer = transformers.Trainer(model=gm, args=args, train_dataset=_Batches(),
                                   eval_dataset=_Batches())
    trainer.train()  # evaluates after step 2 as well: copies made there must not outlive step 3
    loss = trainer.evaluate()["eval_loss"]
    # The reference: Trainer's evaluation of the trained model itself under torch.autocast
    # (it passes both modules num_items_in_batch, as both forwards take **kwargs)
    eager = transformers.Trainer(model=model, args=dataclasses.replace(args, bf16=True),
                                 eval_dataset=_Batches())
    assert loss == pytest.approx(eager.evaluate()["eval_loss"], abs=1e-6)


class _Ragged(torch.utils.data.Dataset):
    """Rows of 5 to 16 tokens: a padding collator makes every batch another length."""

    def __len__(self) -> int:
        return 10  # batches of 4: the last one holds 2 rows

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(i)
        n = int(torch.randint(5, 17, (1,), generator=g))
        ids = torch.randint(1, 64, (n,), generator=g)
        return {"input_ids": ids, "labels": ids}


def _pad(rows: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    n = max(len(r["input_ids"]) for r in rows)
    ids = torch.zeros(len(rows), n, dtype=torch.long)
    mask = torch.zeros(len(rows), n, dtype=torch.long)
    labels = torch.full((len(rows), n), -100)
    for i, r in enumerate(rows):
        k = len(r["input_ids"])
        ids[i, :k], mask[i, :k], labels[i, :k] = r["input_ids"], 1, r["labels"]
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def test_gradient_accumulation_counts_tokens_as_for_the_model(tmp_path: pathlib.Path) -> None:
    """The converted forward has the model's signature (``**kwargs`` included), so Trainer
    passes ``num_items_in_batch`` to it as to the model and averages the loss over the
    accumulated tokens: with 2 micro-batches per step, the loss and weights equal
    ``bf16=True``'s (a signature naming the example's keywords only gave 4.160 for 3.813)."""
    model, twin = _model(), _model()
    gm = _convert(model)
    assert inspect.signature(gm.forward) == inspect.signature(model.forward)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loss = _train(gm, tmp_path / "converted", bf16=False, accumulate=2, batch=2)
    twin_loss = _train(twin, tmp_path / "autocast", bf16=True, accumulate=2, batch=2)
    assert loss == twin_loss
    for (name, p), q in zip(model.named_parameters(), twin.parameters()):
        assert torch.equal(p, q), name


@pytest.mark.parametrize("route", ["keywords", "first_call"])
def test_trainer_with_a_padding_collator_matches_autocast_bitwise(route: str,
                                                                 tmp_path: pathlib.Path) -> None:
    """Trainer's defaults (``remove_unused_columns``, which reads the forward's signature;
    the loss kwargs, which read the model's attributes), a sequence length that changes at
    every batch and a partial last batch: the loss and weights equal ``bf16=True``'s."""
    model, twin = _model(), _model()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        gm = amprewrite.convert(model, (), example_kwargs=_pad([_Ragged()[0], _Ragged()[1]]),
                                policy=PRESET) if route == "keywords" else \
            amprewrite.convert(model, capture="export", policy=PRESET)

    def train(m: torch.nn.Module, out: str, bf16: bool) -> float:
        args = transformers.TrainingArguments(
            output_dir=str(tmp_path / out), per_device_train_batch_size=4, num_train_epochs=1,
            report_to=[], use_cpu=True, bf16=bf16, save_strategy="no", logging_strategy="no",
            dataloader_num_workers=0, seed=0, disable_tqdm=True)
        return transformers.Trainer(model=m, args=args, train_dataset=_Ragged(),
                                    data_collator=_pad).train().training_loss

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loss = train(gm, "converted", bf16=False)
    recaptures = [str(w.message) for w in caught
                  if issubclass(w.category, amprewrite.RecaptureWarning)]
    assert loss == train(twin, "autocast", bf16=True), recaptures
    # NB: GPT-2's padded mask makes torch.export specialise the length (a graph per length,
    # said once), so the count is bounded by the batches here (3), not by one; and the
    # Trainer sets config.use_cache (a state the capture read: one more)
    assert len(recaptures) <= 4, "\n".join(recaptures)
    for (name, p), q in zip(model.named_parameters(), twin.parameters()):
        assert torch.equal(p, q), name


def _checkpointed(model: torch.nn.Module, out: pathlib.Path, bf16: bool,
                  resume: pathlib.Path | None = None, best: bool = True) -> "transformers.Trainer":
    """4 steps at lr 5e-2, evaluated and checkpointed every 2. The best model is the one
    with the *higher* evaluation loss (checkpoint-2): reloading it at the end then changes
    the weights, which a reload that did nothing would not."""
    args = transformers.TrainingArguments(
        output_dir=str(out), per_device_train_batch_size=4, per_device_eval_batch_size=4,
        max_steps=4, learning_rate=5e-2, report_to=[], use_cpu=True, bf16=bf16,
        eval_strategy="steps", eval_steps=2, save_strategy="steps", save_steps=2,
        load_best_model_at_end=best, metric_for_best_model="eval_loss",
        greater_is_better=True, logging_strategy="no", dataloader_num_workers=0, seed=0,
        disable_tqdm=True)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=_Batches(),
                                   eval_dataset=_Batches())
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        trainer.train(resume_from_checkpoint=str(resume) if resume else None)
    # save_pretrained writes config.architectures and config.dtype at each checkpoint: records
    # no forward reads, which capture nothing again (the Trainer's own use_cache switch does)
    recaptures = [str(w.message) for w in seen
                  if issubclass(w.category, amprewrite.RecaptureWarning)]
    assert all("use_cache" in m for m in recaptures), recaptures
    assert not any("architectures" in m or "config.dtype" in m for m in recaptures), recaptures
    return trainer


def _weights(directory: pathlib.Path) -> dict[str, torch.Tensor]:
    """What ``from_pretrained`` loads from ``directory`` (config.json included)."""
    assert json.loads((directory / "config.json").read_text())["architectures"] == \
        ["GPT2LMHeadModel"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return transformers.AutoModelForCausalLM.from_pretrained(directory).state_dict()


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    assert sorted(a) == sorted(b)
    return all(torch.equal(a[k], b[k]) for k in a)


def test_trainer_checkpoints_resume_best_model_and_save_model_as_for_the_model(
        tmp_path: pathlib.Path) -> None:
    """The converted module as ``Trainer``'s model reads as a ``GPT2LMHeadModel``, so the
    Trainer saves it with ``save_pretrained``: each checkpoint, ``save_model()`` and the
    best-model reload give what ``Trainer(model, bf16=True)`` gives, bit for bit (config and
    the model's keys; ``from_pretrained`` loads them); a run resumed from checkpoint-2 ends
    on checkpoint-4's weights; the saved model's logits under torch.autocast are the
    converted module's."""
    model, twin = _model(), _model()
    gm = _convert(model)
    assert isinstance(gm, transformers.GPT2LMHeadModel)
    trainer = _checkpointed(gm, tmp_path / "converted", bf16=False)
    reference = _checkpointed(twin, tmp_path / "autocast", bf16=True)
    unwrapped = trainer.accelerator.unwrap_model(trainer.model)
    assert unwrapped is gm and unwrapped._modules is model._modules
    steps = {}
    for step in (2, 4):
        steps[step] = _weights(tmp_path / "converted" / f"checkpoint-{step}")
        assert _equal(steps[step], _weights(tmp_path / "autocast" / f"checkpoint-{step}"))
    assert not _equal(steps[2], steps[4])
    assert trainer.state.best_model_checkpoint.endswith("checkpoint-2")
    assert _equal(model.state_dict(), steps[2])  # reloaded: the best, not the last
    assert _equal(model.state_dict(), twin.state_dict())

    trainer.save_model(str(tmp_path / "saved"))
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "saved")
    assert _equal(loaded.state_dict(), model.state_dict())
    batch = _batch(7)
    gm.eval()
    loaded.eval()
    with torch.no_grad():
        logits = gm(**batch).logits
        with torch.autocast("cpu", dtype=torch.bfloat16):
            expected = loaded(**batch).logits
    assert logits.dtype == expected.dtype == torch.bfloat16
    assert torch.equal(logits, expected)

    torch.manual_seed(1)  # another initialisation: the checkpoint must replace it
    other = transformers.GPT2LMHeadModel(_model().config).train()
    resumed = _convert(other)
    _checkpointed(resumed, tmp_path / "resumed", bf16=False, best=False,
                  resume=tmp_path / "converted" / "checkpoint-2")
    assert _equal(other.state_dict(), steps[4])
