"""``explain``: every precision decision of a converted graph, as a table.

Collection (:func:`explain_records`, plain dicts for ``--json``) is kept apart from
presentation (:func:`explain`, a fixed-width table whose layout does not depend on any
formatting library's version, so it can be pinned in tests and diffed between runs).

Example (``Sequential(Linear(8, 8), Softmax(-1))``, export capture, default policy; the
summary lines come from :mod:`amprewrite.summary`)::

    model: Sequential
    hardware: cpu: AVX512 (avx512_bf16, amx)
    policy: default (CUDA AMP rules), low dtype bf16
    ops: 1 bf16, 1 fp32, 0 passthrough (2 op nodes)
    casts: 3 cast nodes, 2 of weights (kept copies in inference, one cast per forward in training)
      node     op       category          dtype  out   rule           casts
      -------  -------  ----------------  -----  ----  -------------  ------------------------------------------
    0:
      linear   linear   lower             bf16   bf16  default table  input_1_bf16, _0_weight_bf16, _0_bias_bf16
    1:
      softmax  softmax  fp32 (dtype arg)  f32    f32   default table  -
    2 op nodes: 1 bf16, 1 f32; casts: 3 cast nodes in the graph (0 guarded) after 0 eliminated
"""

from __future__ import annotations

import difflib
from collections import Counter
from typing import Any

import torch
import torch.fx as fx

from .capture.guards import is_input_guards
from .module.first_call import NOT_CAPTURED_YET_KEY
from .module.cache import cache_of
from .module.modes import NOT_CAPTURED_KEY, mode_name
from .compile_backend import AmpBackend
from .graph.meta import META_KEY, cast_info, decision, fp8_step
from .graph.queries import lifted_weight, lifted_weight_name, module_paths
from .graph.subgraphs import nodes_with_bodies
from .policy.tables import OpCategory
from .summary import graph_facts, policy_of, precision_of, short_dtype, summary_lines

__all__ = ["explain", "explain_records", "decision_tables", "converted_graphs", "short_dtype"]

_COLUMNS = ("node", "op", "category", "dtype", "out", "rule", "casts")

SHAPE_OPS = frozenset({
    "view", "reshape", "_unsafe_view", "view_as", "permute", "transpose", "t", "expand",
    "expand_as", "unsqueeze", "squeeze", "flatten", "unflatten", "contiguous", "clone",
    "slice", "select", "narrow", "getitem", "split", "split_with_sizes", "chunk", "unbind",
    "size", "sym_size", "alias", "detach", "as_strided", "movedim", "lift_fresh_copy"})
"""Ops that move or reshape values without computing on them: plumbing, folded by default."""


def converted_graphs(target: Any) -> list[tuple[str, fx.GraphModule]]:
    """The converted graphs behind ``target``: a GraphModule from ``convert``, an
    ``amprewrite.backend()`` object, or a model returned by ``amprewrite.compile``."""

    amp = target.__dict__.get("amprewrite_backend") if hasattr(target, "__dict__") else None
    if isinstance(amp, AmpBackend):
        target = amp
    if isinstance(target, AmpBackend):
        if not target.graphs:
            raise ValueError(
                "amprewrite.explain: this backend has rewritten no graph yet; run the compiled "
                "model once (graphs are captured on the first call), then explain it.")
        return [(f"graph {i}", gm) for i, gm in enumerate(target.graphs)]
    if not isinstance(target, fx.GraphModule):
        raise TypeError(
            f"amprewrite.explain expects a GraphModule returned by amprewrite.convert, an "
            f"amprewrite.backend() or a model from amprewrite.compile; got "
            f"{type(target).__name__}. Convert the model first: "
            "explain(amprewrite.convert(model, example_inputs)).")
    waiting = target.meta.get(NOT_CAPTURED_YET_KEY)
    if waiting is not None:  # a module captured at its first call, not called yet
        raise ValueError(f"amprewrite: {waiting}")
    if policy_of(target) is None:
        raise ValueError(
            f"amprewrite.explain: GraphModule {type(target).__name__} was not converted by "
            "amprewrite (no decisions recorded); pass the result of amprewrite.convert(...).")
    return [("", target)]


def _fp8_row(node: fx.Node) -> dict[str, Any] | None:
    """The row of an fp8 linear: its scaled matmul, fed by the quantize nodes."""
    step = fp8_step(node)
    if step is None or step.role != "matmul":
        return None
    val = node.meta.get("val")
    return {"node": node.name, "op": "linear", "category": "fp8", "dtype": "e4m3",
            "out": short_dtype(val.dtype) if isinstance(val, torch.Tensor) else "-",
            "rule": step.rule, "casts": [a.name for a in node.all_input_nodes
                                         if (q := fp8_step(a)) is not None
                                         and q.role == "quantize"],
            "guarded": False, "module": _module_of(node), "float": True, "precision": "fp8"}


def _module_of(node: fx.Node) -> str:
    """The innermost module ``node`` ran in (``""`` at top level)."""
    # torch.export names nodes outside any module after a hook: they are top level
    paths = [p for p in module_paths(node) if not p.startswith("_empty_nn_module_stack")]
    return paths[-1] if paths else ""


def _row(node: fx.Node, low: torch.dtype) -> dict[str, Any] | None:
    if fp8_step(node) is not None:
        return _fp8_row(node)
    rec = decision(node)
    # torch.export's shape-guard call is bookkeeping, not an op of the model.
    if rec is None or is_input_guards(node):
        return None
    val = node.meta.get("val")
    casts = [a.name for a in node.all_input_nodes if cast_info(a) is not None]
    if not casts:  # guarded promote feeds through getitem nodes of one cast node
        casts = [a.args[0].name for a in node.all_input_nodes
                 if a.op == "call_function" and a.args and isinstance(a.args[0], fx.Node)
                 and cast_info(a.args[0]) is not None and a.args[0].name in rec.casts]
        casts = list(dict.fromkeys(casts))
    return {
        "node": node.name,
        "op": rec.op,
        "category": rec.category.value,
        "dtype": short_dtype(rec.compute_dtype),
        "out": short_dtype(val.dtype) if isinstance(val, torch.Tensor) else
        ("?" if "val" not in node.meta else "-"),
        "rule": f"{rec.rule}; {rec.fp8}" if rec.fp8 else rec.rule,
        "casts": casts,
        "guarded": rec.guarded,
        "module": _module_of(node),
        "float": _computes_on_floats(rec.op, val, "val" in node.meta),
        "precision": precision_of(node, low),
    }


def _computes_on_floats(op: str, val: Any, known: bool) -> bool:
    """Whether a node is float compute (not integer/bool/shape plumbing): its value is a
    floating or complex tensor (an FFT's); a node of unknown dtype (guarded casts) counts."""
    if op in SHAPE_OPS:
        return False
    if not known:
        return True
    return any(isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex())
               for t in torch.utils._pytree.tree_leaves(val))


def _summary(gm: fx.GraphModule, rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The footer's counts. The casts are counted on the graph as it is now, as the header's
    ``cast nodes`` are (:func:`~amprewrite.summary.graph_facts`): a count the passes kept
    would miss the casts the compile backend adds and merges after them."""
    report = gm.meta.get(META_KEY)
    per_dtype = Counter(r["dtype"] if r["category"] != OpCategory.PASSTHROUGH.value
                        else "passthrough" for r in rows)
    eliminated = dict(getattr(report, "eliminated", Counter()))
    casts = [info for n in nodes_with_bodies(gm) if (info := cast_info(n)) is not None]
    return {
        "op_nodes": len(rows),
        "per_dtype": dict(sorted(per_dtype.items())),
        "casts_inserted": len(casts),  # NB: the cast nodes in the graph, all of them ours
        "casts_eliminated": sum(eliminated.values()),
        "eliminated_by_rule": dict(sorted(eliminated.items())),
        "guarded_casts": sum(info.guarded for info in casts),
    }


def explain_records(target: Any) -> list[dict[str, Any]]:
    """The decisions behind :func:`explain` as plain dicts (JSON-ready), one per graph:
    ``{"graph", "policy", "low_dtype", "nodes": [...], "summary": {...}}``.

    A converted module whose train and eval modes run different graphs has one record for
    both: each node row carries ``"mode"`` (``"train"`` or ``"eval"`` for a decision of one
    mode only, ``"both"`` for one both make), ``"summary"`` is the current mode's and
    ``"modes"`` maps each mode to its summary, or to ``{"not_captured": reason}``. A mode
    not captured yet (the module was never switched to it) is named by
    ``"not_captured_yet"``; the rows are then the captured mode's, without ``"mode"``.

    Each row names its innermost ``"module"``, whether it is ``"float"`` compute (an op
    on floating tensors that is not a view or reshape) and its ``"precision"`` (``"low"``,
    ``"fp32"``, ``"passthrough"``, as :func:`amprewrite.summary.precision_of`, or
    ``"fp8"``); ``"facts"`` is
    :func:`amprewrite.summary.graph_facts`."""
    out = []
    model = _compiled_model(target)
    for title, gm in converted_graphs(target):
        low = policy_of(gm)[1]  # type: ignore[index]  # converted_graphs checked it
        rows = _rows(gm, low)
        facts = graph_facts(gm)
        if model is not None:  # a Dynamo graph: named after the model, weights by their names
            facts["model"] = type(model).__name__
            _name_lifted_casts(rows, gm, model)
        record = {"graph": title, "policy": facts["policy"], "low_dtype": facts["low_dtype"],
                  "hardware": facts["hardware"], "fast_low_dtype": facts["fast_low_dtype"],
                  "facts": facts, "nodes": rows, "summary": _summary(gm, rows)}
        cache = cache_of(gm)
        if cache is not None and cache.mode_graphs(gm):
            _add_modes(record, gm, low)
        elif cache is not None and cache.pending_mode() is not None:
            record["not_captured_yet"] = mode_name(bool(cache.pending_mode()))
        out.append(record)
    return out


def _compiled_model(target: Any) -> torch.nn.Module | None:
    """The model behind a model from ``amprewrite.compile`` (``torch.compile``'s wrapper)."""
    model = target.__dict__.get("_orig_mod") if hasattr(target, "__dict__") else None
    if model is None and isinstance(target, torch.nn.Module):
        model = target._modules.get("_orig_mod")
    return model if isinstance(model, torch.nn.Module) else None


def _name_lifted_casts(rows: list[dict[str, Any]], gm: fx.GraphModule,
                       model: torch.nn.Module) -> None:
    """Name each cast of a weight Dynamo lifted to an input as ``convert`` names it, after
    the weight (``blocks_0_qkv_weight_bf16``, not
    ``l_self_modules_blocks_modules_0_modules_qkv_parameters_weight__bf16``)."""
    names = {}
    for node in gm.graph.nodes:
        source = node.all_input_nodes[0] if node.all_input_nodes else None
        if cast_info(node) is None or not lifted_weight(source):
            continue
        qualified = lifted_weight_name(source, model)
        if qualified is not None and node.name.startswith(source.name):
            name = f"{qualified.replace('.', '_')}_{node.name[len(source.name):].lstrip('_')}"
            names[node.name] = f"_{name}" if name[0].isdigit() else name  # as torch.fx names
    for row in rows:
        row["casts"] = [names.get(c, c) for c in row["casts"]]


def _rows(gm: fx.GraphModule, low: torch.dtype) -> list[dict[str, Any]]:
    return [r for r in (_row(n, low) for n in nodes_with_bodies(gm)) if r is not None]


def _add_modes(record: dict[str, Any], gm: fx.GraphModule, low: torch.dtype) -> None:
    """Merge the rows of both modes' graphs, each marked with the mode it belongs to where
    the two differ (in the order of the graphs, as a diff aligns them)."""
    per_mode: dict[str, list[dict[str, Any]]] = {}
    record["modes"] = {}
    for training, graph in cache_of(gm).mode_graphs(gm):  # type: ignore[union-attr]
        name = mode_name(training)
        if NOT_CAPTURED_KEY in graph.meta:
            record["modes"][name] = {"not_captured": graph.meta[NOT_CAPTURED_KEY]}
            per_mode[name] = []
            continue
        per_mode[name] = _rows(graph, low)
        record["modes"][name] = _summary(graph, per_mode[name])
    current = record["modes"][mode_name(gm.training)]
    if "not_captured" not in current:
        record["summary"] = current  # what a call runs now
    (a_name, a), (b_name, b) = per_mode.items()
    keys = [[tuple(str(v) for v in r.values()) for r in rows] for rows in (a, b)]
    merged = []
    for op, i1, i2, j1, j2 in difflib.SequenceMatcher(None, *keys, autojunk=False).get_opcodes():
        if op == "equal":
            merged += [{**r, "mode": "both"} for r in a[i1:i2]]
            continue
        merged += [{**r, "mode": a_name} for r in a[i1:i2]]
        merged += [{**r, "mode": b_name} for r in b[j1:j2]]
    record["nodes"] = merged


def explain(target: Any, *, all_nodes: bool = False,
            casts: dict[str, int] | None = None) -> str:
    """A summary, then the precision decision of every op that computes on floating tensors,
    grouped by module, then a count line.

    Columns: ``node`` (FX node name, usable in ``Policy.override(nodes=...)``), ``op`` (the
    canonical op name, usable in ``ops=...``), ``category``, ``dtype`` (what the op computes
    in; ``-`` for passthrough ops), ``out`` (the dtype it produces), ``rule`` (the table,
    override or autocast region that decided) and ``casts`` (cast nodes feeding it). Rows are
    grouped under the module they run in; integer, bool and shape plumbing (views, reshapes,
    index arithmetic, masks) is folded into one count per module. ``all_nodes=True`` lists
    every op node, in graph order, without grouping. Where the module's train and eval modes
    run different graphs, a ``mode`` column says which mode a decision belongs to (or
    ``both``), and a summary line follows for each mode. Only captured modes are shown: a
    mode the module was never switched to is captured at its first switch (``gm.train()`` /
    ``gm.eval()``; until then, whether its graph differs is not known), so explain a module
    after switching it to each mode to see both.

    ``target`` is a GraphModule from :func:`amprewrite.convert`, an
    :func:`amprewrite.backend` object, or a model from :func:`amprewrite.compile` (one
    table per captured graph). ``casts`` (from :func:`amprewrite.summary.count_forward_casts`)
    adds the cast kernels one forward runs, against ``torch.autocast``'s, to the summary.
    A module captured at its first call and not called yet says so.
    """
    waiting = getattr(target, "meta", {}).get(NOT_CAPTURED_YET_KEY) \
        if isinstance(target, torch.nn.Module) else None
    if waiting is not None:
        return f"not captured yet: {waiting}"
    return _render(target, all_nodes, casts, with_summary=True) + _captures(target)


def _captures(target: Any) -> str:
    """The graphs a converted module keeps, and why each was made (nothing where it holds
    the one graph it was converted with)."""
    cache = cache_of(target) if isinstance(target, torch.nn.Module) else None
    lines = cache.describe() if cache is not None else []
    if not lines or (len(lines) == 1 and not cache.recaptured):  # type: ignore[union-attr]
        return ""
    return "\n\ngraphs kept, oldest first:\n" + "\n".join(
        f"  {i}. {line}" for i, line in enumerate(lines, 1))


def decision_tables(target: Any, *, all_nodes: bool = False) -> str:
    """:func:`explain` without its summary lines (the CLI prints the summary on its own)."""
    return _render(target, all_nodes, None, with_summary=False)


def _render(target: Any, all_nodes: bool, casts: dict[str, int] | None,
            with_summary: bool) -> str:
    if not isinstance(all_nodes, bool):
        raise TypeError(f"amprewrite.explain(all_nodes={all_nodes!r}): expected True or False")
    parts = []
    for rec in explain_records(target):
        lines = [f"== {rec['graph']} ==" if rec["graph"] else ""]
        if with_summary:
            lines += summary_lines(rec["facts"], casts)
        columns = _COLUMNS + (("mode",) if "modes" in rec else ())
        lines += _table(columns, rec["nodes"]) if all_nodes else \
            _grouped_table(columns, rec["nodes"])
        if "modes" not in rec:
            lines.append(_summary_line(rec["summary"]))
        for mode, summary in rec.get("modes", {}).items():
            lines.append(f"{mode} mode: " + (
                f"not captured ({summary['not_captured']}): calling the module in {mode} "
                "mode raises" if "not_captured" in summary else _summary_line(summary)))
        parts.append("\n".join(line for line in lines if line))
    return "\n\n".join(parts)


def _cells(columns: tuple[str, ...], row: dict[str, Any]) -> list[str]:
    return [row[c] if c != "casts" else (", ".join(row[c]) or "-") for c in columns]


def _grouped_table(columns: tuple[str, ...], rows: list[dict[str, Any]]) -> list[str]:
    """The float-compute rows under one line per run of nodes of one module, which also
    counts the plumbing nodes folded away there."""
    groups: list[tuple[str, list[dict[str, Any]], int]] = []
    for row in rows:
        if not groups or groups[-1][0] != row["module"]:
            groups.append((row["module"], [], 0))
        module, kept, folded = groups[-1]
        if row["float"]:
            kept.append(row)
        else:
            groups[-1] = (module, kept, folded + 1)
    table = _table(columns, [r for _, kept, _ in groups for r in kept], indent="  ")
    out, body = table[:2], iter(table[2:])
    for module, kept, folded in groups:
        note = f" ({folded} integer/bool/shape node{'s' if folded != 1 else ''} folded)" \
            if folded else ""
        out.append(f"{module or '(top level)'}:{note}")
        out += [next(body) for _ in kept]
    return out


def _summary_line(s: dict[str, Any]) -> str:
    per = ", ".join(f"{n} {d}" for d, n in s["per_dtype"].items()) or "none"
    by_rule = ", ".join(f"{k} {v}" for k, v in s["eliminated_by_rule"].items())
    return (f"{s['op_nodes']} op nodes: {per}; casts: {s['casts_inserted']} cast nodes in "
            f"the graph ({s['guarded_casts']} guarded) after {s['casts_eliminated']} "
            f"eliminated{f' ({by_rule})' if by_rule else ''}")


def _table(header: tuple[str, ...], rows: list[dict[str, Any]], indent: str = "") -> list[str]:
    cells = [_cells(header, r) for r in rows]
    widths = [max([len(h)] + [len(str(r[i])) for r in cells]) for i, h in enumerate(header)]

    def line(values: Any) -> str:
        return indent + "  ".join(str(c).ljust(w) for c, w in zip(values, widths)).rstrip()

    return [line(header), line("-" * w for w in widths)] + [line(r) for r in cells]
