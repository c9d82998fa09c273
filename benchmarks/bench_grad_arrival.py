"""When do weight gradients reach ``.grad`` during backward? torch.autocast against amprewrite.

DDP all-reduces a bucket of gradients as soon as all of them have reached ``.grad``, while the
backward computes the earlier layers' gradients; a low-precision weight gradient stays alive
until its cast back to fp32 runs. Both depend on *when* autograd runs each weight cast's
backward. This benchmark counts it, without timings: the backward's ATen ops are counted by a
dispatch mode, and each parameter's post-accumulate-grad hook records how many had run when
its gradient arrived. ``arrival`` is that count as a share of the backward's ops (0%: at the
start, 100%: at the very end), over the parameters the variant computes with in low
precision (the matmul weights and biases); ``arrived by 50%`` is the share of those parameters
whose gradient had reached ``.grad`` when half the backward's ops had run (a layer-by-layer
backward gives about half).

    python benchmarks/bench_grad_arrival.py                 # print the table
    python benchmarks/bench_grad_arrival.py --update-md     # also replace its BENCHMARKS.md block
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import warnings
from typing import Any, Callable

import torch
import torch.nn as nn
from _models import GPT, LaunchBound
from _speed_report import write_markdown
from _timing import OpCounter
from tabulate import tabulate

import amprewrite

COMMAND = "python benchmarks/bench_grad_arrival.py --update-md"
DTYPE = torch.bfloat16


def arrivals(model: nn.Module, run: Callable[[], torch.Tensor], lowered: set[str]
             ) -> list[float]:
    """The share of the backward's ops run when each ``lowered`` parameter's gradient arrived."""
    counter = OpCounter()
    seen: dict[str, int] = {}

    def hook(name: str) -> Callable[[torch.Tensor], None]:
        def record(param: torch.Tensor) -> None:
            seen.setdefault(name, counter.calls)
        return record

    hooks = [p.register_post_accumulate_grad_hook(hook(name))
             for name, p in model.named_parameters() if name in lowered]
    model.zero_grad(set_to_none=True)
    loss = run().float().square().mean()
    try:
        with counter:
            loss.backward()
    finally:
        for hook in hooks:
            hook.remove()
    return [seen[name] / counter.calls for name in lowered if name in seen]


def _cases() -> list[tuple[str, nn.Module, tuple]]:
    torch.manual_seed(0)
    return [("Launch-bound 50x(LN+Linear) d8, 2x8", LaunchBound(), (torch.randn(2, 8),)),
            ("GPT stack 4L d32, 2x16 tok", GPT(256, 32, 2, 4, 64).eval(),
             (torch.randint(0, 256, (2, 16)),))]


def rows() -> list[list[Any]]:
    out = []
    for label, model, args in _cases():
        def autocast_run() -> torch.Tensor:
            with torch.autocast("cpu", DTYPE):
                return model(*args)

        variants: dict[str, Callable[[], torch.Tensor]] = {"torch.autocast": autocast_run}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the CPU's bf16 speed warning
            preset = amprewrite.convert(model, args, policy=amprewrite.Policy.autocast("cpu", DTYPE))
            default = amprewrite.convert(model, args, policy=amprewrite.Policy(dtype=DTYPE))
            o2 = amprewrite.convert(model, args, opt_level="O2", dtype=DTYPE)
        # The parameters the preset casts (its weight table's cast entries): the same ones
        # under torch.autocast and the other variants.
        lowered = {entry[0] for entry in preset._amp_weights.entries if len(entry) == 2}
        amprewrite.MasterWeights(o2, torch.optim.SGD(o2.parameters(), lr=0.0))
        variants.update({"preset": lambda: preset(*args), "default": lambda: default(*args),
                         "O2": lambda: o2(*args)})
        for name, run in variants.items():
            shares = arrivals(model, run, lowered)
            out.append([label, name, len(shares), f"{statistics.median(shares):.0%}",
                        f"{min(shares):.0%}", f"{sum(s <= 0.5 for s in shares) / len(shares):.0%}"])
    return out


HEADERS = ["model", "variant", "low-precision params", "median arrival", "first arrival",
           "arrived by 50%"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--update-md", action="store_true",
                        help="replace the grad-arrival block of BENCHMARKS.md")
    opts = parser.parse_args()
    table = tabulate(rows(), HEADERS, tablefmt="github")
    machine = (f"cpu {torch.backends.cpu.get_cpu_capability()}, torch {torch.__version__}, "
               f"bf16; counts of ATen ops, not timings")
    print(machine)
    print(table)
    if opts.update_md:
        write_markdown(pathlib.Path(__file__).resolve().parent.parent / "BENCHMARKS.md",
                       "grad-arrival",
                       [f"Command: `{COMMAND}`  ", f"Machine: {machine}", "", table])

if __name__ == "__main__":
    main()
