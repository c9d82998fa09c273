"""Where a training step's time goes: forward, backward and optimizer step, timed apart.

``bench_speed.py`` times a whole training step; this splits it, for each variant, into the
forward with the loss (under autocast for ``autocast``), ``loss.backward()``, and
``optimizer.step()`` with ``zero_grad()`` (for O2 the step marks the stored low-precision
copies stale; the next forward rewrites them). The variants, optimizer and learning rate are those of
``bench_speed.py``; the steps of all variants are interleaved, round by round in a rotated
order, and each phase's ratio to autocast is the median over rounds of autocast's time for
that phase divided by the variant's (above 1: faster than autocast).

    python benchmarks/bench_phases.py --models launch --threads 1 --rounds 25
    python benchmarks/bench_phases.py --models launch,gpt --size tiny --threads 1 \\
        --markdown-section cpu-phases        # also (re)writes that block of BENCHMARKS.md
    python benchmarks/bench_phases.py --device cuda --dtype fp16 --models launch,gpt

On CUDA each phase ends with a synchronisation, so that a phase's kernels are charged to
it; the step as a whole then loses the overlap of one phase's host work with the previous
phase's kernels.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import pathlib
import sys
import time
from typing import Any, Callable

import torch
from tabulate import tabulate

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from _models import MODEL_KEYS, SIZES, build_case, first_tensor  # noqa: E402
from _speed_report import add_markdown_option, machine, title, write_section  # noqa: E402
from _speed_types import (  # noqa: E402
    CONVERTED,
    INFERENCE_ONLY,
    OPTIMIZERS,
    VARIANTS,
    Options,
    add_machine_options,
    apply_machine_options,
    key_list,
)
from _timing import median, paired_ratio, sync  # noqa: E402
from _variants import bound_optimizer, convert_variants, restored, runner  # noqa: E402

PARTS = ("forward", "backward", "step")


def _stepper(run: Callable[[], Any], optimizer: torch.optim.Optimizer, device: str
             ) -> Callable[[list[float]], None]:
    """One training step that adds the seconds of each of its parts to ``into``."""
    def step(into: list[float]) -> None:
        t0 = time.perf_counter()
        loss = first_tensor(run()).float().square().mean()
        sync(device)
        t1 = time.perf_counter()
        loss.backward()
        sync(device)
        t2 = time.perf_counter()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        sync(device)
        t3 = time.perf_counter()
        into[0] += t1 - t0
        into[1] += t2 - t1
        into[2] += t3 - t2
    return step


def _rounds(steppers: dict[str, Callable[[list[float]], None]], rounds: int, steps: int
            ) -> dict[str, list[list[float]]]:
    """Per variant and round, the mean seconds of each part over ``steps`` steps."""
    for step in steppers.values():  # warm-up: copies made, lazy state built
        for _ in range(3):
            step([0.0, 0.0, 0.0])
    names = list(steppers)
    samples: dict[str, list[list[float]]] = {n: [] for n in names}
    gc.disable()  # a collection would charge its pause to whichever phase ran then
    try:
        for r in range(rounds):
            for name in names[r % len(names):] + names[:r % len(names)]:
                total = [0.0, 0.0, 0.0]
                for _ in range(steps):
                    steppers[name](total)
                samples[name].append([t / steps for t in total])
    finally:
        gc.enable()
    return samples


def _columns(rounds: list[list[float]]) -> list[list[float]]:
    """Per part, then for the whole step, the seconds of each round."""
    return [[r[i] for r in rounds] for i in range(len(PARTS))] + [[sum(r) for r in rounds]]


def _table(samples: dict[str, list[list[float]]]) -> str:
    ref = _columns(samples["autocast"])
    rows = []
    for name, rounds in samples.items():
        cells = [f"{median(values) * 1e3:.3f}" +
                 ("" if name == "autocast" else f" ({paired_ratio(ref_values, values):.2f}x)")
                 for values, ref_values in zip(_columns(rounds), ref)]
        rows.append([name, *cells])
    return tabulate(rows, headers=["variant", *(f"{p}, ms" for p in PARTS), "step total, ms"],
                    tablefmt="github")


def measure(key: str, opts: Options, steps: int) -> list[str]:
    """The phase table of model ``key`` at its first chosen shape, as markdown lines."""
    case = build_case(key, opts.size, opts.device, quick=False, labels=opts.shapes)
    if not case.shapes:
        raise SystemExit(f"bench_phases: {case.name} has no shape {opts.shapes[0]!r} at size "
                         f"{opts.size!r}; leave --shape out to run its first shape")
    shape = next(iter(case.shapes))
    args, description = case.shapes[shape]
    converted, _, errors = convert_variants(
        case, args, [n for n in CONVERTED if n in opts.variants], opts)
    modules = {n: case.model for n in ("fp32", "autocast") if n in opts.variants}
    modules.update(converted)
    lines = [f"### {case.name}, {description}", ""]
    with contextlib.ExitStack() as stack:
        stack.enter_context(restored(case.model))
        steppers = {}
        for name, module in modules.items():
            run = runner(module, args, (opts.device, opts.dtype) if name == "autocast" else None)
            optimizer = bound_optimizer(name, module, opts.optimizer, stack)
            steppers[name] = _stepper(run, optimizer, opts.device)
        samples = _rounds(steppers, opts.rounds, steps)
    lines.append(_table(samples))
    lines += [f"\n{name} failed: {error}" for name, error in errors.items()]
    print("\n".join(lines) + "\n", flush=True)
    return lines


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_machine_options(parser)
    parser.add_argument("--size", default="small", choices=SIZES)
    parser.add_argument("--models", default=["launch"],
                        type=lambda t: key_list(t, MODEL_KEYS, "model"),
                        help=f"any of {', '.join(MODEL_KEYS)}")
    trained = tuple(v for v in VARIANTS if v not in INFERENCE_ONLY)
    parser.add_argument("--variants", default=["autocast", "preset", "default", "O2"],
                        type=lambda t: key_list(t, trained, "variant"),
                        help=f"any of {', '.join(trained)} (autocast is always run)")
    parser.add_argument("--shape", default=None,
                        help="the shape label to run (default: each model's first)")
    parser.add_argument("--optimizer", default="sgd", choices=tuple(OPTIMIZERS))
    parser.add_argument("--rounds", type=int, default=25)
    parser.add_argument("--steps", type=int, default=10, help="steps per variant per round")
    add_markdown_option(parser)
    return parser


def main(argv: list[str] | None = None) -> None:
    parser = _parser()
    args = parser.parse_args(argv)
    opts = Options(args.device, apply_machine_options(parser, args),
                   args.size, args.models,
                   sorted({"autocast", *args.variants}, key=VARIANTS.index),
                   [args.shape] if args.shape else None, args.rounds, False, False,
                   args.optimizer)
    print(f"Machine: {machine(opts.device)}\n", flush=True)
    lines = []
    for key in opts.models:
        lines += measure(key, opts, args.steps) + [""]
    if args.markdown_section:
        write_section(args.markdown_section,
                      f"A training step by phase against torch.autocast: {title(opts)}",
                      "bench_phases.py", argv if argv is not None else sys.argv[1:],
                      opts.device, __doc__, lines)


if __name__ == "__main__":
    main()
