"""Speed, casts and memory of amprewrite against torch.autocast, side by side in one process.

    python benchmarks/bench_speed.py            # full run (CPU bf16), writes BENCHMARKS.md
    python benchmarks/bench_speed.py --quick --no-write --models launch,mlp   # smoke run
    python benchmarks/bench_speed.py --size tiny --models gpt,bert,gpt2 \
        --markdown-section cpu-tiny                 # transformers where per-op overhead decides
    python benchmarks/bench_speed.py --device cuda --dtype fp16 --size realistic \\
        --markdown-section cuda-fp16 --budget-s 210
    python benchmarks/bench_speed.py --device cuda --compile --size realistic --shapes batch \\
        --models gpt,launch --variants autocast,preset,default,O3 --markdown-section cuda-compile

Variants: ``fp32`` eager; ``autocast``: ``torch.autocast``; ``preset``: amprewrite with
``Policy.autocast(device, dtype)`` (autocast's numerics, checked bitwise here); ``default``:
amprewrite with ``Policy(dtype=...)`` (CUDA AMP rules, shared activation casts); ``O2`` and
``O3``: ``convert(..., opt_level="O2"/"O3", dtype=...)`` (low-precision weights with fp32
masters; everything in low precision on the module's own weights); ``cached``: ``preset``'s
module run inside ``amprewrite.cache_weights`` (its kept weight copies reused across calls
instead of rewritten each call; inference only).

Phases (``--phases``): an inference forward under ``torch.no_grad`` (``--inference-mode``:
under ``torch.inference_mode``, as serving code often runs), and a training step: forward, loss
(outside autocast, as the AMP recipes take it), backward, ``optimizer.step()`` and
``optimizer.zero_grad()``. Every variant steps its own optimizer, of the same kind, over its
own parameters: O2's are the fp32 masters bound with ``amprewrite.MasterWeights`` (the step
refreshes their low-precision copies, a cost of O2), O3's are its own low-precision weights.
There is no loss scaler: O3's fp16 weights cannot use one, and every variant runs the same
step.

fp32, autocast, preset and default all train the model's own parameters, so each of their
steps moves the weights that the others then run on (O2 trains a copy of the model: on shared
masters its stored low-precision copies would be refreshed after every variant's step, which
real O2 training never does). Two choices keep that harmless:
the learning rate is 1e-6, so that the weights barely move while the variants are timed
(the work of a step does not depend on the values, barring inf and NaN), and the shared
weights are restored after each training phase, so that every shape and phase starts from
the same weights and a step that overflowed cannot spoil the next measurement. A copy of the
model per variant would avoid the sharing, at the price of one more model per variant in
memory.

Speed is the median over interleaved rounds of torch.autocast's time divided by the
variant's (> 1: faster than autocast); cast kernels are counted exactly with a dispatch mode;
on CUDA, the peak memory of one steady-state call is read from the caching allocator. Only
the block between the ``<!-- NAME:begin/end -->`` markers of BENCHMARKS.md is (re)written,
so runs on several devices and settings keep one block each.
"""

from __future__ import annotations

import time

_START = time.perf_counter()  # the --budget-s clock starts before torch's import

import argparse  # noqa: E402
import contextlib  # noqa: E402
import gc  # noqa: E402
import logging  # noqa: E402
import pathlib  # noqa: E402
import re  # noqa: E402
import sys  # noqa: E402
import threading  # noqa: E402
from typing import Any, Callable  # noqa: E402

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from _models import MODEL_KEYS, SHAPE_LABELS, SIZES, Case, build_case, describe  # noqa: E402
from _speed_report import Finisher, machine, title  # noqa: E402
from _speed_types import (  # noqa: E402
    CONVERTED,
    LR,
    OPTIMIZERS,
    PHASES,
    VARIANTS,
    add_machine_options,
    apply_machine_options,
    ConvertTime,
    key_list,
    Options,
    Report,
    Row,
)
from _timing import (  # noqa: E402
    Budget,
    CastCount,
    count_casts,
    describe_error,
    interleaved_samples,
    median,
    paired_ratio,
    recover,
    step_memory_mb,
)
from _variants import (  # noqa: E402
    bitwise_equal,
    callables,
    convert_variants,
    export_seconds,
    phase_fns,
    restored,
    run_error,
    runner,
)


def _elapsed() -> float:
    """Seconds since the process started (the clock of --budget-s)."""
    return time.perf_counter() - _START


# -- measurement -----------------------------------------------------------------------------
def _prepare(fns: dict[str, Callable[[], Any]], weights: list[torch.Tensor], opts: Options,
             failed: dict[str, str]) -> tuple[dict[str, CastCount], dict[str, tuple[float, float]]]:
    """Run each function to its steady state (weight copies made, lazy initialisation and
    compilation done), then count its casts and, on CUDA, its memory. Functions that raise
    go to ``failed``.

    Casts are not counted under torch.compile: a dispatch mode makes compiled code fall back
    to running eagerly, so the count would describe code that the timings do not run."""
    casts, memory = {}, {}
    device = opts.device
    gc.collect()  # so that the peaks below hold no garbage of earlier phases
    for name, fn in fns.items():
        error = None
        try:
            fn()
            if not opts.compile:
                casts[name] = count_casts(fn, weights)
            used = step_memory_mb(fn, device)
            if used is not None:
                memory[name] = used
        except Exception as exc:  # report it in the table; the other variants go on
            error = describe_error(exc)
        if error is not None:
            failed[name] = error
            recover(device)  # outside the except block: the traceback has let go by now
    return casts, memory


def _measure_phase(model: str, shape: str, phase: str, fns: dict[str, Callable[[], Any]],
                   weights: list[torch.Tensor], opts: Options, deadline: float | None,
                   failed: dict[str, str], bitwise: str) -> Row:
    start = time.perf_counter()
    casts, memory = _prepare(fns, weights, opts, failed)
    setup_s = time.perf_counter() - start
    samples = interleaved_samples({n: f for n, f in fns.items() if n not in failed},
                                  opts.rounds, opts.device, deadline)
    failed.update(samples.failed)
    seconds = samples.seconds
    ms = {n: median(s) * 1e3 for n, s in seconds.items()}
    ref = seconds.get("autocast")
    ratios = {n: paired_ratio(ref, s) for n, s in seconds.items()} if ref else {}
    best = {n: min(ref) / min(s) for n, s in seconds.items()} if ref else {}
    print(f"  {shape:12s} {phase:10s} set-up {setup_s:5.1f} s, {samples.rounds:2d} rounds  "
          + "  ".join(
        f"{n}={ms[n]:.2f}ms" + (f"({ratios[n]:.2f}x)" if n in ratios else "") +
        (f"/{casts[n].kernels}c" if n in casts else "") for n in ms), flush=True)
    for name, error in failed.items():
        print(f"    {name} failed: {error}", flush=True)
    return Row(model, shape, phase, samples.rounds, ms, ratios, best, casts, memory, bitwise,
               dict(failed))


def _measure_shape(case: Case, shape: str, modules: dict[str, nn.Module],
                   convert_errors: dict[str, str], opts: Options, deadline: float | None,
                   report: Report) -> None:
    args, description = case.shapes[shape]
    calls = callables(modules, opts.compile)
    runs = {name: runner(calls[name], args,
                          (opts.device, opts.dtype) if name == "autocast" else None)
            for name in modules}
    bitwise = bitwise_equal(runs)
    # O3's own low-precision tensors count as weights too (none of them should be cast).
    weights = [t for m in {id(m): m for m in modules.values()}.values()
               for t in list(m.parameters()) + list(m.buffers())]
    for i, phase in enumerate(opts.phases):
        report.progress = f"{case.name}, {description}, {phase}"
        failed = dict(convert_errors)
        # The phases left share what is left of this shape's time.
        phase_deadline = None if deadline is None else \
            time.perf_counter() + max(deadline - time.perf_counter(), 0.0) / (len(opts.phases) - i)
        with contextlib.ExitStack() as stack:
            if phase == "train step":
                stack.enter_context(restored(case.model))
            fns = phase_fns(phase, runs, modules, opts, failed, stack)
            report.rows.append(_measure_phase(
                case.name, description, phase, fns, weights, opts, phase_deadline, failed,
                bitwise if phase == "inference" else "-"))


def _fit(case: Case, shape: str, converted: dict[str, nn.Module], converted_for: dict[str, str],
         errors: dict[str, str], opts: Options) -> None:
    """Make the converted variants run on ``shape``'s inputs: reconvert with them those that
    were converted for another shape (export may have specialised a dimension that this
    shape changes). A variant that fails on the very shape it was converted for is dropped
    for the rest of the model, its error kept in ``errors``: converting it again would
    cost seconds and fail again."""
    args = case.shapes[shape][0]
    for name in [n for n in CONVERTED if n in converted]:
        error = run_error(converted[name], args)
        if error is not None and converted_for[name] != shape:
            del converted[name]
            modules, _, failed = convert_variants(case, args, [name], opts)
            converted.update(modules)
            errors.update(failed)
            if name in modules:
                converted_for[name] = shape
                error = run_error(modules[name], args)
        if error is not None and name in converted:
            del converted[name]
            errors[name] = error
            recover(opts.device)


def _measure_model(key: str, opts: Options, budget: Budget, report: Report) -> None:
    name, descriptions = describe(key, opts.size, opts.quick, opts.shapes)
    report.progress = f"{name}: building and converting"
    print(f"[{_elapsed():4.0f} s] {name}", flush=True)
    case = build_case(key, opts.size, opts.device, opts.quick, opts.shapes)
    first = next(iter(case.shapes))
    first_args = case.shapes[first][0]
    names = [n for n in CONVERTED if n in opts.variants]
    export_s = export_seconds(case.model, first_args, report, case.name)
    converted, seconds, errors = convert_variants(case, first_args, names, opts)
    converted_for = {n: first for n in converted}
    report.times.append(ConvertTime(case.name, export_s, seconds, dict(errors)))
    for i, shape in enumerate(case.shapes):
        if budget.exhausted():
            report.note(f"skipped for the time budget: {name} " + ", ".join(descriptions[i:]))
            budget.units_left -= len(descriptions) - i
            return
        deadline = budget.next_deadline()
        _fit(case, shape, converted, converted_for, errors, opts)
        modules = {n: case.model for n in ("fp32", "autocast") if n in opts.variants}
        modules.update({n: converted[n] for n in names if n in converted})
        _measure_shape(case, shape, modules, {n: errors[n] for n in names if n in errors},
                       opts, deadline, report)
        budget.units_left -= 1


def run(opts: Options, budget: Budget, report: Report) -> None:
    """Measure every selected model in turn into ``report``; a model that fails, or does not
    fit in the time budget, is noted and the run goes on."""
    # Export warns when a dynamic dimension of size 1 is specialised; the benchmark then
    # reconverts for the shapes that need it (_fit), so the warning is noise here.
    logging.getLogger("torch._export.non_strict_utils").setLevel(logging.ERROR)
    if opts.compile:
        # Every variant compiles once per grad mode, autocast state and shape; Dynamo's
        # default limit of 8 graphs per function would quietly run the rest eagerly.
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    # torch.export's first call pays one-off imports and set-up; keep it out of the timings.
    torch.export.export(nn.Linear(2, 2).to(opts.device),
                        (torch.randn(1, 2, device=opts.device),), strict=False)
    for key in opts.models:
        name, descriptions = describe(key, opts.size, opts.quick, opts.shapes)
        if not descriptions:
            report.note(f"{name} has none of the shapes {', '.join(opts.shapes or [])}")
            continue
        if budget.exhausted():
            report.note(f"skipped for the time budget: {name} " + ", ".join(descriptions))
            budget.units_left -= len(descriptions)
            continue
        units_before = budget.units_left
        error = None
        try:
            _measure_model(key, opts, budget, report)
        except Exception as exc:  # a model that cannot even be built must not end the run
            error = describe_error(exc)
        if error is not None:
            report.note(f"{name} failed at {report.progress}: {error}")
            budget.units_left = units_before - len(descriptions)
        if opts.compile:
            torch._dynamo.reset()  # the next model's graphs need none of these
        recover(opts.device)


def _parser() -> argparse.ArgumentParser:
    # The docstring's title, usage lines and variants.
    parser = argparse.ArgumentParser(description="\n\n".join(__doc__.split("\n\n")[:3]),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_machine_options(parser)
    parser.add_argument("--size", default="small", choices=SIZES,
                        help="small: 4-layer d256 transformers and small MLP/CNN, sized for "
                        "a CPU; realistic: 12 layers, d_model 768, 12 heads, a 1x128 request "
                        "and an 8x512 batch, MLP 4x4096 and CNN 128ch at 224px, for a GPU; "
                        "tiny: 4-layer d32 transformers on 8 and 2x16 tokens, MLP 4x64, CNN "
                        "8ch at 16px, where per-op host overhead decides (default: small)")
    parser.add_argument("--models", default=",".join(MODEL_KEYS),
                        type=lambda t: key_list(t, MODEL_KEYS, "model"),
                        help="comma-separated model keys: launch (50 tiny LN+Linear blocks, "
                        "batch 2: per-op overhead), mlp, cnn, gpt (a GPT stack), bert, gpt2 and "
                        "llama (HF transformers), run in the order given (default: all)")
    parser.add_argument("--variants", default=",".join(VARIANTS),
                        type=lambda t: key_list(t, VARIANTS, "variant"),
                        help="comma-separated variants to run; autocast, the reference of "
                        "every ratio, is always run; default: all of "
                        f"{','.join(VARIANTS)}")
    parser.add_argument("--shapes", default=None,
                        type=lambda t: key_list(t, SHAPE_LABELS, "shape"),
                        help="comma-separated shape labels to run: single (one request), "
                        "serving (a small batch), large (a larger batch; small size only), "
                        "batch (the realistic size's 8x512 batch and the launch model's "
                        "batch of 2); models with none of them are skipped (default: all)")
    parser.add_argument("--compile", action="store_true",
                        help="wrap every variant in torch.compile (default backend, Inductor)")
    parser.add_argument("--phases", default=",".join(PHASES),
                        type=lambda t: key_list(t, PHASES, "phase"),
                        help=f"comma-separated phases to run (default: {','.join(PHASES)})")
    parser.add_argument("--inference-mode", action="store_true",
                        help="run the inference phase under torch.inference_mode() instead of "
                        "torch.no_grad(), as serving code often does")
    parser.add_argument("--optimizer", default="sgd", choices=tuple(OPTIMIZERS),
                        help=f"the optimizer of every variant's training step, lr {LR:g} "
                        "(default: sgd)")
    parser.add_argument("--quick", action="store_true",
                        help="at most two shapes per model, 5 rounds")
    parser.add_argument("--rounds", type=int, default=None,
                        help="timing rounds per phase (default 25; quick: 5); the time budget "
                        "may cut them to 3")
    parser.add_argument("--budget-s", type=float, default=None,
                        help="wall-clock budget of the whole run in seconds: rounds are cut "
                        "and the remaining shapes and models skipped to fit, and if time "
                        "still runs out, the tables measured so far are printed and the run "
                        "ends (default: no limit)")
    parser.add_argument("--out", default=str(pathlib.Path(__file__).resolve().parents[1]
                                             / "BENCHMARKS.md"),
                        help="the markdown file to write the results into (default: the "
                        "repository's BENCHMARKS.md)")
    parser.add_argument("--markdown-section", default="speed", metavar="NAME",
                        type=_section_name,
                        help="write between <!-- NAME:begin --> and <!-- NAME:end --> in --out "
                        "(appended at the end when the markers are missing), so that runs on "
                        "several devices and settings keep one block each (default: speed)")
    parser.add_argument("--no-write", action="store_true",
                        help="print only; leave the markdown file alone")
    return parser


def _section_name(text: str) -> str:
    if not re.fullmatch(r"[A-Za-z0-9_.-]+", text):
        raise argparse.ArgumentTypeError(
            f"section name {text!r} must be letters, digits, '_', '.' or '-'")
    return text


def main(argv: list[str] | None = None) -> None:
    parser = _parser()
    args = parser.parse_args(argv)
    dtype = apply_machine_options(parser, args)
    opts = Options(args.device, dtype, args.size, args.models,
                   sorted({"autocast", *args.variants}, key=VARIANTS.index), args.shapes,
                   args.rounds or (5 if args.quick else 25), args.quick, args.compile,
                   args.optimizer, args.inference_mode, tuple(args.phases))
    command = " ".join(["python benchmarks/bench_speed.py",
                        *(argv if argv is not None else sys.argv[1:])])
    units = sum(len(describe(k, opts.size, opts.quick, opts.shapes)[1]) for k in opts.models)
    budget = Budget(args.budget_s, _START, units)
    report = Report()
    finisher = Finisher(opts, report, None if args.no_write else pathlib.Path(args.out),
                        args.markdown_section, command, args.budget_s)
    print(f"Machine: {machine(opts.device)}")
    print(f"Run: {title(opts)}; variants {', '.join(opts.variants)}; {opts.rounds} rounds"
          + (f"; budget {args.budget_s:g} s" if args.budget_s else ""), flush=True)
    timer = None
    if args.budget_s is not None:
        timer = threading.Timer(max(budget.remaining() - 1.0, 0.0), finisher.out_of_time)
        timer.daemon = True
        timer.start()
    try:
        run(opts, budget, report)
    except KeyboardInterrupt:
        finisher.finish(f"interrupted during {report.progress}")
        return
    finally:
        if timer is not None:
            timer.cancel()
    finisher.finish()


if __name__ == "__main__":
    main()
