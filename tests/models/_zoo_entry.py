"""What the model zoos of the test suite share: an entry's interface, and how a model's output
becomes the tensors to compare and a training loss.

A zoo entry (:class:`ZooEntry`) builds a fresh, seeded model and fresh example inputs, and says
which tensor of the output to compare and how to compute a loss from it. The checks of
``_hf_checks.py`` run on any entry: ``_hf_zoo.py`` defines the ``transformers`` zoo and
``_ecosystem_zoo.py`` the torchvision, timm, diffusers and multimodal one. Nothing here imports
a model library.
"""

from __future__ import annotations

import sys
from typing import Any, Callable, Protocol

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["Example", "ZooEntry", "cross_entropy_on", "field", "itself", "mean_square_of",
           "model_loss", "tensor_leaves"]

Example = tuple[tuple[Any, ...], dict[str, Any]]
"""Positional and keyword arguments of one forward call."""


class ZooEntry(Protocol):
    """One model of a zoo, as the checks see it."""

    @property
    def name(self) -> str:
        """The id used in test ids and in the zoo's list of known gaps."""

    @property
    def family(self) -> str:
        """What kind of model it is (decoder, vision, segmentation, ...)."""

    @property
    def output(self) -> Callable[[Any], torch.Tensor]:
        """Reads the tensor to compare (logits, a sample, a flow field) off the output."""

    @property
    def loss(self) -> Callable[[Any], torch.Tensor]:
        """A scalar fp32 training loss computed from the output."""

    def build(self) -> nn.Module:
        """A fresh model in eval mode; equal parameters on every call."""

    def example(self) -> Example:
        """Fresh example inputs; equal values on every call."""


# -- reading outputs --------------------------------------------------------------------------


def tensor_leaves(out: Any) -> list[torch.Tensor]:
    """Every tensor in a model output, in a fixed order: ModelOutputs and other dicts,
    sequences, and ``transformers`` KV caches (whose pytree registration depends on whether
    ``torch.export`` has run)."""
    if isinstance(out, torch.Tensor):
        return [out]
    # An output can only hold a transformers cache when transformers is imported: no import
    # here, so the zoos of other libraries run without it.
    transformers = sys.modules.get("transformers")
    if transformers is not None and isinstance(out, transformers.cache_utils.Cache):
        return [t for layer in out.layers for t in tensor_leaves([layer.keys, layer.values])]
    if isinstance(out, dict):  # ModelOutput and diffusers' BaseOutput are OrderedDicts
        return [t for value in out.values() for t in tensor_leaves(value)]
    if isinstance(out, (list, tuple)):
        return [t for value in out for t in tensor_leaves(value)]
    return []


def field(name: str) -> Callable[[Any], torch.Tensor]:
    """Reads ``out[name]`` (a ModelOutput field, a key of a segmentation model's dict)."""

    def read(out: Any) -> torch.Tensor:
        return out[name]

    read.__name__ = f"read_{name}"
    return read


def itself(out: torch.Tensor) -> torch.Tensor:
    """The output is the tensor (plain classifiers)."""
    return out


# -- losses -----------------------------------------------------------------------------------


def _fixed_targets(shape: torch.Size, classes: int) -> torch.Tensor:
    return torch.randint(0, classes, shape, generator=torch.Generator().manual_seed(1))


def cross_entropy_on(read: Callable[[Any], torch.Tensor],
                     class_dim: int = -1) -> Callable[[Any], torch.Tensor]:
    """Cross-entropy of the tensor ``read`` returns against fixed pseudo-random classes,
    computed in fp32 whatever the output dtype."""

    def loss(out: Any) -> torch.Tensor:
        scores = read(out).float().movedim(class_dim, -1)
        targets = _fixed_targets(scores.shape[:-1], scores.shape[-1]).to(scores.device)
        return F.cross_entropy(scores.reshape(-1, scores.shape[-1]), targets.reshape(-1))

    return loss


def mean_square_of(read: Callable[[Any], torch.Tensor]) -> Callable[[Any], torch.Tensor]:
    """Mean square of a feature tensor in fp32: a loss for headless models, denoisers and
    flow fields (their regression loss against a zero target)."""

    def loss(out: Any) -> torch.Tensor:
        return read(out).float().pow(2).mean()

    return loss


def model_loss(out: Any) -> torch.Tensor:
    """The loss the model computed itself (from ``labels``, or CLIP's ``return_loss``)."""
    return out["loss"].float()
