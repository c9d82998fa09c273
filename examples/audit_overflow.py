"""Find a real fp16 overflow with ``amprewrite.lint`` and ``amprewrite.audit`` (runs on CPU).

A small attention block masks padding with ``-1e9`` and forgets the ``1/sqrt(d)`` scaling
of its logits. In fp32 both are harmless. In fp16, ``lint`` flags the -1e9 before anything
runs (an fp16 ``masked_fill`` with it raises). With the mask fixed, the logits of large
activations still pass 65504 and become inf, and the softmax turns them into NaN: the classic
"loss is NaN". The auditor names the op and FX node that *produced* the first inf, not the
softmax, the loss, or the backward ops that only pass it on.

    python examples/audit_overflow.py
"""

from __future__ import annotations

import json
import os
import tempfile

import torch
import torch.nn as nn

import amprewrite


class Attention(nn.Module):
    def __init__(self, dim: int, mask_value: float) -> None:
        super().__init__()
        self.mask_value = mask_value
        self.q = nn.Linear(dim, dim)
        self.k = nn.Linear(dim, dim)
        self.v = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
        logits = self.q(x) @ self.k(x).transpose(-1, -2)  # NB: no / sqrt(dim)
        logits = logits.masked_fill(pad[:, None, :], self.mask_value)
        return logits.softmax(-1) @ self.v(x)


class Model(nn.Module):
    def __init__(self, mask_value: float, dim: int = 32) -> None:
        super().__init__()
        self.attn = Attention(dim, mask_value)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, 4)

    def forward(self, x: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(x + self.attn(x, pad)))


def main() -> None:
    torch.manual_seed(0)
    x = 150.0 * torch.randn(2, 6, 32)  # a residual stream with outlier features
    pad = torch.zeros(2, 6, dtype=torch.bool)
    pad[1, 4:] = True

    model = Model(mask_value=-1e9)
    print(f"fp32 loss: {model(x, pad).float().pow(2).mean().item():.4f}")
    print("\n== amprewrite.lint(convert(model)): before running ==")
    for finding in amprewrite.lint(amprewrite.convert(model, (x, pad), dtype=torch.float16)):
        if finding.rule == "fill-overflow":
            print(finding)

    # Fix the mask as the lint says (same weights); the unscaled logits remain.
    model.attn.mask_value = torch.finfo(torch.float16).min
    gm = amprewrite.convert(model, (x, pad), dtype=torch.float16)

    with amprewrite.audit() as report:
        loss = gm(x, pad).float().pow(2).mean()
        loss.backward()
    print(f"\nfp16 loss: {loss.item()}")

    first = report.first_nonfinite
    print("\n== the op that produced the first inf/NaN ==")
    if first is None:
        print("none: no overflow this time")
        return
    print(f"{first.label} at FX node {first.node!r} in module {first.module!r} "
          f"({first.phase}): {first.nonfinite} inf/NaN values, output {first.out_dtype} "
          f"{list(first.shape)}, inputs {', '.join(first.in_dtypes)}")
    passed_on = sum(1 for r in report.records if r.nonfinite and not r.produced_nonfinite)
    others = [f"{r.label} at {r.node}" for r in report.producers if r is not first]
    print(f"{passed_on} later ops only passed inf/NaN on and are not blamed"
          + (f"; also producers: {', '.join(others)}" if others else "") + ".")

    print("\n== report.table() ==")
    print(report.table(max_rows=12))

    out_dir = tempfile.mkdtemp(prefix="amprewrite_audit_")
    with open(os.path.join(out_dir, "audit.json"), "w") as f:
        json.dump(report.to_dict(), f)
    print(f"\nreport saved as JSON: {os.path.join(out_dir, 'audit.json')}")
    if report.grad_histogram is not None:
        try:
            path = report.grad_histogram.plot(os.path.join(out_dir, "grad_histogram.png"))
            print(f"gradient histogram plot: {path}")
        except ImportError:
            print("(pip install 'amprewrite[plot]' for a PNG of the gradient histogram)")
    # The fix: scale the logits by 1/sqrt(dim) in the model, or keep the attention in fp32.
    policy = amprewrite.Policy().override(keep_fp32=["attn"])
    fixed = amprewrite.convert(model, (x, pad), dtype=torch.float16, policy=policy)
    with amprewrite.audit() as after:
        loss = fixed(x, pad).float().pow(2).mean()
        loss.backward()
    print(f"\nwith Policy().override(keep_fp32=['attn']): loss {loss.item():.4f}, "
          f"first inf/NaN producer: {after.first_nonfinite}")


if __name__ == "__main__":
    main()
