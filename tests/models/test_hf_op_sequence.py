"""CUDA autocast's op sequence on the HuggingFace zoo, without a GPU: each architecture,
converted with ``Policy.autocast("cuda", d)`` (export capture, the route of real models),
runs forward and backward the ATen ops of ``torch.autocast("cuda", dtype=d)`` on the same
dtypes in the same order, on fake CUDA tensors (see ``_op_sequence``).

The default run checks four architectures (about 5 s each per dtype on two CPU cores);
``AMPREWRITE_FULL_ZOO=1`` checks every architecture (about 5 minutes).
"""

from __future__ import annotations

import os

import pytest
import torch
from _versions import TORCH_RELEASE

pytest.importorskip("transformers")

from _hf_zoo import ZOO, Arch, tensor_leaves  # noqa: E402
from _op_sequence import (  # noqa: E402
    CUDA_BUILD_ONLY,
    FakeCudaModel,
    autocast_sequence,
    converted_sequence,
    sequence_diff,
)

import amprewrite  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}

REPRESENTATIVE = ("gpt2_labels", "qwen3", "bert", "resnet")
"""A decoder that computes its loss inside (``F.cross_entropy``, split as CUDA autocast
splits it), a decoder whose code reads dtypes off its tensors (``.to(input_dtype)`` in its
q/k norms: the AMP regime of the capture), an encoder and a convolutional network."""

FULL = os.environ.get("AMPREWRITE_FULL_ZOO") == "1"

_MASK_ON_TRACING = (
    "under torch.export, transformers builds the attention mask on its tracing path: a "
    "float mask of zeros that eager skips, added to the scores (or position bias), so the "
    "converted graph adds zeros where eager autocast upcasts; the values agree")
KNOWN_GAPS: dict[str, str] = dict.fromkeys(("vit", "beit", "dinov2", "wav2vec2"),
                                           _MASK_ON_TRACING)
"""architecture -> why its op sequence differs (a strict xfail)."""

_REAL_CUDA = "the model's code makes a real CUDA call (no fake tensor can stand in for it): "
SKIPS: dict[str, str] = {
    "falcon": _REAL_CUDA + "a tensor created on the device in _split_heads",
    "opt_cache": _REAL_CUDA + "the KV cache's lazy initialisation",
    "mixtral": _REAL_CUDA + "the grouped-matmul experts ask the device's capability",
    "qwen2_moe": _REAL_CUDA + "the grouped-matmul experts ask the device's capability",
    "deberta_v2": _REAL_CUDA + "a tensor created on the device for relative positions",
    "segformer": "the meta replay gives a convolution's output other strides than CUDA's, "
                 "and a view of it fails",
    "bloom": "its GeLU is a custom torch.autograd.Function: the replay differentiates the "
             "recorded forward ops, so the Function's own backward is invisible to it "
             "(test_hf_zoo's preset_grads covers it)",
}
"""architecture -> why the fake-CUDA oracle cannot check it."""

_OLD_MAKE_FX = (
    "torch 2.11 without a GPU: make_fx computes a one-element constant the model creates on "
    "its device (transformers' masks: torch.tensor(0.0, device=...)) as a real tensor there; "
    "torch 2.12 and newer keep it fake")


_OLD_MAKE_FX_GPU = (
    "torch 2.11 with a GPU (measured on an H100): the mask constants transformers creates on "
    "the device are real CUDA tensors under make_fx, and its masking code then builds the "
    "float mask with where() where eager autocast allocates it empty; the values agree")


def _gap(arch: Arch) -> str | None:
    if arch.name in KNOWN_GAPS:
        return KNOWN_GAPS[arch.name]
    if TORCH_RELEASE < (2, 12) and arch.family != "vision" and torch.cuda.is_available():
        return _OLD_MAKE_FX_GPU
    return None


def _skip_reason(arch: Arch) -> str | None:
    if arch.name in SKIPS:
        return SKIPS[arch.name]
    if TORCH_RELEASE < (2, 12) and arch.family != "vision" and not torch.cuda.is_available():
        return _OLD_MAKE_FX
    return None


def _cases() -> list:
    cases = []
    for arch in ZOO:
        if not FULL and arch.name not in REPRESENTATIVE:
            continue
        for dtype in DTYPES:
            skip, gap = _skip_reason(arch), _gap(arch)
            marks = [pytest.mark.skip(reason=skip)] if skip else \
                [pytest.mark.xfail(strict=True, reason=gap)] if gap else []
            cases.append(pytest.param(arch, dtype, marks=marks, id=f"{arch.name}-{dtype}"))
    return cases


def test_representatives_are_zoo_architectures() -> None:
    names = {arch.name for arch in ZOO}
    assert set(REPRESENTATIVE) <= names and set(KNOWN_GAPS) | set(SKIPS) <= names
    assert not set(REPRESENTATIVE) & (set(KNOWN_GAPS) | set(SKIPS))


@CUDA_BUILD_ONLY
@pytest.mark.parametrize("arch,dtype", _cases())
def test_cuda_preset_runs_cuda_autocast_op_sequence(arch: Arch, dtype: str) -> None:
    low = DTYPES[dtype]
    args, kwargs = arch.example()
    fake = FakeCudaModel.of(arch.build().train(), args, kwargs, leaves=tensor_leaves)
    want = autocast_sequence(fake, low)
    gm = amprewrite.convert(fake.model, fake.inputs, example_kwargs=fake.kwargs,
                            policy=amprewrite.Policy.autocast("cuda", low))
    got = converted_sequence(fake, gm)
    diff = sequence_diff(got, want)
    assert not diff, f"{arch.name} ({dtype}): the op sequence differs from " \
                     f"torch.autocast('cuda'):\n{diff}"
