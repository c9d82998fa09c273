"""``convert(model, capture="export")`` without example inputs: a module captured at its first
call from that call's inputs (as torch.compile does), usable as the model before it (its
parameters, state dict, modes, an O2 optimizer binding), captured again for inputs its graph
does not fit, bounded and with a warning."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn as nn

import amprewrite
from amprewrite.explain import explain_records
from amprewrite.module.cache import MAX_STATES, cache_of
from amprewrite.errors import AmpRewriteError

bf16 = torch.bfloat16
PRESET = amprewrite.Policy.autocast("cpu", bf16)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.25), nn.Linear(16, 4))


def _x(i: int, *shape: int) -> torch.Tensor:
    return torch.randn(*(shape or (6, 8)), generator=torch.Generator().manual_seed(i))


def _later(model: nn.Module, **options: object) -> nn.Module:
    return amprewrite.convert(model, capture="export", **({"policy": PRESET} | options))


def test_before_its_first_call_it_is_the_model_and_says_what_to_do() -> None:
    model = _model()
    gm = _later(model)
    assert [n for n, _ in gm.named_parameters()] == [n for n, _ in model.named_parameters()]
    assert all(p is q for p, q in zip(gm.parameters(), model.parameters()))
    assert list(gm.state_dict()) == list(model.state_dict())
    assert "not_captured_yet" in gm.code
    assert amprewrite.explain(gm).startswith("not captured yet: this converted Sequential is "
                                             "captured at its first call")
    for view in (explain_records, amprewrite.html_report):  # no empty table
        with pytest.raises(ValueError, match="this converted Sequential is captured at its "
                                             "first call"):
            view(gm)
    sd = {k: torch.zeros_like(v) for k, v in model.state_dict().items()}
    gm.load_state_dict(sd)  # a checkpoint restored before training reaches the model
    assert all(torch.equal(p, torch.zeros_like(p)) for p in model.parameters())


def test_trains_from_an_optimizer_built_before_the_first_call_bitwise() -> None:
    model, twin = _model(), _model()
    gm = _later(model)
    opt = torch.optim.AdamW(gm.parameters(), lr=1e-2)  # set-up: no batch yet
    twin_opt = torch.optim.AdamW(twin.parameters(), lr=1e-2)
    for step in range(3):
        x = _x(step, 4 + step, 8)  # another batch size each step: one capture
        torch.manual_seed(step)
        loss = gm(x).float().square().mean()
        torch.manual_seed(step)
        with torch.autocast("cpu", dtype=bf16):
            twin_loss = twin(x).float().square().mean()
        assert torch.equal(loss, twin_loss), step
        for o, l in ((opt, loss), (twin_opt, twin_loss)):
            l.backward()
            o.step()
            o.zero_grad()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), twin.parameters()))
    assert len(cache_of(gm).entries) == 1  # the dynamic capture took every batch size
    assert "not_captured_yet" not in gm.code and "bfloat16" in gm.code
    gm.eval()
    twin.eval()
    with torch.no_grad(), torch.autocast("cpu", dtype=bf16):
        want = twin(_x(9))
    assert torch.equal(gm(_x(9)), want)


def test_inputs_the_graph_does_not_fit_are_captured_again_with_a_warning() -> None:
    model = _model()
    gm = _later(model)
    gm.eval()
    with torch.no_grad():
        gm(_x(0))
        with pytest.warns(UserWarning, match=r"called with inputs its graph was not captured "
                                             r"for \(input: captured for float32 of shape "
                                             r"\(any, 8\), called with float32 of shape "
                                             r"\(2, 3, 8\)\), so it was captured again"):
            out = gm(_x(1, 2, 3, 8))
        with torch.autocast("cpu", dtype=bf16):
            assert torch.equal(out, model.eval()(_x(1, 2, 3, 8)))
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            gm(_x(2, 5, 8))  # the first graph again: no capture
            gm(_x(3, 4, 3, 8))  # and the second
    assert len(cache_of(gm).entries) == 2


def test_captures_for_inputs_are_bounded() -> None:
    gm = _later(nn.Linear(8, 4))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for rank in range(1, MAX_STATES + 1):
            gm(torch.randn(*([2] * (rank - 1)), 8))
    with pytest.raises(AmpRewriteError, match=rf"after {MAX_STATES} states were captured"):
        gm(torch.randn(*([2] * MAX_STATES), 8))


def test_o2_binds_its_optimizer_before_the_first_call() -> None:
    model, twin = _model(), _model()
    gm = amprewrite.convert(model, capture="export", dtype=bf16, opt_level="O2")
    opt = torch.optim.SGD(gm.parameters(), lr=0.1)
    amprewrite.MasterWeights(gm, opt)  # before any batch
    twin_gm = amprewrite.convert(twin, (_x(0),), dtype=bf16, opt_level="O2")
    twin_opt = torch.optim.SGD(twin_gm.parameters(), lr=0.1)
    amprewrite.MasterWeights(twin_gm, twin_opt)
    for step in range(3):
        losses = []
        for module, o in ((gm, opt), (twin_gm, twin_opt)):
            torch.manual_seed(step)
            loss = module(_x(step)).float().square().mean()
            loss.backward()
            o.step()
            o.zero_grad()
            losses.append(loss)
        assert torch.equal(*losses), step
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), twin.parameters()))


def test_compiled_before_its_first_call(fresh_dynamo: None) -> None:
    model = _model().eval()
    gm = _later(model).eval()
    compiled = torch.compile(gm, backend="eager")
    with torch.no_grad():
        out = compiled(_x(0))
        with torch.autocast("cpu", dtype=bf16):
            assert torch.equal(out, model(_x(0)))


def test_a_deep_copy_before_the_first_call_captures_its_own_model() -> None:
    model = _model().eval()
    gm = _later(model).eval()
    copied = copy.deepcopy(gm)
    with torch.no_grad():
        out = copied(_x(0))
        assert torch.equal(out, gm(_x(0)))
    assert all(p is not q for p, q in zip(copied.parameters(), model.parameters()))


def test_a_huggingface_model_called_with_keywords() -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=2,
                                     n_positions=32, resid_pdrop=0.0, embd_pdrop=0.0,
                                     attn_pdrop=0.0)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config).eval()
    gm = _later(model)
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = gm(input_ids=ids, labels=ids)
        with torch.autocast("cpu", dtype=bf16):
            want = model(input_ids=ids, labels=ids)
    assert torch.equal(out.loss, want.loss) and torch.equal(out.logits, want.logits)
