"""``amprewrite.integrations.lightning``: a real ``lightning.Trainer`` on CPU trains a
LightningModule whose ``training_step`` calls its submodule, with the casts in the graph:
losses bitwise equal to ``precision="bf16-mixed"`` (and ``"16-mixed"``, with its
``GradScaler``) under the autocast preset, validation in eval mode, a resumed run equal to an
uninterrupted one, O2 with fp32 masters; and Fabric's plugin."""

from __future__ import annotations

import pathlib
import warnings
from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

L = pytest.importorskip("lightning")

import amprewrite  # noqa: E402
from amprewrite.integrations.lightning import AmpFabricPrecision, AmpPrecision  # noqa: E402

bf16 = torch.bfloat16


class Classifier(L.LightningModule):
    def __init__(self, dropout: float = 0.25) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Dropout(dropout),
                                 nn.Linear(32, 4))
        self.losses: list[torch.Tensor] = []
        self.val_losses: list[torch.Tensor] = []

    def training_step(self, batch: Any, index: int) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self.net(x).float(), y)
        self.losses.append(loss.detach())
        return loss

    def validation_step(self, batch: Any, index: int) -> None:
        x, y = batch
        self.val_losses.append(F.cross_entropy(self.net(x).float(), y))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def _data(n: int = 64) -> torch.utils.data.DataLoader:
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(n, 8, generator=gen), torch.randint(0, 4, (n,), generator=gen)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8)


def _fit(module: L.LightningModule, steps: int, ckpt: pathlib.Path | None = None,
         save: pathlib.Path | None = None, **trainer: Any) -> L.Trainer:
    L.seed_everything(0, verbose=False)
    options = {"limit_val_batches": 2, "val_check_interval": 2, "enable_checkpointing": False,
               **trainer}
    run = L.Trainer(accelerator="cpu", devices=1, max_steps=steps, num_sanity_val_steps=0,
                    logger=False, enable_progress_bar=False, enable_model_summary=False,
                    **options)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        run.fit(module, _data(), _data(), ckpt_path=ckpt)
    if save is not None:
        run.save_checkpoint(save)
    return run


def test_trainer_matches_lightning_bf16_mixed_bitwise() -> None:
    ours, theirs = Classifier(), Classifier()
    plugin = AmpPrecision(policy=amprewrite.Policy.autocast("cpu", bf16))
    assert plugin.scaler is None and plugin.precision == "bf16-mixed"
    _fit(ours, 4, plugins=[plugin])
    _fit(theirs, 4, precision="bf16-mixed")
    assert "not captured yet" not in amprewrite.explain(ours.net)  # converted, captured
    assert len(ours.losses) == 4 and torch.equal(torch.stack(ours.losses),
                                                  torch.stack(theirs.losses))
    assert len(ours.val_losses) == 4  # two validations, each in eval mode: no dropout
    assert torch.equal(torch.stack(ours.val_losses), torch.stack(theirs.val_losses))
    for (name, p), q in zip(ours.named_parameters(), theirs.parameters()):
        assert torch.equal(p, q), name
    assert list(ours.state_dict()) == list(theirs.state_dict())


def test_fp16_steps_through_a_grad_scaler_as_amp_does() -> None:
    """Lightning runs no fp16 AMP on a CPU ("16-mixed" becomes bf16 there): the reference is
    the loop Lightning's fp16 plugin runs, by hand, under torch.autocast with a GradScaler."""
    module = Classifier()
    plugin = AmpPrecision(policy=amprewrite.Policy.autocast("cpu", torch.float16),
                          device="cpu")
    assert isinstance(plugin.scaler, torch.amp.GradScaler) and plugin.precision == "16-mixed"
    _fit(module, 3, plugins=[plugin], limit_val_batches=0, val_check_interval=None)
    net = Classifier().net
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu")
    L.seed_everything(0, verbose=False)
    losses = []
    for _, (x, y) in zip(range(3), _data()):
        with torch.autocast("cpu", dtype=torch.float16):
            out = net(x)
        loss = F.cross_entropy(out.float(), y)
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        losses.append(loss.detach())
    assert torch.equal(torch.stack(module.losses), torch.stack(losses))
    assert plugin.scaler.get_scale() == scaler.get_scale()


def test_a_resumed_run_equals_an_uninterrupted_one(tmp_path: pathlib.Path) -> None:
    """Saved at the end of an epoch (2 batches), resumed for a second one. No dropout: a
    Lightning checkpoint does not hold the random state, so masks after a resume differ."""
    policy = amprewrite.Policy.autocast("cpu", bf16)
    whole = Classifier(dropout=0.0)
    _fit(whole, 4, plugins=[AmpPrecision(policy=policy)], limit_train_batches=2)
    first = Classifier(dropout=0.0)
    _fit(first, 2, save=tmp_path / "half.ckpt", plugins=[AmpPrecision(policy=policy)],
         limit_train_batches=2)
    resumed = Classifier(dropout=0.0)
    _fit(resumed, 4, ckpt=tmp_path / "half.ckpt", plugins=[AmpPrecision(policy=policy)],
         limit_train_batches=2)
    assert torch.equal(torch.stack(first.losses + resumed.losses), torch.stack(whole.losses))
    for (name, p), q in zip(resumed.named_parameters(), whole.parameters()):
        assert torch.equal(p, q), name
    plain = torch.load(tmp_path / "half.ckpt", weights_only=False)["state_dict"]
    Classifier().load_state_dict(plain)  # the checkpoint loads into the plain module


class ConvertedNet(Classifier):
    """A LightningModule holding a module converted by hand (no plugin: Lightning's fp32
    precision, the casts in the graph), initialised from ``seed``."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__(dropout=0.0)
        torch.manual_seed(seed)
        for layer in self.net:
            if isinstance(layer, nn.Linear):
                layer.reset_parameters()
        self.net = amprewrite.convert(self.net, (_data().dataset[:8][0],),
                                      policy=amprewrite.Policy.autocast("cpu", bf16))


def test_model_checkpoint_and_a_resumed_fit_restore_a_converted_submodule(
        tmp_path: pathlib.Path) -> None:
    """``ModelCheckpoint`` every 2 steps, then ``Trainer.fit(ckpt_path=...)`` into a module
    initialised otherwise: the resumed steps lose what the uninterrupted run lost, and end on
    its weights and AdamW moments; the uninterrupted run equals ``precision="bf16-mixed"``
    on the eager module, and the checkpoint loads into the plain one (the model's keys)."""
    from lightning.pytorch.callbacks import ModelCheckpoint
    checkpoints = ModelCheckpoint(dirpath=tmp_path, filename="{step}", every_n_train_steps=2,
                                  save_top_k=-1)
    whole = ConvertedNet()
    run = _fit(whole, 4, limit_train_batches=2, enable_checkpointing=True,
               callbacks=[checkpoints])
    eager = Classifier(dropout=0.0)
    torch.manual_seed(0)
    for layer in eager.net:
        if isinstance(layer, nn.Linear):
            layer.reset_parameters()
    _fit(eager, 4, limit_train_batches=2, precision="bf16-mixed")
    assert len(whole.losses) == 4
    assert torch.equal(torch.stack(whole.losses), torch.stack(eager.losses))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step=2.ckpt", "step=4.ckpt"]

    resumed = ConvertedNet(seed=1)
    assert not torch.equal(next(resumed.parameters()), next(whole.parameters()))
    again = _fit(resumed, 4, ckpt=tmp_path / "step=2.ckpt", limit_train_batches=2)
    assert torch.equal(torch.stack(resumed.losses), torch.stack(whole.losses[2:]))
    for (name, p), q in zip(resumed.named_parameters(), whole.parameters(), strict=True):
        assert torch.equal(p, q), name
    moments, expected = (r.optimizers[0].state_dict()["state"] for r in (again, run))
    assert sorted(moments) == sorted(expected) and moments
    for index, state in expected.items():
        for key, value in state.items():
            assert torch.equal(moments[index][key], value), (index, key)
    saved = torch.load(tmp_path / "step=2.ckpt", weights_only=False)["state_dict"]
    Classifier().load_state_dict(saved)  # strict: the plain module's keys

def test_o2_trains_with_fp32_masters_as_a_plain_loop_does() -> None:
    module = Classifier()
    _fit(module, 3, plugins=[AmpPrecision(opt_level="O2", dtype=bf16)], limit_val_batches=0,
         val_check_interval=None)
    assert all(p.dtype == torch.float32 for p in module.parameters())
    net = Classifier().net
    gm = amprewrite.convert(net, capture="export", dtype=bf16, opt_level="O2")
    opt = torch.optim.AdamW(gm.parameters(), lr=1e-2)
    amprewrite.MasterWeights(gm, opt)
    L.seed_everything(0, verbose=False)
    losses = []
    for _, (x, y) in zip(range(3), _data()):
        loss = F.cross_entropy(gm(x).float(), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    assert torch.equal(torch.stack(module.losses), torch.stack(losses))


def test_fabric_matches_its_bf16_amp_bitwise() -> None:
    def run(plugins: list | None, precision: str | None) -> list[torch.Tensor]:
        fabric = L.Fabric(accelerator="cpu", devices=1, plugins=plugins,
                          **({"precision": precision} if precision else {}))
        L.seed_everything(0, verbose=False)
        net = Classifier().net
        opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
        model, opt = fabric.setup(net, opt)
        losses = []
        for _, (x, y) in zip(range(3), _data()):
            loss = F.cross_entropy(model(x).float(), y)
            fabric.backward(loss)
            opt.step()
            opt.zero_grad()
            losses.append(loss.detach())
        return losses

    ours = run([AmpFabricPrecision(policy=amprewrite.Policy.autocast("cpu", bf16))], None)
    assert torch.equal(torch.stack(ours), torch.stack(run(None, "bf16-mixed")))


def test_the_plugin_checks_its_arguments() -> None:
    with pytest.raises(TypeError, match="policy must be an amprewrite.Policy, got str"):
        AmpPrecision(policy="bf16")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"dtype=torch.float32 is not a low-precision dtype"):
        AmpPrecision(dtype=torch.float32)
    with pytest.raises(ValueError, match=r"a policy was given with opt_level='O2'"):
        AmpPrecision(policy=amprewrite.Policy.autocast("cpu"), opt_level="O2")


@pytest.mark.parametrize("plugin", [AmpPrecision, AmpFabricPrecision])
def test_an_explicit_dtype_wins_over_the_policys(plugin: type) -> None:
    """fp16 named beside a bf16 policy: the precision (and its GradScaler) and the converted
    graphs agree on fp16."""
    precision = plugin(policy=amprewrite.Policy(dtype=torch.bfloat16), dtype=torch.float16)
    assert precision.precision == "16-mixed"
    module = nn.Sequential(nn.Sequential(nn.Linear(4, 4)))
    converted = precision.convert_module(module)
    converted = converted[0] if plugin is AmpPrecision else converted
    out = converted(torch.randn(2, 4))
    assert out.dtype == torch.float16


class _Tagger(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(20, 16)
        self.head = nn.Linear(16, 4)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb(input_ids)) * attention_mask[..., None]


class TokenTagger(L.LightningModule):
    """A ``training_step`` that calls its model with keywords, on batches of another length
    each step (a padding collator's)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = _Tagger()
        self.losses: list[torch.Tensor] = []

    def training_step(self, batch: Any, index: int) -> torch.Tensor:
        out = self.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
        loss = F.cross_entropy(out.float().flatten(0, 1), batch["labels"].flatten())
        self.losses.append(loss.detach())
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def _ragged() -> list[dict[str, torch.Tensor]]:
    batches = []
    for i, length in enumerate([5, 9, 7, 12, 6, 10]):
        gen = torch.Generator().manual_seed(i)
        batches.append({"input_ids": torch.randint(0, 20, (3, length), generator=gen),
                        "attention_mask": torch.ones(3, length),
                        "labels": torch.randint(0, 4, (3, length), generator=gen)})
    return batches


def test_keyword_calls_with_a_new_length_every_step_match_bf16_mixed_bitwise() -> None:
    ours, theirs = TokenTagger(), TokenTagger()
    runs = []
    plugin = AmpPrecision(policy=amprewrite.Policy.autocast("cpu", bf16))
    for module, options in ((ours, {"plugins": [plugin]}), (theirs, {"precision": "bf16-mixed"})):
        L.seed_everything(0, verbose=False)
        run = L.Trainer(accelerator="cpu", devices=1, max_steps=6, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, **options)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            run.fit(module, torch.utils.data.DataLoader(_ragged(), batch_size=None))
        runs.append(caught)
    assert len(ours.losses) == 6
    assert torch.equal(torch.stack(ours.losses), torch.stack(theirs.losses))
    recaptures = [w for w in runs[0] if issubclass(w.category, amprewrite.RecaptureWarning)]
    assert len(recaptures) == 1, [str(w.message) for w in recaptures]
    assert not [w for w in runs[0] if "eval mode" in str(w.message)]


@pytest.mark.usefixtures("fresh_dynamo")
def test_the_same_loop_with_the_model_under_amprewrite_compile() -> None:
    """The ``training_step`` calls ``amprewrite.compile(model)`` (Dynamo's guards and
    automatic dynamic sizes) with keywords, a new length every step, under Lightning's fp32
    precision: the losses are ``bf16-mixed``'s on the eager model, step for step."""
    ours, theirs = TokenTagger(), TokenTagger()
    ours.model = amprewrite.compile(ours.model, policy=amprewrite.Policy.autocast("cpu", bf16),
                                    eager=True)
    for module, precision in ((ours, "32-true"), (theirs, "bf16-mixed")):
        L.seed_everything(0, verbose=False)
        run = L.Trainer(accelerator="cpu", devices=1, max_steps=6, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, precision=precision)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            run.fit(module, torch.utils.data.DataLoader(_ragged(), batch_size=None))
    assert len(ours.losses) == 6
    assert torch.equal(torch.stack(ours.losses), torch.stack(theirs.losses))
    assert list(ours.state_dict()) == list(theirs.state_dict())  # the model's keys
