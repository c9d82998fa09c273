"""Convert a small transformer, show the rewritten code, and compare it with fp32 and autocast.

    python examples/quickstart.py
"""

from __future__ import annotations

import torch
import torch.nn as nn

import amprewrite


class Block(nn.Module):
    def __init__(self, d: int = 64, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (z.reshape(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        scores = (q @ k.transpose(-2, -1)) / (d // self.heads) ** 0.5
        mask = torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1)
        attn = scores.masked_fill(mask, float("-inf")).softmax(dim=-1)
        x = x + self.proj((attn @ v).transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.ln2(x))


class TinyTransformer(nn.Module):
    def __init__(self, vocab: int = 100, d: int = 64, layers: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.Sequential(*[Block(d) for _ in range(layers)])
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.blocks(self.embed(ids))))


def main() -> None:
    torch.manual_seed(0)
    model = TinyTransformer().eval()
    ids = torch.randint(0, 100, (2, 16))

    gm = amprewrite.convert(model, (ids,))  # default policy: CUDA AMP rules, bf16 on CPU
    print(gm.code)

    with torch.no_grad():
        ref = model(ids)
        ours = gm(ids).float()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            auto = model(ids).float()
        preset = amprewrite.convert(model, (ids,), policy=amprewrite.Policy.autocast("cpu"))
        mirrored = preset(ids)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            auto_exact = model(ids)
    print(f"max |amprewrite - fp32|        = {(ours - ref).abs().max():.4g}")
    print(f"max |torch.autocast - fp32|    = {(auto - ref).abs().max():.4g}")
    print(f"autocast preset == torch.autocast bitwise: {torch.equal(mirrored, auto_exact)}")


if __name__ == "__main__":
    main()
