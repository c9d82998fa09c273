"""The options, rows and report of ``bench_speed.py``: what a run measures, as data."""

from __future__ import annotations

import argparse
import dataclasses
from typing import Callable

import torch
from _timing import CastCount

from amprewrite.policy.policy import default_low_dtype

VARIANTS = ("fp32", "autocast", "preset", "default", "O2", "O3", "cached")
CONVERTED = ("preset", "default", "O2", "O3", "cached")
SHORT = {"fp32": "fp32", "autocast": "ac", "preset": "pre", "default": "def", "O2": "O2",
          "O3": "O3", "cached": "cac"}
INFERENCE_ONLY = ("cached",)
"""Variants that only the inference phase runs."""
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
OPTIMIZERS: dict[str, Callable[..., torch.optim.Optimizer]] = {
    "sgd": torch.optim.SGD, "adamw": torch.optim.AdamW}
LR = 1e-6
PHASES = ("inference", "train step")


def add_machine_options(parser: argparse.ArgumentParser) -> None:
    """``--device``, ``--dtype`` and ``--threads``, as every speed benchmark takes them."""
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                        help="where the models run (default: cpu)")
    parser.add_argument("--dtype", default=None, choices=tuple(DTYPES),
                        help="low-precision dtype (default: bf16 on cpu, fp16 on cuda)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads (default: torch's own choice)")


def apply_machine_options(parser: argparse.ArgumentParser, args: argparse.Namespace
                          ) -> torch.dtype:
    """Check ``--device``, set ``--threads``; the low-precision dtype ``--dtype`` names (bf16
    on the CPU, fp16 on CUDA when not given)."""
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA device")
    if args.threads:
        torch.set_num_threads(args.threads)
    return DTYPES[args.dtype] if args.dtype else default_low_dtype(args.device)


def key_list(text: str, allowed: tuple[str, ...], what: str) -> list[str]:
    """A comma-separated command-line list of ``allowed`` keys (an argparse ``type``)."""
    keys = [k.strip() for k in text.split(",") if k.strip()]
    unknown = [k for k in keys if k not in allowed]
    if unknown or not keys:
        raise argparse.ArgumentTypeError(
            f"unknown {what} {', '.join(unknown) or '(none given)'}; choose from "
            f"{', '.join(allowed)}")
    return list(dict.fromkeys(keys))  # in the order given, once each


@dataclasses.dataclass
class Options:
    device: str
    dtype: torch.dtype
    size: str
    models: list[str]
    variants: list[str]
    shapes: list[str] | None
    rounds: int
    quick: bool
    compile: bool
    optimizer: str
    inference_mode: bool = False
    """Whether the inference phase runs under ``torch.inference_mode()`` (else ``no_grad``)."""
    phases: tuple[str, ...] = PHASES


@dataclasses.dataclass
class Row:
    """One model, shape and phase. Variants missing from ``ms`` failed (``failed``) or were
    not selected."""

    model: str
    shape: str
    phase: str
    rounds: int
    ms: dict[str, float]
    vs_autocast: dict[str, float]
    vs_autocast_min: dict[str, float]
    casts: dict[str, CastCount]
    memory: dict[str, tuple[float, float]]
    bitwise: str
    failed: dict[str, str]


@dataclasses.dataclass
class ConvertTime:
    model: str
    export_s: float | None
    convert_s: dict[str, float]
    errors: dict[str, str]


@dataclasses.dataclass
class Report:
    """What the run has measured so far; printed whole, or partial when time runs out."""

    rows: list[Row] = dataclasses.field(default_factory=list)
    times: list[ConvertTime] = dataclasses.field(default_factory=list)
    notes: list[str] = dataclasses.field(default_factory=list)
    progress: str = "start-up"

    def note(self, text: str) -> None:
        print(f"  {text}", flush=True)
        if text not in self.notes:
            self.notes.append(text)
