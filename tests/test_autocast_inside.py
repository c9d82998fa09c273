"""A converted module called inside an active ``torch.autocast`` of its device warns, once per
module: autocast then casts on top of the graph's casts and silently undoes what the policy
keeps in fp32."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn

import amprewrite
from amprewrite import AutocastOverrideWarning, Policy
from amprewrite.module.calling import _any_autocast_enabled
from _fake_cuda import cuda_autocast

X = torch.randn(2, 8)


def _converted() -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))
    # the last Linear kept in fp32: what an outer autocast undoes
    return model, amprewrite.convert(model, (X,), policy=Policy().override(keep_fp32=["2"]))


def _autocast_warnings(caught: list[warnings.WarningMessage]) -> list[warnings.WarningMessage]:
    return [w for w in caught if issubclass(w.category, AutocastOverrideWarning)]


def test_warns_once_per_module_naming_the_device_and_the_fix() -> None:
    _, gm = _converted()
    assert gm(X).dtype == torch.float32
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = gm(X)
            gm(X)
            gm(X)
    # the keep_fp32 override is undone: the last Linear ran in bf16
    assert out.dtype == torch.bfloat16
    (warning,) = _autocast_warnings(caught)
    message = str(warning.message)
    assert message.startswith("amprewrite: the converted Sequential was called inside "
                              "torch.autocast('cpu', dtype=torch.bfloat16), which casts again "
                              "on top of the casts in its graph: an op its policy keeps in fp32")
    assert "Call the converted module outside torch.autocast" in message
    assert 'Accelerator(mixed_precision="no")' in message
    assert "policy=amprewrite.Policy.autocast('cpu', torch.bfloat16)" in message
    assert warning.filename == __file__  # the user's line, not amprewrite's or torch's
    # once per converted module: another one warns on its own
    _, other = _converted()
    with pytest.warns(AutocastOverrideWarning, match=r"torch\.autocast\('cpu', "
                                                     r"dtype=torch\.float16\)"):
        with torch.autocast("cpu", dtype=torch.float16):
            other(X)


def test_silent_outside_autocast_and_with_autocast_disabled() -> None:
    model, gm = _converted()
    with warnings.catch_warnings():
        warnings.simplefilter("error", AutocastOverrideWarning)
        assert gm(X).dtype == torch.float32
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=False):
            assert gm(X).dtype == torch.float32
        with torch.autocast("cpu", dtype=torch.bfloat16):
            model(X)  # the model itself under autocast: nothing converted runs
            with torch.autocast("cpu", enabled=False):
                assert gm(X).dtype == torch.float32


def test_silent_under_autocast_of_another_device_type() -> None:
    _, gm = _converted()
    with warnings.catch_warnings():
        warnings.simplefilter("error", AutocastOverrideWarning)
        with cuda_autocast(torch.float16):  # CUDA autocast does not touch CPU tensors
            assert torch.is_autocast_enabled("cuda")
            assert gm(X).dtype == torch.float32
    # NB: the check above found no CPU autocast and so did not mark the module as warned
    with pytest.warns(AutocastOverrideWarning, match="'cpu'"):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            gm(X)


def test_silent_while_a_capture_traces_it_under_the_presets_autocast() -> None:
    """A model that holds a converted block is captured under ``torch.autocast`` when its
    policy is an autocast preset: that trace is amprewrite's, not a call by the user."""
    _, block = _converted()
    outer = nn.Sequential(block, nn.ReLU())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        gm = amprewrite.convert(outer, (X,), policy=Policy.autocast("cpu", torch.bfloat16))
        gm(X)
    # NB: a warning raised inside the trace would also make convert fall back to an fp32
    # trace, with a warning of its own: neither may appear.
    assert [str(w.message) for w in caught] == []


def test_the_one_check_per_call_sees_every_device_type() -> None:
    """``torch._C._is_any_autocast_enabled`` is private: this fails on a release without it."""
    assert not _any_autocast_enabled()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert _any_autocast_enabled()
    with cuda_autocast(torch.float16):
        assert _any_autocast_enabled()
    assert not _any_autocast_enabled()


def test_accelerate_bf16_mixed_precision_warns_at_the_users_line() -> None:
    """accelerate enters autocast inside a wrapper of the instance's ``forward``, not around
    the call: the check sits in ``forward``, and the warning still names the caller's line."""
    accelerate = pytest.importorskip("accelerate")
    from accelerate.state import AcceleratorState, GradientState

    _, gm = _converted()
    # accelerate keeps its state process-wide: start from nothing, leave nothing behind
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    try:
        prepared = accelerate.Accelerator(mixed_precision="bf16", cpu=True).prepare(gm)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            prepared(X)
    finally:
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
    (warning,) = _autocast_warnings(caught)
    assert "torch.autocast('cpu', dtype=torch.bfloat16)" in str(warning.message)
    assert warning.filename == __file__
