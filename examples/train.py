"""Train one small task in every precision variant and print a table of the results.

The task: classify 16-dimensional points into 4 classes whose labels come, with noise, from
a random "teacher" network (generated deterministically, nothing downloaded). A student MLP
with a LayerNorm trains for a few hundred steps with SGD + momentum in each variant:

    fp32              the model as it is (opt_level="O0")
    O1 fp16 + scaler  per-op mixed precision, dynamic loss scaling (torch.amp.GradScaler)
    O1 bf16           per-op mixed precision, no scaler needed
    O2 fp16 + scaler  fp16 weights and activations, fp32 master weights and LayerNorm
    O3 fp16           everything fp16, no masters, no scaler (the speed baseline)

Final loss and accuracy are measured on a held-out set with each variant's own forward.
Then the Mixed Precision Training paper's two failure modes, and their fixes: (a) gradients
that underflow in fp16 without loss scaling, (b) weight updates lost in fp16 weights (O3)
but kept by fp32 master weights (O2).
Run: ``python examples/train.py [--steps 400] [--device cuda]``.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import time
import warnings

import torch
import torch.nn as nn
import torch.nn.functional as F

import amprewrite

DIM, CLASSES, HIDDEN = 16, 4, 64


def make_data(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Points and noisy teacher labels; the same ``seed`` gives the same tensors."""
    g = torch.Generator().manual_seed(1234)
    teacher = [torch.randn(DIM, 32, generator=g) / DIM ** 0.5,
               torch.randn(32, CLASSES, generator=g) * 6 / 32 ** 0.5]
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, DIM, generator=g)
    logits = torch.tanh(x @ teacher[0]) @ teacher[1]
    y = torch.multinomial(F.softmax(logits, -1), 1, generator=g).squeeze(1)
    return x, y


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(DIM, HIDDEN), nn.GELU(), nn.LayerNorm(HIDDEN),
                         nn.Linear(HIDDEN, HIDDEN), nn.GELU(), nn.Linear(HIDDEN, CLASSES))


@dataclasses.dataclass(frozen=True)
class Variant:
    name: str
    opt_level: str
    dtype: torch.dtype | None
    scaler: bool


VARIANTS = (
    Variant("fp32", "O0", None, False),
    Variant("O1 fp16 + scaler", "O1", torch.float16, True),
    Variant("O1 bf16", "O1", torch.bfloat16, False),
    Variant("O2 fp16 + scaler", "O2", torch.float16, True),
    Variant("O3 fp16", "O3", torch.float16, False),
)


@dataclasses.dataclass(frozen=True)
class Result:
    variant: str
    loss: float
    accuracy: float
    skipped_steps: int
    seconds: float


def train(variant: Variant, steps: int = 400, batch: int = 128, lr: float = 0.05,
          device: str = "cpu") -> Result:
    """Train ``variant`` from the common initial weights; evaluate on held-out data."""
    # Fresh points for every step (one pass): the eval loss measures learning, not memory.
    x, y = (t.to(device) for t in make_data(steps * batch, seed=1))
    x_eval, y_eval = (t.to(device) for t in make_data(4096, seed=2))
    model = make_model().to(device)
    gm = amprewrite.convert(copy.deepcopy(model), (x[:batch],), opt_level=variant.opt_level,
                            dtype=variant.dtype)
    opt = torch.optim.SGD(gm.parameters(), lr=lr, momentum=0.9)
    masters = amprewrite.MasterWeights(gm, opt) if variant.opt_level == "O2" else None
    scaler = torch.amp.GradScaler(device) if variant.scaler else None
    with warnings.catch_warnings():
        # O3 fp16 runs without a scaler on purpose (GradScaler refuses fp16 gradients); the
        # monitor's "fp16 without a scaler" warning is expected there.
        warnings.simplefilter("ignore" if variant.opt_level == "O3" else "default")
        monitor = amprewrite.ScalerMonitor(gm, opt, scaler)
    _sync(device)
    start = time.perf_counter()
    for step in range(steps):
        xb, yb = x[step * batch:(step + 1) * batch], y[step * batch:(step + 1) * batch]
        loss = F.cross_entropy(gm(xb).float(), yb)
        (scaler.scale(loss) if scaler else loss).backward()
        if scaler:
            scaler.step(opt)
        else:
            opt.step()
        monitor.update()
        opt.zero_grad(set_to_none=True)
    _sync(device)
    seconds = time.perf_counter() - start
    with torch.no_grad():
        logits = gm(x_eval).float()
        loss = F.cross_entropy(logits, y_eval).item()
        accuracy = (logits.argmax(-1) == y_eval).float().mean().item()
    if masters is not None:
        masters.close()
    return Result(variant.name, loss, accuracy, len(monitor.skipped_steps), seconds)


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def underflow_demo(scaler: bool, steps: int = 30) -> tuple[float, float]:
    """Failure mode (a): a loss term whose gradients (~1e-9) lie below fp16's smallest
    subnormal (6e-8). Returns (fraction of zero gradient elements, relative loss change)."""
    x, y = make_data(256, seed=3)
    gm = amprewrite.convert(make_model(), (x,), opt_level="O1", dtype=torch.float16)
    opt = torch.optim.Adam(gm.parameters(), lr=1e-2)
    grad_scaler = torch.amp.GradScaler("cpu") if scaler else None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the no-scaler warning is this demo's point
        monitor = amprewrite.ScalerMonitor(gm, opt, grad_scaler)
    first = last = 0.0
    for step in range(steps):
        loss = 1e-7 * F.cross_entropy(gm(x).float(), y)
        first = loss.item() if step == 0 else first
        last = loss.item()
        (grad_scaler.scale(loss) if grad_scaler else loss).backward()
        grad_scaler.step(opt) if grad_scaler else opt.step()
        monitor.update()
        opt.zero_grad()
    return monitor.history[-1].zero_fraction, (last - first) / first


def small_update_demo(opt_level: str, steps: int = 50) -> float:
    """Failure mode (b): w = 1.0 and every step subtracts 1e-4, less than half an fp16 ulp at
    1.0 (2**-11 = 4.9e-4). Returns the weight after ``steps`` steps (fp32 would give 0.995)."""
    x = torch.ones(4, 4)
    model = nn.Linear(4, 1, bias=False)
    nn.init.ones_(model.weight)
    gm = amprewrite.convert(model, (x,), opt_level=opt_level, dtype=torch.float16)
    opt = torch.optim.SGD(gm.parameters(), lr=1e-4)
    if opt_level == "O2":
        amprewrite.MasterWeights(gm, opt)
    for _ in range(steps):
        gm(x).mean().backward()  # d/dw = 1 exactly
        opt.step()
        opt.zero_grad()
    return next(gm.parameters())[0, 0].item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    args = parser.parse_args()
    # One thread: for a model this small, thread start-up costs more than it saves.
    torch.set_num_threads(1)
    if args.device == "cuda":
        train(VARIANTS[1], 20, device="cuda")  # CUDA context, kernels and cuBLAS warmed up
    results = [train(v, args.steps, device=args.device) for v in VARIANTS]
    base = results[0].loss
    from tabulate import tabulate

    print(tabulate(
        [(r.variant, f"{r.loss:.5f}", f"{100 * (r.loss - base) / base:+.3f}%",
          f"{100 * r.accuracy:.1f}%", r.skipped_steps, f"{1e3 * r.seconds / args.steps:.2f}")
         for r in results],
        headers=["variant", "final loss", "vs fp32", "accuracy", "skipped steps",
                 f"{args.device} ms/step"]))
    print("\n(a) fp16 gradients below 6e-8 (O1 fp16, 30 Adam steps on a 1e-7-weighted loss)")
    print(tabulate([(name, f"{100 * zeros:.1f}%", f"{100 * change:+.1f}%")
                    for name, (zeros, change) in (("no loss scaling", underflow_demo(False)),
                                                  ("GradScaler", underflow_demo(True)))],
                   headers=["", "zero gradient elements", "loss change"]))
    print("\n(b) updates of 1e-4 to a weight of 1.0, 50 SGD steps (fp32 result: 0.995)")
    print(tabulate([("O3 (fp16 weights)", f"{small_update_demo('O3'):.6f}"),
                    ("O2 (fp32 masters)", f"{small_update_demo('O2'):.6f}")],
                   headers=["", "weight"]))


if __name__ == "__main__":
    main()
