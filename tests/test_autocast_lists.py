"""PyTorch's own CPU autocast conformance lists, converted with ``Policy.autocast("cpu")``.

Every entry of ``AutocastCPUTestLists`` becomes a one-op module; converted through each
capture path, it must give ``torch.autocast("cpu")``'s output dtype and bits, for bf16 and
fp16. As PyTorch's own test does, the promote and builtin-promote lists use their fp16
argument variant under fp16.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from _fake_cuda import one_op_module, resolve_op, tensors_of

import amprewrite

pytest.importorskip("expecttest")  # torch.testing._internal needs it
from torch.testing._internal.autocast_test_lists import AutocastCPUTestLists  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
PATHS = ("export", "symbolic_static", "symbolic_guarded")
_LISTS = AutocastCPUTestLists(torch.device("cpu"))
SYMBOLIC_UNTRACEABLE = {
    "__div__": "torch.fx.Proxy has no __div__ (a Python 2 operator name that only Tensor "
               "keeps), so the symbolic tracer cannot record the call",
}


def _entries() -> list[Any]:
    """``(id, op name, module, args per dtype, kwargs, expected dtype or None = amp dtype)``."""
    out = []

    def add(category: str, name: str, module: Any, args: dict, kwargs: dict, expect: Any) -> None:
        count = sum(1 for e in out if e[0].startswith(f"{category}-{name}"))
        out.append((f"{category}-{name}" + (f"-{count}" if count else ""), name, module, args,
                    kwargs, expect))

    for category, module in (("torch_expect_builtin_promote", torch),
                             ("methods_expect_builtin_promote", None)):
        for name, args_bf16, args_fp16, out_type in getattr(_LISTS, category):
            add(category, name, module, {"bf16": args_bf16, "fp16": args_fp16}, {}, out_type)
    for category, module, expect in (("torch_16", torch, None), ("nn_16", torch._C._nn, None),
                                     ("torch_fp32", torch, torch.float32),
                                     ("nn_fp32", torch._C._nn, torch.float32)):
        for entry in getattr(_LISTS, category):
            name, args, kwargs = entry[0], entry[1], (entry[2] if len(entry) > 2 else {})
            add(category, name, module, {"bf16": args, "fp16": args}, kwargs, expect)
    for name, args_bf16, args_fp16 in _LISTS.torch_need_autocast_promote:
        add("torch_need_autocast_promote", name, torch, {"bf16": args_bf16, "fp16": args_fp16},
            {}, torch.float32)
    return out


ENTRIES = _entries()


def _flat(out: Any) -> list[torch.Tensor]:
    return tensors_of(out)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("entry", ENTRIES, ids=[e[0] for e in ENTRIES])
def test_cpu_list_entry(entry: Any, dtype: str, path: str) -> None:
    _, name, module, args_by_dtype, kwargs, expect = entry
    if path != "export" and name in SYMBOLIC_UNTRACEABLE:
        pytest.skip(SYMBOLIC_UNTRACEABLE[name])
    low = DTYPES[dtype]
    args = args_by_dtype[dtype]
    op = resolve_op(name, module, args[0])
    model = one_op_module(op, args, kwargs)
    inputs = tuple(tensors_of(args))

    with torch.autocast("cpu", dtype=low):
        want = _flat(model(*inputs))
    assert want[0].dtype == (expect or low)  # the list's own expectation holds in eager

    policy = amprewrite.Policy.autocast("cpu", low)
    if path == "export":
        gm = amprewrite.convert(model, inputs, policy=policy, capture="export")
    elif path == "symbolic_static":
        gm = amprewrite.convert(model, inputs, policy=policy, capture="symbolic")
    else:
        gm = amprewrite.convert(model, policy=policy, capture="symbolic")
    got = _flat(gm(*inputs))

    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype, f"{name}: {g.dtype} != autocast's {w.dtype}"
        assert torch.equal(g, w), f"{name}: not bitwise equal to autocast"


def test_lists_cover_every_category() -> None:
    categories = {e[0].split("-")[0] for e in ENTRIES}
    assert categories == {"torch_expect_builtin_promote", "methods_expect_builtin_promote",
                          "torch_16", "nn_16", "torch_fp32", "nn_fp32",
                          "torch_need_autocast_promote"}
    assert len(ENTRIES) >= 50
