"""Runs of ``amprewrite.search`` against a plain bisection without the shadow run's ranking.

Each run is one conversion plus one forward, so the run count is what the search costs. Two
models in fp16: the guide's (a Linear whose outputs overflow fp16, and a mean the policy
forces into fp16) and a 2-layer HuggingFace Llama (random weights, nothing downloaded) whose
layer-1 ``up_proj`` weight is scaled by 3e5, so its activations overflow fp16.

    python benchmarks/bench_search.py
"""

from __future__ import annotations

import time
import warnings

import torch
import torch.nn as nn
from tabulate import tabulate

import amprewrite
from amprewrite import OpCategory, Policy
from amprewrite.precision.search import _bisect


class ReadmeModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.big, self.norm, self.head = nn.Linear(16, 16), nn.LayerNorm(16), nn.Linear(16, 4)
        with torch.no_grad():
            self.big.weight.mul_(1e5)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.big(x))) + (y * 4000).mean(-1, keepdim=True)


def readme_case() -> tuple[str, nn.Module, tuple, Policy, float]:
    torch.manual_seed(0)  # the guide's order: the model, then the inputs
    model, x, y = ReadmeModel(), torch.randn(4, 16), torch.randn(4, 1024)
    y = y - y.mean(-1, keepdim=True) + 2.5e-4
    policy = Policy().override(ops={"mean": OpCategory.LOWER})
    return "README model (mean forced to fp16)", model, (x, y), policy, 1e-3


def llama_case() -> tuple[str, nn.Module, tuple, Policy, float]:
    import transformers

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=128)).eval()
    with torch.no_grad():
        model.model.layers[1].mlp.up_proj.weight.mul_(3e5)
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(1))
    return "tiny Llama, layer-1 up_proj x3e5", model, (ids,), Policy(), 1e-2


def main() -> None:
    warnings.filterwarnings("ignore")
    print(f"torch {torch.__version__}, cpu capability "
          f"{torch.backends.cpu.get_cpu_capability()}, fp16")
    rows = []
    for name, model, inputs, policy, tol in (readme_case(), llama_case()):
        for how, fn in (("search", amprewrite.search), ("bisection", _bisect)):
            start = time.perf_counter()
            result = fn(model, inputs, tol=tol, policy=policy, dtype=torch.float16)
            rows.append([name, tol, how, result.runs, ", ".join(result.nodes),
                         f"{result.start_error:.2e} -> {result.error:.2e}",
                         f"{time.perf_counter() - start:.1f}"])
    print(tabulate(rows, headers=["model", "tol", "method", "runs", "fp32 nodes",
                                  "output error", "seconds"]))


if __name__ == "__main__":
    main()
