"""The weight table: the one call that reads every tensor of a converted forward."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn as nn

import amprewrite
from amprewrite.runtime.weight_table import WEIGHTS_ATTR

pytestmark = pytest.mark.usefixtures("one_thread")

BF16 = torch.bfloat16


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fcs = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))
        self.norm = nn.LayerNorm(8)
        self.register_buffer("shift", torch.full((8,), 0.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for fc in self.fcs:
            x = fc(x) + self.shift
        return self.norm(x)


X = torch.randn(2, 8, generator=torch.Generator().manual_seed(1))


def _converted(model: nn.Module) -> torch.fx.GraphModule:
    return amprewrite.convert(model, (X,), policy=amprewrite.Policy.autocast("cpu", BF16))


def _autocast(model: nn.Module) -> torch.Tensor:
    with torch.autocast("cpu", BF16):
        return model(X)


def test_one_read_per_dict_holding_tensors() -> None:
    gm = _converted(Net())
    table = getattr(gm, WEIGHTS_ATTR)
    read = {entry[0] for entry in table.entries}
    assert read == {n for n, _ in gm.named_parameters()} | {"shift"}
    # the three linears' and the norm's _parameters, the root's _buffers: each dict once
    assert len(table._groups) == 5
    assert len({id(container) for container, _, _ in table._groups}) == 5


def test_the_read_follows_replaced_and_moved_tensors() -> None:
    model = Net()
    gm = _converted(model)
    with torch.no_grad():
        gm(X)  # fills the cast cache
    fc = gm.get_submodule("fcs.1")
    fc.weight = nn.Parameter(torch.randn(8, 8))  # replaced on the converted module...
    assert model.fcs[1].weight is fc.weight  # ...is the model's: they hold one dict
    model.norm.bias = nn.Parameter(torch.full((8,), 2.0))  # replaced on the model
    model.fcs[0]._parameters["bias"] = torch.ones(8)  # written straight into the dict
    with torch.no_grad():
        assert torch.equal(gm(X), _autocast(model))


def _guard_lines(compiled: nn.Module) -> list[str]:
    records: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record.getMessage())

    logger = logging.getLogger("torch._dynamo.guards.__guards")
    handler = Keep()
    logger.addHandler(handler)
    torch._logging.set_logs(guards=True)
    try:
        compiled(X)
    finally:
        torch._logging.set_logs()
        logger.removeHandler(handler)
    return "\n".join(records).splitlines()


@pytest.mark.usefixtures("fresh_dynamo")
def test_compiled_read_needs_no_python_aliasing_guards() -> None:
    """Dynamo guards that two places holding one object still do with a Python check run on
    every call (``a is b``); the table holds each dict once, so a compiled converted module
    has no such guard on its weights, whatever the number of layers."""
    gm = _converted(Net())
    lines = _guard_lines(torch.compile(gm, backend="eager"))
    assert any(WEIGHTS_ATTR in line for line in lines)  # the table's reads are guarded
    # NB: the guard's expression, not the source line quoted after it
    aliasing = [line for line in lines
                if "LAMBDA_GUARD" in line and WEIGHTS_ATTR in line.split("#")[0]]
    assert aliasing == []
