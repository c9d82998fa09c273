"""Memory of one AdamW training step of a small transformer: fp32, torch.autocast, O1, O2, O3.

A 2-layer Llama built from its config (random weights, nothing downloaded), batch 4 x 32
tokens, the model's own loss (``labels=input_ids``). Byte counts are measured by
:func:`amprewrite.compare_memory` (each storage once, exact), so unlike timings they do not
depend on the machine's load.

    python benchmarks/bench_memory.py                # print the table
    python benchmarks/bench_memory.py --update-md    # also replace the block in BENCHMARKS.md
"""

from __future__ import annotations

import argparse
import pathlib
import warnings

import torch
from _speed_report import write_markdown

import amprewrite

COMMAND = "python benchmarks/bench_memory.py --update-md"


def tiny_llama() -> torch.nn.Module:
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, vocab_size=256)
    return transformers.LlamaForCausalLM(config)


def compare(batch: int = 4, seq: int = 32) -> amprewrite.MemoryComparison:
    """``compare_memory`` of the tiny Llama (bf16 on CPU, fp16 on CUDA), AdamW."""
    model = tiny_llama()
    ids = torch.randint(0, model.config.vocab_size, (batch, seq),
                        generator=torch.Generator().manual_seed(1))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "bf16 on cpu without avx512_bf16": bytes are exact
        return amprewrite.compare_memory(model, (ids,), example_kwargs={"labels": ids},
                                         loss_fn=lambda out: out.loss)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--update-md", action="store_true",
                        help="replace the memory block of BENCHMARKS.md with the results")
    args = parser.parse_args()
    table = str(compare())
    print(table)
    if args.update_md:
        _update(table)


def _update(table: str) -> None:
    import transformers

    block = [
        "## Memory of one training step: a small transformer (`benchmarks/bench_memory.py`)",
        "",
        "LlamaForCausalLM from `LlamaConfig(hidden_size=64, intermediate_size=128, "
        "num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=256)` "
        "(random weights), batch 4 x 32 tokens, loss = the model's own (`labels=input_ids`), "
        "AdamW; bf16. Bytes measured by `amprewrite.compare_memory`, exact (not timings).",
        "",
        f"Command: `{COMMAND}`  ",
        f"Machine: CPU capability {torch.backends.cpu.get_cpu_capability()}, torch "
        f"{torch.__version__}, transformers {transformers.__version__}",
        "",
        "```", table, "```",
        "",
        "How to read it (why O1 saves fewer activation bytes than torch.autocast, and why O2 "
        "holds more than O1): docs/precision-tools.md, section \"Memory: what AMP buys\"."]
    write_markdown(pathlib.Path(__file__).resolve().parent.parent / "BENCHMARKS.md", "memory",
                   block)

if __name__ == "__main__":
    main()
