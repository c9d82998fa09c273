"""How much faster than torch.autocast any rewrite can be: the time both spend in the same
compute kernels.

A converted module with the autocast preset runs autocast's matmul, convolution and
attention kernels on bitwise the same inputs (its outputs are bitwise autocast's), so the
time spent in them is a floor for any rewrite that keeps autocast's numerics; what a rewrite
can remove is the rest (casts, dispatch, Python). For each model, shape and phase this
prints autocast's time, the time of those kernels (profiled, in autocast and in the preset),
their share of autocast's time, the *ceiling* (one over that share: the ratio to autocast of
a rewrite with no overhead at all) and the preset's measured ratio. Where a target lies
above the ceiling, no rewrite with autocast's numerics reaches it: the kernels decide.

It also counts the ATen ops one call of each dispatches, and those of the preset's that
autocast does not run (casts apart). Where there are none, the preset's ops are autocast's
minus some casts, and the rest of its gain can only be host time around the ops: the eager
model's Python and autocast's per-op dispatch, which in a training step is the forward's
share alone (the backward and the optimizer run the same ops from the same C++ and Python).

    python benchmarks/bench_ceiling.py --models gpt,bert,gpt2,llama --shapes single --threads 1
    python benchmarks/bench_ceiling.py --models gpt,bert,gpt2,llama --shapes single \
        --threads 1 --markdown-section cpu-ceiling     # also (re)writes that block of BENCHMARKS.md
    python benchmarks/bench_ceiling.py --device cuda --size realistic

Kernel times are self times from ``torch.profiler`` over a few calls (on CUDA the kernels'
device time); the other times are medians of interleaved rounds, as in ``bench_speed.py``,
whose models, shapes, training step (SGD, lr 1e-06) and phases these are.
"""

from __future__ import annotations

import argparse
import contextlib
import pathlib
import sys
import time
from typing import Any, Callable, NamedTuple

import torch
from tabulate import tabulate
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from _models import MODEL_KEYS, SHAPE_LABELS, SIZES, build_case  # noqa: E402
from _speed_report import add_markdown_option, machine, title, write_section  # noqa: E402
from _speed_types import (  # noqa: E402
    PHASES,
    Options,
    add_machine_options,
    apply_machine_options,
    key_list,
)
from _timing import count_ops, interleaved_samples, median, paired_ratio, sync  # noqa: E402
from _variants import convert_variants, phase_fns, restored, runner  # noqa: E402

COMPUTE_KERNELS = (
    # matrix products, forward and (as mm/bmm) backward
    "aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::addbmm", "aten::_grouped_mm",
    # convolutions on the CPU (bf16 has no oneDNN path without avx512_bf16) and elsewhere
    "aten::_slow_conv2d_forward", "aten::_slow_conv2d_backward", "aten::mkldnn_convolution",
    "aten::cudnn_convolution", "aten::convolution_backward",
    # fused attention
    "aten::_scaled_dot_product_flash_attention_for_cpu",
    "aten::_scaled_dot_product_flash_attention_for_cpu_backward",
    "aten::_flash_attention_forward", "aten::_flash_attention_backward",
    "aten::_efficient_attention_forward", "aten::_efficient_attention_backward",
    "aten::_scaled_dot_product_cudnn_attention",
    "aten::_scaled_dot_product_cudnn_attention_backward",
)
"""The ops whose own time is the shared floor: the low-precision compute that autocast and
the preset run alike. Self times, so that a wrapper (``linear``, ``convolution``) counts only
its own overhead, which is not part of the floor."""

TARGETS = {"inference": 1.3, "train step": 1.05}
"""The ratios to autocast the benchmarks aim at, per phase."""


class Profiled(NamedTuple):
    kernels: float
    """Seconds per call in :data:`COMPUTE_KERNELS` (self time; on CUDA their device time)."""
    wall: float
    """Seconds per call, profiled."""


def _profiled(fn: Callable[[], Any], device: str, calls: int) -> Profiled:
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        sync(device)
        wall = time.perf_counter() - start
    total_us = 0.0
    for event in prof.key_averages():
        if event.key in COMPUTE_KERNELS:
            total_us += (event.self_device_time_total if device == "cuda"
                         else event.self_cpu_time_total)
    return Profiled(total_us / 1e6 / calls, wall / calls)


def profiles(fns: dict[str, Callable[[], Any]], seconds: dict[str, float], device: str,
             repeats: int = 7, profile_s: float = 0.1) -> dict[str, list[Profiled]]:
    """Per function, ``repeats`` profiles of about ``profile_s`` each, the functions taken
    in turn, as the timing rounds are (``seconds``: each one's time per call)."""
    calls = {name: max(3, int(profile_s / seconds[name])) for name in fns}
    samples: dict[str, list[Profiled]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            samples[name].append(_profiled(fn, device, calls[name]))
    return samples


_CAST = torch.ops.aten._to_copy.default


def op_counts(autocast: Callable[[], Any], preset: Callable[[], Any]) -> str:
    """``"ac / preset (+extra)"``: the ATen ops one call of each dispatches, and how many of
    the preset's are not among autocast's (a multiset difference; casts apart). With
    ``+0`` the preset runs autocast's ops minus some of its casts: what it can gain beyond
    those casts is host time around the ops (Python, autocast's per-op dispatch), not
    work inside them."""
    ac, pre = count_ops(autocast), count_ops(preset)
    extra = sum(n for op, n in (pre - ac).items() if op is not _CAST)
    return f"{sum(ac.values())} / {sum(pre.values())} (+{extra})"


def measure(key: str, opts: Options) -> list[list[Any]]:
    """One row per shape and phase of model ``key``."""
    case = build_case(key, opts.size, opts.device, quick=False, labels=opts.shapes)
    rows: list[list[Any]] = []
    for args, description in case.shapes.values():
        start = len(rows)
        converted, _, errors = convert_variants(case, args, ["preset"], opts)
        if errors:
            rows.append([case.name, description, "-", errors["preset"]] + ["-"] * 5)
            print(tabulate(rows[start:], tablefmt="plain"), flush=True)
            continue
        modules = {"autocast": case.model, "preset": converted["preset"]}
        runs = {"autocast": runner(case.model, args, (opts.device, opts.dtype)),
                "preset": runner(converted["preset"], args, None)}
        for phase in PHASES:
            with contextlib.ExitStack() as stack:
                stack.enter_context(restored(case.model))
                failed: dict[str, str] = {}
                fns = phase_fns(phase, runs, modules, opts, failed, stack)
                samples = interleaved_samples(fns, opts.rounds, opts.device)
                failed.update(samples.failed)
                if not failed:
                    profiled = profiles(fns, {n: median(t) for n, t in
                                              samples.seconds.items()}, opts.device)
                    ops = op_counts(fns["autocast"], fns["preset"])
            if failed:
                rows.append([case.name, description, phase,
                             "; ".join(f"{n}: {e}" for n, e in failed.items())] + ["-"] * 5)
                continue
            ac, pre = profiled["autocast"], profiled["preset"]
            # Taken within each profile, so that the load of the moment weighs on both terms;
            # the profiler's own cost per op lowers it a little: the ceiling errs high.
            share = median([p.kernels / p.wall for p in ac])
            rows.append([
                case.name, description, phase, f"{median(samples.seconds['autocast']) * 1e3:.2f}",
                f"{median([p.kernels for p in ac]) * 1e3:.2f} / "
                f"{median([p.kernels for p in pre]) * 1e3:.2f}",
                f"{share:.0%}",
                f"{1 / share:.2f}" + (" *" if 1 / share < TARGETS[phase] else ""),
                f"{paired_ratio(samples.seconds['autocast'], samples.seconds['preset']):.2f}",
                ops,
            ])
        print(tabulate(rows[start:], tablefmt="plain"), flush=True)
    return rows


HEADERS = ["model", "shape", "phase", "autocast ms", "kernels ms ac / preset",
           "kernels' share of ac", "ceiling", "preset vs ac", "ATen ops ac / preset"]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_machine_options(parser)
    parser.add_argument("--size", default="small", choices=SIZES)
    parser.add_argument("--models", default=["gpt", "bert", "gpt2", "llama"],
                        type=lambda t: key_list(t, MODEL_KEYS, "model"),
                        help=f"any of {', '.join(MODEL_KEYS)}")
    parser.add_argument("--shapes", default=None,
                        type=lambda t: key_list(t, SHAPE_LABELS, "shape"),
                        help=f"shape labels to run, any of {', '.join(SHAPE_LABELS)} "
                        "(default: every shape of each model)")
    parser.add_argument("--rounds", type=int, default=11)
    add_markdown_option(parser)
    return parser


def main(argv: list[str] | None = None) -> None:
    parser = _parser()
    args = parser.parse_args(argv)
    opts = Options(args.device, apply_machine_options(parser, args), args.size, args.models,
                   ["autocast", "preset"], args.shapes, args.rounds, False, False, "sgd")
    print(f"Machine: {machine(opts.device)}\n", flush=True)
    rows = [row for key in opts.models for row in measure(key, opts)]
    table = tabulate(rows, headers=HEADERS, tablefmt="github")
    legend = ("`kernels ms`: the time in the matmul, convolution and attention kernels of "
              "autocast and of the preset (profiled: equal up to cache effects and the "
              "machine's noise, large for kernels of a few microseconds); `kernels' share`: "
              "their share of autocast's time, within each profile; `ceiling`: one over that "
              "share, the ratio a rewrite with autocast's numerics and no overhead at all "
              "would reach (`*`: below the target, "
              f"{TARGETS['inference']}x in inference, {TARGETS['train step']}x per training "
              "step); `preset vs ac`: the measured ratio, median over the timing rounds (taken "
              "apart from the profiles: on a loaded machine the two can differ by the load's "
              "swings, a few percent); `ATen ops`: the ops one call dispatches (counted "
              "below autocast and autograd, so an op whose inputs autocast casts counts once "
              "and its casts apart), and in parentheses how many of the preset's are not among "
              "autocast's, casts apart: with +0 the preset runs autocast's ops minus some "
              "casts, and what it gains beyond those casts is host time around the ops "
              "(Python, autocast's per-op dispatch).")
    print(f"\n{table}\n\n{legend}")
    if args.markdown_section:
        write_section(args.markdown_section,
                      f"How much faster a rewrite can be: {title(opts)}",
                      "bench_ceiling.py", argv if argv is not None else sys.argv[1:],
                      opts.device, __doc__, [table, "", legend])


if __name__ == "__main__":
    main()
