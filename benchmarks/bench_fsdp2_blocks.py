"""Parameters gathered at once under FSDP2: per-block sharding of converted blocks against the
eager model under autocast, and against a whole converted model sharded at its root.

Two gloo processes on this machine's CPU (``benchmarks/_fsdp2_blocks.py``), an HF Llama of
``--layers`` blocks of width ``--hidden``, two training steps (two micro-batches each), then one
forward and backward during which every op reads how many bytes of unsharded (all-gathered)
parameter storage are alive: the most is the row's figure. Byte counts, not timings: they do
not depend on the machine's load.

    python benchmarks/bench_fsdp2_blocks.py            # print the table
"""

from __future__ import annotations

import argparse
import sys

import torch
from tabulate import tabulate

import _fsdp2_blocks as F2

RUNS = [("root", None), ("root", "O1"), ("blocks", None), ("blocks", "O1"), ("blocks", "O2"),
        ("blocks+ends", None), ("blocks+ends", "O1"), ("blocks+ends", "O2")]


def _worker(rank: int, world: int, port: int, out: str, layers: int, hidden: int) -> None:
    F2.init_rank(rank, world, port)
    results = {}
    for policy, level in RUNS:
        results[(policy, level)] = F2.train(rank, "llama", policy, level, layers=layers,
                                            hidden=hidden, measure=True)
        results[(policy, level)].pop("params")
    torch.save(results, out)
    torch.distributed.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=128)
    args = parser.parse_args()
    res = F2.launch(__file__, 2, [str(args.layers), str(args.hidden)], timeout_s=900)[0]
    first = next(iter(res.values()))
    model, block = first["model_bytes"], first["block_bytes"]
    rows = []
    for (policy, level), r in res.items():
        peak = r["peak_unsharded"]
        rows.append([policy, "eager + autocast" if level is None else f"converted {level}",
                     f"{peak / 2**20:.3f}", f"{peak / block:.2f}", f"{peak / model:.2f}",
                     "-" if level != "O2" else f"{r['low_copy_bytes']}"])
    print(f"torch {torch.__version__}, cpu capability "
          f"{torch.backends.cpu.get_cpu_capability()}, 2 gloo processes; HF Llama, "
          f"{args.layers} blocks of width {args.hidden}: one block {block / 2**20:.3f} MiB, "
          f"the model {model / 2**20:.3f} MiB (fp32, unsharded)")
    print(tabulate(rows, headers=["fully_shard", "run", "most gathered at once (MiB)",
                                  "in blocks", "of the model", "O2 copies held after the step (B)"],
                   tablefmt="github"))


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1].isdigit():
        _worker(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4],
                int(sys.argv[5]), int(sys.argv[6]))
    else:
        main()
