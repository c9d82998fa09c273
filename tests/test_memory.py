"""memory_report / compare_memory: exact byte counts worked out by hand on a small model."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import amprewrite
from amprewrite.runtime.low_copies import LOW_COPIES_ATTR

B, D, OUT = 16, 64, 8
N = D * D + D * OUT                    # 4608 parameters, no biases
FP32, LOW = 4 * N, 2 * N               # 18,432 and 9,216 bytes
ADAMW_FP32 = 2 * FP32 + 2 * 4          # exp_avg and exp_avg_sq per parameter, + a 0-dim
ADAMW_LOW = 2 * LOW + 2 * 4            # fp32 `step` tensor for each of the 2 parameters


def small() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(D, D, bias=False), nn.ReLU(), nn.Linear(D, OUT, bias=False))


@pytest.fixture(scope="module")
def compared() -> dict:
    x = torch.randn(B, D)
    return {k: r.to_dict() for k, r in amprewrite.compare_memory(small(), (x,)).items()}


# What autograd saves for the step (x does not require grad, so the first matmul saves x but
# not its weight; ReLU saves its output; the second matmul saves its input, the same ReLU
# output, counted once, and its weight, transposed):
#   fp32:             x (B*D*4) + relu out (B*D*4) = 8,192 activations; the fp32 weight
#                     `2.weight` (D*OUT*4 = 2,048) is a stored weight: saved_weights.
#   autocast, O1:     x cast to bf16 (B*D*2) + relu out (B*D*2) = 4,096 activations; the bf16
#                     cast of `2.weight` (D*OUT*2 = 1,024) made by this forward: weight_casts.
#   O2:               the same 4,096 activations; `2.weight`'s bf16 copy lives in the store
#                     (low_precision_copies), so saving it costs nothing: saved_weights 1,024.
#   O3:               the same; the module's own bf16 `2.weight`: saved_weights 1,024.
EXPECTED = {
    "fp32": dict(weights=FP32, low_precision_copies=0, weight_casts=0, gradients=FP32,
                 optimizer_state=ADAMW_FP32, activations=2 * B * D * 4,
                 saved_weights=D * OUT * 4, per_module={"0": B * D * 4, "1": B * D * 4}),
    "autocast": dict(weights=FP32, low_precision_copies=0, weight_casts=D * OUT * 2,
                     gradients=FP32, optimizer_state=ADAMW_FP32, activations=2 * B * D * 2,
                     saved_weights=0,
                     per_module={"0": B * D * 2, "1": B * D * 2, "2": D * OUT * 2}),
    "O2": dict(weights=FP32, low_precision_copies=LOW, weight_casts=0, gradients=FP32,
               optimizer_state=ADAMW_FP32, activations=2 * B * D * 2,
               saved_weights=D * OUT * 2, per_module={"0": B * D * 2, "1": B * D * 2}),
    "O3": dict(weights=0, low_precision_copies=LOW, weight_casts=0, gradients=LOW,
               optimizer_state=ADAMW_LOW, activations=2 * B * D * 2,
               saved_weights=D * OUT * 2, per_module={"0": B * D * 2, "1": B * D * 2}),
}
EXPECTED["O1"] = EXPECTED["autocast"]


@pytest.mark.parametrize("variant", ["fp32", "autocast", "O1", "O2", "O3"])
def test_hand_counted_bytes(compared: dict, variant: str) -> None:
    got = dict(compared[variant])
    total = got.pop("total")
    assert got == EXPECTED[variant]
    assert total == sum(v for k, v in EXPECTED[variant].items()
                        if k not in ("saved_weights", "per_module"))


def test_totals(compared: dict) -> None:
    assert {k: r["total"] for k, r in compared.items()} == {
        "fp32": 81_928, "autocast": 78_856, "O1": 78_856, "O2": 87_048, "O3": 40_968}


def test_tables() -> None:
    x = torch.randn(B, D)
    gm = amprewrite.convert(small(), (x,), opt_level="O1", dtype=torch.bfloat16)
    opt = torch.optim.AdamW(gm.parameters())
    text = amprewrite.memory_report(gm, (x,), optimizer=opt).table()
    assert "78,856" in text and "36,872" in text and "saved for backward" in text
    comparison = amprewrite.compare_memory(small(), x, ("fp32", "O3"))
    assert list(comparison) == ["fp32", "O3"]
    assert "(0.50×)" in str(comparison) and "O3" in comparison.table().splitlines()[0]


def test_saved_twice_counted_once() -> None:
    class SaveTwice(torch.autograd.Function):
        @staticmethod
        def forward(ctx, a):
            ctx.save_for_backward(a, a, a[:2])   # one storage, three saves (one a slice)
            return a * 1

        @staticmethod
        def backward(ctx, g):
            return g

    class Square(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(D, OUT, bias=False)

        def forward(self, x):
            h = self.lin(x)
            return SaveTwice.apply(h * h)         # mul saves h as both of its inputs

    x = torch.randn(B, D)
    report = amprewrite.memory_report(Square(), (x,))
    square = B * OUT * 4                           # h * h: a new tensor, saved by SaveTwice
    assert report.activations == B * D * 4 + B * OUT * 4 + square   # x, h once, h * h once
    assert report.per_module == {"lin": B * D * 4, "(top level)": 2 * B * OUT * 4}
    assert report.optimizer_state == 0 and report.saved_weights == 0


def test_loss_fn_saved_tensors_are_listed_as_loss() -> None:
    x, y = torch.randn(B, D), torch.randint(0, OUT, (B,))
    report = amprewrite.memory_report(small(), (x,),
                                      loss_fn=lambda out: nn.functional.cross_entropy(out, y))
    # log_softmax's output (fp32), nll_loss's int64 target and its 0-dim total_weight
    assert report.per_module["(loss)"] == B * OUT * 4 + B * 8 + 4


def test_user_model_and_optimizer_left_unchanged() -> None:
    model = nn.Sequential(nn.Linear(D, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, OUT))
    x = torch.randn(B, D)
    opt = torch.optim.AdamW(model.parameters())
    model(x).sum().backward()
    opt.step()                                     # the optimizer has state already
    grads = [p.grad for p in model.parameters()]
    before = {k: v.clone() for k, v in model.state_dict().items()}
    opt_before = {k: v.clone() for s in opt.state.values() for k, v in s.items()}
    report = amprewrite.memory_report(model, (x,), optimizer=opt)
    assert report.optimizer_state > 0 and report.gradients > 0
    after = model.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in after)
    assert all(p.grad is g for p, g in zip(model.parameters(), grads))
    opt_after = {k: v for s in opt.state.values() for k, v in s.items()}
    assert all(torch.equal(opt_before[k], opt_after[k]) for k in opt_before)
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())
    amprewrite.compare_memory(model, (x,), ("fp32", "O2"))
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in after)


def test_o2_without_optimizer_is_bound_only_for_the_step() -> None:
    x = torch.randn(B, D)
    gm = amprewrite.convert(small(), (x,), opt_level="O2", dtype=torch.bfloat16)
    report = amprewrite.memory_report(gm, (x,))
    assert (report.low_precision_copies, report.optimizer_state) == (LOW, 0)
    assert getattr(gm, LOW_COPIES_ATTR).bindings == 0
    with pytest.raises(amprewrite.AmpRewriteError, match="no optimizer"):
        gm(x)


def test_unknown_variant() -> None:
    with pytest.raises(ValueError, match="unknown variant 'fp16'"):
        amprewrite.compare_memory(small(), (torch.randn(B, D),), ("fp32", "fp16"))
