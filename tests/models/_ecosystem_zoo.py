"""A zoo of models from the rest of the PyTorch ecosystem in tiny random configurations:
torchvision (classification, segmentation, video, optical flow), timm (one entry per
architecture family), diffusers (a UNet, a VAE, diffusion transformers) and the multimodal
classes of ``transformers`` (CLIP, LLaVA).

Every entry is a :class:`Model`, a ``_zoo_entry.ZooEntry``: the checks of ``_hf_checks.py``
run on it. ``_ecosystem_models.py`` builds the models with the library's own classes and
builders (``weights=None``, ``pretrained=False``: nothing is downloaded), here under
``torch.manual_seed(0)``, so two builds are equal; every dropout and drop-path rate is 0, so
train mode is deterministic. Stages are one block deep and channels 8-64 wide where the class
allows it (graph size is what conversion time depends on); inputs are 32x32 images (64x64
where the model downsamples by 32 or needs attention windows), batches of 2.

The libraries are imported when a model is built, so the zoo is importable without them;
:meth:`Model.missing` says why an entry cannot be built here.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
from typing import Any, Callable

import _ecosystem_models as build
import torch
import torch.nn as nn
from _ecosystem_models import IMAGE_TOKEN, PATCHES, VOCAB
from _zoo_entry import Example, cross_entropy_on, field, itself, mean_square_of, model_loss

__all__ = ["FAMILIES", "LIBRARIES", "Model", "ZOO", "model"]

FAMILIES = ("classification", "segmentation", "video", "optical-flow", "diffusion",
            "multimodal")
LIBRARIES = ("torchvision", "timm", "diffusers", "transformers")

BATCH = 2


@dataclasses.dataclass(frozen=True)
class Model:
    """One model of the zoo.

    Attributes:
        name: the id used in test ids and in ``_ecosystem_gaps.py``.
        library: the package the model comes from (one of :data:`LIBRARIES`).
        family: one of :data:`FAMILIES`.
        make: builds the model (imports the library).
        inputs: builds the example call from a seeded generator.
        output: reads the tensor to compare off the output.
        loss: a scalar fp32 training loss computed from the output.
    """

    name: str
    library: str
    family: str
    make: Callable[[], nn.Module]
    inputs: Callable[[torch.Generator], Example]
    output: Callable[[Any], torch.Tensor] = itself
    loss: Callable[[Any], torch.Tensor] = cross_entropy_on(itself)

    def build(self) -> nn.Module:
        """A fresh model in eval mode; equal parameters on every call."""
        torch.manual_seed(0)
        return self.make().eval()

    def example(self) -> Example:
        """Fresh example inputs; equal values on every call."""
        return self.inputs(torch.Generator().manual_seed(0))

    def missing(self) -> str | None:
        """Why this entry cannot be built here (its library does not import), or None."""
        return _import_error(self.library)


@functools.cache
def _import_error(library: str) -> str | None:
    try:
        importlib.import_module(library)
    except Exception as exc:  # noqa: BLE001  (torchvision raises RuntimeError on a torch mismatch)
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        return (f"{library} does not import ({type(exc).__name__}: {first}); "
                "pip install 'amprewrite[zoo]' next to a torch it was built for")
    return None


# -- inputs -----------------------------------------------------------------------------------


def images(size: int = 32) -> Callable[[torch.Generator], Example]:
    def inputs(gen: torch.Generator) -> Example:
        return (torch.randn(BATCH, 3, size, size, generator=gen),), {}

    return inputs


def clips(gen: torch.Generator) -> Example:
    """Video: (batch, channels, frames, height, width); 16x16 frames, as 3D convolutions cost
    a frame's worth of 2D ones per frame."""
    return (torch.randn(BATCH, 3, 4, 16, 16, generator=gen),), {}


def image_pairs(gen: torch.Generator) -> Example:
    """Two frames for optical flow, and two refinement steps instead of RAFT's 12."""
    first, second = (torch.randn(BATCH, 3, 32, 32, generator=gen) for _ in range(2))
    return (first, second), {"num_flow_updates": 2}


def _timesteps() -> torch.Tensor:
    return torch.tensor([10, 500])


def unet_inputs(gen: torch.Generator) -> Example:
    """Latents, timesteps and a text encoder's hidden states (7 tokens of width 32)."""
    return ((torch.randn(BATCH, 4, 16, 16, generator=gen), _timesteps()),
            {"encoder_hidden_states": torch.randn(BATCH, 7, 32, generator=gen)})


def dit_inputs(gen: torch.Generator) -> Example:
    return ((torch.randn(BATCH, 4, 8, 8, generator=gen),),
            {"timestep": _timesteps(), "class_labels": torch.tensor([1, 3])})


def sd3_inputs(gen: torch.Generator) -> Example:
    return ((torch.randn(BATCH, 4, 8, 8, generator=gen),),
            {"encoder_hidden_states": torch.randn(BATCH, 6, 32, generator=gen),
             "pooled_projections": torch.randn(BATCH, 16, generator=gen),
             "timestep": _timesteps()})


def clip_inputs(gen: torch.Generator) -> Example:
    ids = torch.randint(3, VOCAB, (BATCH, 12), generator=gen)
    mask = torch.ones(BATCH, 12, dtype=torch.long)
    mask[1, 9:] = 0
    return (), {"input_ids": ids, "pixel_values": torch.randn(BATCH, 3, 32, 32, generator=gen),
                "attention_mask": mask, "return_loss": True}


def llava_inputs(gen: torch.Generator) -> Example:
    """A prompt with one image's tokens after 4 text tokens, as a processor lays it out."""
    ids = torch.randint(3, IMAGE_TOKEN, (BATCH, 4 + PATCHES + 6), generator=gen)
    ids[:, 4:4 + PATCHES] = IMAGE_TOKEN
    return (), {"input_ids": ids, "pixel_values": torch.randn(BATCH, 3, 32, 32, generator=gen),
                "attention_mask": torch.ones_like(ids)}


# -- the zoo ----------------------------------------------------------------------------------

sample = field("sample")
logits = field("logits")


def last_flow(out: list[torch.Tensor]) -> torch.Tensor:
    """RAFT returns the flow after each refinement step; the last one is the prediction."""
    return out[-1]


def _classifier(make: Callable[[], nn.Module], library: str,
                inputs: Callable[[torch.Generator], Example] = images()) -> Model:
    return Model(make.__name__, library, "classification", make, inputs)


def _denoiser(make: Callable[[], nn.Module],
              inputs: Callable[[torch.Generator], Example]) -> Model:
    return Model(make.__name__, "diffusers", "diffusion", make, inputs, sample,
                 mean_square_of(sample))


ZOO: tuple[Model, ...] = (
    # -- torchvision ------------------------------------------------------------------------
    *(_classifier(make, "torchvision") for make in (
        build.tv_resnet, build.tv_mobilenet_v3, build.tv_efficientnet, build.tv_convnext,
        build.tv_regnet, build.tv_shufflenet, build.tv_densenet,
        build.tv_vit,  # nn.MultiheadAttention
        build.tv_swin, build.tv_googlenet)),
    Model("tv_lraspp", "torchvision", "segmentation", build.tv_lraspp, images(64), field("out"),
          cross_entropy_on(field("out"), class_dim=1)),
    Model("tv_video_resnet", "torchvision", "video", build.tv_video_resnet, clips),
    Model("tv_mvit", "torchvision", "video", build.tv_mvit, clips),
    Model("tv_raft", "torchvision", "optical-flow", build.tv_raft, image_pairs, last_flow,
          mean_square_of(last_flow)),
    # -- timm -------------------------------------------------------------------------------
    *(_classifier(make, "timm") for make in (
        build.timm_vit, build.timm_eva, build.timm_convnext, build.timm_resnet,
        build.timm_efficientnet, build.timm_mixer, build.timm_nfnet)),
    *(_classifier(make, "timm", images(64)) for make in (  # downsample by 32 or window
        build.timm_coatnet, build.timm_levit, build.timm_efficientformerv2)),
    _classifier(build.timm_poolformer, "timm"),
    _classifier(build.timm_swin, "timm"),
    _classifier(build.timm_ghostnetv2, "timm", images(64)),
    _classifier(build.timm_sequencer2d, "timm"),
    # -- diffusers --------------------------------------------------------------------------
    _denoiser(build.diffusers_unet, unet_inputs),
    Model("diffusers_vae", "diffusers", "diffusion", build.diffusers_vae, images(32), sample,
          mean_square_of(sample)),  # reconstruction from the posterior's mode
    _denoiser(build.diffusers_dit, dit_inputs),
    _denoiser(build.diffusers_sd3, sd3_inputs),
    # -- transformers' multimodal classes ---------------------------------------------------
    Model("hf_clip", "transformers", "multimodal", build.hf_clip, clip_inputs,
          field("logits_per_image"), model_loss),  # CLIP's contrastive loss
    Model("hf_llava", "transformers", "multimodal", build.hf_llava, llava_inputs, logits,
          cross_entropy_on(logits)),
)

_BY_NAME = {m.name: m for m in ZOO}
assert len(_BY_NAME) == len(ZOO), "model names must be unique"
assert all(m.family in FAMILIES and m.library in LIBRARIES for m in ZOO)


def model(name: str) -> Model:
    """The zoo entry called ``name``."""
    try:
        return _BY_NAME[name]
    except KeyError:
        raise KeyError(f"no model {name!r} in the zoo; known: {', '.join(_BY_NAME)}") from None
