"""The auditor's and the linter's text output, pinned (update: EXPECTTEST_ACCEPT=1 pytest ...)."""

from __future__ import annotations

import expecttest
import torch
import torch.nn as nn

import amprewrite


class Small(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(2, 2)
        with torch.no_grad():
            self.fc.weight.copy_(torch.tensor([[1.0, 2.0], [300.0, 400.0]]))
            self.fc.bias.copy_(torch.tensor([0.5, -0.5]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.fc(x))


class Masked(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(6, 10)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        scores = self.proj(x) @ self.proj(x).transpose(-1, -2)
        scores = scores.masked_fill(mask, torch.finfo(torch.float32).min)
        return (scores + 1e-8).softmax(-1)


class TestAuditTable(expecttest.TestCase):
    def test_table(self) -> None:
        x = torch.tensor([[100.0, 100.0]])  # fc row 2: 70000.5 > 65504: inf in fp16
        gm = amprewrite.convert(Small(), (x,), dtype=torch.float16)
        with amprewrite.audit() as report:
            gm(x).float().sum().backward()
        self.assertExpectedInline(report.table(), """\
amprewrite audit: 14 ops (8 forward, 6 backward), 7 casts (52 B)

out dtype      forward ops    backward ops
-----------  -------------  --------------
f16                      5               4
f32                      3               2

matmul/conv dtype      FLOPs    share
-------------------  -------  -------
f16                       16   100.0%
in fp16/bf16: 100.0% of matmul/conv FLOPs

non-finite producers (inf/NaN from finite inputs, or NaN from NaN-free ones); first: addmm at linear (forward)
  #  phase    op     node/module    grad_fn      nonfinite
---  -------  -----  -------------  ---------  -----------
  3  forward  addmm  linear                              1

  #  phase     op               node/module    dtype      max finite |x|    fp16 headroom (bits)
---  --------  ---------------  -------------  -------  ----------------  ----------------------
  3  forward   addmm            linear         f16                   300          overflowed (1)
  4  forward   relu             relu           f16                   300          overflowed (1)
  1  forward   cast (_to_copy)  fc_weight_f16  f16                   400                     7.4
  2  forward   cast (_to_copy)  x_f16          f16                   100                     9.4
 10  backward  mm               linear         f16                   100                     9.4

  #  ph    op                  node/module    module    in           out    shape      max|x|    min|x|>0    nonfinite    >f16max    <f16tiny
---  ----  ------------------  -------------  --------  -----------  -----  -------  --------  ----------  -----------  ---------  ----------
  0  for   cast (_to_copy)     fc_bias_f16    fc        f32          f16    2             0.5         0.5            0          0           0
  1  for   cast (_to_copy)     fc_weight_f16  fc        f32          f16    2x2           400           1            0          0           0
  2  for   cast (_to_copy)     x_f16          fc        f32          f16    1x2           100         100            0          0           0
  3  for   addmm               linear         fc        f16,f16,f16  f16    1x2           300         300           1*          1           0
  4  for   relu                relu                     f16          f16    1x2           300         300            1          1           0
  5  for   cast (_to_copy)                              f16          f32    1x2           300         300            1          0           0
  6  for   sum                                          f32          f32    ()              -           -            1          0           0
  7  for   ones_like                                    f32          f32    ()              1           1            0          0           0
  8  bac   cast (_to_copy)                              f32          f16    1x2             1           1            0          0           0
  9  bac   threshold_backward  relu                     f16,f16      f16    1x2             1           1            0          0           0
 10  bac   mm                  linear         fc        f16,f16      f16    2x2           100         100            0          0           0
 11  bac   sum                 linear         fc        f16          f16    1x2             1           1            0          0           0
 12  bac   cast (_to_copy)     fc_weight_f16  fc        f16          f32    2x2           100         100            0          0           0
 13  bac   cast (_to_copy)     fc_bias_f16    fc        f16          f32    2               1           1            0          0           0
(* = produced the inf/NaN, did not only pass it on)

gradient magnitudes (fp16 backward values)
  |grad| >=    values    share  in fp16
-----------  --------  -------  ---------
        2^6         4    40.0%  normal
        2^0         6    60.0%  normal
flush to zero in fp16 (< 2^-24): 0.00%; subnormal in fp16: 0.00%
max |grad|: 100; recommended static loss scale: 2^9 = 512""")

    def test_lints(self) -> None:
        x, mask = torch.randn(2, 3, 6), torch.zeros(2, 3, 3, dtype=torch.bool)
        gm = amprewrite.convert(Masked(), (x, mask), dtype=torch.float16)
        self.assertExpectedInline("\n".join(map(str, amprewrite.lint(gm, device="cuda"))), """\
[fill-overflow] masked_fill: masked_fill uses the constant -3.40282e+38 (argument 2), which overflows fp16 (this op runs in fp16): fills raise 'value cannot be converted to type ... without overflow', arithmetic makes it -inf and a fully masked softmax row NaN.
    fix: fill with a value that fits fp16 (torch.finfo(torch.float16).min, or -1e4); NB: torch.finfo(x.dtype).min is captured as fp32's. Or keep the op in fp32: Policy().override(nodes={'masked_fill': OpCategory.FP32})
[eps-underflow] add: add adds the epsilon 1e-08 (argument 1) in fp16, below its smallest normal 6.1e-05: it rounds to 0 and no longer guards the division or square root after it.
    fix: run this op in fp32: Policy().override(nodes={'add': OpCategory.FP32}), or use an epsilon >= 6.1e-05
[matmul-alignment] linear: fp16 linear with K=6, N=10 (not a multiple of 8): tensor cores are not used at full rate; 40.0% of this graph's fp16/bf16 matmul/conv FLOPs.
    fix: pad to K=8, N=16 (e.g. the vocabulary or hidden size), or ignore if its FLOP share is small
[matmul-alignment] linear_1: fp16 linear with K=6, N=10 (not a multiple of 8): tensor cores are not used at full rate; 40.0% of this graph's fp16/bf16 matmul/conv FLOPs.
    fix: pad to K=8, N=16 (e.g. the vocabulary or hidden size), or ignore if its FLOP share is small
[matmul-alignment] matmul: fp16 matmul with K=10, N=3 (not a multiple of 8): tensor cores are not used at full rate; 20.0% of this graph's fp16/bf16 matmul/conv FLOPs.
    fix: pad to K=16, N=8 (e.g. the vocabulary or hidden size), or ignore if its FLOP share is small""")
