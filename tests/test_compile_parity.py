"""The suite's model zoos through ``amprewrite.compile``, bitwise against ``torch.autocast``.

``test_parity_zoo.py``, ``models/test_hf_zoo.py`` and ``models/test_ecosystem_zoo.py`` hold
``convert`` to bitwise parity with eager autocast; this file runs the same cases through the
``torch.compile`` route, so that a gap on one route shows on the other as well. Under a
``Policy.autocast("cpu", dtype)`` preset, the outputs, every parameter gradient of one
backward and every buffer (BatchNorm's running statistics) must be bitwise those of the model
run under ``torch.autocast("cpu", dtype=dtype)``:

* the parity zoo (``_zoo.py``), in bf16 and fp16, with fixed pseudo-random output gradients;
* a representative set of the HuggingFace zoo (``models/_hf_zoo.py``: one or more entries per
  family, and each with a feature of its own), training mode, the entry's fp32 loss;
* the ecosystem zoo's representatives (torchvision, timm, diffusers, LLaVA), where their
  libraries import.

``AMPREWRITE_ZOO_FULL=1`` runs every model of both zoos (as it does for
``models/test_ecosystem_zoo.py``).

The rewritten graphs run eagerly (``eager=True``): Inductor's fused kernels round differently
from eager ones, so only the eager graphs can be bitwise, and they cost Dynamo's tracing
alone (about a second per model on one thread). Detectors with dozens of graph breaks are
``test_detection_zoo.py``'s.
"""

from __future__ import annotations

import copy
import os
import sys
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
import torch.nn as nn
from _zoo import ZOO, ZooCase

import amprewrite
from amprewrite import Policy

sys.path.insert(0, str(Path(__file__).parent / "models"))
from _zoo_entry import tensor_leaves  # noqa: E402  (tests/models; imports no model library)

pytestmark = pytest.mark.usefixtures("fresh_dynamo", "one_thread")

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}

HF_MODELS = (
    "llama",          # grouped-query attention, rotary embeddings in an fp32 region
    "llama_sdpa",     # the same through scaled_dot_product_attention
    "gemma2",         # sliding window, logit soft-capping
    "bloom",          # a custom autograd.Function (convert's export records its forward ops)
    "opt_cache",      # returns a DynamicCache
    "gpt2_labels",    # the loss computed inside the model
    "gpt2_ckpt",      # gradient checkpointing
    "mixtral",        # a mixture of experts: data-dependent token routing
    "mamba",          # a state-space scan
    "bert",
    "deberta_v2",     # relative position buckets
    "t5",
    "wav2vec2",       # convolutions on raw audio, a padding mask
    "vit",
    "dinov2",         # interpolated position embeddings
    "swin",
)
"""The HuggingFace zoo's entries this file runs: every family, and models with a feature of
their own. ``AMPREWRITE_ZOO_FULL=1`` runs every entry of the HuggingFace and ecosystem zoos."""

FULL = os.environ.get("AMPREWRITE_ZOO_FULL") == "1"

DYNAMO_REFERENCE = {
    "mamba": "transformers' slow path scans with torch's associative_scan when "
             "is_torchdynamo_compiling() (the config's use_associative_scan, True by default), "
             "with a Python loop in eager, and the two sum in another order: on torch 2.13 and "
             "2.14 eager autocast itself differs from autocast under torch.compile in 2 of 22 "
             "gradients, the two layers' A_log, by at most 1.8e-12 against gradients of "
             "1.1e-5 (1.7e-7 relative, fp32 rounding); the outputs are equal. Bitwise with "
             "use_associative_scan=False, and on torch 2.11",
    "hf_llava": "the language model's grouped-query sdpa attention (1 key/value head for 2 "
                "query heads): while Dynamo traces, transformers materialises the causal mask "
                "(the padding mask is a traced tensor) and so repeats the key/value heads, "
                "where eager passes is_causal and enable_gqa to sdpa, whose backward sums the "
                "heads in another order. Eager autocast itself differs from autocast under "
                "torch.compile in most gradients (the vision tower's too, reached through "
                "the image features), by at most 0.0078 against gradients of up to 1.4 (bf16 "
                "rounding of differently ordered sums); the outputs are equal, on torch 2.11, "
                "2.13 and 2.14. convert's export has the same gap (_ecosystem_gaps.py)",
}
"""Models whose Python takes another branch while Dynamo traces it, so that eager autocast is
not the oracle of what the compiled route can compute. Their reference is the model compiled
with ``backend="eager"`` and called under torch.autocast: autocast on the program Dynamo
traces, with no amprewrite involved."""


def _assert_same(what: str, got: torch.Tensor | None, want: torch.Tensor | None) -> None:
    if got is None or want is None:
        assert got is None and want is None, f"{what}: one is None"
        return
    assert got.dtype == want.dtype, f"{what}: dtype {got.dtype} != autocast's {want.dtype}"
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    assert torch.equal(got, want), (
        f"{what}: not bitwise autocast's, max |diff| "
        f"{(got.double() - want.double()).abs().max().item():.3g}")


def _assert_same_state(model: nn.Module, reference: nn.Module) -> None:
    """Every parameter gradient and every buffer bitwise the reference's."""
    grads = [(n, p.grad, q.grad) for (n, p), (_, q) in
             zip(model.named_parameters(), reference.named_parameters())]
    assert any(w is not None for _, _, w in grads), "no parameter received a gradient"
    differ = [n for n, g, w in grads if (g is None) != (w is None) or (
        g is not None and (g.dtype != w.dtype or not torch.equal(g, w)))]
    assert not differ, f"{len(differ)} of {len(grads)} gradients differ from autocast's, " \
                       f"first {differ[0]}: " + _why(*next((g, w) for n, g, w in grads
                                                          if n == differ[0]))
    for (name, b), (_, c) in zip(model.named_buffers(), reference.named_buffers()):
        _assert_same(f"buffer {name}", b, c)


def _why(got: torch.Tensor | None, want: torch.Tensor | None) -> str:
    if got is None or want is None:
        return "one is None"
    if got.dtype != want.dtype:
        return f"dtype {got.dtype} vs {want.dtype}"
    return f"max |diff| {(got.double() - want.double()).abs().max().item():.3g}"


def _under_autocast(fn: Callable[..., Any], dtype: torch.dtype) -> Callable[..., Any]:
    def call(*args: Any, **kwargs: Any) -> Any:
        with torch.autocast("cpu", dtype=dtype):
            return fn(*args, **kwargs)

    return call


def _reference(model: nn.Module, dtype: torch.dtype, dynamo: bool) -> Callable[..., Any]:
    return _under_autocast(torch.compile(model, backend="eager") if dynamo else model, dtype)


# -- the parity zoo ---------------------------------------------------------------------------
def _output_grads(outputs: list[torch.Tensor]) -> None:
    """Backpropagate fixed pseudo-random output gradients (the same for both runs)."""
    g = torch.Generator().manual_seed(7)
    pairs = [(o, torch.randn(o.shape, generator=g).to(o.dtype)) for o in outputs
             if o.requires_grad]
    torch.autograd.backward([o for o, _ in pairs], [d for _, d in pairs])


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPES)
@pytest.mark.parametrize("case", ZOO, ids=[c.name for c in ZOO])
def test_parity_zoo(case: ZooCase, dtype: str) -> None:
    low = DTYPES[dtype]
    torch.manual_seed(0)
    model = case.make_model().train(case.train)
    reference = copy.deepcopy(model)
    inputs = case.make_inputs()
    compiled = amprewrite.compile(model, policy=Policy.autocast("cpu", low), eager=True)
    outputs = []
    for fn in (compiled, _reference(reference, low, dynamo=False)):
        torch.manual_seed(123)  # dropout draws the same mask in both runs
        outputs.append(tensor_leaves(fn(*inputs)))
        _output_grads(outputs[-1])
    got, want = outputs
    assert compiled.amprewrite_backend.graphs
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        _assert_same(f"output {i}", g, w)
    _assert_same_state(model, reference)


# -- the HuggingFace and ecosystem zoos -------------------------------------------------------
def _train_step(entry: Any, fn: Callable[..., Any]) -> list[torch.Tensor]:
    args, kwargs = entry.example()
    out = fn(*args, **kwargs)
    entry.loss(out).backward()
    return [t.detach() for t in tensor_leaves(out)]


def _check_entry(entry: Any) -> None:
    model = entry.build().train()
    reference = copy.deepcopy(model)
    compiled = amprewrite.compile(model, policy=Policy.autocast("cpu", torch.bfloat16),
                                  eager=True)
    got = _train_step(entry, compiled)
    want = _train_step(entry, _reference(reference, torch.bfloat16,
                                         dynamo=entry.name in DYNAMO_REFERENCE))
    assert compiled.amprewrite_backend.graphs
    assert len(got) == len(want), f"{len(got)} output tensors, autocast returns {len(want)}"
    for i, (g, w) in enumerate(zip(got, want)):
        _assert_same(f"output {i}", g, w)
    _assert_same_state(model, reference)


def _hf_cases() -> list[Any]:
    try:
        from _hf_zoo import ZOO as HF_ZOO, arch
    except ImportError as exc:
        return [pytest.param(None, id="transformers",
                             marks=pytest.mark.skip(reason=f"transformers: {exc}"))]
    names = [a.name for a in HF_ZOO] if FULL else HF_MODELS
    return [pytest.param(arch(name), id=name) for name in names]


@pytest.mark.parametrize("entry", _hf_cases())
def test_hf_zoo(entry: Any) -> None:
    _check_entry(entry)


def _ecosystem_cases() -> list[Any]:
    try:
        from _ecosystem_zoo import ZOO as ECOSYSTEM_ZOO, model
        from test_ecosystem_zoo import REPRESENTATIVES
    except ImportError as exc:
        return [pytest.param(None, id="ecosystem",
                             marks=pytest.mark.skip(reason=f"the ecosystem zoo: {exc}"))]
    cases = []
    for name in [m.name for m in ECOSYSTEM_ZOO] if FULL else sorted(REPRESENTATIVES):
        entry = model(name)
        missing = entry.missing()
        cases.append(pytest.param(entry, id=name, marks=[pytest.mark.skip(reason=missing)]
                                  if missing else []))
    return cases


@pytest.mark.parametrize("entry", _ecosystem_cases())
def test_ecosystem_zoo(entry: Any) -> None:
    _check_entry(entry)

