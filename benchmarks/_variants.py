"""The variants ``bench_speed.py`` times: converting the model, and the function each variant
calls per phase (an inference forward, or a whole training step)."""

from __future__ import annotations

import contextlib
import copy
import time
from typing import Any, Callable, Iterator

import torch
import torch.nn as nn
from _models import Case, first_tensor
from _speed_types import INFERENCE_ONLY, LR, OPTIMIZERS, Options, Report
from _timing import describe_error, recover

import amprewrite


def _dynamic_shapes(args: tuple) -> tuple:
    """Every dimension of every tensor argument ``Dim.AUTO``: what convert exports with, so
    that one conversion serves several shapes where the model allows."""
    return tuple({i: torch.export.Dim.AUTO for i in range(a.dim())}
                 if isinstance(a, torch.Tensor) else None for a in args)


def export_seconds(model: nn.Module, args: tuple, report: Report, name: str) -> float | None:
    try:
        start = time.perf_counter()
        torch.export.export(model, args, dynamic_shapes=_dynamic_shapes(args), strict=False)
        return time.perf_counter() - start
    except Exception as exc:  # report, keep going: the table covers the other models
        report.note(f"{name}: torch.export failed: {describe_error(exc)}")
        return None


def _converters(device: str, dtype: torch.dtype
                ) -> dict[str, Callable[[nn.Module, tuple], nn.Module]]:
    return {
        "preset": lambda m, a: amprewrite.convert(
            m, a, policy=amprewrite.Policy.autocast(device, dtype)),
        "default": lambda m, a: amprewrite.convert(m, a, policy=amprewrite.Policy(dtype=dtype)),
        # O2 trains masters of its own: on shared ones, every other variant's step would make
        # its stored copies stale, and each O2 forward would remake them (inside
        # amprewrite.cache_weights, a cost that real training, where only O2's own step moves
        # them, never pays twice; outside it every forward rewrites them anyway).
        "O2": lambda m, a: amprewrite.convert(copy.deepcopy(m), a, opt_level="O2", dtype=dtype),
        "O3": lambda m, a: amprewrite.convert(m, a, opt_level="O3", dtype=dtype),
        # preset's module, run inside amprewrite.cache_weights (phase_fns)
        "cached": lambda m, a: amprewrite.convert(
            m, a, policy=amprewrite.Policy.autocast(device, dtype)),
    }


def convert_variants(case: Case, args: tuple, names: list[str], opts: Options
             ) -> tuple[dict[str, nn.Module], dict[str, float], dict[str, str]]:
    """The selected amprewrite variants of ``case.model`` converted with ``args``, the
    seconds each conversion took, and the error of each that failed."""
    converters = _converters(opts.device, opts.dtype)
    modules, seconds, errors = {}, {}, {}
    for name in names:
        try:
            start = time.perf_counter()
            modules[name] = converters[name](case.model, args)
            seconds[name] = time.perf_counter() - start
        except Exception as exc:  # one failing variant must not stop the others
            errors[name] = f"convert: {describe_error(exc)}"
        if name in errors:
            recover(opts.device)  # outside the except block: the traceback has let go now
    return modules, seconds, errors


def run_error(module: nn.Module, args: tuple) -> str | None:
    """Why a converted module does not run on ``args`` under ``no_grad``; None if it does."""
    try:
        with torch.no_grad():
            module(*args)
        return None
    except Exception as exc:
        return describe_error(exc)


def runner(fn: Callable[..., Any], args: tuple, autocast: tuple[str, torch.dtype] | None
            ) -> Callable[[], Any]:
    if autocast is None:
        return lambda: fn(*args)

    def run() -> Any:
        with torch.autocast(autocast[0], autocast[1]):
            return fn(*args)
    return run


def inference(run: Callable[[], Any], inference_mode: bool = False) -> Callable[[], Any]:
    """``run`` under ``torch.no_grad()``, or under ``torch.inference_mode()``, as serving code
    often runs a model: no autograd dispatch at all, and tensors without version counters."""
    context = torch.inference_mode if inference_mode else torch.no_grad

    def forward() -> Any:
        with context():
            return run()
    return forward


def _train_step(run: Callable[[], Any], optimizer: torch.optim.Optimizer) -> Callable[[], Any]:
    def step() -> Any:
        # The loss is taken outside autocast, as the AMP recipes do.
        loss = first_tensor(run()).float().square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss
    return step


def callables(modules: dict[str, nn.Module], compile_: bool) -> dict[str, Callable[..., Any]]:
    """What each variant calls: its module, or the module under ``torch.compile``.

    fp32 and autocast run the same model, so they share one compiled module, as a user
    who toggles autocast would (Dynamo compiles one graph per autocast state)."""
    if not compile_:
        return dict(modules)
    compiled: dict[nn.Module, Callable[..., Any]] = {}
    for module in modules.values():
        if module not in compiled:
            compiled[module] = torch.compile(module)
    return {name: compiled[m] for name, m in modules.items()}


def bitwise_equal(runs: dict[str, Callable[[], Any]]) -> str:
    """Whether preset's inference output equals autocast's bitwise, else their largest
    absolute difference."""
    if "preset" not in runs or "autocast" not in runs:
        return "-"
    try:
        with torch.no_grad():
            ac, pre = first_tensor(runs["autocast"]()), first_tensor(runs["preset"]())
        if torch.equal(ac, pre):
            return "yes"
        return f"NO (max abs diff {(ac.float() - pre.float()).abs().max().item():.1e})"
    except Exception as exc:
        return f"failed: {type(exc).__name__}"


def bound_optimizer(name: str, module: nn.Module, kind: str, stack: contextlib.ExitStack
                    ) -> torch.optim.Optimizer:
    """An optimizer of ``kind`` over ``module``'s trainable parameters; for O2, the fp32
    masters bound with :class:`amprewrite.MasterWeights` for as long as ``stack`` is open
    (its steps refresh the stored low-precision copies)."""
    optimizer = OPTIMIZERS[kind]([p for p in module.parameters() if p.requires_grad], lr=LR)
    if name == "O2":
        stack.callback(amprewrite.MasterWeights(module, optimizer).close)
    return optimizer


def phase_fns(phase: str, runs: dict[str, Callable[[], Any]], modules: dict[str, nn.Module],
               opts: Options, failed: dict[str, str], stack: contextlib.ExitStack
               ) -> dict[str, Callable[[], Any]]:
    """The function each variant times in ``phase``. Training binds O2's masters to its
    optimizer for as long as ``stack`` is open."""
    if phase == "inference":
        if "cached" in modules:  # the fast path's promise, for the whole phase
            stack.enter_context(amprewrite.cache_weights(modules["cached"]))
        return {name: inference(run, opts.inference_mode) for name, run in runs.items()}
    fns = {}
    for name, run in runs.items():
        if name in INFERENCE_ONLY:
            continue
        try:
            optimizer = bound_optimizer(name, modules[name], opts.optimizer, stack)
        except Exception as exc:
            failed[name] = describe_error(exc)
            continue
        fns[name] = _train_step(run, optimizer)
    return fns


@contextlib.contextmanager
def restored(model: nn.Module) -> Iterator[None]:
    """Put the model's parameters and buffers back as they were when the block began."""
    tensors = list(model.parameters()) + list(model.buffers())
    saved = [t.detach().clone() for t in tensors]
    try:
        yield
    finally:
        with torch.no_grad():
            for tensor, value in zip(tensors, saved):
                tensor.copy_(value)
