"""The tables and markdown of ``bench_speed.py``: speed, casts and memory, conversion times,
the machine line, and the one-shot writer that also runs when the time budget ends."""

from __future__ import annotations

import argparse
import dataclasses
import os
import pathlib
import platform
import sys
import threading
from typing import Any, Callable

import torch
from _speed_types import (
    CONVERTED,
    DTYPES,
    LR,
    SHORT,
    VARIANTS,
    ConvertTime,
    Options,
    Report,
    Row,
)

from amprewrite.hardware import describe as describe_hardware


def _value(row: Row, name: str, values: dict[str, Any], fmt: Callable[[Any], str]) -> str:
    if name in row.failed:
        return "failed"
    return fmt(values[name]) if name in values else "-"


def _ratio(row: Row, name: str) -> str:
    return _value(row, name, row.vs_autocast,
                  lambda r: f"{r:.2f} ({row.vs_autocast_min[name]:.2f})")


def _per_variant(row: Row, names: list[str], values: dict[str, Any],
                 fmt: Callable[[Any], str]) -> str:
    return " / ".join(_value(row, n, values, fmt) for n in names)


def _joined(names: list[str]) -> str:
    return "/".join(SHORT[n] for n in names)


GAIN_FLOOR = 1.10
"""O3's speed over autocast from which a row gets a share of O3's gain: below it the gain is
within the rounds' noise and a share would be a ratio of two noises."""


def share_of_o3_gain(row: Row, name: str) -> float | None:
    """What part of O3's gain over autocast ``name`` captures, by median ratios of one run:
    ``(name vs ac - 1) / (O3 vs ac - 1)`` (1: all of it; 0: none; negative: slower than
    autocast); None where O3 gains less than :data:`GAIN_FLOOR` or a variant is missing."""
    o3, own = row.vs_autocast.get("O3"), row.vs_autocast.get(name)
    if o3 is None or own is None or o3 < GAIN_FLOOR:
        return None
    return (own - 1.0) / (o3 - 1.0)


def speed_table(rows: list[Row], variants: list[str]) -> str:
    from tabulate import tabulate

    if not rows:
        return ""
    shown = [n for n in ("fp32", "autocast") if n in variants]
    ratios = [n for n in VARIANTS if n in variants and n != "autocast"]
    shares = [n for n in ratios if n not in ("fp32", "O3")] if "O3" in variants else []
    bitwise = "preset" in variants

    def share(row: Row) -> str:
        found = [share_of_o3_gain(row, n) for n in shares]
        return " / ".join("-" if v is None else f"{v:.0%}" for v in found)

    return tabulate(
        [[r.model, r.shape, r.phase, r.rounds]
         + [_value(r, n, r.ms, lambda v: f"{v:.2f}") for n in shown]
         + [_ratio(r, n) for n in ratios] + ([share(r)] if shares else [])
         + ([r.bitwise] if bitwise else []) for r in rows],
        headers=["model", "shape", "phase", "rounds"] + [f"{n} ms" for n in shown]
        + [f"{n} vs ac" for n in ratios]
        + ([f"share of O3's gain {_joined(shares)}"] if shares else [])
        + (["preset == ac"] if bitwise else []),
        tablefmt="github")


def casts_table(rows: list[Row], opts: Options) -> str:
    """Cast counts (not under torch.compile) and, on CUDA, memory; empty when neither."""
    from tabulate import tabulate

    cast = [n for n in VARIANTS if n in opts.variants and n != "fp32"]
    columns: list[tuple[str, Callable[[Row], str]]] = []
    if not opts.compile:
        columns += [
            (f"cast kernels {_joined(cast)}",
             lambda r: _per_variant(r, cast, r.casts, lambda c: str(c.kernels))),
            (f"weight casts {_joined(cast)}",
             lambda r: _per_variant(r, cast, r.casts, lambda c: str(c.weight_kernels))),
            (f"cast MB {_joined(cast)}",
             lambda r: _per_variant(r, cast, r.casts, lambda c: f"{c.nbytes / 1e6:.1f}"))]
    if opts.device == "cuda":
        columns += [
            (f"peak MB {_joined(opts.variants)}",
             lambda r: _per_variant(r, opts.variants, r.memory, lambda m: f"{m[0]:.0f}")),
            (f"step MB {_joined(opts.variants)}",
             lambda r: _per_variant(r, opts.variants, r.memory, lambda m: f"{m[1]:.0f}"))]
    if not columns or not rows:
        return ""
    return tabulate([[r.model, r.shape, r.phase] + [cell(r) for _, cell in columns]
                     for r in rows],
                    headers=["model", "shape", "phase"] + [h for h, _ in columns],
                    tablefmt="github")


def convert_table(times: list[ConvertTime], variants: list[str]) -> str:
    from tabulate import tabulate

    names = [n for n in CONVERTED if n in variants]
    if not times:
        return ""

    def seconds(value: float | None) -> str:
        return f"{value:.2f}" if value is not None else "failed"

    return tabulate(
        [[t.model, seconds(t.export_s)]
         + [seconds(t.convert_s.get(n)) if n in t.convert_s or n in t.errors else "-"
            for n in names]
         + ["; ".join(f"{n}: {e}" for n, e in t.errors.items())] for t in times],
        headers=["model", "torch.export s (dynamic dims)"]
        + [f"convert {n} s" for n in names] + ["error"],
        tablefmt="github")


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine(device: str) -> str:
    """The hardware and software the numbers were measured on."""
    host = f"{_cpu_name()}, {os.cpu_count()} cores"
    if device == "cuda":
        major, minor = torch.cuda.get_device_capability()
        gib = torch.cuda.get_device_properties(0).total_memory / 2**30
        return (f"{torch.cuda.get_device_name()} (compute capability {major}.{minor}, "
                f"{gib:.0f} GiB), CUDA {torch.version.cuda}, cuDNN "
                f"{torch.backends.cudnn.version()}, fp32 matmul precision "
                f"'{torch.get_float32_matmul_precision()}'; host {host}; "
                f"torch {torch.__version__}")
    load = f", 1-minute load average {os.getloadavg()[0]:.1f}" if hasattr(os, "getloadavg") \
        else ""
    return (f"{host}, {describe_hardware('cpu')}, "
            f"torch threads: {torch.get_num_threads()}{load}; torch {torch.__version__}")


def _explanation(opts: Options) -> str:
    optimizer = {"sgd": "SGD", "adamw": "AdamW"}[opts.optimizer]
    text = (
        "Times are medians of interleaved rounds in one process (`rounds` per row: fewer "
        "when the time budget cut them short); `X vs ac` is the median over rounds of "
        "torch.autocast's time divided by X's in the same round (above 1: faster than "
        "autocast), and in parentheses the ratio of the fastest rounds, the steadier "
        "estimate when other jobs share the machine. Variants: `fp32` eager; `ac` "
        "`torch.autocast`; `preset` amprewrite with `Policy.autocast(device, dtype)` "
        "(autocast's numerics; `preset == ac` compares the inference outputs bitwise, else "
        "gives their largest difference); `default` `Policy(dtype=...)` (CUDA AMP rules, "
        "shared activation casts); `O2` `opt_level=\"O2\"` (stored low-precision copies of "
        "fp32 master weights, rewritten only after their masters were written; embedding "
        "lookups and norms read their fp32 masters, norms on the low-precision input "
        "where the device's kernel takes it, else in fp32); `O3` `opt_level=\"O3\"` "
        "(everything in low precision, on its own low-precision weights); `share of O3's "
        "gain` is `(X vs ac - 1) / (O3 vs ac - 1)` by the median ratios, where O3 is at "
        f"least {GAIN_FLOOR:.2f}x autocast (else `-`): 100% is all of O3's gain, 0% none, "
        "negative slower than autocast; `cached` `preset` run inside "
        "`amprewrite.cache_weights` (kept weight copies reused across calls instead of "
        "rewritten each call; inference only). Shapes are batch x features, images "
        "or tokens; the launch-bound model is 50 blocks `x + Linear(LayerNorm(x))` of width "
        "8 at batch 2, where the time is per-op overhead on the host. `inference` is one "
        f"forward under `{'inference_mode' if opts.inference_mode else 'no_grad'}`; "
        "`train step` is forward, loss (mean square of the output, outside "
        f"autocast), backward, `{optimizer}.step()` (lr {LR:g}, no loss scaler) and "
        "`zero_grad()`, each variant with its own optimizer over its own parameters (O2: the "
        "fp32 masters bound with `MasterWeights`, whose copies the step marks stale and the next "
        "forward rewrites; O3: its "
        "low-precision weights); the shared weights are restored after each training phase. "
        "Cast kernels are `_to_copy`/`copy_`/`_foreach_copy_` dtype conversions counted "
        "with a dispatch mode in one steady-state call (a `_foreach_copy_`, O2's rewrite of "
        "its copies, is one multi-tensor kernel on a GPU and counts as one); "
        "weight casts are those that read a parameter's or buffer's own storage (a cast of "
        "several weights packed into one buffer counts as a cast kernel only); cast MB = "
        "bytes read + written by all of them. ")
    if opts.compile:
        text += (
            "Every variant runs under `torch.compile` (Inductor; the optimizer step stays "
            "eager). Casts are not counted here: a dispatch mode makes compiled code run "
            "eagerly, so a count would not describe the code timed; the eager run of the same "
            "models counts them. `preset == ac` compares the compiled outputs, which Inductor "
            "need not keep bitwise equal. ")
    if opts.device == "cuda":
        text += (
            "`peak MB` is `torch.cuda.max_memory_allocated()` over one steady-state call "
            "(MB = 1e6 bytes): it includes everything the process holds at that moment, "
            "the model, every variant's converted weights, caches and optimizer state; "
            "`step MB` is the part of that peak the call itself allocated (activations, "
            "gradients, temporaries, weight casts made in the call). fp32 matmuls run at "
            "the fp32 matmul precision of the machine line ('highest': without TF32). ")
    return text + ("Models are in `eval()` with dropout 0; weights random. Failed cells "
                   "name their error below the tables.")


def render(opts: Options, report: Report, partial: str) -> list[str]:
    """The report as markdown lines: tables, then notes and failures."""
    where: dict[tuple[str, str, str], list[str]] = {}
    for row in report.rows:
        for name, error in row.failed.items():
            where.setdefault((row.model, name, error), []).append(f"{row.shape} {row.phase}")
    failures = [f"- {model}, {name} failed ({'; '.join(rows)}): {error}"
                for (model, name, error), rows in where.items()]
    tables = [speed_table(report.rows, opts.variants), casts_table(report.rows, opts),
              convert_table(report.times, opts.variants)]
    lines = "\n\n".join(t for t in tables if t).splitlines()
    notes = ([f"- PARTIAL: {partial}"] if partial else []) + \
        [f"- {n}" for n in report.notes] + failures
    return lines + (["", "Notes and failures:", ""] + notes if notes else [])


def title(opts: Options) -> str:
    # The launch-bound model has one size: a run of it alone names it rather than a size.
    sizes = "the launch-bound model" if opts.models == ["launch"] else f"{opts.size} sizes"
    return f"{opts.device}, {_dtype_name(opts.dtype)}" + \
        (" + torch.compile" if opts.compile else "") + f", {sizes}" + \
        (", inference under torch.inference_mode" if opts.inference_mode else "")


def _dtype_name(dtype: torch.dtype) -> str:
    return next(k for k, v in DTYPES.items() if v == dtype)


def add_markdown_option(parser: argparse.ArgumentParser) -> None:
    """``--markdown-section NAME``: the block of BENCHMARKS.md the run (re)writes."""
    parser.add_argument("--markdown-section", default=None, metavar="NAME",
                        help="(re)write the <!-- NAME:begin/end --> block of BENCHMARKS.md")


def write_markdown(path: pathlib.Path, section: str, block: list[str]) -> None:
    """Replace the block between ``<!-- section:begin -->`` and ``<!-- section:end -->`` in
    ``path``, or append it when the markers are missing."""
    begin, end = f"<!-- {section}:begin -->", f"<!-- {section}:end -->"
    text = "\n".join([begin, *block, end])
    old = path.read_text() if path.exists() else "# Benchmarks\n"
    if begin in old and end in old:
        head, rest = old.split(begin, 1)
        new = head + text + rest.split(end, 1)[1]
    else:
        new = old.rstrip("\n") + "\n\n" + text + "\n"
    path.write_text(new)


def write_section(section: str, title: str, script: str, argv: list[str], device: str,
                  doc: str, body: list[str]) -> None:
    """(Re)write block ``section`` of the repository's BENCHMARKS.md as the benchmark
    scripts lay it out: ``title``, the command that reproduces it (``script`` run with
    ``argv``), the machine, the paragraph of ``doc`` after its title (what is measured), then
    ``body``."""
    command = " ".join([f"python benchmarks/{script}", *argv])
    block = [f"## {title}", "", f"Command: `{command}`  ", f"Machine: {machine(device)}", "",
             doc.split("\n\n")[1].replace("\n", " "), "", *body]
    while block[-1] == "":
        block.pop()
    out = pathlib.Path(__file__).resolve().parents[1] / "BENCHMARKS.md"
    write_markdown(out, section, block)
    print(f"wrote the '{section}' section of {out}")


class Finisher:
    """Prints the tables, and writes the markdown, exactly once: when the run ends, or when
    the time budget runs out first (then from a timer thread, with what was measured so
    far, and the process exits)."""

    def __init__(self, opts: Options, report: Report, out: pathlib.Path | None, section: str,
                 command: str, budget_s: float | None) -> None:
        self.opts, self.report, self.out, self.section = opts, report, out, section
        self.command, self.budget_s = command, budget_s
        self._lock = threading.Lock()

    def finish(self, partial: str = "") -> bool:
        if not self._lock.acquire(blocking=False):
            return False
        report = dataclasses.replace(self.report, rows=list(self.report.rows),
                                     times=list(self.report.times),
                                     notes=list(self.report.notes))
        lines = render(self.opts, report, partial)
        print("\n" + "\n".join(lines), flush=True)
        if self.out is not None:
            block = [f"## Speed, casts and memory against torch.autocast: {title(self.opts)}",
                     "", f"Command: `{self.command}`  ", f"Machine: {machine(self.opts.device)}",
                     "", _explanation(self.opts), "", *lines]
            write_markdown(self.out, self.section, block)
            print(f"\nwrote the '{self.section}' section of {self.out}", flush=True)
        return True

    def out_of_time(self) -> None:
        if self.finish(f"the time budget of {self.budget_s:g} s ran out during "
                       f"{self.report.progress}; later shapes and models were not run"):
            sys.stdout.flush()
            os._exit(0)  # the main thread may be deep inside a kernel or a compilation
