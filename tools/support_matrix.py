"""Which amprewrite capabilities work on which HuggingFace architectures: a markdown table.

    python tools/support_matrix.py                          # every architecture and capability
    python tools/support_matrix.py --only llama,bert --capabilities default,compile
    python tools/support_matrix.py --json results.json     # also dump the raw results
    python tools/support_matrix.py --update-docs            # rewrite docs/models.md's matrix block

Runs the checks of ``tests/models/_hf_checks.py`` (the ones ``tests/models/test_hf_zoo.py``
runs) on the zoo of ``tests/models/_hf_zoo.py``, all in this process, and catches every
failure. Each cell is "yes" or "no" with a footnote: the first line of the error, or the
``KNOWN_GAPS`` reason. ``--update-docs`` replaces what lies between
``<!-- support-matrix:begin -->`` and ``<!-- support-matrix:end -->`` in docs/models.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import sys
import time
import warnings
from typing import Any, Sequence

import torch
from tabulate import tabulate

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # _versions, read by the checks
sys.path.insert(0, str(ROOT / "tests" / "models"))

import transformers  # noqa: E402
from _hf_checks import CAPABILITIES, KNOWN_GAPS, run_check  # noqa: E402
from _hf_zoo import ZOO, Arch  # noqa: E402
from _hf_zoo import arch as zoo_arch

BEGIN, END = "<!-- support-matrix:begin -->", "<!-- support-matrix:end -->"
MAX_NOTE = 300
"""Footnotes keep at most this many characters of an error's first line."""


@dataclasses.dataclass(frozen=True)
class Result:
    """The outcome of one capability on one architecture."""

    arch: str
    family: str
    model_class: str
    capability: str
    ok: bool
    error: str | None
    known_gap: str | None
    seconds: float

    @property
    def note(self) -> str | None:
        """The footnote of the cell: why it is "no", or that a listed gap now passes."""
        if self.known_gap is not None:
            return (f"known gap: {self.known_gap}" if not self.ok
                    else f"passes, but KNOWN_GAPS lists it: {self.known_gap}")
        return self.error


def first_line(exc: BaseException) -> str:
    """``Type: first line of the message``, cut to :data:`MAX_NOTE` characters."""
    lines = str(exc).strip().splitlines()
    text = f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__
    return text if len(text) <= MAX_NOTE else text[:MAX_NOTE - 3] + "..."


def run_case(arch: Arch, capability: str) -> Result:
    """Run one check, catching whatever it raises."""
    start = time.perf_counter()
    try:
        run_check(arch, capability)
        error = None
    except Exception as exc:  # noqa: BLE001  (every failure is a cell of the matrix)
        error = first_line(exc)
    return Result(arch.name, arch.family, arch.model_class.__name__, capability, error is None,
                  error, KNOWN_GAPS.get((arch.name, capability)), time.perf_counter() - start)


def run_all(archs: Sequence[Arch], capabilities: Sequence[str]) -> list[Result]:
    """Every capability on every architecture, with one progress line per case on stderr."""
    results = []
    total = len(archs) * len(capabilities)
    for arch in archs:
        for capability in capabilities:
            result = run_case(arch, capability)
            results.append(result)
            status = "yes" if result.ok else f"no: {result.error}"
            print(f"[{len(results):3d}/{total}] {arch.name} {capability}: {status} "
                  f"({result.seconds:.1f} s)", file=sys.stderr, flush=True)
    return results


def render(results: Sequence[Result], capabilities: Sequence[str]) -> str:
    """The markdown table, a pass count and the numbered footnotes."""
    notes: dict[str, int] = {}  # identical messages share one footnote
    by_arch: dict[str, dict[str, Result]] = {}
    for r in results:
        by_arch.setdefault(r.arch, {})[r.capability] = r

    def cell(r: Result) -> str:
        word = "yes" if r.ok else "no"
        if r.note is None:
            return word
        number = notes.setdefault(r.note, len(notes) + 1)
        return f"{word} [{number}]"

    rows = []
    for name, cells in by_arch.items():
        first = next(iter(cells.values()))
        rows.append([f"`{name}`", first.family, first.model_class,
                     *(cell(cells[c]) if c in cells else "" for c in capabilities)])
    table = tabulate(rows, headers=["architecture", "family", "class", *capabilities],
                     tablefmt="github")
    passed = sum(r.ok for r in results)
    lines = [table, "", f"{passed} of {len(results)} cases pass "
             f"(torch {torch.__version__}, transformers {transformers.__version__}).", ""]
    lines += [f"{n}. {text}" for text, n in notes.items()]
    return "\n".join(lines)


def update_readme(path: pathlib.Path, block: str) -> None:
    """Replace the text between the support-matrix markers of ``path`` with ``block``."""
    text = path.read_text()
    if BEGIN not in text or END not in text or text.index(BEGIN) > text.index(END):
        raise SystemExit(
            f"{path}: no support-matrix block to replace. Add the two lines\n  {BEGIN}\n  {END}\n"
            "where the matrix should go, then run --update-docs again.")
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    path.write_text(f"{head}{BEGIN}\n{block}\n{END}{tail}")


def _names(value: str | None, known: Sequence[str], what: str) -> list[str]:
    if value is None:
        return list(known)
    names = [n.strip() for n in value.split(",") if n.strip()]
    unknown = [n for n in names if n not in known]
    if unknown:
        raise SystemExit(f"unknown {what}: {', '.join(unknown)}; known: {', '.join(known)}")
    return names


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", help="comma-separated architectures (default: the whole zoo)")
    parser.add_argument("--capabilities",
                        help=f"comma-separated capabilities (default: {','.join(CAPABILITIES)})")
    parser.add_argument("--json", type=pathlib.Path, help="write the raw results here")
    parser.add_argument("--update-docs", "--update-readme", dest="update_docs",
                        action="store_true",
                        help=f"replace the block between {BEGIN} and {END} in docs/models.md")
    args = parser.parse_args(argv)
    archs = [zoo_arch(n) for n in _names(args.only, [a.name for a in ZOO], "architectures")]
    capabilities = _names(args.capabilities, CAPABILITIES, "capabilities")

    # The matrix records failures; warnings and transformers' notices would bury the progress.
    warnings.simplefilter("ignore")
    transformers.logging.set_verbosity_error()
    results = run_all(archs, capabilities)
    block = render(results, capabilities)
    print(block)
    if args.json is not None:
        payload: dict[str, Any] = {
            "torch": torch.__version__, "transformers": transformers.__version__,
            "capabilities": capabilities,
            "known_gaps": [[a, c, reason] for (a, c), reason in KNOWN_GAPS.items()],
            "results": [dataclasses.asdict(r) for r in results]}
        args.json.write_text(json.dumps(payload, indent=1) + "\n")
    if args.update_docs:
        update_readme(ROOT / "docs" / "models.md", block)


if __name__ == "__main__":
    main()
