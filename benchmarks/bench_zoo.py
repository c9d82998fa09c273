"""Speed against torch.autocast on every architecture of the Hugging Face zoo.

``bench_speed.py`` measures a few models in depth; this runs the tiny models of
``tests/models/_hf_zoo.py`` (decoders, mixtures of experts, a state-space model, encoders,
encoder-decoders, audio, vision; 2 layers, width 32) through autocast, the autocast preset and
the default policy, to find the architectures where a converted module is slower than
autocast. ``inference`` is one forward under ``no_grad``; ``train`` is forward, the zoo
entry's loss (outside autocast) and backward (no optimizer step: the three variants share the
model's parameters). Each ratio is the median over interleaved rounds of autocast's time
divided by the variant's (above 1: faster than autocast); ``ac ms`` is autocast's median.

    python benchmarks/bench_zoo.py --threads 1
    python benchmarks/bench_zoo.py --only mixtral,qwen2_moe --rounds 15
    python benchmarks/bench_zoo.py --threads 1 --markdown-section cpu-zoo   # BENCHMARKS.md
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import warnings
from typing import Any, Callable

import torch
from tabulate import tabulate

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "tests" / "models"))
sys.path.insert(0, str(ROOT))

import amprewrite  # noqa: E402
from _hf_zoo import ZOO, Arch  # noqa: E402
from _speed_report import add_markdown_option, machine, write_section  # noqa: E402
from _speed_types import add_machine_options, apply_machine_options  # noqa: E402
from _timing import describe_error, interleaved_samples, median, paired_ratio  # noqa: E402
from _variants import inference  # noqa: E402

VARIANTS = ("preset", "default")
PHASES = ("inference", "train")


def _variants(arch: Arch, model: torch.nn.Module, example: tuple[tuple, dict], device: str,
              low: torch.dtype) -> dict[str, Callable[[], Any]]:
    args, kwargs = example
    converted = {
        "preset": amprewrite.convert(model, args, example_kwargs=kwargs,
                                     policy=amprewrite.Policy.autocast(device, low)),
        "default": amprewrite.convert(model, args, example_kwargs=kwargs, dtype=low),
    }

    def autocast() -> Any:
        with torch.autocast(device, low):
            return model(*args, **kwargs)

    runs: dict[str, Callable[[], Any]] = {"autocast": autocast}
    for name, gm in converted.items():
        runs[name] = (lambda gm=gm: gm(*args, **kwargs))
    return runs


def _phase(phase: str, arch: Arch, model: torch.nn.Module, run: Callable[[], Any]
           ) -> Callable[[], Any]:
    if phase == "inference":
        return inference(run)

    def step() -> Any:
        loss = arch.loss(run())
        loss.backward()
        for p in model.parameters():
            p.grad = None
        return loss
    return step


def measure(arch: Arch, device: str, low: torch.dtype, rounds: int) -> list[Any]:
    """One table row: the architecture, then per phase autocast's ms and the variants'
    ratios; a failure fills the row's last cell."""
    row: list[Any] = [arch.name, arch.family]
    try:
        model = arch.build().to(device)
        example = torch.utils._pytree.tree_map(
            lambda v: v.to(device) if isinstance(v, torch.Tensor) else v, arch.example())
        runs = _variants(arch, model, example, device, low)
        for phase in PHASES:
            fns = {name: _phase(phase, arch, model, run) for name, run in runs.items()}
            samples = interleaved_samples(fns, rounds, device)
            if samples.failed:
                raise RuntimeError("; ".join(f"{k}: {v}" for k, v in samples.failed.items()))
            reference = samples.seconds["autocast"]
            row.append(f"{median(reference) * 1e3:.2f}")
            row += [f"{paired_ratio(reference, samples.seconds[name]):.2f}" for name in VARIANTS]
        return row + [""]
    except Exception as exc:
        # NB: cells of a phase measured before the failure stay.
        width = 2 + len(PHASES) * (1 + len(VARIANTS))
        return row + ["-"] * (width - len(row)) + [describe_error(exc)]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_machine_options(parser)
    parser.add_argument("--only", default=None, help="comma-separated zoo names")
    parser.add_argument("--rounds", type=int, default=9)
    add_markdown_option(parser)
    return parser


def main(argv: list[str] | None = None) -> None:
    parser = _parser()
    args = parser.parse_args(argv)
    low = apply_machine_options(parser, args)
    names = {a.name for a in ZOO}
    only = args.only.split(",") if args.only else None
    unknown = sorted(set(only or ()) - names)
    if unknown:
        parser.error(f"--only: no zoo architecture {', '.join(unknown)}; known: "
                     f"{', '.join(sorted(names))}")
    print(f"Machine: {machine(args.device)}\n", flush=True)
    rows = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the hardware warning, transformers' notices
        for arch in ZOO:
            if only is None or arch.name in only:
                rows.append(measure(arch, args.device, low, args.rounds))
                print("  ".join(map(str, rows[-1])).rstrip(), flush=True)
    headers = ["model", "family"]
    for phase in PHASES:
        headers += [f"{phase} ac ms"] + [f"{phase} {v} vs ac" for v in VARIANTS]
    headers.append("error")
    table = tabulate(rows, headers=headers, tablefmt="github")
    ratios = [(float(r[i]), r[0], headers[i]) for r in rows for i in range(2, len(r) - 1)
              if "vs ac" in headers[i] and r[i] != "-"]
    summary = "No ratios measured."
    if ratios:
        lowest, name, column = min(ratios)
        summary = (f"Lowest ratio: {lowest:.2f} ({name}, {column}); "
                   f"{sum(1 for r in ratios if r[0] < 1.0)} of {len(ratios)} ratios below 1.0.")
    print("\n" + table + "\n\n" + summary)
    if args.markdown_section:
        write_section(args.markdown_section,
                      f"Speed against torch.autocast on the Hugging Face zoo: {args.device}, "
                      f"{str(low).removeprefix('torch.')}", "bench_zoo.py",
                      argv if argv is not None else sys.argv[1:], args.device, __doc__,
                      [table, "", summary])


if __name__ == "__main__":
    main()
