"""PEFT as people use it, on a converted ``get_peft_model(...)`` model: LoRA and IA3 training
bitwise equal to autocast's under the CPU preset (losses, every adapter gradient, the weights
after AdamW steps, the evaluation after training), and the adapter switches
(``merge_adapter``, ``unmerge_adapter``, ``disable_adapter()``, a second adapter,
``set_adapter``, ``set_scale``, ``merge_and_unload``) followed, at O1 and O2; HF ``Trainer``
with evaluation steps equal to ``Trainer(bf16=True)``, and its ``save_model`` an adapter
``PeftModel.from_pretrained`` loads."""

from __future__ import annotations

import contextlib
import copy
import pathlib
import warnings
from typing import Any, Callable, Iterator

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

import amprewrite  # noqa: E402

bf16 = torch.bfloat16
PRESET = amprewrite.Policy.autocast("cpu", bf16)
VOCAB = 64


def _base(kv_heads: int = 4, attention: str = "sdpa") -> torch.nn.Module:
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=kv_heads, use_cache=False,
        attn_implementation=attention)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


def _lora(**kw: Any) -> Any:
    return peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.0,
                           init_lora_weights=False, **kw)


def _ia3() -> Any:
    return peft.IA3Config(target_modules=["k_proj", "v_proj", "down_proj"],
                          feedforward_modules=["down_proj"], init_ia3_weights=False)


METHODS = {"lora": _lora, "ia3": _ia3}


def _peft(method: str, **base: Any) -> torch.nn.Module:
    return peft.get_peft_model(_base(**base), METHODS[method]())


def _ids(i: int, length: int = 8) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, length), generator=torch.Generator().manual_seed(i))


def _loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().reshape(-1, VOCAB), ids.reshape(-1))


def _convert(model: torch.nn.Module, opt_level: str = "O1") -> torch.nn.Module:
    options = {"policy": PRESET} if opt_level == "O1" else {"dtype": bf16, "opt_level": opt_level}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return amprewrite.convert(model, (_ids(0),), **options)  # type: ignore[arg-type]


def _autocast_logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.autocast("cpu", dtype=bf16):
        return model(ids).logits


@pytest.mark.parametrize("fused", [False, True], ids=["foreach", "fused"])
@pytest.mark.parametrize("method", sorted(METHODS))
def test_adapter_training_matches_autocast_bitwise(method: str, fused: bool) -> None:
    model, twin = _peft(method).train(), _peft(method).train()
    gm = _convert(model)
    trained = [p for p in model.parameters() if p.requires_grad]
    twin_trained = [p for p in twin.parameters() if p.requires_grad]
    assert trained and len(trained) < len(list(model.parameters()))  # the base is frozen
    opt = torch.optim.AdamW(trained, lr=1e-2, fused=fused, foreach=not fused)
    twin_opt = torch.optim.AdamW(twin_trained, lr=1e-2, fused=fused, foreach=not fused)
    for step in range(5):
        ids = _ids(step, length=8 + step)  # another length each step: dynamic shapes
        loss = _loss(gm(ids).logits, ids)
        twin_loss = _loss(_autocast_logits(twin, ids), ids)
        assert torch.equal(loss, twin_loss), step
        loss.backward()
        twin_loss.backward()
        for p, q in zip(trained, twin_trained):
            assert torch.equal(p.grad, q.grad), step
        for o in (opt, twin_opt):
            o.step()
            o.zero_grad()
    for p, q in zip(trained, twin_trained):
        assert torch.equal(p, q)
    gm.eval()
    twin.eval()
    with torch.no_grad():
        ids = _ids(99)
        assert torch.equal(_loss(gm(ids).logits, ids), _loss(_autocast_logits(twin, ids), ids))


_GQA_SDPA_GAP = (
    "transformers builds the causal mask when torch.compiler.is_exporting() (masking_utils: "
    "it cannot skip it under export), and with a mask its SDPA attention repeats the k/v "
    "heads (repeat_kv) instead of SDPA's own GQA, which eager runs without a mask: the "
    "backward sums the repeated heads' gradients in bf16, so adapter gradients differ at "
    "bf16 rounding; eager attention, or as many k/v heads as heads, are bitwise")


@pytest.mark.parametrize("attention", [
    pytest.param("sdpa", marks=pytest.mark.xfail(strict=True, reason=_GQA_SDPA_GAP)), "eager"])
def test_lora_with_grouped_query_attention_matches_autocast_bitwise(attention: str) -> None:
    model = _peft("lora", kv_heads=2, attention=attention).train()
    twin = _peft("lora", kv_heads=2, attention=attention).train()
    gm = _convert(model)
    ids = _ids(0)
    _loss(gm(ids).logits, ids).backward()
    _loss(_autocast_logits(twin, ids), ids).backward()
    for (name, p), q in zip(model.named_parameters(), twin.parameters()):
        if p.requires_grad:
            assert torch.equal(p.grad, q.grad), name


def _set_scale(model: torch.nn.Module) -> None:
    for module in model.modules():
        if isinstance(module, peft.tuners.lora.LoraLayer):
            module.set_scale("default", 0.5)


def _second_adapter(model: torch.nn.Module) -> None:
    model.add_adapter("second", _lora())
    model.set_adapter("second")


@contextlib.contextmanager
def _adapters_disabled(model: torch.nn.Module) -> Iterator[None]:
    with model.disable_adapter():
        yield


# (id, what is done to the PEFT model)
SWITCHES: list[tuple[str, Callable[[torch.nn.Module], Any]]] = [
    ("merge_adapter", lambda m: m.merge_adapter()),
    ("unmerge_adapter", lambda m: m.unmerge_adapter()),
    ("second adapter", _second_adapter),
    ("set_adapter back", lambda m: m.set_adapter("default")),
    ("set_scale", _set_scale),
]


def _reference(model: torch.nn.Module, opt_level: str, ids: torch.Tensor) -> torch.Tensor:
    """The PEFT model now: under autocast (O1, bitwise), or converted afresh (O2)."""
    if opt_level == "O1":
        return _autocast_logits(model, ids)
    return _convert(copy.deepcopy(model), opt_level)(ids).logits


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_adapter_switches_are_followed(opt_level: str) -> None:
    model = _peft("lora").eval()
    gm = _convert(model, opt_level)
    ids = _ids(1)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert torch.equal(gm(ids).logits, _reference(model, opt_level, ids))
        # O2's reference is a fresh conversion per state: a few switches keep it short
        switches = SWITCHES if opt_level == "O1" else [SWITCHES[0], SWITCHES[1], SWITCHES[4]]
        for name, switch in switches:
            before = gm(ids).logits
            switch(model)
            out = gm(ids).logits
            assert torch.equal(out, _reference(model, opt_level, ids)), name
            if name != "unmerge_adapter" and name != "merge_adapter":
                assert not torch.equal(out, before), name
        with _adapters_disabled(model):
            out = gm(ids).logits
            assert torch.equal(out, _reference(model, opt_level, ids))
        if opt_level == "O2":
            return
        base = _base()
        assert torch.equal(out, _reference(base.eval(), opt_level, ids))  # the base alone
        assert torch.equal(gm(ids).logits, _reference(model, opt_level, ids))  # enabled again
        merged = model.merge_and_unload()
        assert torch.equal(gm(ids).logits, _reference(merged, opt_level, ids))


def test_merge_adapter_is_not_counted_twice() -> None:
    """The weights merged in place and the adapter skipped (``merged``): the converted module
    computes base + delta once, as eager does."""
    model = _peft("lora").eval()
    gm = _convert(model)
    ids = _ids(2)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        unmerged = gm(ids).logits
        model.merge_adapter()
        merged = gm(ids).logits
    assert torch.equal(merged, _autocast_logits(model, ids))
    assert (merged.float() - unmerged.float()).abs().max() < 0.1  # the same model, rounded


class _Texts(torch.utils.data.Dataset):
    def __init__(self, offset: int) -> None:
        self.offset = offset

    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = _ids(self.offset + i)[0]
        return {"input_ids": ids, "labels": ids}


def _trainer_eval_losses(model: torch.nn.Module, out: pathlib.Path, bf16_amp: bool
                         ) -> list[float]:
    args = transformers.TrainingArguments(
        output_dir=str(out), per_device_train_batch_size=2, per_device_eval_batch_size=2,
        max_steps=4, eval_strategy="steps", eval_steps=2, report_to=[], use_cpu=True,
        bf16=bf16_amp, save_strategy="no", logging_strategy="no", dataloader_num_workers=0,
        seed=0, disable_tqdm=True)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=_Texts(0),
                                   eval_dataset=_Texts(100))
    trainer.train()
    trainer.save_model(str(out / "saved"))
    return [entry["eval_loss"] for entry in trainer.state.log_history if "eval_loss" in entry]


def test_trainer_with_lora_and_evaluation_matches_trainer_bf16(tmp_path: pathlib.Path) -> None:
    pytest.importorskip("accelerate")
    model, twin = _peft("lora"), _peft("lora")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        gm = amprewrite.convert(model.train(), (), example_kwargs={"input_ids": _ids(0),
                                                                     "labels": _ids(0)},
                                policy=PRESET)
        ours = _trainer_eval_losses(gm, tmp_path / "ours", bf16_amp=False)
        theirs = _trainer_eval_losses(twin, tmp_path / "theirs", bf16_amp=True)
    assert len(ours) == 2 and ours == theirs
    for (name, p), q in zip(model.named_parameters(), twin.parameters()):
        assert torch.equal(p, q), name
    # ``save_model`` saves the converted PEFT model as a PeftModel: its adapter, which loads
    # onto a fresh base model as the trained one
    assert isinstance(gm, peft.PeftModel)
    saved = sorted(p.name for p in (tmp_path / "ours" / "saved").iterdir())
    assert saved == sorted(p.name for p in (tmp_path / "theirs" / "saved").iterdir())
    assert "adapter_model.safetensors" in saved and "adapter_config.json" in saved
    loaded = peft.PeftModel.from_pretrained(_base(), tmp_path / "ours" / "saved")
    expected = model.state_dict()
    for name, value in loaded.state_dict().items():
        assert torch.equal(value, expected[name]), name
