"""The slow-dtype check: which devices have a fast path, the one warning per process, and
where the capability is printed. The probes are monkeypatched, so every case runs anywhere."""

from __future__ import annotations

import warnings
from typing import Iterator

import pytest
import torch
import torch.nn as nn

import amprewrite
from amprewrite import hardware as _hardware
from amprewrite.explain import explain_records


@pytest.fixture
def fresh_warnings(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setattr(_hardware, "_WARNED", set())
    yield


def _cpu(monkeypatch: pytest.MonkeyPatch, *, avx512_bf16: bool = False, amx: bool = False,
         amx_fp16: bool = False, capability: str = "AVX2") -> None:
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    monkeypatch.setattr(torch.cpu, "_is_amx_fp16_supported", lambda: amx_fp16)
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: capability)


def _gpu(monkeypatch: pytest.MonkeyPatch, capability: tuple[int, int], name: str) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)


def test_avx2_cpu_has_no_fast_low_precision(monkeypatch: pytest.MonkeyPatch) -> None:
    _cpu(monkeypatch)
    reason = _hardware.slow_reason("cpu", torch.bfloat16)
    assert reason is not None
    assert "AVX2" in reason and "avx512_bf16 or AMX" in reason
    assert "torch.backends.cpu.get_cpu_capability()" in reason and "opt_level='O0'" in reason
    assert "AMX-FP16" in _hardware.slow_reason("cpu", torch.float16)
    assert _hardware.describe("cpu") == "cpu: AVX2 (no avx512_bf16, no AMX)"


@pytest.mark.parametrize("flags", [{"avx512_bf16": True}, {"amx": True}])
def test_native_bf16_cpu_is_fast(monkeypatch: pytest.MonkeyPatch, flags: dict) -> None:
    _cpu(monkeypatch, capability="AVX512", **flags)
    assert _hardware.slow_reason("cpu", torch.bfloat16) is None
    assert _hardware.slow_reason("cpu", torch.float16) is not None  # needs AMX-FP16
    assert _hardware.describe("cpu").startswith("cpu: AVX512 (")


def test_amx_fp16_cpu_is_fast_for_fp16(monkeypatch: pytest.MonkeyPatch) -> None:
    _cpu(monkeypatch, amx=True, amx_fp16=True, capability="AVX512")
    assert _hardware.slow_reason("cpu", torch.float16) is None
    assert _hardware.describe("cpu") == "cpu: AVX512 (amx, amx_fp16)"


@pytest.mark.parametrize("capability, fp16_fast, bf16_fast", [
    ((6, 1), False, False),   # Pascal: no tensor cores
    ((7, 5), True, False),    # Turing: fp16 tensor cores, no bf16
    ((8, 0), True, True),     # Ampere
    ((9, 0), True, True),     # Hopper
])
def test_cuda_compute_capability(monkeypatch: pytest.MonkeyPatch, capability: tuple[int, int],
                                 fp16_fast: bool, bf16_fast: bool) -> None:
    _gpu(monkeypatch, capability, "Some GPU")
    assert (_hardware.slow_reason("cuda", torch.float16) is None) == fp16_fast
    assert (_hardware.slow_reason("cuda", torch.bfloat16) is None) == bf16_fast
    assert _hardware.describe("cuda:0") == \
        f"cuda:0: Some GPU, compute capability {capability[0]}.{capability[1]}"


def test_bf16_on_turing_suggests_fp16(monkeypatch: pytest.MonkeyPatch) -> None:
    _gpu(monkeypatch, (7, 5), "Tesla T4")
    reason = _hardware.slow_reason("cuda", torch.bfloat16)
    assert reason.startswith("Tesla T4 has compute capability 7.5")
    assert "needs 8.0 (Ampere)" in reason and "dtype=torch.float16" in reason
    _gpu(monkeypatch, (6, 0), "Tesla P100")
    assert "opt_level='O0'" in _hardware.slow_reason("cuda", torch.float16)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))


def test_convert_warns_once_per_device_and_dtype(monkeypatch: pytest.MonkeyPatch,
                                                 fresh_warnings: None) -> None:
    _cpu(monkeypatch)
    x = torch.randn(2, 4)
    with pytest.warns(UserWarning, match=r"amprewrite.convert: bf16 on cpu: this CPU \(AVX2"):
        amprewrite.convert(_model(), (x,))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        amprewrite.convert(_model(), (x,))  # the same pair again: silent
    with pytest.warns(UserWarning, match=r"fp16 on cpu: .* no AMX-FP16"):
        amprewrite.convert(_model(), (x,), dtype=torch.float16)


def test_fast_hardware_and_o0_do_not_warn(monkeypatch: pytest.MonkeyPatch,
                                          fresh_warnings: None) -> None:
    x = torch.randn(2, 4)
    _cpu(monkeypatch)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        amprewrite.convert(_model(), (x,), opt_level="O0")  # O0 computes in fp32
        _cpu(monkeypatch, avx512_bf16=True, capability="AVX512")
        amprewrite.convert(_model(), (x,))


def test_compile_warns_too(monkeypatch: pytest.MonkeyPatch, fresh_warnings: None) -> None:
    _cpu(monkeypatch)
    with pytest.warns(UserWarning, match="bf16 on cpu"):
        amprewrite.compile(_model(), eager=True)


def test_explain_names_the_hardware(monkeypatch: pytest.MonkeyPatch) -> None:
    _cpu(monkeypatch)
    gm = amprewrite.convert(_model(), (torch.randn(2, 4),))
    first_lines = amprewrite.explain(gm).splitlines()[:2]
    assert any(line == "hardware: cpu: AVX2 (no avx512_bf16, no AMX); no fast bf16 kernels "
               "here, expect it slower than fp32" for line in first_lines), first_lines
    record = explain_records(gm)[0]
    assert record["hardware"] == "cpu: AVX2 (no avx512_bf16, no AMX)"
    assert record["fast_low_dtype"] is False
