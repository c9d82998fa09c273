"""The arguments of ``python -m amprewrite``: every command, its options and an example.

Argument parsing only: this module imports nothing but ``argparse`` (no torch), so that
``--help`` and a mistyped option answer before the commands import torch and the package
(``tests/test_cli.py`` loads it on its own and checks).
"""

from __future__ import annotations

import argparse

__all__ = ["build_parser", "DTYPE_NAMES", "POLICIES", "CAPTURES"]

DTYPE_NAMES = ("bf16", "fp16")
"""The names ``--dtype`` takes (:data:`amprewrite.cli.common.DTYPES` maps them to dtypes)."""

POLICIES = ("default", "autocast-cpu", "autocast-cuda", "fp8")

CAPTURES = ("export", "symbolic", "compile")

_TARGET = ("pkg.module:factory or path/to/file.py:factory; the factory returns "
           "(model, example_inputs)")

_FACTORY = """
A factory is a function of no arguments returning (model, example_inputs), e.g. in
my_models.py:

    import torch

    def tiny():
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Softmax(-1))
        return model, (torch.randn(2, 8),)
"""

_EXAMPLES = {
    "demo": "example:\n  python -m amprewrite demo --html report.html",
    "explain": "example:\n  python -m amprewrite explain my_models.py:tiny --casts-only",
    "audit": "example:\n  python -m amprewrite audit my_models.py:tiny --dtype fp16",
    "lint": "example:\n  python -m amprewrite lint my_models.py:tiny",
    "compare": "example:\n  python -m amprewrite compare my_models.py:tiny --dtype fp16 --top 10",
    "search": "example:\n  python -m amprewrite search my_models.py:tiny --tol 1e-3",
    "memory": "example:\n  python -m amprewrite memory my_models.py:tiny --json",
}
"""One example per command, shown at the end of its ``--help``."""


def _command(sub: argparse._SubParsersAction, name: str, text: str,
             parents: list[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    epilog = _EXAMPLES[name] + ("" if name == "demo" else "\n" + _FACTORY)
    cmd = sub.add_parser(name, parents=parents, help=text, description=text, epilog=epilog,
                         formatter_class=argparse.RawDescriptionHelpFormatter)
    if name != "demo":
        cmd.add_argument("target", help=_TARGET)
    return cmd


def build_parser() -> argparse.ArgumentParser:
    """The parser of ``python -m amprewrite`` and its commands."""
    parser = argparse.ArgumentParser(
        prog="python -m amprewrite",
        description="Automatic mixed precision as a graph rewrite: show the rewritten graph, "
                    "every precision decision, and the dtypes of a training step.",
        epilog="example:\n  python -m amprewrite demo\n  python -m amprewrite explain "
               "my_models.py:tiny\n\n'python -m amprewrite COMMAND --help' shows each "
               "command's options and an example.",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--dtype", choices=sorted(DTYPE_NAMES), default="bf16",
                        help="low precision dtype (default: bf16)")
    common.add_argument("--policy", choices=POLICIES, default="default",
                        help="default: CUDA AMP rules on every device; autocast-cpu / "
                             "autocast-cuda: exactly torch.autocast's lists for that device; "
                             "fp8: bf16 with the linear layers as fp8 matmuls")
    common.add_argument("--capture", choices=CAPTURES, default="export",
                        help="export (default), symbolic, or compile (the torch.compile "
                             "backend, for models with graph breaks)")
    common.add_argument("--json", action="store_true", help="print JSON instead of tables")
    view = argparse.ArgumentParser(add_help=False)
    view.add_argument("--html", metavar="PATH",
                      help="also write a self-contained HTML report to PATH")
    code = argparse.ArgumentParser(add_help=False)
    code.add_argument("--all-nodes", action="store_true",
                      help="list every node's decision, not only the ops on floating tensors")
    code.add_argument("--casts-only", action="store_true",
                      help="print only the cast lines of gm.code and their neighbours")
    _command(sub, "demo", "convert a small transformer; print its graph, decisions and audit",
             [common, view, code])
    _command(sub, "explain", "print the rewritten graph and every decision",
             [common, view, code])
    _command(sub, "audit", "audit the dtypes and ranges of one training step", [common, view])
    _command(sub, "lint", "static checks for fp16/bf16 pitfalls (overflowing fills, tiny "
                          "epsilons, fp16 parameters; on CUDA, tensor-core alignment), each "
                          "with a fix", [common])
    cmd = _command(sub, "compare", "error of every op and every gradient against an fp64 run",
                   [common])
    cmd.add_argument("--top", type=int, default=20,
                     help="rows of the op table, worst added error first (default: 20)")
    cmd.add_argument("--no-backward", action="store_true",
                     help="skip the gradients (forward only)")
    cmd = _command(sub, "search",
                   "the fewest ops to keep in fp32 for the output to be within --tol", [common])
    cmd.add_argument("--tol", type=float, default=1e-2,
                     help="largest relative error of the output vs fp64 (default: 1e-2)")
    cmd.add_argument("--max-runs", type=int, default=32,
                     help="conversions and runs allowed (default: 32)")
    _command(sub, "memory", "bytes one training step holds: fp32, autocast, O0-O3", [common])
    return parser
