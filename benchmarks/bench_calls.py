"""Host cost of single calls that a converted forward or training step makes, in µs.

The per-call numbers that BENCHMARKS.md quotes for choices of the generated code and of O2's
refresh, measured with ``timeit`` (best of ``--repeat`` runs of ``--number`` calls), one
torch thread:

* a cast through ``Tensor.to`` against the dtype's own method (``x.bfloat16()``), for a
  weight that requires grad in grad mode and for a tensor without autograd;
* an ATen op through its ``OpOverload`` (``torch.ops.aten.layer_norm.default``) against the
  Python binding eager code calls (``torch.layer_norm``);
* an exported forward's flattening of its arguments against the input spec, which binds a
  positional tensor argument to itself, against binding it directly (no code);
* torch.export's input-shape check (``self._guards_fn(x)``) as torch.export leaves it,
  wrapped in a Dynamo config patch, against the converted module's direct call;
* that check with and without the converted module's floating-vs-integer check of each
  tensor argument, alone and in a whole forward (an embedding and a linear, token ids and
  features);
* the weight read that starts a converted forward of the launch-bound model (200 tensors,
  100 of them handed over as cached bf16 copies in inference, or as O2's stored copies), in
  inference and grad mode;
* O2's stored low-precision copies of the launch-bound model (100 copies): marking them
  stale after a step (``LowPrecisionCopies.mark_stepped``, what ``MasterWeights`` does), their
  refresh (``LowPrecisionCopies.refresh`` whole) and the ``torch._foreach_copy_`` inside it.

    python benchmarks/bench_calls.py
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import timeit
import warnings
from typing import Any

import torch
from torch.fx import _pytree as fx_pytree

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from _models import LaunchBound  # noqa: E402
from _speed_report import machine  # noqa: E402

import amprewrite  # noqa: E402
from amprewrite.runtime.low_copies import LOW_COPIES_ATTR  # noqa: E402
from amprewrite.runtime.weight_cache import CACHE_ATTR  # noqa: E402
from amprewrite.runtime.weight_table import WEIGHTS_ATTR  # noqa: E402
from amprewrite.training.optimizers import held_tensors  # noqa: E402


def _us(stmt: str, env: dict[str, Any], number: int, repeat: int) -> float:
    return min(timeit.repeat(stmt, globals=env, number=number, repeat=repeat)) / number * 1e6


def _converted(opt_level: str) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The launch-bound model converted with autocast's CPU rules (O1) or with O2 (its fp32
    masters bound to the returned optimizer), after one forward: its copies made."""
    model, x = LaunchBound(), torch.randn(2, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the no-fast-bf16 warning of CPUs without AMX
        if opt_level == "O2":
            gm = amprewrite.convert(model, (x,), opt_level="O2")
        else:
            gm = amprewrite.convert(model, (x,), policy=amprewrite.Policy.autocast("cpu"))
    optimizer = torch.optim.SGD(gm.parameters(), lr=1e-6)
    if opt_level == "O2":
        amprewrite.MasterWeights(gm, optimizer)
    with torch.no_grad():
        gm(x)
    return gm, optimizer


def _fetch_env(gm: torch.nn.Module) -> dict[str, Any]:
    """What the weight read of ``gm``'s forward is called with."""
    kwargs = {key: gm.__dict__[attr] for key, attr in
              (("cache", CACHE_ATTR), ("store", LOW_COPIES_ATTR)) if attr in gm.__dict__}
    table = getattr(gm, WEIGHTS_ATTR)
    return {"table": table, "entries": table.entries, "kwargs": kwargs}


def _refresh_env(gm: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """What an O2 refresh after ``optimizer``'s step works on."""
    store = getattr(gm, LOW_COPIES_ATTR)
    pairs = store.copies()
    return {"store": store, "masters": held_tensors([optimizer]), "torch": torch,
            "copies": [c for _, c in pairs], "sources": [m for m, _ in pairs]}


def _guard_rows(x: torch.Tensor, env: dict[str, Any]) -> list[tuple[str, str, str]]:
    """The input-shape check of a Linear exported and converted, if torch.export makes one,
    and the converted forward's argument binding."""
    model = torch.nn.Linear(8, 8)
    exported = getattr(torch.export.export(model, (x,)).module(), "_guards_fn", None)
    if exported is None:
        return []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        gm = amprewrite.convert(model, (x,))
    env.update(converted_guards=gm._guards_fn, exported_guards=exported, spec=gm._in_spec,
               fx_pytree=fx_pytree)
    return [("input-shape check", "exported_guards(x)", "converted_guards(x)"),
            ("argument binding", "y, = fx_pytree.tree_flatten_spec(([x], {}), spec)", "y = x")]


class _IdsAndFeatures(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed, self.fc = torch.nn.Embedding(10, 8), torch.nn.Linear(8, 8)

    def forward(self, ids: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return self.embed(ids) + self.fc(x)


def _dtype_check_line(number: int, repeat: int) -> str:
    """The floating-vs-integer check's cost: the input check (``forward`` of the module that
    runs it) and a whole no-grad forward, each with the check and without it (the same
    module, its per-argument kinds emptied), interleaved, the order alternating."""
    ids, x = torch.randint(0, 10, (2, 3)), torch.randn(2, 3, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        gm = amprewrite.convert(_IdsAndFeatures(), (ids, x))
    guards, kinds = gm._guards_fn, gm._guards_fn._floating
    env = {"gm": gm, "guards": guards, "ids": ids, "x": x, "torch": torch}
    best: dict[tuple[str, bool], float] = {}
    for i in range(2 * repeat):
        for stmt, calls in (("guards.forward(ids, x)", 10 * number), ("gm(ids, x)", number)):
            for checked in ((False, True) if i % 2 else (True, False)):
                guards._floating = kinds if checked else ()
                with torch.no_grad():
                    us = _us(stmt, env, calls, 1)
                best[stmt, checked] = min(best.get((stmt, checked), us), us)
    guards._floating = kinds
    check = {c: best["guards.forward(ids, x)", c] for c in (False, True)}
    forward = {c: best["gm(ids, x)", c] for c in (False, True)}
    return (f"Floating-vs-integer input check (2 tensor arguments): input check "
            f"{check[False]:.2f} -> {check[True]:.2f} µs ({check[True] - check[False]:+.2f}); "
            f"whole no-grad forward {forward[False]:.1f} -> {forward[True]:.1f} µs "
            f"({forward[True] - forward[False]:+.2f}, "
            f"{(forward[True] - forward[False]) / forward[False]:+.1%})")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--number", type=int, default=2000)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    bf16 = torch.bfloat16
    w = torch.randn(8, 8, requires_grad=True)
    x, lw, lb = torch.randn(2, 8), torch.ones(8), torch.zeros(8)
    env = {"w": w, "x": x, "lw": lw, "lb": lb, "bf16": bf16, "torch": torch}
    rows = [
        ("weight cast, grad mode", "w.to(bf16)", "w.bfloat16()"),
        ("activation cast, no autograd", "x.to(bf16)", "x.bfloat16()"),
        ("layer_norm", "torch.ops.aten.layer_norm.default(x, [8], lw, lb, 1e-5, False)",
         "torch.layer_norm(x, [8], lw, lb, 1e-5, False)"),
        ("add", "torch.ops.aten.add.Tensor(x, x)", "torch.add(x, x)"),
    ]
    rows += _guard_rows(x, env)
    print(f"Machine: {machine('cpu')}\n")
    print("| call | slow form | µs | fast form | µs |")
    print("|---|---|---:|---|---:|")
    for what, slow, fast in rows:
        print(f"| {what} | `{slow}` | {_us(slow, env, args.number, args.repeat):.2f} | "
              f"`{fast}` | {_us(fast, env, args.number, args.repeat):.2f} |")
    print()
    print(_dtype_check_line(args.number, args.repeat))
    converted = {level: _converted(level) for level in ("O1", "O2")}
    for opt_level, (gm, _) in converted.items():
        fetch, read = _fetch_env(gm), "table.fetch(*entries, **kwargs)"
        with torch.no_grad():
            inference = _us(read, fetch, args.number, args.repeat)
        print(f"Weight read of the launch-bound model, {opt_level} ({len(fetch['entries'])} "
              f"tensors): {inference:.0f} µs in inference, "
              f"{_us(read, fetch, args.number, args.repeat):.0f} µs in grad mode")
    refresh = _refresh_env(*converted["O2"])
    n = len(refresh["copies"])
    whole = _us("store.refresh()", refresh, args.number // 10, args.repeat)
    marked = _us("store.mark_stepped(masters)", refresh, args.number // 10, args.repeat)
    with torch.no_grad():
        alone = _us("torch._foreach_copy_(copies, sources)", refresh, args.number // 10,
                    args.repeat)
    print(f"O2 copies of the launch-bound model ({n}): marked stale after a step "
          f"{marked:.0f} µs; refreshed all at once {whole:.0f} µs, of which _foreach_copy_ "
          f"{alone:.0f} µs")


if __name__ == "__main__":
    main()
