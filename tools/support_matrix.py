"""Which amprewrite capabilities work on which models of a zoo: a markdown table.

    python tools/support_matrix.py                          # every architecture and capability
    python tools/support_matrix.py --only llama,bert --capabilities default,compile
    python tools/support_matrix.py --json results.json     # also dump the raw results
    python tools/support_matrix.py --update-docs            # rewrite docs/models.md's matrix block
    python tools/support_matrix.py --zoo ecosystem          # torchvision, timm, diffusers, ...

Runs the checks of ``tests/models/_hf_checks.py`` (the ones ``tests/models/test_hf_zoo.py``
and ``test_ecosystem_zoo.py`` run) on the zoo of ``tests/models/_hf_zoo.py`` (``--zoo
transformers``, the default) or of ``_ecosystem_zoo.py`` (``--zoo ecosystem``: every model
whose library imports), all in this process, and catches
every failure. Each cell is "yes" or "no" with a footnote: the first line of the error, or the
known gap's reason. ``--update-docs`` replaces what lies between
``<!-- support-matrix:begin -->`` and ``<!-- support-matrix:end -->`` (``ecosystem-matrix``
for the ecosystem zoo) in docs/models.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import pathlib
import sys
import time
import warnings
from typing import Any, Callable, Sequence

import torch
from tabulate import tabulate

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # _versions, read by the checks
sys.path.insert(0, str(ROOT / "tests" / "models"))

from _hf_checks import CAPABILITIES, run_check  # noqa: E402
from _zoo_entry import ZooEntry  # noqa: E402

MAX_NOTE = 300
"""Footnotes keep at most this many characters of an error's first line."""


@dataclasses.dataclass(frozen=True)
class Zoo:
    """A zoo the matrix runs on.

    Attributes:
        entries: its models.
        known_gaps: (model, capability) -> why it does not work yet.
        model_class: the class column's text for an entry.
        marker: the name of docs/models.md's block (``<!-- {marker}:begin -->``).
        libraries: the packages whose versions the footer names.
    """

    entries: tuple[ZooEntry, ...]
    known_gaps: dict[tuple[str, str], str]
    model_class: Callable[[Any], str]
    marker: str
    libraries: tuple[str, ...]


def transformers_zoo() -> Zoo:
    from _hf_checks import KNOWN_GAPS
    from _hf_zoo import ZOO

    return Zoo(ZOO, KNOWN_GAPS, lambda arch: arch.model_class.__name__, "support-matrix",
               ("torch", "transformers"))


def ecosystem_zoo() -> Zoo:
    from _ecosystem_gaps import KNOWN_GAPS
    from _ecosystem_zoo import ZOO

    here = []
    for m in ZOO:
        if (why := m.missing()) is None:
            here.append(m)
        else:
            print(f"{m.name}: left out, {why}", file=sys.stderr)
    libraries = sorted({m.library for m in here}, key=[m.library for m in ZOO].index)
    return Zoo(tuple(here), {key: gap.reason for key, gap in KNOWN_GAPS.items()},
               lambda m: type(m.build()).__name__, "ecosystem-matrix", ("torch", *libraries))


ZOOS: dict[str, Callable[[], Zoo]] = {"transformers": transformers_zoo,
                                      "ecosystem": ecosystem_zoo}


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


def run_case(zoo: Zoo, arch: ZooEntry, capability: str) -> Result:
    """Run one check, catching whatever it raises."""
    start = time.perf_counter()
    try:
        run_check(arch, capability)
        error = None
    except Exception as exc:  # noqa: BLE001  (every failure is a cell of the matrix)
        error = first_line(exc)
    return Result(arch.name, arch.family, zoo.model_class(arch), capability, error is None,
                  error, zoo.known_gaps.get((arch.name, capability)), time.perf_counter() - start)


def run_all(zoo: Zoo, archs: Sequence[ZooEntry], capabilities: Sequence[str]) -> list[Result]:
    """Every capability on every architecture, with one progress line per case on stderr."""
    results = []
    total = len(archs) * len(capabilities)
    for arch in archs:
        for capability in capabilities:
            result = run_case(zoo, arch, capability)
            results.append(result)
            status = "yes" if result.ok else f"no: {result.error}"
            print(f"[{len(results):3d}/{total}] {arch.name} {capability}: {status} "
                  f"({result.seconds:.1f} s)", file=sys.stderr, flush=True)
    return results


def versions(libraries: Sequence[str]) -> str:
    """``torch 2.14.1, timm 1.0.31, ...``: the versions of the given installed packages."""
    return ", ".join(f"{name} {importlib.import_module(name).__version__}" for name in libraries)


def render(results: Sequence[Result], capabilities: Sequence[str],
           libraries: Sequence[str] = ("torch", "transformers")) -> str:
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
    lines = [table, "", f"{passed} of {len(results)} cases pass ({versions(libraries)}).", ""]
    lines += [f"{n}. {text}" for text, n in notes.items()]
    return "\n".join(lines)


def update_readme(path: pathlib.Path, block: str, marker: str = "support-matrix") -> None:
    """Replace the text between the ``marker`` lines of ``path`` with ``block``."""
    begin, end = f"<!-- {marker}:begin -->", f"<!-- {marker}:end -->"
    text = path.read_text()
    if begin not in text or end not in text or text.index(begin) > text.index(end):
        raise SystemExit(
            f"{path}: no {marker} block to replace. Add the two lines\n  {begin}\n  {end}\n"
            "where the matrix should go, then run --update-docs again.")
    head, rest = text.split(begin, 1)
    _, tail = rest.split(end, 1)
    path.write_text(f"{head}{begin}\n{block}\n{end}{tail}")


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
    parser.add_argument("--zoo", choices=sorted(ZOOS), default="transformers",
                        help="which zoo (default: transformers)")
    parser.add_argument("--only", help="comma-separated architectures (default: the whole zoo)")
    parser.add_argument("--capabilities",
                        help=f"comma-separated capabilities (default: {','.join(CAPABILITIES)})")
    parser.add_argument("--json", type=pathlib.Path, help="write the raw results here")
    parser.add_argument("--update-docs", "--update-readme", dest="update_docs",
                        action="store_true",
                        help="replace the zoo's block in docs/models.md")
    args = parser.parse_args(argv)
    zoo = ZOOS[args.zoo]()
    by_name = {a.name: a for a in zoo.entries}
    archs = [by_name[n] for n in _names(args.only, list(by_name), "architectures")]
    capabilities = _names(args.capabilities, CAPABILITIES, "capabilities")

    # The matrix records failures; warnings and transformers' notices would bury the progress.
    warnings.simplefilter("ignore")
    import transformers

    transformers.logging.set_verbosity_error()
    results = run_all(zoo, archs, capabilities)
    block = render(results, capabilities, zoo.libraries)
    print(block)
    if args.json is not None:
        payload: dict[str, Any] = {
            **{name: importlib.import_module(name).__version__ for name in zoo.libraries},
            "capabilities": capabilities,
            "known_gaps": [[a, c, reason] for (a, c), reason in zoo.known_gaps.items()],
            "results": [dataclasses.asdict(r) for r in results]}
        args.json.write_text(json.dumps(payload, indent=1) + "\n")
    if args.update_docs:
        update_readme(ROOT / "docs" / "models.md", block, zoo.marker)


if __name__ == "__main__":
    main()
