"""``python -m amprewrite``: see what amprewrite does to a model, from the shell.

::

    python -m amprewrite demo                              # a small transformer, end to end
    python -m amprewrite explain pkg.module:factory        # your model: graph + decisions
    python -m amprewrite audit pkg.module:factory          # your model: one training step
    python -m amprewrite demo --html report.html           # the same as one HTML page
    python -m amprewrite lint pkg.module:factory           # your model: fp16/bf16 pitfalls
    python -m amprewrite compare|search|memory pkg.module:factory   # see cli/precision.py

A factory is a function of no arguments returning ``(model, example_inputs)`` (a module and a
tuple of positional inputs), or ``(model, example_inputs, example_kwargs)``. demo, explain,
audit and lint print a summary first (model, hardware, policy, ops per precision and, but for
lint, which runs nothing, casts against ``torch.autocast``'s); ``--all-nodes`` lists every
node's decision, not only float compute, ``--casts-only`` prints only the cast lines of
``gm.code`` (and their neighbours), ``--html PATH`` also writes one self-contained HTML report
and prints its absolute path. Targets may also be files: ``path/to/file.py:factory``. Errors
in the target or in what the factory returns are reported on one line (exit status 2); a
model that cannot be converted exits with status 1.
Every warning the library gives while a command runs (a model in train mode whose dropout makes
``compare`` meaningless, a checkpoint that export records as plain ops, ...) is printed once, on
stderr after the command's output, as ``amprewrite: warning: ...``.
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import importlib
import importlib.util
import io
import json
import logging
import sys
import warnings
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
import torch.nn as nn

from .common import DTYPES, CliError, policy_for
from .parser import build_parser
from .precision import COMMANDS as PRECISION_COMMANDS
from .precision import run_command as run_precision_command

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "demo":
            from .demo import demo_factory

            model, inputs, kwargs = _check_factory_result(demo_factory(), "demo")
        else:
            model, inputs, kwargs = _check_factory_result(
                _call_factory(_load_factory(args.target), args.target), args.target)
    except CliError as exc:
        print(f"amprewrite: error: {exc}", file=sys.stderr)
        return 2
    # torch logs graph dumps and warnings of failed captures; our message says what matters.
    # NB: for this command only: main() also runs in the caller's process (tests, notebooks).
    torch_logger = logging.getLogger("torch")
    level = torch_logger.level
    torch_logger.setLevel(logging.ERROR)
    try:
        return _main(args, model, inputs, kwargs)
    finally:
        torch_logger.setLevel(level)


def _main(args: argparse.Namespace, model: Any, inputs: Any, kwargs: Any) -> int:
    # NB: recorded, not shown as raised: the commands silence stderr around captures (torch
    # prints partial graphs there), which would swallow the library's warnings with it.
    with warnings.catch_warnings(record=True) as caught:
        error, status = None, 0
        try:
            result = _run(args, model, inputs, kwargs)
        except CliError as exc:
            error, status = f"amprewrite: error: {exc}", 2
        except (ValueError, TypeError, RuntimeError) as exc:  # AmpRewriteError: a RuntimeError
            hint = "\nFrom the command line: add --capture compile." if \
                "could not capture" in str(exc) and args.capture != "compile" else ""
            error, status = (f"amprewrite: cannot convert {type(model).__name__}: "
                             f"{type(exc).__name__}: {exc}{hint}"), 1
    if error is None:
        print(json.dumps(result, indent=2) if args.json else result)
    for line in _warning_lines(caught):
        print(line, file=sys.stderr)
    if error is not None:
        print(error, file=sys.stderr)
    return status


def _warning_lines(caught: list[warnings.WarningMessage]) -> list[str]:
    """Each warning raised during a command, once, as ``amprewrite: warning: ...`` (the
    category named when it is not a plain UserWarning)."""
    lines: list[str] = []
    for w in caught:
        text = str(w.message).removeprefix("amprewrite: ")
        kind = "" if w.category is UserWarning else f" ({w.category.__name__})"
        line = f"amprewrite: warning{kind}: {text}"
        if line not in lines:
            lines.append(line)
    return lines


# -- targets ----------------------------------------------------------------------------------
def _load_factory(target: str) -> Callable[[], Any]:
    module_name, sep, attr = target.rpartition(":")
    if not sep or not module_name or not attr:
        raise CliError(f"target {target!r} must look like 'pkg.module:factory' or "
                       "'path/to/file.py:factory'")
    try:
        if module_name.endswith(".py") or "/" in module_name:
            module = _import_file(Path(module_name))
        else:
            sys.path.insert(0, str(Path.cwd()))  # as `python -m` does for the current folder
            module = importlib.import_module(module_name)
    except CliError:
        raise
    except Exception as exc:  # an import runs the user's code: any error means "cannot load"
        raise CliError(f"cannot import {module_name!r} (from target {target!r}): "
                       f"{type(exc).__name__}: {_first_line(exc)}") from None
    factory = getattr(module, attr, None)
    if factory is None:
        names = [n for n in vars(module) if not n.startswith("_")]
        near = difflib.get_close_matches(attr, names, 3)
        raise CliError(f"module {module_name!r} has no attribute {attr!r}"
                       + (f"; did you mean {', '.join(map(repr, near))}?" if near else ""))
    if not callable(factory):
        raise CliError(f"{target!r} is a {type(factory).__name__}, not a function; expected a "
                       "factory returning (model, example_inputs)")
    return factory


def _call_factory(factory: Callable[[], Any], target: str) -> Any:
    try:
        return factory()
    except Exception as exc:  # the user's code: report it, do not crash with a traceback
        raise CliError(f"factory {target!r} raised {type(exc).__name__}: "
                       f"{_first_line(exc)}") from None


def _import_file(path: Path) -> Any:
    if not path.is_file():
        raise CliError(f"no such file: {str(path)!r}")
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    sys.modules[path.stem] = module
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else "(no message)"


def _check_factory_result(result: Any, target: str) -> tuple[nn.Module, tuple, dict]:
    where = f"factory {target!r}"
    if not isinstance(result, tuple) or len(result) not in (2, 3):
        raise CliError(f"{where} returned {_describe(result)}; expected a tuple "
                       "(model, example_inputs) or (model, example_inputs, example_kwargs)")
    model, inputs, kwargs = (tuple(result) + ({},))[:3]
    if not isinstance(model, nn.Module):
        raise CliError(f"{where} returned {_describe(model)} as the model; expected a "
                       "torch.nn.Module")
    if isinstance(inputs, torch.Tensor):
        raise CliError(f"{where} returned a Tensor as example_inputs; expected a tuple of "
                       "positional inputs: return (model, (x,))")
    if not isinstance(inputs, tuple):
        raise CliError(f"{where} returned {_describe(inputs)} as example_inputs; expected a "
                       "tuple of positional inputs, e.g. (x,)")
    if not isinstance(kwargs, dict):
        raise CliError(f"{where} returned {_describe(kwargs)} as example_kwargs; expected a "
                       "dict")
    return model, inputs, kwargs


def _describe(value: Any) -> str:
    if isinstance(value, tuple):
        return f"a tuple of {len(value)}"
    return f"a {type(value).__name__}"


def _convert(args: argparse.Namespace, model: nn.Module, inputs: tuple,
             kwargs: dict) -> tuple[Any, list[Any], Callable[[], Any]]:
    """(what explain() takes, its converted graphs, a call of the converted model)."""
    from ..compile_backend import compile as amp_compile
    from ..convert import convert

    dtype = DTYPES[args.dtype]
    policy = policy_for(args.policy, dtype)
    if args.capture == "compile":
        compiled = amp_compile(model, policy=policy, dtype=dtype, eager=True)
        compiled(*inputs, **kwargs)  # graphs are captured on the first call
        return compiled, list(compiled.amprewrite_backend.graphs), \
            lambda: compiled(*inputs, **kwargs)
    gm = convert(model, inputs, example_kwargs=kwargs or None, policy=policy, dtype=dtype,
                 capture=args.capture)
    return gm, [gm], lambda: gm(*inputs, **kwargs)


def _run(args: argparse.Namespace, model: nn.Module, inputs: tuple, kwargs: dict) -> Any:
    from ..code_view import marked_code
    from ..explain import decision_tables, explain_records
    from ..summary import count_forward_casts, graph_facts

    if args.command in PRECISION_COMMANDS:
        return run_precision_command(args, model, inputs, kwargs)
    if args.command in ("demo", "audit") and args.capture == "compile":
        # NB: torch.compile runs a model eagerly, unconverted, while a dispatch mode (the
        # auditor's) is active: the audit would describe fp32 ops that never run converted.
        raise CliError(f"{args.command} cannot use --capture compile: torch.compile skips "
                       "its compiled graphs under the auditor; use --capture export or "
                       "symbolic, or 'explain --capture compile' for the decisions")
    # NB: a failed torch.export prints its partial graph; our error message says what matters.
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        converted, graphs, call = _convert(args, model, inputs, kwargs)
    dtype = DTYPES[args.dtype]
    all_nodes = getattr(args, "all_nodes", False)
    # NB: lint only reads the graph: a model whose converted forward fails (an fp16 fill that
    # overflows) is what it is there to explain.
    casts = None if args.command == "lint" else \
        count_forward_casts(model, call, inputs, kwargs, dtype)
    facts = [graph_facts(gm) for gm in graphs]
    summary: dict[str, Any] = {"graphs": facts, "forward_casts": casts}
    loss_fn = _demo_loss if args.command == "demo" else _generic_loss
    if args.command == "demo":
        from .measure import side_by_side

        summary["vs_autocast"] = side_by_side(model, converted, inputs, call, loss_fn, dtype)
    out: dict[str, Any] = {"summary": summary}
    if args.command in ("demo", "explain"):
        out["code"] = "\n".join(
            (f"# graph {i}\n" if len(graphs) > 1 else "")
            + marked_code(gm, casts_only=getattr(args, "casts_only", False))
            for i, gm in enumerate(graphs))
        out["explain"] = explain_records(converted) if args.json else \
            decision_tables(converted, all_nodes=all_nodes)
    if args.command == "lint":
        out["lint"] = _lint(graphs, args.json)
    report = None
    if args.command in ("demo", "audit"):
        report = _audit_step(model, call, loss_fn)
        if report is None:
            out["audit"] = "(auditor unavailable: needs tabulate)"
        else:
            out["audit"] = report.to_dict() if args.json else \
                _audit_text(report, max_rows=15 if args.command == "demo" else 40)
    html = getattr(args, "html", None)
    if html:
        from ..htmlreport import html_report

        html_report(converted, audit_report=report, path=html,
                    casts=summary["forward_casts"], vs_autocast=summary.get("vs_autocast"))
        out["html"] = str(Path(html).resolve())
    if args.json:
        return out
    out["summary"] = _summary_text(summary, len(graphs) > 1)
    return _text(out)


def _lint(graphs: list[Any], as_json: bool) -> Any:
    """``amprewrite.lint`` of each graph: its findings, or (as text) a line that says that
    none were found and which device's advice was checked."""
    import dataclasses

    from ..audit.lints import advice_device, lint

    findings = [finding for gm in graphs for finding in lint(gm)]
    if as_json:
        return [dataclasses.asdict(finding) for finding in findings]
    device = advice_device(graphs[0])
    note = f"advice for {device}" + ("" if device == "cuda" else
                                     "; tensor-core alignment is checked on CUDA only")
    return "\n".join(map(str, findings)) + f"\n({note})" if findings else \
        f"nothing found ({note})"


def _summary_text(summary: dict[str, Any], several: bool) -> str:
    from ..summary import summary_lines
    from .measure import measurement_lines

    lines = []
    for i, facts in enumerate(summary["graphs"]):
        lines += ([f"graph {i}:"] if several else []) + summary_lines(
            facts, None if several else summary["forward_casts"])
    casts = summary["forward_casts"]
    if several and casts is not None:
        lines.append(f"one forward runs {casts['converted']} cast kernels, torch.autocast "
                     f"{casts['autocast']}")
    if "vs_autocast" in summary:
        lines += measurement_lines(summary["vs_autocast"])
    return "\n".join(lines)


def _text(out: dict[str, Any]) -> str:
    titles = {"summary": "summary", "code": "rewritten graph (gm.code; # cast marks casts)",
              "explain": "decisions on floating tensors (amprewrite.explain)",
              "lint": "fp16/bf16 pitfalls (amprewrite.lint)",
              "audit": "one training step (amprewrite.audit)"}
    html = out.pop("html", None)
    return "\n\n".join(f"== {titles[key]} ==\n{value}" for key, value in out.items()) + \
        (f"\n\nwrote the HTML report: {html}" if html else "")


def _demo_loss(out: torch.Tensor) -> torch.Tensor:
    # Next-token prediction on the demo's own ids would need them here; a fixed target works
    # as well to exercise every backward op.
    target = torch.zeros(out.shape[:-1], dtype=torch.long, device=out.device)
    return torch.nn.functional.cross_entropy(out.float().flatten(0, -2), target.flatten())


def _generic_loss(out: Any) -> torch.Tensor:
    leaves = [t for t in torch.utils._pytree.tree_leaves(out)
              if isinstance(t, torch.Tensor) and t.is_floating_point()]
    if not leaves:
        raise CliError("the model returned no floating-point tensor to take a loss of; "
                       "audit needs one to run a backward pass")
    return leaves[0].float().pow(2).mean()


def _audit_text(report: Any, max_rows: int) -> str:
    """The audit tables, and the fp8 matmuls' scales and saturation when the model has any."""
    fp8 = report.fp8_table()
    return report.table(max_rows=max_rows) + (f"\n\nfp8 matmuls\n{fp8}" if fp8 else "")


def _audit_step(model: nn.Module, call: Callable[[], Any],
                loss_fn: Callable[[Any], torch.Tensor]) -> Any:
    """Forward and backward of one training step under ``amprewrite.audit()``, then an SGD
    step; the report, or None when the auditor is not available."""
    try:
        import tabulate  # noqa: F401 -- the report's tables need it

        from ..audit.report import audit
    except ImportError:
        return None
    params = [p for p in model.parameters() if p.requires_grad]
    with audit() as report:
        loss = loss_fn(call())
        if loss.requires_grad:
            loss.backward()
    if params:
        torch.optim.SGD(params, lr=1e-3).step()
    return report
