"""torchvision's detectors as users run them, through ``amprewrite.compile``.

Faster R-CNN, RetinaNet, FCOS, SSDlite, Mask R-CNN and Keypoint R-CNN (``weights=None``) break
into 10-65 Dynamo graphs each: the transform's random resize reads ``.item()``, box decoding
and NMS have data-dependent sizes, the heads loop over images and feature levels in Python.
``torch.export`` captures none of them. Under the CPU bf16 preset, the training losses,
every parameter gradient and the inference detections are bitwise those of eager
``torch.autocast``; under the default policy the training loss and gradients are within
twice autocast's distance from fp32. The full detectors cannot be converted at O2 (that is
``convert``, which needs an export); their exportable backbone takes one SGD step there.

Small on purpose: 2 images of 64x80, ``min_size``/``max_size`` 64/96 (SSDlite's size is
fixed at 320), few proposals and detections, narrow mask and keypoint heads (one and two
convolutions of 32 channels where torchvision builds four of 256 and eight of 512: the same
layers and Python, a fraction of the arithmetic, which a CPU without native bf16 emulates),
the rewritten graphs run eagerly
(``eager=True``: Inductor would spend minutes compiling 300 graphs on a CPU). Dynamo's
tracing dominates the run time, about 10 s per detector and mode on one thread.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import pytest
import torch
import torch.nn as nn

import amprewrite
from amprewrite import Policy

PRESET = Policy.autocast("cpu", torch.bfloat16)
SIZE = dict(min_size=64, max_size=96)
"""The transform resizes images to these: small, so that the backbones run in milliseconds."""
RCNN = dict(rpn_pre_nms_top_n_train=100, rpn_post_nms_top_n_train=50,
            rpn_pre_nms_top_n_test=100, rpn_post_nms_top_n_test=50,
            box_batch_size_per_image=32, box_detections_per_img=4)
"""Fewer proposals and detections: Mask and Keypoint R-CNN post-process each detection in
a Python loop, which Dynamo unrolls."""
ONE_STAGE = dict(topk_candidates=50, detections_per_img=4)
ABS_FLOOR = 1e-5
"""Error always allowed, so that a value autocast computes exactly does not make the bound 0."""


@functools.cache
def _torchvision_missing() -> str | None:
    """Why torchvision's detectors cannot run here (no torchvision, or a wheel built for
    another torch whose C++ ops do not load), or None."""
    try:
        import torchvision  # noqa: F401

        torch.ops.torchvision.nms  # noqa: B018  (the C++ ops load with the package)
    except Exception as exc:  # noqa: BLE001  (a torch mismatch raises RuntimeError or OSError)
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        return (f"torchvision's ops do not load ({type(exc).__name__}: {first}); "
                "pip install 'amprewrite[zoo]' next to a torch it was built for")
    return None


pytestmark = [pytest.mark.usefixtures("fresh_dynamo", "one_thread"),
              pytest.mark.skipif(_torchvision_missing() is not None,
                                 reason=_torchvision_missing() or "")]


def _detector(name: str) -> nn.Module:
    from torchvision.models import detection as tv

    none = dict(weights=None, weights_backbone=None)
    builders: dict[str, Callable[[], nn.Module]] = {
        "fasterrcnn": lambda: tv.fasterrcnn_mobilenet_v3_large_fpn(
            num_classes=5, **none, **SIZE, **RCNN),
        "retinanet": lambda: tv.retinanet_resnet50_fpn(num_classes=5, **none, **SIZE,
                                                       **ONE_STAGE),
        "fcos": lambda: tv.fcos_resnet50_fpn(num_classes=5, **none, **SIZE, **ONE_STAGE),
        "ssdlite": lambda: tv.ssdlite320_mobilenet_v3_large(num_classes=5, **none,
                                                            **ONE_STAGE),
        "maskrcnn": lambda: _narrow_heads(tv.maskrcnn_resnet50_fpn(
            num_classes=5, **none, **SIZE, **RCNN)),
        "keypointrcnn": lambda: _narrow_heads(tv.keypointrcnn_resnet50_fpn(
            num_classes=2, num_keypoints=3, **none, **SIZE, **RCNN)),
    }
    torch.manual_seed(0)
    return builders[name]()


def _narrow_heads(model: nn.Module) -> nn.Module:
    """The mask or keypoint head of a built detector replaced by a narrow one, seeded: the
    builders take no head with ``num_classes`` given, so they are swapped after."""
    from torchvision.models.detection import keypoint_rcnn, mask_rcnn

    heads = model.roi_heads
    torch.manual_seed(1)
    if heads.mask_head is not None:
        heads.mask_head = mask_rcnn.MaskRCNNHeads(256, [32], 1)
        heads.mask_predictor = mask_rcnn.MaskRCNNPredictor(32, 32, 5)
    if heads.keypoint_head is not None:
        heads.keypoint_head = keypoint_rcnn.KeypointRCNNHeads(256, [32, 32])
        heads.keypoint_predictor = keypoint_rcnn.KeypointRCNNPredictor(32, 3)
    return model


DETECTORS = ["fasterrcnn", "retinanet", "fcos", "ssdlite", "maskrcnn", "keypointrcnn"]


def _batch(name: str) -> tuple[list[torch.Tensor], list[dict[str, torch.Tensor]]]:
    """Two 64x80 images and their targets: three boxes each, 8-28 pixels wide and high,
    inside the image; masks and keypoints for the detectors that learn them."""
    g = torch.Generator().manual_seed(1)
    images = [torch.rand(3, 64, 80, generator=g) for _ in range(2)]
    classes = 2 if name == "keypointrcnn" else 5
    targets = []
    for _ in images:
        corner = torch.rand(3, 2, generator=g) * torch.tensor([50.0, 35.0])
        size = 8 + torch.rand(3, 2, generator=g) * 20
        target = {"boxes": torch.cat([corner, corner + size], 1),
                  "labels": torch.randint(1, classes, (3,), generator=g)}
        if name == "maskrcnn":
            target["masks"] = (torch.rand(3, 64, 80, generator=g) > 0.5).to(torch.uint8)
        if name == "keypointrcnn":
            xy = corner[:, None] + torch.rand(3, 3, 2, generator=g) * size[:, None]
            target["keypoints"] = torch.cat([xy, torch.ones(3, 3, 1)], 2)
        targets.append(target)
    return images, targets


def _under_autocast(model: nn.Module) -> Callable[..., Any]:
    def call(*args: Any) -> Any:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return model(*args)

    return call


def _train_step(model: nn.Module, call: Callable[..., Any], name: str
                ) -> tuple[dict[str, torch.Tensor], list[torch.Tensor | None]]:
    """The loss dict of one training forward (their sum backpropagated) and every
    parameter's gradient. Seeded: the transform draws a size, the samplers draw boxes."""
    images, targets = _batch(name)
    model.train()
    torch.manual_seed(2)
    losses = call(images, targets)
    sum(losses.values()).backward()
    return ({k: v.detach() for k, v in losses.items()},
            [p.grad for p in model.parameters()])


def _detect(model: nn.Module, call: Callable[..., Any], name: str
            ) -> list[dict[str, torch.Tensor]]:
    images, _ = _batch(name)
    model.eval()
    torch.manual_seed(2)
    with torch.no_grad():
        return call(images)


def _graphs(compiled: nn.Module) -> int:
    return len(compiled.amprewrite_backend.graphs)


@pytest.mark.parametrize("name", DETECTORS)
def test_training_is_bitwise_with_autocast_under_the_preset(name: str) -> None:
    reference, model = _detector(name), _detector(name)
    want_losses, want_grads = _train_step(reference, _under_autocast(reference), name)
    compiled = amprewrite.compile(model, policy=PRESET, eager=True)
    losses, grads = _train_step(model, compiled, name)
    assert _graphs(compiled) > 1  # graph breaks: Python runs between the rewritten graphs
    assert losses.keys() == want_losses.keys()
    for key, loss in losses.items():
        assert loss.dtype == want_losses[key].dtype == torch.float32, key
        assert torch.equal(loss, want_losses[key]), (key, loss.item(), want_losses[key].item())
    names = [n for n, _ in model.named_parameters()]
    missing = [n for n, g, w in zip(names, grads, want_grads) if (g is None) != (w is None)]
    assert not missing
    differ = [n for n, g, w in zip(names, grads, want_grads)
              if g is not None and (g.dtype != w.dtype or not torch.equal(g, w))]
    assert not differ, f"{len(differ)} of {len(names)} gradients differ, first {differ[:3]}"
    assert all(p.dtype == torch.float32 for p in model.parameters())


@pytest.mark.parametrize("name", DETECTORS)
def test_inference_is_bitwise_with_autocast_under_the_preset(name: str) -> None:
    reference, model = _detector(name), _detector(name)
    want = _detect(reference, _under_autocast(reference), name)
    compiled = amprewrite.compile(model, policy=PRESET, eager=True)
    got = _detect(model, compiled, name)
    assert _graphs(compiled) > 1
    assert len(got) == len(want) == 2
    assert want[0]["boxes"].dtype == torch.bfloat16  # the box head's dtype under autocast
    for image, (ours, theirs) in enumerate(zip(got, want)):
        assert ours.keys() == theirs.keys()
        for key, value in ours.items():
            assert value.dtype == theirs[key].dtype, (image, key)
            assert value.shape == theirs[key].shape, (image, key)
            assert torch.equal(value, theirs[key]), (image, key)


def _flat_grads(grads: list[torch.Tensor | None]) -> torch.Tensor:
    return torch.cat([g.double().flatten() for g in grads if g is not None])


def test_default_policy_trains_within_autocasts_error() -> None:
    """The default policy (CUDA AMP rules on a CPU model) is not autocast's CPU list, and
    its graphs hand fp32 to the Python between them; it stays as close to fp32 as autocast:
    the summed loss, and all gradients as one vector. (One detector: the others measure
    alike, and each costs a Dynamo trace.)"""
    name = "fasterrcnn"
    fp32, reference, model = _detector(name), _detector(name), _detector(name)
    exact_losses, exact_grads = _train_step(fp32, fp32, name)
    autocast_losses, autocast_grads = _train_step(reference, _under_autocast(reference), name)
    compiled = amprewrite.compile(model, eager=True)
    losses, grads = _train_step(model, compiled, name)
    exact, autocast, ours = (sum(v.double() for v in d.values())
                             for d in (exact_losses, autocast_losses, losses))
    err, err_autocast = (ours - exact).abs().item(), (autocast - exact).abs().item()
    assert 0 < err <= 2 * err_autocast + ABS_FLOOR, (err, err_autocast)
    g_exact = _flat_grads(exact_grads)
    g_err = (_flat_grads(grads) - g_exact).norm().item()
    g_err_autocast = (_flat_grads(autocast_grads) - g_exact).norm().item()
    assert 0 < g_err <= 2 * g_err_autocast, (g_err, g_err_autocast)


def test_an_o2_step_on_the_exportable_backbone() -> None:
    """O2 is ``convert``'s: it needs ``torch.export``, which captures RetinaNet's ResNet-50 +
    FPN backbone but not the detector. bf16 weights, fp32 masters bound with MasterWeights,
    one SGD step: the loss is O1's to bf16 weights' precision, the masters stay fp32 and
    move, and the next forward reads the refreshed copies."""
    backbone = _detector("retinanet").backbone.train()
    x = torch.randn(2, 3, 64, 96, generator=torch.Generator().manual_seed(3))

    def loss_of(features: dict[str, torch.Tensor]) -> torch.Tensor:
        return sum(f.float().square().mean() for f in features.values())

    with torch.no_grad():
        o1 = loss_of(amprewrite.convert(backbone, (x,))(x)).item()
    gm = amprewrite.convert(backbone, (x,), opt_level="O2", dtype=torch.bfloat16)
    opt = torch.optim.SGD(gm.parameters(), lr=0.1)
    amprewrite.MasterWeights(gm, opt)
    before = {n: p.detach().clone() for n, p in gm.named_parameters()}
    loss = loss_of(gm(x))
    assert abs(loss.item() - o1) <= 0.05 * abs(o1), (loss.item(), o1)
    loss.backward()
    opt.step()
    assert all(p.dtype == torch.float32 for p in gm.parameters())
    trained = [(n, p) for n, p in gm.named_parameters() if p.grad is not None]
    assert len(trained) == len(before)
    for n, p in trained:  # SGD's fp32 update of the master, with its fp32 gradient
        assert p.grad.dtype == torch.float32, n
        assert torch.equal(p, before[n].add(p.grad, alpha=-0.1)), n
    assert any(not torch.equal(p, before[n]) for n, p in trained)
    with torch.no_grad():
        after = loss_of(gm(x)).item()
    assert after != loss.item()
