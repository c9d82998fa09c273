"""A submodule's own mode, set on the model after conversion, is the converted module's too:
``model.train(); model.bn.eval()`` (a frozen batch norm, the fine-tuning recipe) trains with
running statistics, as eager does. The export route guards each submodule flag the capture
read and captures once for a new pattern; the symbolic route calls the model's own batch-norm
and dropout layers, which read their flags at each call. Compared with eager
``torch.autocast`` under the CPU preset, bitwise, over optimizer steps."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn as nn

import amprewrite
from amprewrite import RecaptureWarning
from amprewrite.module.cache import cache_of

PRESET = amprewrite.Policy.autocast("cpu", torch.bfloat16)
X = torch.randn(6, 8, generator=torch.Generator().manual_seed(0))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.bn = nn.BatchNorm1d(8)
        self.drop = nn.Dropout(0.5)
        self.gate = Gate()
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.gate(self.drop(self.bn(self.fc(x)))))


class Gate(nn.Module):
    """A module whose own Python branches on its flag (not a batch norm or dropout)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2 if self.training else x - 1


def _convert(model: nn.Module, route: str) -> torch.fx.GraphModule:
    if route == "export":
        return amprewrite.convert(model, (X,), policy=PRESET)
    return amprewrite.convert(model, policy=PRESET, capture="symbolic")


def _eager(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.autocast("cpu", torch.bfloat16):
        return model(x)


def _steps(gm: nn.Module, model: nn.Module, twin: nn.Module, n: int, seed: int) -> None:
    """``n`` SGD steps of the converted module and of eager autocast on the twin, from the
    same random stream, each bitwise: outputs, every parameter and buffer."""
    opt = torch.optim.SGD(gm.parameters(), lr=0.1)
    opt_twin = torch.optim.SGD(twin.parameters(), lr=0.1)
    for step in range(n):
        x = torch.randn(6, 8, generator=torch.Generator().manual_seed(seed + step))
        torch.manual_seed(step)
        got = gm(x)
        torch.manual_seed(step)
        want = _eager(twin, x)
        assert torch.equal(got, want), step
        got.float().pow(2).sum().backward()
        want.float().pow(2).sum().backward()
        opt.step(), opt_twin.step(), opt.zero_grad(), opt_twin.zero_grad()
        for (name, mine), theirs in zip(model.state_dict().items(), twin.state_dict().values()):
            assert torch.equal(mine, theirs), (step, name)


@pytest.mark.parametrize("route", ["export", "symbolic"])
def test_a_frozen_batch_norm_trains_with_running_statistics(route: str) -> None:
    torch.manual_seed(0)
    model = Net()
    twin = copy.deepcopy(model)
    gm = _convert(model, route)
    for m in (model, twin):
        m.train()
        m.bn.eval()  # frozen: running statistics, not updated
        m.gate.eval()
    frozen = model.bn.running_mean.clone()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _steps(gm, model, twin, 3, seed=1)
    assert torch.equal(model.bn.running_mean, frozen)
    recaptures = [str(w.message) for w in caught if w.category is RecaptureWarning]
    if route == "export":  # one capture for the new flags, named in the warning
        assert len(recaptures) == 1 and "bn.training: True -> False" in recaptures[0]
        assert "gate.training: True -> False" in recaptures[0]
    else:  # the model's own layers read their flags; the gate's branch is the traced one
        assert gm.bn is model.bn and gm.drop is model.drop
        assert len(recaptures) == 1 and "gate.training: True -> False" in recaptures[0]
        assert "bn.training" not in recaptures[0]


@pytest.mark.parametrize("route", ["export", "symbolic"])
def test_train_after_freezing_unfreezes_as_in_eager(route: str) -> None:
    """``gm.train()`` is ``model.train()``: every flag set again, the frozen layer included,
    and the graph captured for that state is held again (no new capture)."""
    torch.manual_seed(0)
    model = Net()
    twin = copy.deepcopy(model)
    gm = _convert(model, route)
    for m in (model, twin):
        m.bn.eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RecaptureWarning)
        _steps(gm, model, twin, 1, seed=10)
    kept = len(cache_of(gm).entries)
    gm.train(), twin.train()
    assert model.bn.training and model.gate.training
    with warnings.catch_warnings():
        warnings.simplefilter("error", RecaptureWarning)
        _steps(gm, model, twin, 2, seed=20)
    assert len(cache_of(gm).entries) == kept


@pytest.mark.parametrize("route", ["export", "symbolic"])
def test_the_models_switch_keeps_a_submodule_switched_back(route: str) -> None:
    """``model.eval(); gm(x); model.train(); model.bn.eval()``: the converted module follows
    the model's switch without setting the submodules' flags again (a switch through
    ``gm.train()`` would unfreeze the batch norm the user froze)."""
    torch.manual_seed(0)
    model = Net()
    twin = copy.deepcopy(model)
    gm = _convert(model, route)
    with torch.no_grad():
        model.eval(), twin.eval()
        assert torch.equal(gm(X), _eager(twin, X))
    for m in (model, twin):
        m.train()
        m.bn.eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RecaptureWarning)
        _steps(gm, model, twin, 2, seed=30)
    assert not model.bn.training and model.drop.training


@pytest.mark.parametrize("route", ["export", "symbolic"])
def test_requires_grad_off_on_a_submodule_is_followed(route: str) -> None:
    torch.manual_seed(0)
    model = Net().eval()
    twin = copy.deepcopy(model)
    gm = _convert(model, route)
    model.fc.requires_grad_(False)
    twin.fc.requires_grad_(False)
    got, want = gm(X), _eager(twin, X)
    assert torch.equal(got, want)
    got.float().sum().backward()
    want.float().sum().backward()
    assert model.fc.weight.grad is None and model.fc.bias.grad is None
    assert torch.equal(model.head.weight.grad, twin.head.weight.grad)


def test_o3_owns_its_flags() -> None:
    """O3 runs on a low-precision copy of its own: the model's flags are not its state, and
    switching the converted module captures no state change."""
    model = Net().eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        gm = amprewrite.convert(model, (X,), opt_level="O3", dtype=torch.bfloat16)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RecaptureWarning)
        for _ in range(2):
            gm.train()
            gm(X)
            gm.eval()
            gm(X)
    assert len({e.group for e in cache_of(gm).entries}) == 1
