"""Training with converted modules: loss scaling, O2 master weights, recipes, convergence.

Covers the Mixed Precision Training paper's two failure modes (gradient underflow without
loss scaling; weight updates lost in fp16 weights), GradScaler recipes (clipping after
``unscale_``, gradient accumulation, two losses and optimizers, checkpoint and resume),
parity of O1 gradients with ``torch.autocast``, and ScalerMonitor's records and warnings.
"""

from __future__ import annotations

import copy
import importlib.util
import io
import math
import pathlib
import sys
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import amprewrite
from amprewrite import Policy
from amprewrite.runtime.low_copies import LOW_COPIES_ATTR

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


pytestmark = pytest.mark.usefixtures("one_thread")


class Net(nn.Module):
    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.fc1 = nn.Linear(8, 32)
        self.norm = nn.LayerNorm(32)
        self.fc2 = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.norm(F.gelu(self.fc1(x))))


class TwoHeads(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(8, 4)
        self.b = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.a(x), self.b(x)


def batch(step: int, n: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(n, 8, generator=g), torch.randint(0, 4, (n,), generator=g)


X, Y = batch(0)


def o2(model: nn.Module, dtype: torch.dtype = torch.float16) -> torch.fx.GraphModule:
    return amprewrite.convert(model, (X,), opt_level="O2", dtype=dtype)


def grads(module: nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() for p in module.parameters()]


_SAME_WIDTH_INT = {torch.float32: torch.int32, torch.float16: torch.int16,
                   torch.bfloat16: torch.int16}


def bitwise(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    """Same dtypes and the same bits (NaN payloads included, unlike torch.equal)."""
    return len(a) == len(b) and all(
        x.dtype == y.dtype and torch.equal(x.view(_SAME_WIDTH_INT[x.dtype]),
                                           y.view(_SAME_WIDTH_INT[y.dtype]))
        for x, y in zip(a, b))


def copies_follow_masters(gm: torch.fx.GraphModule, dtype: torch.dtype, x: torch.Tensor) -> bool:
    """Whether the next forward reads copies equal to the masters cast (a step only marks the
    copies stale: the forward brings them up to date)."""
    with torch.no_grad():
        gm(x)
    pairs = getattr(gm, LOW_COPIES_ATTR).copies()
    return bool(pairs) and all(torch.equal(c, m.detach().to(dtype)) for m, c in pairs)


# -- convergence ------------------------------------------------------------------------------
def _example():
    path = pathlib.Path(__file__).resolve().parents[1] / "examples" / "train.py"
    spec = importlib.util.spec_from_file_location("amprewrite_example_train", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_every_variant_trains_like_fp32() -> None:
    example = _example()
    results = {v.name: example.train(v, steps=300) for v in example.VARIANTS}
    fp32 = results["fp32"]
    assert fp32.loss < 0.6 < math.log(4) and fp32.accuracy > 0.75  # it learned something
    for name in ("O1 fp16 + scaler", "O1 bf16", "O2 fp16 + scaler"):
        assert abs(results[name].loss - fp32.loss) / fp32.loss < 0.02, (name, results)
    assert math.isfinite(results["O3 fp16"].loss)


@CUDA
def test_o2_trains_like_fp32_on_cuda() -> None:
    example = _example()
    fp32 = example.train(example.VARIANTS[0], steps=200, device="cuda")
    for variant in example.VARIANTS[1:4]:
        result = example.train(variant, steps=200, device="cuda")
        assert abs(result.loss - fp32.loss) / fp32.loss < 0.02, (variant, result, fp32)


# -- the paper's failure modes ----------------------------------------------------------------
def _train_tiny_loss(scaler: torch.amp.GradScaler | None, dtype: torch.dtype | None,
                     steps: int = 30) -> tuple[amprewrite.ScalerMonitor, float, float, bool]:
    """A loss whose gradients (~1e-9) are below fp16's smallest subnormal (6e-8)."""
    model = Net()
    gm = amprewrite.convert(model, (X,), opt_level="O0" if dtype is None else "O1",
                            dtype=dtype)
    opt = torch.optim.Adam(gm.parameters(), lr=1e-2)  # Adam: insensitive to the grads' size
    start = copy.deepcopy(model.state_dict())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        monitor = amprewrite.ScalerMonitor(gm, opt, scaler)

    def loss_of(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return 1e-7 * F.cross_entropy(gm(x).float(), y)

    first = loss_of(X, Y).item()
    for _ in range(steps):
        loss = loss_of(X, Y)
        (scaler.scale(loss) if scaler else loss).backward()
        scaler.step(opt) if scaler else opt.step()
        monitor.update()
        opt.zero_grad()
    moved = any(not torch.equal(v, start[k]) for k, v in model.state_dict().items())
    return monitor, first, loss_of(X, Y).item(), moved


def test_fp16_gradients_underflow_without_loss_scaling() -> None:
    monitor, first, last, moved = _train_tiny_loss(None, torch.float16)
    assert all(r.zero_fraction == 1.0 for r in monitor.history)  # every gradient is 0
    assert not moved and last == first  # training stalled, silently
    monitor, first, last, moved = _train_tiny_loss(None, None)  # fp32 for reference
    assert monitor.history[0].zero_fraction == 0.0 and last < 0.9 * first


def test_dynamic_loss_scaling_recovers_the_gradients() -> None:
    monitor, first, last, moved = _train_tiny_loss(torch.amp.GradScaler("cpu"), torch.float16)
    assert monitor.history[0].scale == 2.0 ** 16
    assert all(r.zero_fraction < 0.05 for r in monitor.history)
    assert moved and last < 0.9 * first


def test_updates_below_half_an_ulp_need_fp32_masters() -> None:
    """w = 1.0, each step subtracts lr * grad = 1e-4 < half an fp16 ulp at 1.0 (2**-11)."""
    x = torch.ones(4, 4)

    def run(opt_level: str) -> tuple[torch.fx.GraphModule, nn.Module]:
        model = nn.Linear(4, 1, bias=False)
        nn.init.ones_(model.weight)
        gm = amprewrite.convert(model, (x,), opt_level=opt_level,
                                dtype=None if opt_level == "O0" else torch.float16)
        opt = torch.optim.SGD(gm.parameters(), lr=1e-4)
        if opt_level == "O2":
            amprewrite.MasterWeights(gm, opt)
        for _ in range(50):
            gm(x).mean().backward()  # d/dw = 1.0 exactly, in fp16 as in fp32
            opt.step()
            opt.zero_grad()
        return gm, model

    o3, _ = run("O3")
    assert torch.equal(o3.get_parameter("weight"), torch.ones(1, 4, dtype=torch.float16))
    o2_gm, o2_model = run("O2")
    _, fp32 = run("O0")
    assert o2_model.weight.dtype == torch.float32
    assert torch.equal(o2_model.weight, fp32.weight)  # the fp32 masters kept every update
    assert abs(o2_model.weight[0, 0].item() - 0.995) < 1e-5
    assert copies_follow_masters(o2_gm, torch.float16, x)


# -- parity with torch.autocast ---------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_o1_gradients_equal_autocast_bitwise(dtype: torch.dtype) -> None:
    model, reference = Net(), Net()
    gm = amprewrite.convert(model, (X,), policy=Policy.autocast("cpu", dtype))
    opt = torch.optim.SGD(gm.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    scaler, ref_scaler = (torch.amp.GradScaler("cpu", init_scale=2.0 ** 8, growth_interval=2)
                          for _ in range(2))
    for step in range(4):
        x, y = batch(step)
        loss = F.cross_entropy(gm(x), y)
        with torch.autocast("cpu", dtype=dtype):
            out = reference(x)
        ref_loss = F.cross_entropy(out, y)
        assert torch.equal(loss, ref_loss)
        scaler.scale(loss).backward()
        ref_scaler.scale(ref_loss).backward()
        assert all(g.isfinite().all() for g in grads(model)), step  # a real step, not a skip
        assert bitwise(grads(model), grads(reference)), step
        for s, o in ((scaler, opt), (ref_scaler, ref_opt)):
            s.step(o)
            s.update()
            o.zero_grad()
    assert bitwise(list(model.parameters()), list(reference.parameters()))


# -- recipes ----------------------------------------------------------------------------------
def test_clipping_after_unscale_sees_true_fp32_gradients() -> None:
    # bf16 has fp32's exponent range: scaling by 2**10 then unscaling is exact, so the
    # unscaled master gradients must equal those of an unscaled backward bit for bit.
    model = Net()
    gm = o2(model, torch.bfloat16)
    opt = torch.optim.SGD(gm.parameters(), lr=0.1)
    amprewrite.MasterWeights(gm, opt)
    F.cross_entropy(gm(X), Y).backward()
    plain = grads(gm)
    opt.zero_grad()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    scaler.scale(F.cross_entropy(gm(X), Y)).backward()
    assert not bitwise(grads(gm), plain)  # still scaled
    scaler.unscale_(opt)
    assert bitwise(grads(gm), plain) and all(g.dtype == torch.float32 for g in plain)
    total = torch.nn.utils.clip_grad_norm_(gm.parameters(), max_norm=0.05)
    assert total.item() > 0.05
    clipped = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g)
                                                    for g in grads(gm)]))
    assert clipped.item() <= 0.05 * (1 + 1e-5)
    before = [p.detach().clone() for p in gm.parameters()]
    scaler.step(opt)
    scaler.update()
    assert not bitwise([p.detach() for p in gm.parameters()], before)
    assert copies_follow_masters(gm, torch.bfloat16, X)


def test_gradient_accumulation_sums_in_fp32_masters() -> None:
    model = Net()
    gm = o2(model)
    opt = torch.optim.SGD(gm.parameters(), lr=0.1)
    amprewrite.MasterWeights(gm, opt)
    scaler = torch.amp.GradScaler("cpu")
    monitor = amprewrite.ScalerMonitor(gm, opt, scaler)
    micro = [batch(i, n=4) for i in range(4)]
    separate = []
    for x, y in micro:  # each micro-batch's fp32 master gradient on its own
        opt.zero_grad()
        scaler.scale(F.cross_entropy(gm(x), y) / 4).backward()
        separate.append(grads(gm))
    opt.zero_grad()
    for x, y in micro:  # the accumulation recipe: scale constant, one step at the end
        scaler.scale(F.cross_entropy(gm(x), y) / 4).backward()
    expected = [sum(parts[1:], parts[0].clone()) for parts in zip(*separate)]
    assert bitwise(grads(gm), expected)  # fp32 sums, in order
    scaler.step(opt)
    record = monitor.update()
    assert len(monitor.history) == 1 and not record.skipped
    assert copies_follow_masters(gm, torch.float16, micro[0][0])


def test_two_losses_two_optimizers() -> None:
    model = TwoHeads()
    gm = o2(model)
    opt_a = torch.optim.SGD(model.a.parameters(), lr=0.1)
    opt_b = torch.optim.Adam(model.b.parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r"do not hold 2 of the module's trainable fp32 master "
                                         r"weights \(b.weight, b.bias\)"):
        amprewrite.MasterWeights(gm, opt_a)
    amprewrite.MasterWeights(gm, [opt_a, opt_b])
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8)
    monitor = amprewrite.ScalerMonitor(gm, [opt_a, opt_b], scaler)
    for step in range(2):
        x, y = batch(step)
        out_a, out_b = gm(x)
        scaler.scale(F.cross_entropy(out_a, y)).backward(retain_graph=True)
        scaler.scale(F.mse_loss(out_b, torch.zeros_like(out_b))).backward()
        if step == 1:  # an overflow in b's gradients: only opt_b skips
            model.b.weight.grad[0, 0] = float("inf")
        a_before = model.a.weight.detach().clone()
        b_before = model.b.weight.detach().clone()
        scaler.unscale_(opt_a)
        scaler.step(opt_a)
        scaler.step(opt_b)
        record = monitor.update()
        opt_a.zero_grad()
        opt_b.zero_grad()
        assert not torch.equal(model.a.weight, a_before)
        assert torch.equal(model.b.weight, b_before) == (step == 1)
        assert copies_follow_masters(gm, torch.float16, x)
    assert record.skipped and record.nonfinite == ("b.weight",)
    assert (record.scale, record.next_scale) == (2.0 ** 8, 2.0 ** 7)


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_resume_from_checkpoint_is_bit_identical(opt_level: str) -> None:
    def setup(seed: int):
        model = Net(seed)
        gm = amprewrite.convert(model, (X,), opt_level=opt_level, dtype=torch.float16)
        opt = torch.optim.Adam(gm.parameters(), lr=1e-2)
        if opt_level == "O2":
            amprewrite.MasterWeights(gm, opt)
        return gm, opt, torch.amp.GradScaler("cpu", init_scale=2.0 ** 8, growth_interval=2)

    def train(gm, opt, scaler, steps: range) -> None:
        for step in steps:
            x, y = batch(step)
            scaler.scale(F.cross_entropy(gm(x).float(), y)).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()

    straight = setup(0)
    train(*straight, range(6))
    first = setup(0)
    train(*first, range(3))
    buffer = io.BytesIO()
    gm, opt, scaler = first
    # gm.state_dict() holds the fp32 masters: the low-precision copies are derived state
    torch.save({"model": gm.state_dict(), "optimizer": opt.state_dict(),
                "scaler": scaler.state_dict()}, buffer)
    buffer.seek(0)
    resumed = setup(seed=1)  # other initial weights, overwritten by the checkpoint
    state = torch.load(buffer)
    assert all(v.dtype == torch.float32 for v in state["model"].values())
    resumed[0].load_state_dict(state["model"])
    resumed[1].load_state_dict(state["optimizer"])
    resumed[2].load_state_dict(state["scaler"])
    train(*resumed, range(3, 6))
    assert bitwise([p.detach() for p in resumed[0].parameters()],
                   [p.detach() for p in straight[0].parameters()])
    assert resumed[2].get_scale() == straight[2].get_scale() == 2.0 ** 11  # grew 3 times


# -- the monitor ------------------------------------------------------------------------------
def test_monitor_records_scale_and_skips_and_warns_on_collapse() -> None:
    model = Net()
    gm = o2(model)
    opt = torch.optim.SGD(gm.parameters(), lr=0.1)
    amprewrite.MasterWeights(gm, opt)
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0, growth_interval=1)
    monitor = amprewrite.ScalerMonitor(gm, opt, scaler, min_scale=1.0, max_skipped_in_a_row=3)
    caught = []
    for step in range(4):
        scaler.scale(F.cross_entropy(gm(X), Y)).backward()
        if step >= 1:
            model.fc2.bias.grad[1] = float("nan")
        scaler.step(opt)
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            monitor.update()
        caught += [str(m.message) for m in w]
        opt.zero_grad()
    assert [(r.scale, r.skipped, r.nonfinite, r.next_scale) for r in monitor.history] == [
        (4.0, False, (), 8.0), (8.0, True, ("fc2.bias",), 4.0),
        (4.0, True, ("fc2.bias",), 2.0), (2.0, True, ("fc2.bias",), 1.0)]
    assert monitor.skipped_steps == [1, 2, 3]
    assert len(caught) == 1 and "3 steps in a row were skipped (steps 1..3)" in caught[0]
    assert "fc2.bias" in caught[0]
    scaler.scale(F.cross_entropy(gm(X), Y)).backward()
    model.fc2.bias.grad[1] = float("nan")
    scaler.step(opt)
    with pytest.warns(UserWarning, match=r"loss scale collapsed to 0.5 \(below min_scale=1\) "
                                         r"at step 4.*fc2.bias"):
        monitor.update()
    assert "skipped" in monitor.table(only_skipped=True)


def test_monitor_warns_fp16_without_scaler() -> None:
    gm = amprewrite.convert(Net(), (X,), dtype=torch.float16)
    opt = torch.optim.SGD(gm.parameters(), lr=0.1)
    with pytest.warns(UserWarning, match="fp16 training with no scaler: gradients below 6e-8"):
        amprewrite.ScalerMonitor(gm, opt)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        amprewrite.ScalerMonitor(gm, opt, torch.amp.GradScaler("cpu"))  # no warning
        bf16 = amprewrite.convert(Net(), (X,), dtype=torch.bfloat16)
        amprewrite.ScalerMonitor(bf16, torch.optim.SGD(bf16.parameters(), lr=0.1))


@pytest.mark.skipif(torch.cuda.is_available(), reason="GradScaler('cuda') works here")
def test_monitor_warns_disabled_scaler() -> None:
    gm = amprewrite.convert(Net(), (X,), dtype=torch.float16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        scaler = torch.amp.GradScaler()  # device "cuda": disables itself on this machine
    with pytest.warns(UserWarning, match="a disabled GradScaler"):
        amprewrite.ScalerMonitor(gm, torch.optim.SGD(gm.parameters(), lr=0.1), scaler)


# -- bad input --------------------------------------------------------------------------------
def test_fp16_parameters_given_to_grad_scaler() -> None:
    gm = amprewrite.convert(Net(), (X,), opt_level="O3", dtype=torch.float16)
    opt = torch.optim.SGD(gm.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    with pytest.raises(ValueError, match=r"GradScaler was given fp16 parameters that require "
                                         r"grad \(fc1.weight, fc1.bias, norm.weight, "
                                         r"norm.bias, fc2.weight and 1 more\).*"
                                         r"'O2' \(fp32 master weights\)"):
        amprewrite.ScalerMonitor(gm, opt, scaler)
    # what the user would otherwise meet at the first step
    scaler.scale(F.cross_entropy(gm(X), Y)).backward()
    with pytest.raises(ValueError, match="Attempting to unscale FP16 gradients"):
        scaler.step(opt)


def test_master_weights_rejects_wrong_module_or_optimizer() -> None:
    model = Net()
    o1 = amprewrite.convert(model, (X,), dtype=torch.float16)
    with pytest.raises(ValueError, match=r"opt_level='O2'\), got opt_level='O1'"):
        amprewrite.MasterWeights(o1, torch.optim.SGD(o1.parameters(), lr=0.1))
    with pytest.raises(ValueError, match="a Net that amprewrite did not convert"):
        amprewrite.MasterWeights(model, torch.optim.SGD(model.parameters(), lr=0.1))
    gm = o2(model)
    with pytest.raises(TypeError, match="expected a torch.optim.Optimizer or a non-empty list "
                                        "of them, got str"):
        amprewrite.MasterWeights(gm, "sgd")
    elsewhere = torch.optim.SGD(Net().parameters(), lr=0.1)  # another copy's parameters
    with pytest.raises(ValueError, match=r"do not hold 6 of the module's trainable fp32 master "
                                         r"weights \(fc1.weight, fc1.bias, norm.weight, "
                                         r"norm.bias, fc2.weight and 1 more\).*gm.parameters"):
        amprewrite.MasterWeights(gm, elsewhere)
