"""accelerate: a converted module trained and evaluated by a real ``accelerate.Accelerator`` on
the CPU, bitwise equal to ``Accelerator(mixed_precision="bf16")`` (torch.autocast) on the model
itself under the CPU autocast preset; ``save_state`` / ``load_state`` resume it bit for bit."""

from __future__ import annotations

import pathlib
import warnings
from typing import Iterator

import pytest
import torch
import torch.nn.functional as F

accelerate = pytest.importorskip("accelerate")
from accelerate.state import AcceleratorState, GradientState  # noqa: E402

import amprewrite  # noqa: E402

PRESET = amprewrite.Policy.autocast("cpu", torch.bfloat16)
STEPS = 6  # one epoch of the training set


class Classifier(torch.nn.Module):
    """Linear, LayerNorm (fp32 under autocast), GELU, dropout (the RNG a resumed run must
    restore), Linear, and the loss inside the forward."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(16, 32)
        self.norm = torch.nn.LayerNorm(32)
        self.drop = torch.nn.Dropout(0.2)
        self.fc2 = torch.nn.Linear(32, 4)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.fc2(self.drop(F.gelu(self.norm(self.fc1(x))))), y)


def _data() -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(0)
    return torch.utils.data.TensorDataset(torch.randn(4 * STEPS, 16, generator=g),
                                          torch.randint(0, 4, (4 * STEPS,), generator=g))


@pytest.fixture(autouse=True)
def _fresh_accelerator_state() -> Iterator[None]:
    """accelerate keeps its state (mixed precision, device) process-wide; each run here starts
    from nothing, and leaves nothing to the next test."""
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    yield
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def _prepare(converted: bool, init_seed: int = 0, policy: amprewrite.Policy = PRESET,
             mixed_precision: str | None = None) -> tuple:
    """(accelerator, module, optimizer, train loader, eval loader): the converted module under
    ``mixed_precision="no"`` (its casts are in the graph), or the model under ``"bf16"``."""
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    torch.manual_seed(init_seed)
    model = Classifier()
    if converted:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            module = amprewrite.convert(model, _data()[0:4], policy=policy)
    else:
        module = model
    accelerator = accelerate.Accelerator(
        mixed_precision=mixed_precision or ("no" if converted else "bf16"), cpu=True)
    opt = torch.optim.AdamW(module.parameters(), lr=1e-2)
    train = torch.utils.data.DataLoader(_data(), batch_size=4, shuffle=True,
                                        generator=torch.Generator().manual_seed(1))
    evaluation = torch.utils.data.DataLoader(_data(), batch_size=8)
    torch.manual_seed(2)  # the dropout masks
    return accelerator, *accelerator.prepare(module, opt, train, evaluation)


def _train(accelerator, module, opt, loader, skip: int = 0, save_at: int | None = None,
           save_to: pathlib.Path | None = None) -> list[torch.Tensor]:
    module.train()
    losses = []
    for x, y in accelerator.skip_first_batches(loader, skip) if skip else loader:
        loss = module(x, y)
        accelerator.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
        if len(losses) == save_at:
            accelerator.save_state(save_to)
    return losses


def _evaluate(accelerator, module, loader) -> torch.Tensor:
    module.eval()
    with torch.no_grad():
        return torch.stack([accelerator.gather_for_metrics(module(x, y)) for x, y in loader])


def test_training_and_evaluation_match_accelerate_bf16_bitwise() -> None:
    runs = {}
    for converted in (True, False):
        accelerator, module, opt, train, evaluation = _prepare(converted)
        losses = torch.stack(_train(accelerator, module, opt, train))
        runs[converted] = (losses, _evaluate(accelerator, module, evaluation),
                           [p.detach().clone() for p in module.parameters()])
    (losses, evaluated, params), (ref_losses, ref_evaluated, ref_params) = runs[True], runs[False]
    assert losses.dtype == evaluated.dtype == torch.float32 and len(losses) == STEPS
    assert torch.equal(losses, ref_losses)
    assert torch.equal(evaluated, ref_evaluated)  # the eval graph: no dropout
    for p, q in zip(params, ref_params, strict=True):
        assert torch.equal(p, q)
    assert not torch.equal(params[0], Classifier().fc1.weight)  # it trained


def test_save_state_and_load_state_resume_bitwise(tmp_path: pathlib.Path) -> None:
    """Saved after 3 steps, loaded into a converted module of a differently initialised model
    by a new Accelerator: the last 3 steps give the uninterrupted run's losses (weights,
    optimizer moments and the dropout RNG restored), and the checkpoint holds the model's own
    keys, so the plain model loads it too."""
    accelerator, module, opt, train, _ = _prepare(converted=True)
    uninterrupted = _train(accelerator, module, opt, train, save_at=3, save_to=tmp_path)
    final = [p.detach().clone() for p in module.parameters()]

    accelerator, module, opt, train, _ = _prepare(converted=True, init_seed=1)
    accelerator.load_state(tmp_path)
    resumed = _train(accelerator, module, opt, train, skip=3)
    assert torch.equal(torch.stack(resumed), torch.stack(uninterrupted[3:]))
    for p, q in zip(module.parameters(), final, strict=True):
        assert torch.equal(p, q)

    from safetensors.torch import load_file
    saved = load_file(tmp_path / "model.safetensors")
    Classifier().load_state_dict(saved)  # strict: the model's keys, no more
    assert sorted(saved) == sorted(Classifier().state_dict())


def test_accelerate_bf16_over_a_converted_module_undoes_its_fp32_overrides() -> None:
    """``mixed_precision="bf16"`` wraps the forward in torch.autocast, which lowers again what
    the policy kept in fp32: with ``keep_fp32=["fc2"]`` the loss is the one without the
    override. Hence ``mixed_precision="no"`` for a converted module."""
    kept = PRESET.override(keep_fp32=["fc2"])
    x, y = _data()[0:8]
    loss = {}
    for name, policy, mixed_precision in (("kept", kept, "no"), ("kept+autocast", kept, "bf16"),
                                          ("lowered", PRESET, "no")):
        accelerator, module, *_ = _prepare(converted=True, policy=policy,
                                           mixed_precision=mixed_precision)
        torch.manual_seed(3)  # the same dropout mask each time
        if mixed_precision == "bf16":
            with pytest.warns(amprewrite.AutocastOverrideWarning, match="torch.autocast"):
                loss[name] = module(x, y)
        else:
            loss[name] = module(x, y)
    assert not torch.equal(loss["kept"], loss["lowered"])
    assert torch.equal(loss["kept+autocast"], loss["lowered"])


def test_accelerate_bf16_wrapper_runs_the_graph_of_the_current_mode() -> None:
    """accelerate's autocast wrapper holds the bound ``forward`` the module had at
    ``prepare``; that forward runs the graph the module holds when it is called, so after
    ``eval()`` both ``"bf16"`` and ``"no"`` run the eval graph (dropout off)."""
    x, y = _data()[0:8]
    for mixed_precision in ("bf16", "no"):
        accelerator, module, *_ = _prepare(converted=True, mixed_precision=mixed_precision)
        module.eval()
        losses = []
        for seed in (4, 5):
            torch.manual_seed(seed)
            losses.append(module(x, y))
        assert torch.equal(*losses), mixed_precision


class _Sequence(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(20, 16)
        self.fc = torch.nn.Linear(16, 4)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.fc(self.emb(input_ids)).float().flatten(0, 1),
                               labels.flatten())


@pytest.mark.parametrize("route", ["convert", "compile"])
def test_variable_lengths_keyword_calls_match_accelerates_bf16_bitwise(route: str) -> None:
    """``model(**batch)`` on batches of another length each step, and a partial last batch,
    through a real ``Accelerator``: the converted module (first-call capture) or the module of
    ``amprewrite.compile`` loses what the model loses under ``mixed_precision="bf16"``, step
    for step."""
    def batches() -> list[dict[str, torch.Tensor]]:
        out = []
        for i, (rows, length) in enumerate([(4, 5), (4, 9), (4, 7), (4, 12), (2, 6)]):
            g = torch.Generator().manual_seed(i)
            out.append({"input_ids": torch.randint(0, 20, (rows, length), generator=g),
                        "labels": torch.randint(0, 4, (rows, length), generator=g)})
        return out

    losses = []
    for converted in (True, False):
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
        torch.manual_seed(0)
        model = _Sequence()
        module = model
        if converted and route == "convert":
            module = amprewrite.convert(model, capture="export", policy=PRESET)
        elif converted:
            torch._dynamo.reset()
            module = amprewrite.compile(model, policy=PRESET, eager=True)
        accelerator = accelerate.Accelerator(cpu=True,
                                             mixed_precision="no" if converted else "bf16")
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        module, optimizer = accelerator.prepare(module, optimizer)
        run = []
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for batch in batches():
                loss = module(**batch)
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
                run.append(loss.detach())
        losses.append(torch.stack(run))
    assert torch.equal(losses[0], losses[1])


def test_a_converted_hf_model_saves_and_unwraps_as_the_model(tmp_path: pathlib.Path) -> None:
    """A converted GPT-2 through a real Accelerator: ``unwrap_model`` gives the converted
    module, which is a ``GPT2LMHeadModel`` sharing the model's submodules, and its
    ``save_pretrained`` writes the directory ``from_pretrained`` loads; ``save_state`` /
    ``load_state`` move the trained weights into a converted model initialised otherwise.
    The losses are ``mixed_precision="bf16"``'s on the eager model."""
    transformers = pytest.importorskip("transformers")

    def gpt2(seed: int) -> torch.nn.Module:
        torch.manual_seed(seed)
        return transformers.GPT2LMHeadModel(transformers.GPT2Config(
            vocab_size=64, n_embd=32, n_layer=1, n_head=2, n_positions=16, resid_pdrop=0.0,
            embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0))

    batches = [torch.randint(0, 64, (4, 8), generator=torch.Generator().manual_seed(i))
               for i in range(3)]

    def run(model: torch.nn.Module, converted: bool, steps: int) -> tuple:
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
        module = model
        if converted:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                module = amprewrite.convert(model, (), policy=PRESET, example_kwargs={
                    "input_ids": batches[0], "labels": batches[0]})
        accelerator = accelerate.Accelerator(cpu=True,
                                             mixed_precision="no" if converted else "bf16")
        module, opt = accelerator.prepare(module, torch.optim.AdamW(model.parameters(),
                                                                    lr=1e-2))
        losses = []
        for ids in batches[:steps]:
            loss = module(input_ids=ids, labels=ids).loss
            accelerator.backward(loss)
            opt.step()
            opt.zero_grad()
            losses.append(loss.detach())
        return accelerator, module, losses

    model = gpt2(0)
    accelerator, gm, losses = run(model, converted=True, steps=3)
    _, _, eager_losses = run(gpt2(0), converted=False, steps=3)
    assert torch.equal(torch.stack(losses), torch.stack(eager_losses))
    unwrapped = accelerator.unwrap_model(gm)
    assert unwrapped is gm and isinstance(unwrapped, transformers.GPT2LMHeadModel)
    assert unwrapped._modules is model._modules and unwrapped.config is model.config
    unwrapped.save_pretrained(tmp_path / "saved")
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "saved")
    assert type(loaded) is transformers.GPT2LMHeadModel
    for name, value in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], value), name

    accelerator.save_state(tmp_path / "state")
    other = gpt2(1)
    accelerator, _, _ = run(other, converted=True, steps=0)
    accelerator.load_state(tmp_path / "state")
    for name, value in model.state_dict().items():
        assert torch.equal(other.state_dict()[name], value), name
