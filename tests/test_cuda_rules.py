"""CUDA autocast rules without a GPU: ``Policy.autocast("cuda")`` and the default policy on
PyTorch's CUDA conformance lists (``AutocastTestLists``), checked for output dtypes.

The reference is the real ``AutocastCUDA`` kernels, run on fake CUDA tensors with the
autocast thread-local state set directly (see ``_fake_cuda``). The one-op module is converted
with *fake CUDA* example inputs: the CUDA preset casts only tensors on CUDA (autocast's
eligibility rule, ``policy.device_type == "cuda"``), so CPU example inputs would make every
input ineligible and hide the rules. With fake CUDA inputs, dtypes and devices are known
statically and the casts are decided exactly as for a model on a GPU; the converted module
then runs on the same fake inputs. The guarded path (no example inputs) decides eligibility
at run time from the fake inputs' device.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from _versions import TORCH_RELEASE
from _fake_cuda import cuda_autocast, fake_cuda, one_op_module, resolve_op, tensors_of
from torch._subclasses.fake_tensor import FakeTensorMode

import amprewrite
from amprewrite import AmpRewriteError

pytest.importorskip("expecttest")  # torch.testing._internal needs it
from torch.testing._internal.autocast_test_lists import AutocastTestLists  # noqa: E402

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
_LISTS = AutocastTestLists(torch.device("cpu"))  # CPU tensors, made fake CUDA per test

# Entries the fake-CUDA reference cannot run, or that are not checks of a policy.
SKIPS = {
    "cudnn_convolution": "needs the real cuDNN kernel (no CUDA-agnostic fake/meta path)",
    "cudnn_convolution_transpose": "needs the real cuDNN kernel (no fake/meta path)",
    "gru_cell": "_thnn_fused_gru_cell needs a real CUDA kernel (no fake/meta path)",
    "grid_sampler": "the CUDA grid_sampler kernel has no fake/meta path",
    "einsum": "the list's entry is malformed (its equation sits where the skip flag goes, "
              "and the 4-index equation does not fit its 8x8 inputs); PyTorch skips it too",
    "equal": "data-dependent (returns a Python bool), cannot run on fake tensors",
}
if TORCH_RELEASE < (2, 13):
    SKIPS["_convolution"] = (
        "torch 2.11 and 2.12: aten._convolution has no fake-tensor kernel for CUDA tensors, so "
        "tracing runs the real kernel (no driver here; 'Cannot call numel() on tensor with "
        "symbolic sizes/strides' under export's dynamic shapes); torch 2.13 and newer have it")
# torch_need_autocast_promote mixes fp16 with fp32 inputs: under bf16 autocast, CUDA's
# promote raises "Unexpected floating ScalarType in at::autocast::prioritize", which is why
# PyTorch runs that list with fp16 only. The same holds here.
FP16_ONLY = {"torch_need_autocast_promote"}
# Like the symbolic tracer on any model, torch.fx cannot record these names.
SYMBOLIC_UNTRACEABLE = {
    "__div__": "torch.fx.Proxy has no __div__ (a Python 2 operator name only Tensor keeps)",
}

EXPORT_UNSUPPORTED = {
    **dict.fromkeys(("dot", "vdot", "bilinear", "tensordot", "scatter_add"),
                    "the list mixes fp16 and fp32 inputs, valid only once autocast's promote "
                    "casts them: torch.export traces the unconverted op, which rejects them (the "
                    "symbolic path, which learns dtypes after the casts, covers these)"),
    **dict.fromkeys(("cosine_similarity", "hinge_embedding_loss", "margin_ranking_loss"),
                    "torch.export makes a real CUDA tensor while tracing this composite on fake "
                    "CUDA inputs, which a CPU-only build cannot do"),
}


def _entries() -> list[tuple[str, str, Any, tuple, dict, Any]]:
    """``(id, op name, module, args, kwargs, expected dtype; None = the amp dtype)``."""
    out: list[tuple[str, str, Any, tuple, dict, Any]] = []

    def add(category: str, name: str, module: Any, args: tuple, kwargs: dict, expect: Any) -> None:
        base = f"{category}-{name}"
        count = sum(1 for e in out if e[0] == base or e[0].startswith(base + "-"))
        out.append((base + (f"-{count}" if count else ""), name, module, args, kwargs, expect))

    for category, module in (("torch_expect_builtin_promote", torch),
                             ("methods_expect_builtin_promote", None)):
        for name, args, out_type in getattr(_LISTS, category):
            add(category, name, module, args, {}, out_type)
    for category, module, expect in (
            ("torch_fp16", torch, None), ("torch_fp32", torch, torch.float32),
            ("torch_need_autocast_promote", torch, torch.float32),
            ("nn_fp16", torch._C._nn, None), ("nn_fp32", torch._C._nn, torch.float32),
            ("linalg_fp16", torch._C._linalg, None), ("methods_fp16", None, None),
            ("methods_fp32", None, torch.float32)):
        for entry in getattr(_LISTS, category):
            kwargs = entry[2] if len(entry) > 2 and isinstance(entry[2], dict) else {}
            add(category, entry[0], module, entry[1], kwargs, expect)
    return out


ENTRIES = _entries()


def _cases() -> list[Any]:
    cases = []
    for entry in ENTRIES:
        category = entry[0].split("-")[0]
        for dtype in DTYPES:
            marks = []
            if entry[1] in SKIPS:
                marks.append(pytest.mark.skip(reason=SKIPS[entry[1]]))
            elif category in FP16_ONLY and dtype == "bf16":
                marks.append(pytest.mark.skip(reason="autocast itself raises (see FP16_ONLY)"))
            cases.append(pytest.param(entry, dtype, id=f"{entry[0]}-{dtype}", marks=marks))
    return cases


def _autocast_cuda_dtypes(model: Any, inputs: tuple, dtype: torch.dtype,
                          mode: FakeTensorMode) -> list[torch.dtype]:
    with mode, cuda_autocast(dtype):
        return [t.dtype for t in tensors_of(model(*inputs))]


def _converted_dtypes(model: Any, inputs: tuple, policy: amprewrite.Policy, path: str,
                      mode: FakeTensorMode) -> list[torch.dtype]:
    if path == "symbolic_guarded":
        gm = amprewrite.convert(model, policy=policy, capture="symbolic")
    else:
        gm = amprewrite.convert(model, inputs, policy=policy, capture=path.split("_")[0])
    with mode:
        outputs = tensors_of(gm(*inputs))
    assert all(t.device.type == "cuda" for t in outputs)
    return [t.dtype for t in outputs]


def _setup(entry: Any) -> tuple[Any, tuple, FakeTensorMode]:
    _, name, module, args, kwargs, _ = entry
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    op = resolve_op(name, module, args[0])
    model = one_op_module(op, args, kwargs)
    return model, tuple(fake_cuda(mode, tensors_of(args))), mode


@pytest.mark.parametrize("path", ("export", "symbolic_static", "symbolic_guarded"))
@pytest.mark.parametrize("entry,dtype", _cases())
def test_cuda_preset_matches_autocast_cuda(entry: Any, dtype: str, path: str) -> None:
    name, expect = entry[1], entry[5]
    if path != "export" and name in SYMBOLIC_UNTRACEABLE:
        pytest.skip(SYMBOLIC_UNTRACEABLE[name])
    if path == "export" and name in EXPORT_UNSUPPORTED:
        pytest.skip(EXPORT_UNSUPPORTED[name])
    low = DTYPES[dtype]
    model, inputs, mode = _setup(entry)
    want = _autocast_cuda_dtypes(model, inputs, low, mode)
    assert want[0] == (expect or low)  # the list's own expectation holds for the reference
    got = _converted_dtypes(model, inputs, amprewrite.Policy.autocast("cuda", low), path, mode)
    assert got == want


@pytest.mark.parametrize("entry,dtype", _cases())
def test_default_policy_matches_cuda_preset(entry: Any, dtype: str) -> None:
    if entry[1] in SYMBOLIC_UNTRACEABLE:
        pytest.skip(SYMBOLIC_UNTRACEABLE[entry[1]])
    low = DTYPES[dtype]
    model, inputs, mode = _setup(entry)
    want = _autocast_cuda_dtypes(model, inputs, low, mode)
    got = _converted_dtypes(model, inputs, amprewrite.Policy(dtype=low), "symbolic_static", mode)
    assert got == want


def _banned() -> list[Any]:
    return [pytest.param(e, id=e[0]) for e in _LISTS.banned]


@pytest.mark.parametrize("path", ("export", "symbolic_static", "symbolic_guarded"))
@pytest.mark.parametrize("entry", _banned())
def test_banned_raises_under_cuda_preset(entry: Any, path: str) -> None:
    name, args, module = entry
    model, inputs, mode = _setup((name, name, module, args, {}, None))
    with mode, cuda_autocast(torch.float16), pytest.raises(RuntimeError, match="unsafe to autocast"):
        model(*inputs)  # the reference refuses it
    with pytest.raises(AmpRewriteError, match=name):
        _converted_dtypes(model, inputs, amprewrite.Policy.autocast("cuda", torch.float16),
                          path, mode)


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("entry", _banned())
def test_default_policy_runs_banned_op_in_fp32(entry: Any, dtype: str) -> None:
    name, args, module = entry
    model, inputs, mode = _setup((name, name, module, args, {}, None))
    # Inputs of every floating dtype the lists use come out fp32, never low precision.
    for cast in (torch.float32, torch.float16, torch.bfloat16):
        with mode:
            typed = tuple(t.to(cast) for t in inputs)
        got = _converted_dtypes(model, typed, amprewrite.Policy(dtype=DTYPES[dtype]),
                                "symbolic_static", mode)
        assert got == [torch.float32]


# -- on a real GPU: bitwise, not only dtypes -------------------------------------------------
_GPU_SKIPS = {
    "einsum": SKIPS["einsum"],
    "equal": "returns a Python bool, not a tensor",
}
# torch.export traces on fake tensors; these CUDA kernels have no fake (meta) implementation.
_GPU_EXPORT_GAPS = dict.fromkeys(
    ("cudnn_convolution", "cudnn_convolution_transpose", "gru_cell"),
    "torch.export cannot trace it: its CUDA kernel has no fake (meta) implementation "
    "(symbolic capture converts it)")
if TORCH_RELEASE < (2, 13):
    _GPU_EXPORT_GAPS["_convolution"] = SKIPS["_convolution"]


def _gpu_cases() -> list[Any]:
    cases = []
    for entry in ENTRIES:
        category = entry[0].split("-")[0]
        for dtype in DTYPES:
            for path in ("export", "symbolic_static", "symbolic_guarded"):
                marks = []
                if entry[1] in _GPU_SKIPS:
                    marks.append(pytest.mark.skip(reason=_GPU_SKIPS[entry[1]]))
                elif category in FP16_ONLY and dtype == "bf16":
                    marks.append(pytest.mark.skip(reason="autocast itself raises (FP16_ONLY)"))
                elif path != "export" and entry[1] in SYMBOLIC_UNTRACEABLE:
                    marks.append(pytest.mark.skip(reason=SYMBOLIC_UNTRACEABLE[entry[1]]))
                elif path == "export" and entry[1] in _GPU_EXPORT_GAPS:
                    marks.append(pytest.mark.xfail(strict=True,
                                                   reason=_GPU_EXPORT_GAPS[entry[1]]))
                cases.append(pytest.param(entry, dtype, path, marks=marks,
                                          id=f"{entry[0]}-{dtype}-{path}"))
    return cases


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("entry,dtype,path", _gpu_cases())
def test_cuda_preset_bitwise_on_gpu(entry: Any, dtype: str, path: str) -> None:
    """The real kernels on a GPU: ``Policy.autocast("cuda")`` gives torch.autocast("cuda")'s
    output dtypes and bits."""
    _, name, module, args, kwargs, expect = entry
    low = DTYPES[dtype]
    args = torch.utils._pytree.tree_map(
        lambda x: x.detach().cuda() if isinstance(x, torch.Tensor) else x, args)
    model = one_op_module(resolve_op(name, module, args[0]), args, kwargs)
    inputs = tuple(tensors_of(args))
    with torch.autocast("cuda", dtype=low):
        want = tensors_of(model(*inputs))
    assert want[0].dtype == (expect or low)
    policy = amprewrite.Policy.autocast("cuda", low)
    if path == "symbolic_guarded":
        gm = amprewrite.convert(model, policy=policy, capture="symbolic")
    else:
        gm = amprewrite.convert(model, inputs, policy=policy, capture=path.split("_")[0])
    got = tensors_of(gm(*inputs))
    assert [t.dtype for t in got] == [t.dtype for t in want]
    for g, w in zip(got, want):
        assert torch.equal(g, w), f"{name}: not bitwise equal to autocast (max |diff| " \
                                  f"{(g.double() - w.double()).abs().max().item()})"


def test_cuda_autocast_stops_at_the_first_listed_op_of_a_composite() -> None:
    """What DecomposeCompositesPass reproduces, dtype-level on fake CUDA tensors: ``inner``
    meets ``tensordot`` (promote) and stays fp32 though it ends in an mm; ``cross_entropy``
    runs ``log_softmax`` in the low dtype, then ``nll_loss`` in fp32."""
    from torch.fx.experimental.proxy_tensor import make_fx

    def under_autocast(x: torch.Tensor, w: torch.Tensor, target: torch.Tensor) -> Any:
        with cuda_autocast(torch.bfloat16):
            return torch.inner(x, w), torch.nn.functional.cross_entropy(x.bfloat16(), target)

    with FakeTensorMode() as mode:
        x, w = fake_cuda(mode, torch.empty(4, 8)), fake_cuda(mode, torch.empty(8, 8))
        target = fake_cuda(mode, torch.zeros(4, dtype=torch.long))
        inner, loss = under_autocast(x, w, target)
        gm = make_fx(under_autocast, tracing_mode="fake")(x, w, target)
    assert inner.dtype == loss.dtype == torch.float32
    log_softmax = gm.graph.find_nodes(op="call_function",
                                      target=torch.ops.aten._log_softmax.default)[0]
    assert log_softmax.meta["val"].dtype == torch.bfloat16
    assert [u.target for u in log_softmax.users] == [torch.ops.aten._to_copy.default]
