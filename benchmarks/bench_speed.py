"""Speed and cast counts of amprewrite against torch.autocast, side by side in one process.

    python benchmarks/bench_speed.py            # full run (CPU bf16), writes BENCHMARKS.md
    python benchmarks/bench_speed.py --quick    # smoke run: serving shapes, few rounds
    python benchmarks/bench_speed.py --device cuda --dtype fp16 [--compile]

Variants: fp32 eager, ``torch.autocast`` eager, amprewrite with the autocast preset (same
numerics as autocast, checked bitwise here) and amprewrite with the default policy (CUDA AMP
rules, shared activation casts). Phases: inference forward under ``torch.no_grad`` and a
training step (forward, loss, backward). Speed is the median over rounds of torch.autocast's
time divided by the variant's (> 1: faster than autocast); cast kernels are counted exactly with
a dispatch mode. Only the block between the ``speed`` markers of BENCHMARKS.md is (re)written.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import pathlib
import platform
import sys
import time
from typing import Any, Callable

import torch
import torch.nn as nn

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import amprewrite  # noqa: E402
from _models import Case, build_cases, first_tensor  # noqa: E402
from _timing import CastCount, count_casts, interleaved_samples, median, paired_ratio  # noqa: E402

BEGIN, END = "<!-- speed:begin -->", "<!-- speed:end -->"
VARIANTS = ("fp32", "autocast", "amp preset", "amp default")
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


@dataclasses.dataclass
class Row:
    model: str
    shape: str
    phase: str
    ms: dict[str, float]
    vs_autocast: dict[str, float]
    vs_autocast_min: dict[str, float]
    casts: dict[str, CastCount]
    bitwise: str


@dataclasses.dataclass
class ConvertTime:
    model: str
    export_s: float | None
    export_dynamic_s: float | None
    convert_s: float | None
    error: str = ""


def _runner(fn: Callable[..., Any], args: tuple, autocast: tuple[str, torch.dtype] | None
            ) -> Callable[[], Any]:
    if autocast is None:
        return lambda: fn(*args)

    def run() -> Any:
        with torch.autocast(autocast[0], autocast[1]):
            return fn(*args)
    return run


def _train_step(run: Callable[[], Any], params: list[nn.Parameter]) -> Callable[[], Any]:
    def step() -> Any:
        for p in params:
            p.grad = None
        # The loss is taken outside autocast, as the AMP recipes do.
        loss = first_tensor(run()).float().square().mean()
        loss.backward()
        return loss
    return step


def _inference(run: Callable[[], Any]) -> Callable[[], Any]:
    def forward() -> Any:
        with torch.no_grad():
            return run()
    return forward


def _convert_all(case: Case, args: tuple, device: str, dtype: torch.dtype
                 ) -> tuple[dict[str, nn.Module], ConvertTime]:
    """Both amprewrite conversions, and the time of convert next to torch.export's."""
    from amprewrite._capture import _auto_dynamic_shapes

    export_s: dict[str, float | None] = {}
    # convert exports with dynamic dimensions where the model allows (slower to trace).
    for kind, dynamic in (("static", None), ("dynamic", _auto_dynamic_shapes(args, None))):
        try:
            start = time.perf_counter()
            torch.export.export(case.model, args, dynamic_shapes=dynamic, strict=False)
            export_s[kind] = time.perf_counter() - start
        except Exception as exc:  # report, keep going: the benchmark covers the other models
            export_s[kind] = None
            print(f"  torch.export ({kind}) failed on {case.name}: {type(exc).__name__}: "
                  f"{exc}"[:300])
    try:
        start = time.perf_counter()
        preset = amprewrite.convert(case.model, args,
                                    policy=amprewrite.Policy.autocast(device, dtype))
        convert_s = time.perf_counter() - start
        default = amprewrite.convert(case.model, args, policy=amprewrite.Policy(dtype=dtype))
    except Exception as exc:
        message = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        print(f"  amprewrite.convert failed on {case.name}: {message}"[:400])
        return {}, ConvertTime(case.name, export_s["static"], export_s["dynamic"], None,
                               message[:160])
    return {"amp preset": preset, "amp default": default}, \
        ConvertTime(case.name, export_s["static"], export_s["dynamic"], convert_s)


def _variant_fns(case: Case, converted: dict[str, nn.Module], args: tuple, device: str,
                 dtype: torch.dtype, compile_: bool) -> dict[str, Callable[[], Any]]:
    model: Callable[..., Any] = case.model
    fns: dict[str, Callable[..., Any]] = {"fp32": model, "autocast": model, **converted}
    if compile_:
        compiled_model = torch.compile(model)
        fns = {name: (compiled_model if name in ("fp32", "autocast") else torch.compile(m))
               for name, m in fns.items()}
    return {name: _runner(fn, args, (device, dtype) if name == "autocast" else None)
            for name, fn in fns.items()}


def _bitwise(runs: dict[str, Callable[[], Any]]) -> str:
    if "amp preset" not in runs:
        return "-"
    with torch.no_grad():
        same = torch.equal(first_tensor(runs["autocast"]()), first_tensor(runs["amp preset"]()))
    return "yes" if same else "NO"


def _measure_shape(case: Case, shape: str, converted: dict[str, nn.Module], device: str,
                   dtype: torch.dtype, rounds: int, compile_: bool) -> list[Row]:
    args, description = case.shapes[shape]
    runs = _variant_fns(case, converted, args, device, dtype, compile_)
    params = [p for p in case.model.parameters() if p.requires_grad]
    weights = list(case.model.parameters()) + list(case.model.buffers())
    rows = []
    bitwise = _bitwise(runs)
    for phase, wrap in (("inference", _inference), ("train step", None)):
        fns = {name: (wrap(run) if wrap else _train_step(run, params))
               for name, run in runs.items()}
        casts = {}
        for name, fn in fns.items():
            fn()  # steady state: weight copies made, lazy initialisation done
            casts[name] = count_casts(fn, weights)
        samples = interleaved_samples(fns, rounds, device)
        ratios = {n: paired_ratio(samples["autocast"], s) for n, s in samples.items()}
        best = {n: min(samples["autocast"]) / min(s) for n, s in samples.items()}
        rows.append(Row(case.name, description, phase,
                        {n: median(s) * 1e3 for n, s in samples.items()}, ratios, best, casts,
                        bitwise if phase == "inference" else "-"))
        print(f"  {shape:8s} {phase:10s} " + "  ".join(
            f"{n}={median(samples[n]) * 1e3:.2f}ms({ratios[n]:.2f}x)/{casts[n].kernels}c"
            for n in fns), flush=True)
    return rows


def _fits(converted: dict[str, nn.Module], args: tuple) -> bool:
    """Whether the converted modules accept ``args`` (export may specialise shapes)."""
    try:
        with torch.no_grad():
            for gm in converted.values():
                gm(*args)
        return True
    except Exception:
        return False


def run(device: str, dtype: torch.dtype, rounds: int, quick: bool, compile_: bool
        ) -> tuple[list[Row], list[ConvertTime]]:
    rows: list[Row] = []
    times: list[ConvertTime] = []
    # torch.export's first call pays one-off imports and set-up; keep it out of the timings.
    torch.export.export(nn.Linear(2, 2).to(device), (torch.randn(1, 2, device=device),),
                        strict=False)
    for case in build_cases(device, quick):
        print(f"{case.name}", flush=True)
        first_shape = next(iter(case.shapes))
        converted, convert_time = _convert_all(case, case.shapes[first_shape][0], device, dtype)
        times.append(convert_time)
        for shape, (args, _) in case.shapes.items():
            if converted and not _fits(converted, args):
                converted, _ = _convert_all(case, args, device, dtype)
            rows += _measure_shape(case, shape, converted, device, dtype, rounds, compile_)
    return rows, times


# -- presentation ----------------------------------------------------------------------------
def _ratio(row: Row, name: str) -> str:
    if name not in row.ms:
        return "-"
    return f"{row.vs_autocast[name]:.2f} ({row.vs_autocast_min[name]:.2f})"


def _triple(row: Row, get: Callable[[CastCount], Any]) -> str:
    return " / ".join(str(get(row.casts[n])) if n in row.casts else "-"
                      for n in ("autocast", "amp preset", "amp default"))


def tables(rows: list[Row], times: list[ConvertTime]) -> tuple[str, str]:
    from tabulate import tabulate

    speed = tabulate(
        [[r.model, r.shape, r.phase, f"{r.ms['fp32']:.2f}", f"{r.ms['autocast']:.2f}",
          _ratio(r, "fp32"), _ratio(r, "amp preset"), _ratio(r, "amp default"),
          _triple(r, lambda c: c.kernels), _triple(r, lambda c: c.weight_kernels),
          _triple(r, lambda c: f"{c.nbytes / 1e6:.1f}"), r.bitwise] for r in rows],
        headers=["model", "shape", "phase", "fp32 ms", "autocast ms", "fp32 vs ac",
                 "preset vs ac", "default vs ac", "cast kernels ac/pre/def",
                 "weight casts ac/pre/def", "cast MB ac/pre/def", "preset == ac"],
        tablefmt="github")
    def seconds(value: float | None) -> str:
        return f"{value:.2f}" if value is not None else "failed"

    convert = tabulate(
        [[t.model, seconds(t.export_s), seconds(t.export_dynamic_s), seconds(t.convert_s),
          t.error or ""] for t in times],
        headers=["model", "torch.export s", "torch.export, dynamic dims s",
                 "amprewrite.convert s (exports with dynamic dims)", "error"],
        tablefmt="github")
    return speed, convert


def _machine(device: str) -> str:
    if device == "cuda":
        return f"{torch.cuda.get_device_name()}, CUDA {torch.version.cuda}"
    cpu = platform.processor() or platform.machine()
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    load = ", load average %.1f (shared machine)" % os.getloadavg()[0] if hasattr(
        os, "getloadavg") else ""
    return f"{cpu}, {os.cpu_count()} cores, {torch.get_num_threads()} torch threads{load}"


def write_markdown(path: pathlib.Path, command: str, device: str, dtype: str, speed: str,
                   convert: str) -> None:
    block = "\n".join([
        BEGIN,
        "## Speed and casts against torch.autocast",
        "",
        f"Command: `{command}`  ",
        f"Machine: {_machine(device)}; device {device}, {dtype}; torch {torch.__version__}.",
        "",
        "Times are medians of interleaved rounds in one process; `X vs ac` is the median over "
        "rounds of torch.autocast's time divided by X's in the same round (above 1: faster than "
        "autocast), and in parentheses the ratio of the fastest rounds, the steadier estimate "
        "when other jobs share the machine. `preset` is amprewrite with "
        "`Policy.autocast` (autocast's numerics; `preset == ac` checks the outputs bitwise), "
        "`default` is `Policy()` (CUDA AMP rules, shared activation casts). Cast kernels are "
        "`_to_copy`/`copy_` dtype conversions counted with a dispatch mode in one steady-state "
        "forward (inference, `no_grad`) or training step (forward + backward, loss outside "
        "autocast); cast MB = bytes read + written by them. Each model runs a single request, a "
        "small serving batch (batch x features, images or tokens) and, for honesty, a larger "
        "batch. Models are in "
        "`eval()` with dropout 0; weights random.",
        "",
        speed,
        "",
        convert,
        END,
    ])
    text = path.read_text() if path.exists() else "# Benchmarks\n"
    if BEGIN in text and END in text:
        head, rest = text.split(BEGIN, 1)
        text = head + block + rest.split(END, 1)[1]
    else:
        text = text.rstrip("\n") + "\n\n" + block + "\n"
    path.write_text(text)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--dtype", default=None, choices=tuple(_DTYPES),
                        help="default: bf16 on cpu, fp16 on cuda")
    parser.add_argument("--compile", action="store_true",
                        help="wrap every variant in torch.compile")
    parser.add_argument("--quick", action="store_true",
                        help="single-request and serving shapes only, 5 rounds")
    parser.add_argument("--rounds", type=int, default=None, help="default 25 (quick: 5)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads (default: torch's own choice)")
    parser.add_argument("--out", default=str(pathlib.Path(__file__).resolve().parents[1]
                                             / "BENCHMARKS.md"))
    parser.add_argument("--no-write", action="store_true", help="print only")
    opts = parser.parse_args(argv)
    dtype_name = opts.dtype or ("bf16" if opts.device == "cpu" else "fp16")
    rounds = opts.rounds or (5 if opts.quick else 25)
    if opts.threads:
        torch.set_num_threads(opts.threads)
    rows, times = run(opts.device, _DTYPES[dtype_name], rounds, opts.quick, opts.compile)
    speed, convert = tables(rows, times)
    print()
    print(speed)
    print()
    print(convert)
    if not opts.no_write:
        command = "python benchmarks/bench_speed.py " + " ".join(argv if argv is not None
                                                                 else sys.argv[1:])
        write_markdown(pathlib.Path(opts.out), command.strip(), opts.device,
                       dtype_name + (" + torch.compile" if opts.compile else ""), speed, convert)
        print(f"\nwrote {opts.out}")


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        main()
