"""The options, rows and report of ``bench_speed.py``: what a run measures, as data."""

from __future__ import annotations

import argparse
import dataclasses
from typing import Callable

import torch
from _timing import CastCount

VARIANTS = ("fp32", "autocast", "preset", "default", "O2", "O3")
CONVERTED = ("preset", "default", "O2", "O3")
SHORT = {"fp32": "fp32", "autocast": "ac", "preset": "pre", "default": "def", "O2": "O2",
          "O3": "O3"}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
OPTIMIZERS: dict[str, Callable[..., torch.optim.Optimizer]] = {
    "sgd": torch.optim.SGD, "adamw": torch.optim.AdamW}
LR = 1e-6
PHASES = ("inference", "train step")


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
