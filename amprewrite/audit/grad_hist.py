"""Gradient-magnitude histogram: log2 buckets, as Figure 3 of Micikevicius et al. (2018).

What it counts: the values the low dtype holds in the backward, the fp16 (or bf16) outputs of
backward ops, casts included. Those are the values a loss scale multiplies and that overflow
when it is too large. It leaves out fp32 outputs: internals of a backward formula (rsqrt's
backward computes ``pow(x, -1.5)``, huge on the zero embedding row of a padding token, and it
does not grow with the loss) and gradients kept in fp32 (the loss's own, a master weight's);
fp16 never holds them. In a bf16 run the bf16 values stand for what the fp16 policy would
hold (the same ops run in the low dtype): the recommendation is then an fp16 what-if.

From the histogram: the fraction of those values that fp16 would flush to zero
(``|g| < 2**-24``, its smallest subnormal), and a recommended static loss scale: the largest
power of two that keeps the largest of them under fp16's max (65504). The scale is relative
to the loss that was audited: if the audited loss was already scaled by ``s``, multiply.

Its limit: an fp16 run sees only what fp16 kept. A gradient flushed to zero at this scale
makes every gradient computed from it zero too, and a larger scale could make them larger
than anything seen here. When even the largest gradient fp16 held is subnormal, most were
lost, and the recommendation is marked as an upper bound (:attr:`GradHistogram.needs_probe`):
audit one more step with the loss multiplied by it, and follow that step's recommendation
times the probe scale. A bf16 run has no such blind spot: bf16 keeps fp32's range.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch

__all__ = ["GradHistogram", "accumulate", "LOW_EXP", "HIGH_EXP"]

LOW_EXP = -127
"""Lowest bucket: fp32 subnormals (below 2**-126)."""
HIGH_EXP = 128
"""One past the highest bucket: fp32's max is below 2**128."""
_FP16_MAX = 65504.0
_FP16_FLUSH_EXP = -24
"""fp16's smallest subnormal is 2**-24; smaller magnitudes round to zero or to it."""
_FP16_NORMAL_EXP = -14


def accumulate(total: torch.Tensor | None, exponents: torch.Tensor,
               zeros: torch.Tensor) -> torch.Tensor:
    """Add one output's biased-exponent histogram (256 bins of fp32 exponents, as built by
    the audit; bin 0 holds zeros and fp32 subnormals, bin 255 inf/NaN) to ``total``, without
    its ``zeros`` and non-finite values; returns the (new) total, on the same device."""
    counts = exponents[:HIGH_EXP - LOW_EXP].to(torch.float64)
    counts[0] -= zeros
    return counts if total is None else total.add_(counts)


@dataclasses.dataclass(frozen=True)
class GradHistogram:
    """Counts of backward-op output magnitudes per power of two.

    ``counts[e]`` is the number of values with ``2**e <= |g| < 2**(e+1)``; empty buckets are
    left out. ``max_abs`` is the largest finite gradient magnitude seen.
    """

    counts: dict[int, int]
    max_abs: float | None
    dtype: str | None = None
    """``"float16"`` when fp16 held the values, ``"bfloat16"`` for a bf16 run (the fp16
    what-if); None for a report written before the histogram said."""
    nonfinite: int = 0
    """Backward values the low dtype held as inf/NaN (fp16 overflow at the audited scale)."""

    @property
    def what_if(self) -> bool:
        """The values were bf16: the recommendation is what the fp16 policy would need."""
        return self.dtype == "bfloat16"

    @property
    def overflowed(self) -> bool:
        """fp16 already overflowed at the audited scale: scale the loss down."""
        return self.nonfinite > 0 and not self.what_if

    @property
    def needs_probe(self) -> bool:
        """Even the largest gradient fp16 held is subnormal (below 2**-14): at this scale fp16
        lost most gradients, and with them what a larger scale gives. The recommendation is
        then an upper bound until a step at that scale confirms it (the module's docstring).

        NB: subnormal gradients beside normal ones are the rule (a third to all of them on
        the models of the tests) and do not make the largest one wrong: only a gradient
        computed from flushed ones could outgrow it."""
        return (not self.what_if and not self.overflowed and self.max_abs is not None
                and self.max_abs < 2.0 ** _FP16_NORMAL_EXP)

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    @property
    def fp16_flush_fraction(self) -> float:
        """Fraction of nonzero gradient values that fp16 flushes to zero (< 2**-24)."""
        total = self.total
        lost = sum(c for e, c in self.counts.items() if e < _FP16_FLUSH_EXP)
        return lost / total if total else 0.0

    @property
    def fp16_subnormal_fraction(self) -> float:
        """Fraction in fp16's subnormal range [2**-24, 2**-14): kept, with fewer bits."""
        total = self.total
        sub = sum(c for e, c in self.counts.items() if _FP16_FLUSH_EXP <= e < _FP16_NORMAL_EXP)
        return sub / total if total else 0.0

    @property
    def recommended_loss_scale(self) -> float | None:
        """Largest power of two ``s`` with ``max_abs * s <= 65504``, from the values fp16
        holds (or would hold) in the backward. Below 1 when they exceed fp16's max: scale
        the loss down. None without such values, or when fp16 already overflowed (one step
        cannot tell by how much to scale down: :attr:`overflowed`)."""
        if not self.max_abs or self.overflowed:
            return None
        return 2.0 ** math.floor(math.log2(_FP16_MAX / self.max_abs))

    def advice(self) -> str:
        """The recommendation as one line a user can follow, its limits included."""
        scale = self.recommended_loss_scale
        if self.overflowed:
            return (f"{self.nonfinite} fp16 gradient values overflowed at the audited scale: "
                    "lower the loss scale (GradScaler halves it on each overflow) and audit a "
                    "step at the lower scale")
        if scale is None:
            return ("no fp16 or bf16 values in the backward: nothing to recommend (audit the "
                    "converted module, or the model under torch.autocast)")
        line = f"recommended static loss scale: {_fmt_scale(scale)}"
        if self.what_if:
            return line + " (fp16 what-if: the bf16 gradients as fp16 would hold them)"
        if self.needs_probe:
            return line + f", an upper bound: {self.probe()}"
        return line

    def probe(self) -> str:
        """Why the recommendation is an upper bound, and the step that settles it (the
        words :meth:`advice` and the HTML report use when :attr:`needs_probe`)."""
        scale = self.recommended_loss_scale
        return (f"fp16 flushed gradients below 2^-24 at this scale, hiding what a larger one "
                f"gives; audit one more step with the loss multiplied by {scale:g} and "
                f"multiply its recommendation by {scale:g}")

    def rows(self, scale: float = 1.0) -> list[tuple[str, int, float, str]]:
        """(bucket, count, share, fp16 fate) per nonempty bucket, largest first; ``scale``
        shows where the values land after multiplying the loss by it."""
        shift = int(round(math.log2(scale))) if scale > 0 else 0
        total = self.total or 1
        out = []
        for e in sorted(self.counts, reverse=True):
            shifted = e + shift
            if shifted >= 16:
                fate = "overflow"
            elif shifted < _FP16_FLUSH_EXP:
                fate = "flush to 0"
            elif shifted < _FP16_NORMAL_EXP:
                fate = "subnormal"
            else:
                fate = "normal"
            out.append((f"2^{e}", self.counts[e], self.counts[e] / total, fate))
        return out

    def table(self) -> str:
        """The histogram as a text table plus the fractions and the recommended scale."""
        import tabulate

        rows = [(b, c, f"{s:.1%}", fate) for b, c, s, fate in self.rows()]
        body = tabulate.tabulate(rows, headers=["|grad| >=", "values", "share", "in fp16"],
                                 colalign=("right", "right", "right", "left"))
        lines = [body,
                 f"flush to zero in fp16 (< 2^-24): {self.fp16_flush_fraction:.2%}; "
                 f"subnormal in fp16: {self.fp16_subnormal_fraction:.2%}",
                 f"max |grad|: {_fmt(self.max_abs)}; {self.advice()}"]
        return "\n".join(lines)

    @property
    def title(self) -> str:
        """What the histogram counts, in the words every view of the report uses."""
        if self.what_if:
            return "gradient magnitudes (bf16 backward values; fp16 what-if)"
        return "gradient magnitudes (fp16 backward values)"

    def plot(self, path: str) -> str:
        """Save a bar plot (log2 buckets, fp16 limits marked) as a PNG; needs matplotlib
        (``pip install amprewrite[plot]``). Returns ``path``."""
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError as exc:
            raise ImportError("GradHistogram.plot needs matplotlib: pip install "
                              "'amprewrite[plot]' (or use GradHistogram.table())") from exc
        exps = sorted(self.counts)
        total = self.total or 1
        fig, ax = plt.subplots(figsize=(8, 3.5))
        ax.bar(exps, [self.counts[e] / total for e in exps], width=0.9, align="edge",
               color="tab:blue")  # bucket e spans [2**e, 2**(e+1))
        for x, label in ((_FP16_FLUSH_EXP, "fp16 smallest subnormal"),
                         (_FP16_NORMAL_EXP, "fp16 smallest normal"), (16, "fp16 max")):
            ax.axvline(x, color="tab:red", linestyle="--", linewidth=1)
            ax.text(x, ax.get_ylim()[1] * 0.95, label, rotation=90, va="top", ha="right",
                    fontsize=7)
        ax.set_xlabel("log2 |gradient|")
        ax.set_ylabel("share of values")
        ax.set_title(self.title[0].upper() + self.title[1:])
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        plt.close(fig)
        return path

    def to_dict(self) -> dict[str, Any]:
        return {"counts": {str(e): c for e, c in sorted(self.counts.items())},
                "max_abs": self.max_abs,
                "dtype": self.dtype,
                "nonfinite": self.nonfinite,
                "fp16_flush_fraction": self.fp16_flush_fraction,
                "recommended_loss_scale": self.recommended_loss_scale,
                "needs_probe": self.needs_probe,
                "advice": self.advice()}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "GradHistogram":
        return cls({int(e): int(c) for e, c in data["counts"].items()}, data["max_abs"],
                   data.get("dtype"), int(data.get("nonfinite", 0)))

    @classmethod
    def from_counts(cls, counts: list[float], max_abs: float | None, dtype: str | None = None,
                    nonfinite: int = 0) -> "GradHistogram":
        """From a dense histc result (bucket i is exponent LOW_EXP + i)."""
        return cls({LOW_EXP + i: int(c) for i, c in enumerate(counts) if c}, max_abs, dtype,
                   nonfinite)


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.4g}"


def _fmt_scale(scale: float | None) -> str:
    if scale is None:
        return "- (no gradients recorded)"
    return f"2^{int(math.log2(scale))} = {scale:g}"
