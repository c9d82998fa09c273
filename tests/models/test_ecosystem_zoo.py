"""Every amprewrite capability on the ecosystem zoo (``_ecosystem_zoo.py``): torchvision,
timm, diffusers and the multimodal classes of transformers.

The checks are the HuggingFace zoo's (``_hf_checks.py``), one case per capability and model. A model
whose library does not import here is skipped with the import error (torchvision's wheels
load only with the torch they were built for; ``pip install 'amprewrite[zoo]'``). Cases in
``_ecosystem_gaps.KNOWN_GAPS`` are strict xfails that expect their symptom.

Conversion dominates the run time (seconds per model and column on one CPU thread), so by
default the :data:`EVERY_MODEL` columns run on every model, the others on
:data:`REPRESENTATIVES` (one model per library), and every known gap runs (so that
a fix shows as a strict XPASS). ``AMPREWRITE_ZOO_FULL=1`` runs every column on every
model.
"""

from __future__ import annotations

import os
import re

import pytest
import torch
import torch.nn as nn
from _ecosystem_gaps import KNOWN_GAPS
from _ecosystem_zoo import ZOO, Model
from _hf_checks import CAPABILITIES, CheckFailed, check_tiny_and_deterministic, run_check

MAX_PARAMETERS = 6_000_000
"""torchvision's ResNets (and GoogLeNet) have fixed stage widths of 64-512 channels: one block
per stage is 5M parameters. Every other model of the zoo has under 1M."""

EVERY_MODEL = ("preset_grads",)
"""The columns run on every model by default: bitwise parity of every parameter gradient
with torch.autocast's (forward and backward of a train-mode graph) is the check most
sensitive to a wrong rule."""

REPRESENTATIVES = frozenset({
    "tv_vit",  # nn.MultiheadAttention
    "tv_raft",  # grid sampling, a recurrent refinement loop
    "timm_eva",  # rotary position embeddings, SwiGLU
    "diffusers_unet",  # convolutions, group norms, cross-attention to text
    "hf_llava",  # a vision tower, a projector and a language model
})
"""The models every column runs on by default: one per library, the cheap to convert among
those with the most kinds of op."""

FULL = os.environ.get("AMPREWRITE_ZOO_FULL") == "1"


def _skip_reason(entry: Model, capability: str | None) -> str | None:
    missing = entry.missing()
    if missing is not None or capability is None:
        return missing
    if (FULL or capability in EVERY_MODEL or entry.name in REPRESENTATIVES
            or (entry.name, capability) in KNOWN_GAPS):  # so that a fix shows as an XPASS
        return None
    return (f"{capability} runs on the representative models by default; "
            "AMPREWRITE_ZOO_FULL=1 runs it on every model")


def _marks(entry: Model, capability: str | None) -> list[pytest.MarkDecorator]:
    if (skip := _skip_reason(entry, capability)) is not None:
        return [pytest.mark.skip(reason=skip)]
    if capability is not None and (gap := KNOWN_GAPS.get((entry.name, capability))):
        return [pytest.mark.xfail(strict=True, raises=KnownGapFailure, reason=gap.reason)]
    return []


class KnownGapFailure(AssertionError):
    """A case of ``KNOWN_GAPS`` failed with its symptom."""


def _messages(exc: BaseException | None) -> list[str]:
    """The message of ``exc`` and of each exception it was raised from."""
    messages = []
    while exc is not None:
        messages.append(f"{type(exc).__name__}: {exc}")
        exc = exc.__cause__ or exc.__context__
    return messages


def test_gaps_name_real_cases() -> None:
    names = {entry.name for entry in ZOO}
    stale = [key for key in KNOWN_GAPS if key[0] not in names or key[1] not in CAPABILITIES]
    assert not stale, f"_ecosystem_gaps names unknown models/capabilities: {stale}"


def test_the_zoo_covers_each_library_and_task() -> None:
    """torchvision: classification, segmentation, video and optical flow; 8 timm families;
    diffusers: a UNet, a VAE and a transformer; CLIP and LLaVA."""
    default = list(ZOO)
    tasks = {e.family for e in default if e.library == "torchvision"}
    assert tasks == {"classification", "segmentation", "video", "optical-flow"}, tasks
    assert sum(e.library == "torchvision" for e in default) >= 8
    assert sum(e.library == "timm" for e in default) >= 8
    assert {"diffusers_unet", "diffusers_vae", "diffusers_dit", "hf_clip", "hf_llava"} <= \
        {e.name for e in default}
    assert REPRESENTATIVES <= {e.name for e in default}


@pytest.mark.parametrize("entry", [pytest.param(e, id=e.name, marks=_marks(e, None))
                                   for e in ZOO])
def test_zoo_entry_is_tiny_and_deterministic(entry: Model) -> None:
    check_tiny_and_deterministic(entry, MAX_PARAMETERS)


def test_the_entry_check_finds_an_active_dropout() -> None:
    entry = Model("dropout", "torchvision", "classification",
                  lambda: nn.Sequential(nn.Linear(8, 4), nn.Dropout(0.5)),
                  lambda gen: ((torch.randn(2, 8, generator=gen),), {}))
    with pytest.raises(CheckFailed, match="dropout: two train-mode forwards under different "
                                          "seeds differ"):
        check_tiny_and_deterministic(entry, MAX_PARAMETERS)


@pytest.mark.parametrize("entry, capability", [
    pytest.param(e, c, id=f"{c}-{e.name}", marks=_marks(e, c)) for c in CAPABILITIES for e in ZOO])
def test_capability(entry: Model, capability: str) -> None:
    gap = KNOWN_GAPS.get((entry.name, capability))
    try:
        run_check(entry, capability)
    except Exception as exc:
        messages = _messages(exc)
        if gap is not None and any(re.search(gap.symptom, m) for m in messages):
            raise KnownGapFailure(" <- ".join(messages)) from exc
        raise
