"""A converted module is called through amprewrite's own ``__call__``: the same results, a
report of the generated line that failed, and a compiled region that starts at the call."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
from torch._dynamo.eval_frame import _debug_get_cache_entry_list

import amprewrite
from amprewrite.module.calling import _converted_call

pytestmark = pytest.mark.usefixtures("one_thread")

BF16 = torch.bfloat16
X = torch.randn(2, 8, generator=torch.Generator().manual_seed(1))


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.LayerNorm(8))


def _converted(inputs: tuple | None = (X,)) -> fx.GraphModule:
    return amprewrite.convert(_net(), inputs, policy=amprewrite.Policy.autocast("cpu", BF16))


def test_converted_modules_take_the_call_and_recompile_keeps_it() -> None:
    gm = _converted()
    assert type(gm).__call__ is _converted_call
    other = _converted()
    assert type(other) is not type(gm)  # one class per module: setting it touches no other
    with torch.no_grad():
        out = gm(X)
        with torch.autocast("cpu", BF16):
            assert torch.equal(out, _net()(X))
        gm.recompile()
        assert type(gm).__call__ is _converted_call
        assert torch.equal(gm(X), out)
    assert type(other).__call__ is _converted_call


def test_after_recompile_a_call_follows_weights_and_modes_and_the_code_stays() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5), nn.Linear(8, 4))
    gm = amprewrite.convert(model, (X,), policy=amprewrite.Policy.autocast("cpu", BF16))
    gm.eval()
    code = gm.code
    with torch.no_grad():
        before = gm(X)
    gm.recompile()
    assert gm.code == code
    assert "def forward(self, input)" in str(gm.print_readable(print_output=False))
    with torch.no_grad():
        model[0].weight.mul_(2)  # a weight change: the kept bf16 copy is made again
        out = gm(X)
        with torch.autocast("cpu", BF16):
            assert torch.equal(out, model.eval()(X)) and not torch.equal(out, before)
    gm.train()  # the training graph (dropout on), captured at this switch
    torch.manual_seed(1)
    out = gm(X)
    torch.manual_seed(1)
    with torch.autocast("cpu", BF16):
        assert torch.equal(out, model.train()(X))
    gm.recompile()
    gm.eval()
    assert gm.code == code
    with torch.no_grad(), torch.autocast("cpu", BF16):
        assert torch.equal(gm(X), model.eval()(X))


def test_a_deep_copy_keeps_the_call_and_the_bindings() -> None:
    gm = _converted()
    for _ in range(2):  # and a copy of the copy
        copied = copy.deepcopy(gm)
        assert type(copied) is not type(gm) and type(copied).__call__ is _converted_call
        assert copied.code == gm.code and "torch.ops.aten" not in copied.code
        assert all(a is not b for a, b in zip(copied.parameters(), gm.parameters()))
        with torch.no_grad():
            assert torch.equal(copied(X), gm(X))
        gm = copied


def test_a_failing_generated_line_is_reported_and_the_error_kept(
        capsys: pytest.CaptureFixture) -> None:
    gm = _converted(None)  # symbolic capture: no input-shape check, the linear itself fails
    with pytest.raises(RuntimeError, match="cannot be multiplied") as info:
        gm(torch.randn(2, 7))
    err = capsys.readouterr().err.splitlines()
    failed = info.traceback[-1]  # the traceback still reaches the generated forward
    assert "eval_with_key" in str(failed.path)
    assert err[0] == (f"RuntimeError at line {failed.lineno + 1} of the converted module's "
                      "generated forward (print gm.code for all of it):")
    marked = next(i for i, text in enumerate(err) if text.endswith("<--- HERE"))
    assert "= torch.nn.functional.linear(" in err[marked - 1]
    assert err[marked] == "~" * len(err[marked - 1]) + " <--- HERE"


def test_other_errors_print_nothing(capsys: pytest.CaptureFixture) -> None:
    gm = _converted()
    # torch.export's shape check fails; the error names the argument that does not fit
    with pytest.raises(amprewrite.AmpRewriteError, match=r"called with float32 of shape \(2, 7\)") \
            as info:
        gm(torch.randn(2, 7))
    assert "Guard failed" in str(info.value.__cause__)
    assert capsys.readouterr().err == ""


@pytest.mark.usefixtures("fresh_dynamo")
def test_dynamo_compiles_from_the_call() -> None:
    """torch.fx's own call lives in a file Dynamo skips, so the compiled region would start
    below it; this call is traced from its first frame, with the same results."""
    gm = _converted()
    assert _debug_get_cache_entry_list(_converted_call.__code__) == []
    compiled = torch.compile(gm, backend="eager")
    with torch.no_grad():
        assert torch.equal(compiled(X), gm(X))
    assert len(_debug_get_cache_entry_list(_converted_call.__code__)) == 1
