"""The first lines of ``explain``, ``audit`` and ``demo``: what was converted, on what, how.

Collection (:func:`graph_facts`, :func:`count_forward_casts`: plain dicts) is apart from
presentation (:func:`summary_lines`). Example (the demo's Llama)::

    model: LlamaLogits
    hardware: cpu: AVX2 (no avx512_bf16, no AMX); no fast bf16 kernels here
    policy: default (CUDA AMP rules), low dtype bf16
    ops: 10 bf16, 8 fp32, 99 passthrough (117 op nodes)
    casts: 14 cast nodes, 8 of weights (kept copies in inference, one cast per forward in training)
    cast kernels in one forward: 15, torch.autocast's on the same input: 18

Speed against ``torch.autocast`` is said with its certainty (:func:`speed_spread`,
:func:`speed_sentence`): a median over interleaved rounds and the spread of the rounds, or
"too noisy to tell" when they disagree on which is faster, or "the machine is too busy to
tell" when some round ran several times slower than the others.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections import Counter
from typing import Any, Callable, Sequence

import torch
import torch.fx as fx
import torch.nn as nn

from .cast_count import count_casts
from .capture.converted import CONVERTED_KEY, MODEL_KEY
from .capture.guards import is_input_guards
from .graph.meta import cast_info, decision
from .graph.queries import lifted_weight
from .graph.subgraphs import nodes_with_bodies
from .hardware import describe, model_device, slow_reason
from .passes.opt_levels import OPT_LEVEL_KEY
from .policy.policy import Policy
from .policy.tables import OpCategory

__all__ = ["graph_facts", "count_forward_casts", "summary_lines", "precision_of",
           "short_dtype", "AS_FAST_WITHIN", "SpeedSpread", "speed_spread", "speed_verdict",
           "speed_words", "spread_words", "speed_sentence", "UNSURE", "SIZED_WITHIN",
           "MIN_ROUNDS_TO_TELL", "BUSY", "BUSY_FACTOR"]


def short_dtype(dtype: Any) -> str:
    """``torch.bfloat16`` → ``"bf16"``; other dtypes by their torch name; None → ``"-"``."""
    if not isinstance(dtype, torch.dtype):
        return "-"
    names = {torch.float16: "f16", torch.bfloat16: "bf16", torch.float32: "f32",
             torch.float64: "f64", torch.int64: "i64", torch.int32: "i32", torch.bool: "bool",
             torch.float8_e4m3fn: "e4m3", torch.float8_e5m2: "e5m2"}
    return names.get(dtype, str(dtype).replace("torch.", ""))


def precision_of(node: fx.Node, low: torch.dtype) -> str | None:
    """``"low"``, ``"fp32"`` or ``"passthrough"``: what an op node computes in (None for
    nodes without a decision)."""
    rec = decision(node)
    if rec is None or is_input_guards(node):
        return None
    if rec.category == OpCategory.LOWER or rec.compute_dtype == low:
        return "low"
    if rec.category == OpCategory.FP32 or rec.compute_dtype == torch.float32:
        return "fp32"
    return "passthrough"


def policy_of(gm: fx.GraphModule) -> tuple[Policy, torch.dtype] | None:
    """The policy and low dtype ``gm`` was converted with: O1's, or the rules of opt level
    O2/O3 (None for O0, which decides nothing, and for modules amprewrite did not convert)."""
    if CONVERTED_KEY in gm.meta:
        return gm.meta[CONVERTED_KEY]
    level = gm.meta.get(OPT_LEVEL_KEY)
    if level is None or level.dtype is None:
        return None
    return Policy(preset=level.level, dtype=level.dtype), level.dtype


def graph_facts(gm: fx.GraphModule) -> dict[str, Any]:
    """What a converted graph is, as plain data: model, hardware, policy, ops per precision,
    cast nodes and how many of them cast weights."""
    policy, low = policy_of(gm)  # type: ignore[misc]  # callers pass converted graphs
    inputs = tuple(n.meta.get("val") for n in gm.graph.find_nodes(op="placeholder"))
    device = model_device(gm, inputs, None)
    nodes = list(nodes_with_bodies(gm))
    ops = Counter(p for p in (precision_of(n, low) for n in nodes) if p is not None)
    # A cast of a weight: of a get_attr tensor (convert) or of a parameter or buffer that
    # Dynamo lifted to an input (amprewrite.compile)
    casts = [info.weight or any(map(lifted_weight, n.all_input_nodes[:1]))
             for n in nodes if (info := cast_info(n)) is not None]
    return {"model": gm.meta.get(MODEL_KEY, type(gm).__name__),
            "hardware": describe(device), "fast_low_dtype": slow_reason(device, low) is None,
            "policy": policy.summary(), "low_dtype": short_dtype(low),
            "ops": {k: ops.get(k, 0) for k in ("low", "fp32", "passthrough")},
            "cast_nodes": len(casts), "weight_cast_nodes": sum(casts)}


def count_forward_casts(model: nn.Module, call: Callable[[], Any], inputs: tuple,
                        kwargs: dict[str, Any] | None, dtype: torch.dtype) -> dict[str, int]:
    """Cast kernels of one forward: ``call()`` (the converted model) and ``model`` under
    ``torch.autocast`` on the same input, counted by :class:`~amprewrite.cast_count.CastCounter`
    (exact on any machine). Runs with gradients, as a training forward does."""
    device = model_device(model, inputs, kwargs)
    ours = count_casts(call)

    def autocast_forward() -> Any:
        with torch.autocast(device.type, dtype=dtype):
            return model(*inputs, **(kwargs or {}))

    return {"converted": ours.kernels, "autocast": count_casts(autocast_forward).kernels}


def summary_lines(facts: dict[str, Any], casts: dict[str, int] | None = None) -> list[str]:
    """The summary as text lines (:func:`graph_facts` and, if measured, the cast kernels of
    :func:`count_forward_casts`)."""
    low = facts["low_dtype"]
    slow = "" if facts["fast_low_dtype"] else \
        f"; no fast {low} kernels here, expect it slower than fp32"
    ops = facts["ops"]
    lines = [f"casts: {facts['cast_nodes']} cast nodes, {facts['weight_cast_nodes']} of "
             "weights (kept copies in inference, one cast per forward in training)"]
    if casts is not None:
        lines.append(f"cast kernels in one forward: {casts['converted']}, torch.autocast's on "
                     f"the same input: {casts['autocast']}")
    return [f"model: {facts['model']}",
            f"hardware: {facts['hardware']}{slow}",
            f"policy: {facts['policy']}, low dtype {low}",
            f"ops: {ops['low']} {low}, {ops['fp32']} fp32, {ops['passthrough']} passthrough "
            f"({sum(ops.values())} op nodes)", *lines]


AS_FAST_WITHIN = 0.03
"""A speed ratio this close to 1 either way reads "as fast": the spread of interleaved rounds
on a quiet machine. The demo's line and the page say the same."""
SIZED_WITHIN = 1.5
"""The middle half of the rounds spans at most this factor when the ratio is sized: wider,
the direction may hold but its size is noise (another job slowed whole rounds)."""
MIN_ROUNDS_TO_TELL = 3
"""Fewer rounds show no spread: no verdict is drawn from them."""
UNSURE = "too noisy to tell"
BUSY_FACTOR = 3.0
"""A round whose time, on either side, is over this many times that side's median round
was slowed as a whole by other work: a round keeps the fastest of its calls, so every call
of it was that slow (other jobs only ever add time; a round faster than the median is no
sign of them). Rounds that disagree that wildly judge the machine, not the model: the
quartiles would hide the round, and the verdict would stand on a machine that cannot time."""
BUSY = "the machine is too busy to tell"


def speed_verdict(speedup: float) -> str:
    """``"faster"``, ``"slower"`` or ``"as fast"``: torch.autocast's time over ours (above 1:
    faster, as in every table of the project), with :data:`AS_FAST_WITHIN`."""
    if abs(speedup - 1) < AS_FAST_WITHIN:
        return "as fast"
    return "faster" if speedup > 1 else "slower"


@dataclasses.dataclass(frozen=True)
class SpeedSpread:
    """Speed against ``torch.autocast`` over rounds of interleaved timing: per round,
    torch.autocast's time over the converted module's (above 1: faster)."""

    ratio: float
    """The median round's ratio."""
    low: float
    """Lower quartile of the rounds' ratios: with :attr:`high`, the middle half of them."""
    high: float
    rounds: int
    verdict: str
    """``"faster"``, ``"slower"``, ``"as fast"``, or :data:`UNSURE` (see
    :func:`speed_spread`)."""
    slowest: float = 1.0
    """The slowest round's time over the median round's, of the side where that is larger."""

    @property
    def busy(self) -> bool:
        """Whether a round ran over :data:`BUSY_FACTOR` times slower than the median round:
        the machine was too busy to time (the verdict is then :data:`UNSURE`)."""
        return self.slowest > BUSY_FACTOR

    @property
    def sized(self) -> bool:
        """Whether the rounds agree on the size of the ratio, not only on its direction
        (their middle half spans at most :data:`SIZED_WITHIN`)."""
        return self.high <= self.low * SIZED_WITHIN


def speed_spread(rounds: Sequence[tuple[float, float]]) -> SpeedSpread:
    """The verdict on ``rounds``, ``(converted time, autocast time)`` per round (any unit).

    The median ratio decides, unless the rounds disagree: when the middle half of them (their
    interquartile range, robust to the odd round another job slowed) holds ratios below
    ``1 - AS_FAST_WITHIN`` *and* above ``1 + AS_FAST_WITHIN``, no direction is stated; nor
    "as fast" when that middle half spans more than :data:`SIZED_WITHIN`.
    """
    if not rounds:
        raise ValueError("speed_spread(rounds=[]): expected at least one round of "
                         "(converted time, autocast time)")
    if any(not (c > 0 and a > 0) for c, a in rounds):
        raise ValueError(f"speed_spread(rounds={list(rounds)!r}): every time must be positive")
    ratios = sorted(a / c for c, a in rounds)
    median = statistics.median(ratios)
    slowest = max(max(side) / statistics.median(side) for side in zip(*rounds))
    if len(ratios) < MIN_ROUNDS_TO_TELL:
        return SpeedSpread(median, ratios[0], ratios[-1], len(ratios), UNSURE, slowest)
    low, _, high = statistics.quantiles(ratios, n=4, method="inclusive")
    verdict = speed_verdict(median)
    disagree = low < 1 - AS_FAST_WITHIN and high > 1 + AS_FAST_WITHIN
    # "as fast" is a size (within a few percent): rounds that do not agree on sizes cannot
    # say it.
    if disagree or (verdict == "as fast" and high > low * SIZED_WITHIN) or \
            slowest > BUSY_FACTOR:
        verdict = UNSURE
    return SpeedSpread(median, low, high, len(ratios), verdict, slowest)


def speed_words(speed: float) -> str:
    """``"1.52x torch.autocast's speed, faster"`` / ``"1.02x, as fast as torch.autocast"``: a
    speed ratio (above 1 = faster) in words, judged by :func:`speed_verdict`."""
    verdict = speed_verdict(speed)
    if verdict == "as fast":
        return f"{speed:.2f}x, as fast as torch.autocast"
    return f"{speed:.2f}x torch.autocast's speed, {verdict}"


def spread_words(spread: SpeedSpread) -> str:
    """``"1.31x-1.55x, middle half of 7 rounds"``: what the verdict stands on."""
    if spread.rounds < MIN_ROUNDS_TO_TELL:
        return f"{spread.rounds} round{'s' if spread.rounds != 1 else ''}, too few to tell"
    return f"{spread.low:.2f}x-{spread.high:.2f}x, middle half of {spread.rounds} rounds"


def speed_sentence(spread: SpeedSpread) -> str:
    """The demo's words: ``"1.42x torch.autocast's speed, faster (1.31x-1.55x, middle half of
    7 rounds)"``, or, when the rounds disagree, ``"about as fast as torch.autocast; too noisy
    to tell (0.80x-1.30x, middle half of 7 rounds)"``; a direction the rounds agree on
    but not its size: ``"1.68x torch.autocast's speed, faster; how much is too noisy to tell
    (1.11x-17.56x, middle half of 5 rounds)"``; a round many times slower than the others:
    ``"no verdict: the machine is too busy to tell (its slowest round took 71x the median
    round's time, of 7 rounds); run it again on a quiet machine"``."""
    if spread.rounds < MIN_ROUNDS_TO_TELL:
        return (f"{spread.ratio:.2f}x torch.autocast's speed in {spread_words(spread)}")
    if spread.busy:
        return (f"no verdict: {BUSY} (its slowest round took {spread.slowest:.0f}x the "
                f"median round's time, of {spread.rounds} rounds); run it again on a quiet "
                "machine")
    if spread.verdict == UNSURE:
        return f"about as fast as torch.autocast; {UNSURE} ({spread_words(spread)})"
    how_much = "" if spread.sized else f"; how much is {UNSURE}"
    return f"{speed_words(spread.ratio)}{how_much} ({spread_words(spread)})"
