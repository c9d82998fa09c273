"""The HF zoo's preset checks on one device and dtype: outputs and gradients of every
architecture, bitwise against torch.autocast on that device, under deterministic algorithms.

    CUBLAS_WORKSPACE_CONFIG=:4096:8 python tools/hf_zoo_cuda.py --device cuda --dtype fp16
    python tools/hf_zoo_cuda.py --device cpu --only bert --out zoo.md   # a CPU dry run

The checks are those of ``tests/models/_hf_checks.py`` (``preset_outputs``,
``preset_grads``), made device- and dtype-generic: ``Policy.autocast(device, dtype)`` against
``torch.autocast(device, dtype)``. Each case's failure is caught and reported; the exit status
is 1 when any case failed.
"""

from __future__ import annotations

import argparse
import copy
import os
import pathlib
import sys
import time
from typing import Any, Sequence

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "tests" / "models"))

from _hf_checks import _call, _convert, _expect_same_grads, _expect_same_tensors  # noqa: E402
from _hf_zoo import ZOO, Arch, tensor_leaves  # noqa: E402

import amprewrite  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def _on(device: str, value: Any) -> Any:
    return torch.utils._pytree.tree_map(
        lambda x: x.to(device) if isinstance(x, torch.Tensor) else x, value)


def check_outputs(arch: Arch, device: str, low: torch.dtype) -> None:
    model, example = arch.build().to(device), _on(device, arch.example())
    twin = copy.deepcopy(model)
    gm = _convert(model, example, policy=amprewrite.Policy.autocast(device, low))
    with torch.no_grad():
        with torch.autocast(device, dtype=low):
            want = tensor_leaves(_call(twin, example))
        got = tensor_leaves(_call(gm, example))
    _expect_same_tensors(f"outputs on {device}", got, want)


def check_grads(arch: Arch, device: str, low: torch.dtype) -> None:
    model, example = arch.build().train().to(device), _on(device, arch.example())
    twin = copy.deepcopy(model)
    gm = _convert(model, example, policy=amprewrite.Policy.autocast(device, low))
    arch.loss(_call(gm, example)).backward()
    with torch.autocast(device, dtype=low):
        out = _call(twin, example)
    arch.loss(out).backward()
    _expect_same_grads(model, twin)


CHECKS = {"outputs": check_outputs, "grads": check_grads}


def run(archs: Sequence[Arch], device: str, low: torch.dtype) -> list[tuple[str, str, str]]:
    rows = []
    for arch in archs:
        for name, check in CHECKS.items():
            start = time.perf_counter()
            try:
                torch.manual_seed(0)
                check(arch, device, low)
                status = "yes"
            except Exception as exc:  # noqa: BLE001  (every failure is a row)
                status = "no: " + (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
            rows.append((arch.name, name, status))
            print(f"{arch.name} {name}: {status} ({time.perf_counter() - start:.1f} s)",
                  file=sys.stderr, flush=True)
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", choices=("cpu", "cuda"))
    parser.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    parser.add_argument("--only", help="comma-separated architectures (default: the whole zoo)")
    parser.add_argument("--out", type=pathlib.Path, help="also write the markdown table here")
    args = parser.parse_args(argv)
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    wanted = set(args.only.split(",")) if args.only else None
    archs = [a for a in ZOO if wanted is None or a.name in wanted]
    if wanted and len(archs) != len(wanted):
        parser.error(f"--only: unknown architectures {sorted(wanted - {a.name for a in archs})}")
    rows = run(archs, args.device, DTYPES[args.dtype])
    table = "\n".join([f"HF zoo, {args.device}, {args.dtype}, deterministic algorithms", "",
                       "| architecture | check | bitwise vs torch.autocast |", "|---|---|---|"]
                      + [f"| {a} | {c} | {s} |" for a, c, s in rows])
    print(table)
    if args.out:
        args.out.write_text(table + "\n")
    return 0 if all(s == "yes" for _, _, s in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
