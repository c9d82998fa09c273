"""``gm.train()`` / ``gm.eval()`` on a converted module: the forward runs the graph of the
mode the module is in (dropout, batch-norm statistics, ``self.training`` branches), both
graphs on one set of tensors; the other mode is captured at the first switch to it; a mode the
model cannot be captured in raises when called."""

from __future__ import annotations

import contextlib
import copy
import io
import warnings
from typing import Iterator

import pytest
import torch
import torch.nn as nn

import amprewrite
from amprewrite.capture import export as export_capture
from amprewrite.module.cache import cache_of
from amprewrite.module.modes import NOT_CAPTURED_KEY
from amprewrite.explain import explain_records
from amprewrite.errors import AmpRewriteError

PRESET = amprewrite.Policy.autocast("cpu", torch.bfloat16)
X = torch.randn(16, 8, generator=torch.Generator().manual_seed(0))


def _model(training: bool) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Dropout(0.5))
    return model.train(training)


def _convert(model: nn.Module, capture: str, opt_level: str = "O1", **kw: object) -> nn.Module:
    inputs = (X,) if capture == "export" else None
    policy = {"policy": PRESET} if opt_level == "O1" else {"dtype": torch.bfloat16}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return amprewrite.convert(model, inputs, capture=capture, opt_level=opt_level,
                                  **policy, **kw)  # type: ignore[arg-type]


def _run(gm: nn.Module, opt_level: str) -> torch.Tensor:
    """O2 trains only with its masters bound to an optimizer (MasterWeights); the mode's
    forward is the same without gradients."""
    with torch.no_grad() if opt_level == "O2" else contextlib.nullcontext():
        return gm(X)


def _stats(gm: nn.Module) -> torch.Tensor:
    return gm.get_submodule("1").running_mean.clone()


CASES = [(c, o) for c in ("export", "symbolic") for o in ("O1", "O2")]


@pytest.mark.parametrize("capture,opt_level", CASES)
def test_converted_in_eval_trains_with_dropout_and_batch_statistics(capture: str,
                                                                   opt_level: str) -> None:
    model = _model(training=False)
    eager = copy.deepcopy(model).train()
    gm = _convert(model, capture, opt_level)
    gm.train()
    assert gm.training and all(m.training for m in gm.modules())
    before = _stats(gm)
    torch.manual_seed(1)
    out = _run(gm, opt_level)
    zeros = (out == 0).float().mean().item()
    assert 0.3 < zeros < 0.7, zeros
    assert not torch.equal(_stats(gm), before)  # running statistics moved
    assert gm.get_submodule("1").num_batches_tracked.item() == 1
    if opt_level == "O1":  # the autocast preset: bitwise what eager autocast does
        torch.manual_seed(1)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            expected = eager(X)
        assert torch.equal(out, expected)
        assert torch.equal(_stats(gm), eager[1].running_mean)


@pytest.mark.parametrize("capture,opt_level", CASES)
def test_converted_in_train_evaluates_deterministically(capture: str, opt_level: str) -> None:
    model = _model(training=True)
    gm = _convert(model, capture, opt_level)
    _run(gm, opt_level)  # a training step's forward: statistics move
    gm.eval()
    before = _stats(gm)
    first, second = _run(gm, opt_level), _run(gm, opt_level)
    assert torch.equal(first, second) and (first == 0).float().mean().item() < 0.1
    assert torch.equal(_stats(gm), before)  # eval reads the running statistics only
    eager = copy.deepcopy(model).eval()
    if opt_level == "O1":
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert torch.equal(first, eager(X))
    else:
        torch.testing.assert_close(first, eager(X), atol=0.1, rtol=0.05)
    gm.train()
    assert (_run(gm, opt_level) == 0).float().mean().item() > 0.3  # and back


class _Branching(nn.Module):
    """Model code that reads ``self.training`` itself, and a functional dropout."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = nn.functional.dropout(self.fc(x), 0.5, self.training)
        if self.training:
            return h * 2
        return h + 1


@pytest.mark.parametrize("capture", ["export", "symbolic"])
@pytest.mark.parametrize("training", [False, True])
def test_training_branches_of_the_model_code_follow_the_mode(capture: str,
                                                              training: bool) -> None:
    torch.manual_seed(0)
    model = _Branching().train(training)
    gm = _convert(model, capture)
    for mode in (not training, training):
        gm.train(mode)
        eager = copy.deepcopy(model).train(mode)
        torch.manual_seed(2)
        out = gm(X)
        torch.manual_seed(2)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert torch.equal(out, eager(X)), mode
    assert model.training is training  # the model's own flags are put back


class _TrainOnlyDataDependent(nn.Module):
    """Exports in eval mode; in train mode its code branches on a tensor's value."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        if self.training and h.sum() > 0:
            h = h * 2
        return h


def test_a_mode_that_cannot_be_captured_raises_when_called() -> None:
    model = _TrainOnlyDataDependent().eval()
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        warnings.filterwarnings("ignore", message=".*bf16 matmuls run in emulation")
        gm = amprewrite.convert(model, (X,), policy=PRESET)  # train mode: not captured yet
    out = gm(X)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.equal(out, model(X))
    with pytest.warns(UserWarning, match="could not be captured in train mode"):
        gm.train()
    assert NOT_CAPTURED_KEY in gm.meta
    with pytest.raises(AmpRewriteError, match=r"called in train mode.*gm\.eval\(\)"):
        gm(X)
    with pytest.raises(AmpRewriteError, match="could not be captured in train mode"):
        torch.export.export(gm, (X,))  # never the eval graph in its place
    assert "train mode: not captured (" in amprewrite.explain(gm)
    gm.eval()
    gm(X)  # the captured mode still runs


def _one_graph(gm: torch.fx.GraphModule) -> bool:
    """Whether one graph serves both modes (the held entry computes both)."""
    return cache_of(gm).held.modes == (False, True)


def _graph_of(gm: torch.fx.GraphModule, training: bool) -> torch.fx.GraphModule:
    """The module holding the graph of ``training`` mode (``gm``, or a kept entry's)."""
    return dict(cache_of(gm).mode_graphs(gm))[training]


def test_one_graph_for_models_without_mode_dependent_code() -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU())
    gm = _convert(model, "export").eval()  # (model is in train mode)
    assert _one_graph(gm)
    gm = _convert(_model(training=False), "symbolic")  # BatchNorm and Dropout stay modules
    gm.train().eval()
    assert _one_graph(gm)
    header = next(line for line in amprewrite.explain(gm).splitlines() if "category" in line)
    assert "mode" not in header


def test_both_graphs_share_one_state_and_copies_keep_sharing() -> None:
    model = _model(training=False)
    gm = _convert(model, "export").train().eval()
    sibling = _graph_of(gm, True)
    assert gm.graph is not sibling.graph and sibling._parameters is gm._parameters
    assert list(gm.state_dict()) == list(model.state_dict())
    assert [n for n, _ in gm.named_parameters()] == [n for n, _ in model.named_parameters()]
    assert sibling._amp_weight_cache is gm._amp_weight_cache
    # load_state_dict (in place) and a module copy reach both graphs
    state = {k: v + 1 if v.is_floating_point() else v for k, v in model.state_dict().items()}
    gm.load_state_dict(state)
    copied = copy.deepcopy(gm).train()
    assert _graph_of(copied, False)._parameters is copied._parameters
    before = _stats(copied)
    torch.manual_seed(3)
    out = copied(X)
    assert not torch.equal(_stats(copied), before)
    assert torch.equal(_stats(gm), model[1].running_mean)  # the original is not the copy
    eager = copy.deepcopy(model).train()
    torch.manual_seed(3)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.equal(out, eager(X))


def test_explain_marks_the_decisions_of_one_mode() -> None:
    gm = _convert(_model(training=False), "export")
    (record,) = explain_records(gm)  # train mode: not captured yet
    assert record["not_captured_yet"] == "train" and "modes" not in record
    assert "mode" not in record["nodes"][0]
    text = amprewrite.explain(gm)
    assert "train mode" not in text and "eval mode" not in text  # only the captured mode
    gm.train().eval()
    (record,) = explain_records(gm)
    modes = {r["node"]: r["mode"] for r in record["nodes"]}
    assert modes["add_"] == "train" and modes["linear"] == "both"  # num_batches_tracked += 1
    assert set(record["modes"]) == {"eval", "train"}
    text = amprewrite.explain(gm)
    assert "eval mode: " in text and "train mode: " in text


@pytest.mark.parametrize("opt_level", ["O1", "O2", "O3"])
def test_convert_again_and_opt_levels_keep_both_modes(opt_level: str) -> None:
    model = _model(training=False)
    gm = _convert(model, "export")
    again = _convert(gm, "export", opt_level) if opt_level != "O1" else _convert(gm, "export")
    for module in (_convert(model, "export", opt_level), again):
        module.train()
        assert (_run(module, opt_level) == 0).float().mean().item() > 0.3
        module.eval()
        assert torch.equal(_run(module, opt_level), _run(module, opt_level))


@pytest.mark.parametrize("training", [False, True])
def test_torch_compile_runs_the_mode_it_is_called_in(training: bool,
                                                     fresh_dynamo: None) -> None:
    gm = _convert(_model(training=False), "export")
    compiled = torch.compile(gm, backend="eager")
    gm.train(training)
    torch.manual_seed(4)
    expected = gm(X)
    torch.manual_seed(4)
    assert torch.equal(compiled(X), expected)
    gm.train(not training)
    torch.manual_seed(4)
    expected = gm(X)
    torch.manual_seed(4)
    assert torch.equal(compiled(X), expected)  # recompiled for the other mode


@pytest.mark.parametrize("training", [False, True])
def test_export_and_save_each_mode(training: bool) -> None:
    gm = _convert(_model(training=not training), "export")
    gm.train(training)
    ep = torch.export.export(gm, (X,))
    buffer = io.BytesIO()
    torch.export.save(ep, buffer)
    buffer.seek(0)
    loaded = torch.export.load(buffer).module()
    ops = {str(n.target) for n in ep.graph.nodes if n.op == "call_function"}
    if training:
        assert any("dropout" in op or "bernoulli" in op for op in ops), ops
        assert (loaded(X) == 0).float().mean().item() > 0.3
    else:
        assert not any("bernoulli" in op for op in ops), ops
        assert torch.equal(loaded(X), gm(X))


class _Tokens(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = torch.randint(0, 64, (12,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": ids}


def _gpt2_with_dropout() -> nn.Module:
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(
        vocab_size=64, n_embd=32, n_layer=2, n_head=2, n_positions=32, resid_pdrop=0.1,
        embd_pdrop=0.1, attn_pdrop=0.1, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config).train()


def _trainer_eval_losses(model: nn.Module, out: str, bf16: bool) -> list[float]:
    """Two training steps, each followed by an evaluation (Trainer switches to eval mode and
    back), and one more evaluation at the end."""
    transformers = pytest.importorskip("transformers")
    args = transformers.TrainingArguments(
        output_dir=out, per_device_train_batch_size=4, per_device_eval_batch_size=4,
        max_steps=2, eval_strategy="steps", eval_steps=1, report_to=[], use_cpu=True,
        bf16=bf16, save_strategy="no", logging_strategy="no", dataloader_num_workers=0, seed=0,
        disable_tqdm=True)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=_Tokens(),
                                   eval_dataset=_Tokens())
    trainer.train()
    losses = [h["eval_loss"] for h in trainer.state.log_history if "eval_loss" in h]
    return losses + [trainer.evaluate()["eval_loss"]]


def test_trainer_evaluation_of_a_model_with_dropout_matches_autocast(tmp_path: object) -> None:
    """GPT-2 with dropout 0.1, converted in train mode: Trainer's evaluations run the
    eval-mode graph (no dropout), equal to the eager model's under ``torch.autocast``."""
    pytest.importorskip("accelerate")  # Trainer needs it
    model, twin = _gpt2_with_dropout(), _gpt2_with_dropout()
    ids = _Tokens()[0]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        gm = amprewrite.convert(model, (), example_kwargs={k: v[None].repeat(4, 1)
                                                           for k, v in ids.items()},
                                policy=PRESET)
    assert cache_of(gm).pending_mode() is False  # captured at Trainer's eval
    losses = _trainer_eval_losses(gm, f"{tmp_path}/converted", bf16=False)
    assert cache_of(gm).mode_graphs(gm)  # dropout: a graph per mode
    expected = _trainer_eval_losses(twin, f"{tmp_path}/autocast", bf16=True)
    assert len(losses) == 3 and losses == expected


@contextlib.contextmanager
def _counted_exports() -> Iterator[list[bool]]:
    """The modes (``training`` flags) of the models torch.export captures in the block."""
    calls: list[bool] = []
    real = export_capture._export

    def counting(model: nn.Module, *args: object, **kwargs: object) -> object:
        calls.append(model.training)
        return real(model, *args, **kwargs)

    export_capture._export = counting  # type: ignore[assignment]
    try:
        yield calls
    finally:
        export_capture._export = real  # type: ignore[assignment]


@pytest.mark.parametrize("training", [False, True])
def test_convert_captures_one_mode_and_the_first_switch_the_other(training: bool) -> None:
    with _counted_exports() as calls:
        gm = _convert(_model(training), "export")
    assert calls == [training]  # one capture, in the model's mode
    assert cache_of(gm).pending_mode() is (not training)
    with _counted_exports() as calls:
        gm.train(training)  # no switch: nothing to capture
        gm(X)
        assert calls == []
        gm.train(not training)
        assert calls == [not training]  # the first switch captures the other mode
        out = _run(gm, "O1")
        if not training:
            assert (out == 0).float().mean().item() > 0.3  # the train graph: dropout
        else:
            assert torch.equal(out, gm(X))  # the eval graph: deterministic
        for _ in range(2):
            gm.train(training)
            gm(X)
            gm.train(not training)
        assert calls == [not training]  # later switches exchange the two graphs
    assert cache_of(gm).pending_mode() is None and len(cache_of(gm).entries) == 2


def test_a_deep_copy_captures_its_pending_mode_on_its_own_tensors() -> None:
    model = _model(training=False)
    gm = _convert(model, "export")
    copied = copy.deepcopy(gm).train()
    assert cache_of(gm).pending_mode() is True  # the original: still pending
    assert _graph_of(copied, False)._parameters is copied._parameters
    assert list(copied.state_dict()) == list(model.state_dict())
    before = _stats(copied)
    copied(X)
    assert not torch.equal(_stats(copied), before)
    assert torch.equal(_stats(gm), model[1].running_mean)  # not the original's buffers
    assert torch.equal(_stats(gm), before)
    again = _convert(copied, "export").eval()  # a converted input in its other mode
    assert torch.equal(again(X), again(X))


def test_switching_to_a_pending_mode_while_tracing_asks_for_a_switch_outside() -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    gm = _convert(_model(training=False), "export")
    with FakeTensorMode(), pytest.raises(AmpRewriteError, match=r"Call gm\.train\(\) once outside"):
        gm.train()
    assert not gm.training or cache_of(gm).pending_mode() is True
    gm.eval().train()  # outside: captured
    with FakeTensorMode():
        gm.eval()
        gm.train()  # captured already: a swap
    assert gm.graph is not _graph_of(gm, False).graph


def test_an_override_naming_only_the_other_mode_captures_it_at_conversion() -> None:
    policy = PRESET.override(nodes={"add_": amprewrite.OpCategory.FP32})  # train mode only
    with _counted_exports() as calls, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        gm = amprewrite.convert(_model(training=False), (X,), policy=policy)
    assert calls == [False, True]
    assert len(cache_of(gm).entries) == 2 and cache_of(gm).pending_mode() is None


def test_a_call_that_does_not_fit_the_capture_says_so_in_either_mode() -> None:
    gm = _convert(_model(training=False), "export")
    for training in (False, True, False):
        gm.train(training)
        with pytest.raises(AmpRewriteError, match="captured for float32 of shape"):
            gm(X[:, :4])


@pytest.mark.parametrize("capture", ("export", "symbolic"))
def test_a_pickled_module_runs_the_mode_it_was_saved_in_and_refuses_to_switch(
        capture: str) -> None:
    model = _model(training=False)
    gm = _convert(model, capture)
    gm.train()  # both modes captured
    gm.eval()
    buffer = io.BytesIO()
    torch.save(gm, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert torch.equal(loaded(X), gm(X))  # eval: deterministic, running statistics
    loaded.eval()  # already in the saved mode: fine
    with pytest.raises(AmpRewriteError, match=r"saved in eval mode.*train\(\) cannot switch"):
        loaded.train()
    assert not loaded.training
