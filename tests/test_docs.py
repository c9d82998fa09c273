"""The docs cannot drift from the code: every ```python block of README.md and docs/*.md runs,
page by page, and every relative link points to a file (and heading) that exists.

Each page's Python blocks run in order in one fresh namespace, in a temporary working
directory, so a later block may use the variables an earlier one of the same page defined; the
modules it uses it imports itself, so that it reads (and runs) on its own. A block that
cannot run here (a distributed launch, say) is preceded by the line ``<!-- no-run -->`` and is
only compiled; one that needs an optional extra is preceded by ``<!-- requires: onnx,
onnxruntime -->`` and runs where those modules import (compiled elsewhere); output and shell
blocks are fenced ```text / ```bash and not run.
"""

from __future__ import annotations

import ast
import builtins
import importlib.util
import re
import warnings
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
NO_RUN = "<!-- no-run -->"
_REQUIRES = re.compile(r"^<!-- requires: ([\w., ]+) -->$")
_FENCE = re.compile(r"^(\s*)(```+|~~~+)\s*([\w+-]*)")
_LINK = re.compile(r"(?<!!)\[(?:[^\]\[]|\[[^\]]*\])*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def _blocks(path: Path) -> list[tuple[int, str, str, bool]]:
    """(line, language, code, no_run) of every fenced block of ``path``."""
    lines = path.read_text().split("\n")
    blocks: list[tuple[int, str, str, bool]] = []
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        fence, lang, start = m.group(2), m.group(3).lower(), i
        previous = next((x.strip() for x in reversed(lines[:i]) if x.strip()), "")
        i += 1
        body: list[str] = []
        while i < len(lines) and not lines[i].strip().startswith(fence):
            body.append(lines[i])
            i += 1
        blocks.append((start + 1, lang, "\n".join(body) + "\n", previous == NO_RUN))
        i += 1
    return blocks


def _python_pages() -> list[Path]:
    return [p for p in PAGES if any(lang == "python" for _, lang, _, _ in _blocks(p))]


def _name(path: Path) -> str:
    return str(path.relative_to(ROOT))


def _missing_modules(page: Path, line: int) -> list[str]:
    """The modules a ``<!-- requires: ... -->`` mark before the block at ``line`` names that do
    not import here."""
    previous = next((x.strip() for x in reversed(page.read_text().split("\n")[:line - 1])
                     if x.strip()), "")
    m = _REQUIRES.match(previous)
    names = [n.strip() for n in m.group(1).split(",")] if m else []
    return [n for n in names if importlib.util.find_spec(n) is None]


@pytest.mark.parametrize("page", _python_pages(), ids=_name)
def test_python_blocks_run(page: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    namespace: dict[str, object] = {"__name__": "__docs__"}
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the docs show what a call returns, not its notices
        for line, lang, code, no_run in _blocks(page):
            if lang != "python":
                continue
            compiled = compile(code, f"{_name(page)}:{line}", "exec")
            if not no_run and not _missing_modules(page, line):
                exec(compiled, namespace)


def _bound(tree: ast.AST) -> tuple[set[str], set[str]]:
    """(names a block imports, names it binds otherwise: assignments, loops, defs, ...)."""
    imported: set[str] = set()
    other: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            imported |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, ast.Name) and not isinstance(node.ctx, ast.Load):
            other.add(node.id)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            other.add(node.name)
        elif isinstance(node, ast.arg):
            other.add(node.arg)
        elif isinstance(node, ast.ExceptHandler) and node.name:
            other.add(node.name)
    return imported, other


@pytest.mark.parametrize("page", _python_pages(), ids=_name)
def test_each_block_imports_the_modules_it_uses(page: Path) -> None:
    """A block may use variables of earlier blocks, never their imports: copied into a fresh
    interpreter, with the variables it names defined, it runs. Checked on no-run blocks too."""
    defined: set[str] = set()
    missing = []
    for line, lang, code, _ in _blocks(page):
        if lang != "python":
            continue
        tree = ast.parse(code)
        imported, other = _bound(tree)
        used = {n.id for n in ast.walk(tree)
                if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
        free = sorted(used - imported - other - defined - set(dir(builtins)))
        if free:
            missing.append(f"{_name(page)}:{line} uses {', '.join(free)}")
        defined |= other
    assert not missing, "import them in the block, or define them in an earlier one: " + \
        "; ".join(missing)


def test_no_run_marks_are_few_and_on_python_blocks() -> None:
    marked = [(p, line) for p in PAGES for line, lang, _, no_run in _blocks(p) if no_run]
    wrong = [f"{_name(p)}:{line}" for p, line in marked
             if next(b for b in _blocks(p) if b[0] == line)[1] != "python"]
    assert not wrong, f"{NO_RUN} marks a block that is not ```python: {wrong}"
    assert len(marked) <= 6, f"{len(marked)} blocks are not run: {marked}"


def test_requires_marks_are_on_python_blocks() -> None:
    python_lines = {(p, line) for p in PAGES
                    for line, lang, _, _ in _blocks(p) if lang == "python"}
    marks = [(p, i + 1) for p in PAGES for i, x in enumerate(p.read_text().split("\n"))
             if _REQUIRES.match(x.strip())]
    wrong = [f"{_name(p)}:{i}" for p, i in marks
             if not any(q == p and i < line <= i + 2 for q, line in python_lines)]
    assert not wrong, f"a requires mark is not right above a ```python block: {wrong}"


def _slug(heading: str) -> str:
    """A heading's anchor as a Git host renders it: lower case, punctuation dropped, spaces
    to hyphens."""
    text = re.sub(r"[`*_]|<[^>]+>", "", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    anchors: set[str] = set()
    in_code = False
    for line in path.read_text().split("\n"):
        if _FENCE.match(line):
            in_code = not in_code
        elif not in_code and line.startswith("#"):
            slug = _slug(line.lstrip("#"))
            n = seen.get(slug, 0)
            seen[slug] = n + 1
            anchors.add(slug if n == 0 else f"{slug}-{n}")
    return anchors


def _links(path: Path) -> list[str]:
    text, found, in_code = path.read_text(), [], False
    for line in text.split("\n"):
        if _FENCE.match(line):
            in_code = not in_code
        elif not in_code:
            found += _LINK.findall(re.sub(r"`[^`]*`", "", line))
    return found


@pytest.mark.parametrize("page", [*PAGES, ROOT / "BENCHMARKS.md"], ids=_name)
def test_relative_links_resolve(page: Path) -> None:
    broken = []
    for target in _links(page):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
            continue
        file, _, anchor = target.partition("#")
        dest = (page.parent / file).resolve() if file else page
        if not dest.exists():
            where = dest.relative_to(ROOT) if dest.is_relative_to(ROOT) else dest
            broken.append(f"{target}: no file {where}")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            broken.append(f"{target}: no heading #{anchor} in {_name(dest)}")
    assert not broken, f"{_name(page)}: " + "; ".join(broken)


def test_the_link_checker_sees_links() -> None:
    """A checker that found no link would pass trivially."""
    assert "docs/training.md" in _links(ROOT / "README.md")
    assert "weights-changed-after-conversion" in _anchors(ROOT / "docs" / "training.md")


def _training_block(marker: str) -> tuple[int, str]:
    page = ROOT / "docs" / "training.md"
    (found,) = [(line, code) for line, lang, code, _ in _blocks(page)
                if lang == "python" and marker in code]
    return found


def test_the_o2_loop_scales_the_loss_on_the_device_it_runs_on(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """On a machine without a GPU, ``GradScaler("cuda")`` disables itself and fp16 trains
    unscaled; the block's scaler is the model's device's, and nothing warns."""
    monkeypatch.chdir(tmp_path)
    line, code = _training_block("amprewrite.MasterWeights(gm, opt)")
    namespace: dict[str, object] = {"__name__": "__docs__"}
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        exec(compile(code, f"docs/training.md:{line}", "exec"), namespace)
    assert namespace["scaler"].is_enabled()  # type: ignore[attr-defined]
    assert namespace["scaler"]._device == namespace["device"]  # type: ignore[attr-defined]
    about_scaling = [str(w.message) for w in seen
                     if "GradScaler" in str(w.message) or "ScalerMonitor" in str(w.message)]
    assert about_scaling == []


def test_the_cache_weights_block_runs_on_its_own(tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    line, code = _training_block("amprewrite.cache_weights(gm)")
    namespace: dict[str, object] = {"__name__": "__docs__"}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        exec(compile(code, f"docs/training.md:{line}", "exec"), namespace)
    assert len(namespace["replies"]) == 3  # type: ignore[arg-type]


def test_the_trainer_block_says_how_to_install_accelerate() -> None:
    """``transformers.Trainer`` imports accelerate, which the demo extra does not bring."""
    page = ROOT / "docs" / "training.md"
    line, _ = _training_block("transformers.Trainer(")
    lines = page.read_text().split("\n")[:line - 1]
    assert lines[-1] == "<!-- requires: transformers, accelerate -->"
    intro = "\n".join(lines[-8:])
    assert "`pip install transformers accelerate`" in intro
