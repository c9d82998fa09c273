"""The package's architecture, checked: lower layers never import higher ones, no import cycles.

Layers, lowest first (docs/how-it-works.md shows the same map)::

    errors, hardware,    no imports from the package but errors (versions: the tested torch
    versions, cast_count range; cast_count: the cast kernels a run makes)
    policy               which op runs in which precision (data and rules)
    runtime              what converted graphs call while they run
    graph                facts about nodes shared by capture, passes and tools
    capture              model -> GraphModule
    module               the converted module after convert: its cache of graphs, its calls
    passes               the graph rewrite
    convert, options     the entry point that runs capture and passes; its options, checked
    compile_backend      the torch.compile backend (runs the passes on Dynamo graphs), and
    compiled_view        the compiled module read as its model
    summary              the first lines of explain, audit and demo
    explain              the decisions of a converted graph, as a table
    audit, training      what ran and in which dtype; master weights, loss scaling, memory
    precision            error per op against an fp64 shadow; the search for fp32 overrides
    htmlreport           one self-contained HTML page of summary, code, decisions and audit
    integrations         bridges to the tools people train and deploy with (optional extras)
    cli                  the command line

An import guarded by ``if TYPE_CHECKING:`` is for annotations only and never runs; it may point
to the same layer, but not close a circle: no cycles even counting those imports.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "amprewrite"

LAYERS = [
    {"errors", "hardware", "versions", "cast_count"},
    {"policy"},
    {"runtime"},
    {"graph"},
    {"capture"},
    {"module"},
    {"passes"},
    {"convert", "options", "recipe"},
    {"compile_backend", "compiled_view"},
    {"summary", "code_view"},
    {"explain"},
    {"audit", "training"},
    {"precision"},
    {"htmlreport"},
    {"integrations"},
    {"cli"},
    {"__main__", "__init__"},
]
RANK = {name: rank for rank, names in enumerate(LAYERS) for name in names}


def _modules() -> dict[str, Path]:
    """``"passes.classify"`` -> its path, for every module of the package."""
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE).with_suffix("").parts
        out[".".join(parts)] = path
    return out


def _is_type_checking_block(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and isinstance(node.test, ast.Name) and \
        node.test.id == "TYPE_CHECKING"


def _runtime_imports(module: str, path: Path, known: set[str],
                     type_only: bool = False) -> set[str]:
    """The package modules ``module`` imports when it runs (any nesting; with ``type_only``,
    also those imported for annotations only)."""
    package = module.split(".")[:-1]  # "passes.classify" and "passes.__init__" -> ["passes"]
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if _is_type_checking_block(node) and not type_only:
            return
        if isinstance(node, ast.ImportFrom) and node.level:
            base = package[: len(package) - (node.level - 1)] if node.level > 1 else package
            target = ".".join(base + (node.module.split(".") if node.module else []))
            for alias in node.names:
                sub = f"{target}.{alias.name}" if target else alias.name
                found.add(sub if sub in known else target)
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("amprewrite"):
            found.add(node.module.removeprefix("amprewrite").lstrip("."))
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text()))
    return {m for m in found if m in known and m != module}


def _graph(type_only: bool = False) -> dict[str, set[str]]:
    modules = _modules()
    return {m: _runtime_imports(m, p, set(modules), type_only) for m, p in modules.items()}


def _layer(module: str) -> int:
    top = module.split(".")[0]
    assert top in RANK, f"amprewrite.{module}: its folder or file {top!r} has no layer in " \
                        "tests/test_layers.py LAYERS; add it where it belongs"
    return RANK[top]


def test_every_module_has_a_layer() -> None:
    for module in _modules():
        _layer(module)


def test_lower_layers_never_import_higher_ones() -> None:
    bad = [f"amprewrite.{m} (layer {_layer(m)}) imports amprewrite.{d} (layer {_layer(d)})"
           for m, deps in _graph().items() for d in deps if _layer(d) > _layer(m)]
    assert not bad, "\n".join(bad)


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    cycles: list[list[str]] = []

    def walk(node: str, path: list[str]) -> None:
        state[node] = 1
        for dep in sorted(graph[node]):
            if state.get(dep) == 1:
                cycles.append(path[path.index(dep):] + [dep] if dep in path else [node, dep])
            elif dep not in state:
                walk(dep, path + [dep])
        state[node] = 2

    for module in sorted(graph):
        if module not in state:
            walk(module, [module])
    return cycles


def test_no_import_cycles() -> None:
    cycles = _cycles(_graph())
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_no_import_cycles_counting_type_only_imports() -> None:
    """An annotation-only import back (``if TYPE_CHECKING:``) still ties two modules into one:
    the shared piece belongs in a third module (``audit.records`` for report and tables)."""
    cycles = _cycles(_graph(type_only=True))
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_the_import_parser_resolves_every_depth() -> None:
    """The parser resolves relative imports at every depth (a check that resolved none would
    pass trivially)."""
    graph = _graph()
    assert "capture.facts" in graph["passes.classify"]
    assert "policy.tables" in graph["graph.meta"]
    assert "passes.calibrate" in graph["passes.classify"]  # a sibling: one dot
    assert "graph.queries" in graph["audit.where"]
    assert "audit.records" in graph["audit.tables"]
    assert "audit.report" not in _graph(type_only=True)["audit.tables"]


def test_each_package_docstring_names_its_modules() -> None:
    """Each folder's ``__init__`` docstring is its map: it names every module in it, as
    ``name`` (docs/how-it-works.md's code map points at these docstrings)."""
    missing = []
    for init in sorted(PACKAGE.glob("*/__init__.py")):
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        for path in sorted(init.parent.glob("*.py")):
            if path.stem != "__init__" and f"``{path.stem}``" not in doc \
                    and f"``amprewrite.{init.parent.name}.{path.stem}``" not in doc:
                missing.append(f"{init.parent.name}/{path.name}")
    assert not missing, "not named in their package's __init__ docstring: " + ", ".join(missing)


def test_the_code_map_names_every_top_level_module() -> None:
    doc = (PACKAGE.parent / "docs" / "how-it-works.md").read_text()
    table = doc[doc.index("## The code map"):].split("\n## ")[0]
    missing = [p.name for p in sorted(PACKAGE.glob("*.py")) if p.name != "__init__.py"
               and f"`{p.name}`" not in table]
    missing += [f"{p.name}/" for p in sorted(PACKAGE.iterdir())
                if (p / "__init__.py").exists() and f"`{p.name}/`" not in table]
    assert not missing, "docs/how-it-works.md's code map lacks: " + ", ".join(missing)
