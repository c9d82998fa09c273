"""The ``compare``, ``search`` and ``memory`` commands of ``python -m amprewrite``.

::

    python -m amprewrite compare pkg.module:factory --dtype fp16   # error per op and per grad
    python -m amprewrite search pkg.module:factory --tol 1e-3      # fewest ops to keep in fp32
    python -m amprewrite memory pkg.module:factory                 # bytes of one training step

Targets, ``--dtype``, ``--policy`` and ``--json`` work as for ``explain`` (see
:mod:`amprewrite.cli.main`). A search that cannot reach ``--tol`` says what it reached, on one
line, with exit status 2.
"""

from __future__ import annotations

import argparse
import contextlib
import io
from typing import Any

import torch.nn as nn

from ..convert import convert
from ..precision.compare import compare
from ..precision.search import ToleranceNotReached, search
from ..training.memory import compare_memory
from .common import DTYPES, CliError, policy_for

__all__ = ["COMMANDS", "run_command"]

COMMANDS = ("compare", "search", "memory")


def run_command(args: argparse.Namespace, model: nn.Module, inputs: tuple,
                kwargs: dict) -> Any:
    """The text (or, with ``--json``, the dict) that the command prints."""

    if args.capture == "compile" or (args.command != "compare" and args.capture != "export"):
        raise CliError(f"{args.command} cannot use --capture {args.capture}: it converts "
                       "with " + ("export or symbolic capture" if args.command == "compare"
                                  else "the default capture (export); drop --capture"))
    dtype = DTYPES[args.dtype]
    # NB: a failed torch.export prints its partial graph; the error message says what matters.
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        if args.command == "compare":
            return _compare(args, model, inputs, kwargs, policy_for(args.policy, dtype), dtype)
        if args.command == "search":
            return _search(args, model, inputs, kwargs, policy_for(args.policy, dtype), dtype)
        return _memory(args, model, inputs, kwargs, dtype)


def _compare(args: argparse.Namespace, model: nn.Module, inputs: tuple, kwargs: dict,
             policy: Any, dtype: Any) -> Any:

    gm = convert(model, inputs, example_kwargs=kwargs or None, policy=policy, dtype=dtype,
                 capture=args.capture)
    report = compare(gm, model, inputs, example_kwargs=kwargs or None,
                     backward=not args.no_backward and _trainable(model))
    if args.json:
        return report.to_dict()
    parts = [report.summary(), "== ops, worst added error first ==\n" + report.table(args.top)]
    if report.grads:
        parts.append("== gradients ==\n" + report.grad_table())
    return "\n\n".join(parts)


def _search(args: argparse.Namespace, model: nn.Module, inputs: tuple, kwargs: dict,
            policy: Any, dtype: Any) -> Any:

    try:
        result = search(model, inputs, tol=args.tol, policy=policy, dtype=dtype,
                        max_runs=args.max_runs, example_kwargs=kwargs or None)
    except ToleranceNotReached as exc:
        raise CliError(str(exc).replace("amprewrite.search: ", "search: ")) from None
    if args.json:
        return result.to_dict()
    overrides = ", ".join(f"{n!r}: OpCategory.FP32" for n in result.nodes)
    return (f"{result}\n\nuse it: Policy(...).override(nodes={{{overrides}}})"
            if result.nodes else str(result))


def _memory(args: argparse.Namespace, model: nn.Module, inputs: tuple, kwargs: dict,
            dtype: Any) -> Any:

    result = compare_memory(model, inputs, example_kwargs=kwargs or None, dtype=dtype)
    if args.json:
        return {name: report.to_dict() for name, report in result.items()}
    return result.table()


def _trainable(model: nn.Module) -> bool:
    return any(p.requires_grad for p in model.parameters())
