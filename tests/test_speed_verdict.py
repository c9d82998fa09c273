"""Speed against torch.autocast, said with its certainty: the verdict on per-round timings
(amprewrite.summary.speed_spread), the demo's words for it, and the interleaved rounds that
the demo times (amprewrite.cli.measure)."""

from __future__ import annotations

import time

import pytest

from amprewrite.cli import measure
from amprewrite.summary import BUSY_FACTOR, UNSURE, speed_sentence, speed_spread


def _rounds(ratios: list[float], converted_ms: float = 10.0) -> list[tuple[float, float]]:
    """Rounds of (converted ms, autocast ms) whose autocast/converted ratios are ``ratios``."""
    return [(converted_ms, converted_ms * r) for r in ratios]


def test_rounds_that_agree_give_the_median_and_the_middle_half() -> None:
    spread = speed_spread(_rounds([1.31, 1.42, 1.55, 1.38, 1.47, 1.29, 1.6]))
    assert spread.verdict == "faster" and spread.rounds == 7
    assert spread.ratio == pytest.approx(1.42)
    # inclusive quartiles of the 7 sorted ratios: halfway between the 2nd and 3rd, 5th and 6th
    assert spread.low == pytest.approx((1.31 + 1.38) / 2)
    assert spread.high == pytest.approx((1.47 + 1.55) / 2)
    assert speed_sentence(spread) == ("1.42x torch.autocast's speed, faster (1.34x-1.51x, "
                                      "middle half of 7 rounds)")
    slower = speed_spread(_rounds([0.74, 0.7, 0.78, 0.72, 0.76]))
    assert slower.verdict == "slower"
    assert speed_sentence(slower) == ("0.74x torch.autocast's speed, slower (0.72x-0.76x, "
                                      "middle half of 5 rounds)")


def test_rounds_that_straddle_1_are_too_noisy_to_tell() -> None:
    # the middle half holds rounds 20% slower and 30% faster: no direction is stated, even
    # though the median alone would read "faster"
    spread = speed_spread(_rounds([0.7, 0.8, 0.9, 1.1, 1.2, 1.3, 1.4]))
    assert spread.ratio == pytest.approx(1.1)
    assert spread.verdict == UNSURE
    assert speed_sentence(spread) == ("about as fast as torch.autocast; too noisy to tell "
                                      "(0.85x-1.25x, middle half of 7 rounds)")


def test_a_narrow_straddle_is_as_fast() -> None:
    spread = speed_spread(_rounds([0.98, 1.0, 1.01, 1.02, 1.03]))
    assert spread.verdict == "as fast"
    assert speed_sentence(spread) == ("1.01x, as fast as torch.autocast (1.00x-1.02x, middle "
                                      "half of 5 rounds)")


def test_one_noisy_round_is_not_the_verdict() -> None:
    # a first round slowed 10x by another job (0.09x), the others near 1.4x: the verdict is
    # theirs, and the slow round does not even widen the middle half
    spread = speed_spread(_rounds([0.09, 1.38, 1.42, 1.45, 1.4, 1.41, 1.43]))
    assert spread.verdict == "faster" and spread.ratio == pytest.approx(1.41)
    assert 1.38 <= spread.low < spread.high <= 1.45


def test_a_direction_without_a_size() -> None:
    # every middle round is faster, by anything from 1.1x to 5x: the direction is said, the
    # size is not claimed
    spread = speed_spread(_rounds([1.1, 1.2, 2.0, 4.0, 5.0]))
    assert spread.verdict == "faster" and not spread.sized
    assert speed_sentence(spread) == ("2.00x torch.autocast's speed, faster; how much is too "
                                      "noisy to tell (1.20x-4.00x, middle half of 5 rounds)")
    # near 1 but spanning a factor of 2 is no "as fast"
    assert speed_spread(_rounds([0.98, 0.99, 1.0, 2.0, 2.1])).verdict == UNSURE


def test_too_few_rounds_give_no_verdict() -> None:
    spread = speed_spread([(2.31, 25.44)])
    assert spread.verdict == UNSURE and spread.rounds == 1
    assert speed_sentence(spread) == "11.01x torch.autocast's speed in 1 round, too few to tell"
    with pytest.raises(ValueError, match=r"speed_spread\(rounds=\[\]\)"):
        speed_spread([])
    with pytest.raises(ValueError, match="every time must be positive"):
        speed_spread([(0.0, 1.0), (1.0, 1.0), (1.0, 1.0)])


def test_rounds_interleave_the_two_and_are_time_boxed() -> None:
    calls: list[str] = []

    def model(name: str, seconds: float):
        def call() -> None:
            calls.append(name)
            time.sleep(seconds)
        return call

    # slow calls: the minimum of rounds, one call of each per round, the first alternating
    fns = {"converted": model("c", 0.03), "autocast": model("a", 0.005)}
    begin = time.perf_counter()
    rounds = measure._forward_rounds(fns, budget_s=0.05)
    assert time.perf_counter() - begin < 3.0
    assert len(rounds) == measure._MIN_ROUNDS
    assert calls[4:] == ["c", "a", "a", "c", "c", "a", "a", "c", "c", "a"]  # after warm-up
    for ours, theirs in rounds:  # milliseconds, each side its own (sleeps only run over)
        assert ours >= 30 and theirs >= 5
    # fast calls: more rounds, up to the most, each of many calls, within about the budget
    calls.clear()
    begin = time.perf_counter()
    rounds = measure._forward_rounds({"converted": model("c", 0), "autocast": model("a", 0)},
                                     budget_s=0.3)
    assert time.perf_counter() - begin < 1.5
    assert measure._MIN_ROUNDS <= len(rounds) <= measure._MAX_ROUNDS
    assert calls.count("c") == calls.count("a") > 2 * len(rounds) + 2


def test_the_demo_line_states_the_spread() -> None:
    measured = {"forward_ms": {"converted": 2.0, "autocast": 2.8},
                "forward_rounds": _rounds([1.3, 1.4, 1.5, 1.35, 1.45], converted_ms=2.0),
                "step_bytes": {"converted": 179 * 1024, "autocast": 183 * 1024},
                "max_abs_error": {"converted": 1.5e-3, "autocast": 2.5e-3}}
    lines = measure.measurement_lines(measured)
    assert lines == [
        "vs torch.autocast, same input: forward 2.00 ms vs 2.80 ms (medians of 5 interleaved "
        "rounds): 1.40x torch.autocast's speed, faster (1.35x-1.45x, middle half of 5 rounds)",
        "memory of one training step (weights, gradients, saved activations): 179 KiB vs "
        "183 KiB with torch.autocast (0.98x)",
        "max |logits - fp32 logits|: 0.0015 (torch.autocast 0.0025)"]


def test_a_round_many_times_slower_than_the_others_means_the_machine_is_too_busy() -> None:
    """One round measured 100 ms where the others measured 1.4 ms: the quartiles would hide
    it and state a verdict; a round slowed that much as a whole says the machine is busy."""
    rounds = [(1.40, 2.00), (1.41, 2.02), (100.0, 101.0), (1.39, 1.98), (1.42, 2.01),
              (1.40, 2.03), (1.41, 1.99)]
    quiet = [r for r in rounds if r[0] < 50]
    assert speed_spread(quiet).verdict == "faster"  # the same rounds without the busy one
    spread = speed_spread(rounds)
    assert spread.busy and spread.verdict == UNSURE
    assert spread.slowest == pytest.approx(100.0 / 1.41)
    assert speed_sentence(spread) == (
        "no verdict: the machine is too busy to tell (its slowest round took 71x the median "
        "round's time, of 7 rounds); run it again on a quiet machine")
    # either side's slow round counts; just under the factor does not
    assert speed_spread([(c, a * 50 if i == 2 else a) for i, (c, a) in
                         enumerate(quiet)]).busy
    below = [(c * (BUSY_FACTOR - 0.1) if i == 0 else c, a) for i, (c, a) in enumerate(quiet)]
    assert not speed_spread(below).busy
    # a round faster than the rest is no sign of other work (test_one_noisy_round...)
    assert not speed_spread(_rounds([0.09, 1.38, 1.42, 1.45, 1.4, 1.41, 1.43])).busy


def test_the_demo_shows_fp32_where_the_low_dtype_has_no_fast_kernels() -> None:
    measured = {"forward_ms": {"converted": 227.0, "autocast": 230.5, "fp32": 24.5},
                "forward_rounds": [[227.0, 230.5]] * 5,
                "slow_low_dtype": {"hardware": "cpu: AVX2 (no avx512_bf16, no AMX)",
                                   "low_dtype": "bf16"},
                "step_bytes": {"converted": 179 * 1024, "autocast": 183 * 1024},
                "max_abs_error": {"converted": 1.5e-3, "autocast": 2.5e-3}}
    lines = measure.measurement_lines(measured)
    assert lines[1] == (
        "fp32 forward 24.50 ms, converted 227.00 ms, torch.autocast 230.50 ms: cpu: AVX2 (no "
        "avx512_bf16, no AMX) has no fast bf16 kernels, so fp32 runs 9.3x faster here; keep "
        "the model in fp32 on this machine (opt_level='O0')")
    assert lines[2].startswith("memory of one training step")
    # an fp32 round many times slower than its others: no advice either way
    busy = {**measured, "fp32_rounds": [24.5, 24.4, 24.6, 24.5, 110.0]}
    assert measure.measurement_lines(busy)[1] == (
        "fp32 forward 24.50 ms, converted 227.00 ms, torch.autocast 230.50 ms: cpu: AVX2 (no "
        "avx512_bf16, no AMX) has no fast bf16 kernels, but the machine is too busy to tell "
        "which is faster here")


@pytest.mark.parametrize("fast", [True, False])
def test_side_by_side_times_fp32_only_where_the_low_dtype_is_slow(
        fast: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    import torch
    import torch.nn as nn

    import amprewrite

    monkeypatch.setattr(measure, "slow_reason", lambda device, dtype: None if fast else "slow")
    model = nn.Sequential(nn.Linear(8, 8))
    x = torch.randn(2, 8)
    gm = amprewrite.convert(model, (x,))
    measured = measure.side_by_side(model, gm, (x,), lambda: gm(x),
                                    lambda out: out.float().sum(), torch.bfloat16)
    assert set(measured["forward_ms"]) == ({"converted", "autocast"} if fast else
                                           {"converted", "autocast", "fp32"})
    assert all(len(r) == 2 for r in measured["forward_rounds"])
    assert ("slow_low_dtype" in measured) is not fast
    assert len(measured.get("fp32_rounds", [])) == (0 if fast else measured["rounds"])
    lines = measure.measurement_lines(measured)
    assert len(lines) == (3 if fast else 4)
    assert any(line.startswith("fp32 forward ") for line in lines) is not fast


def test_rounds_of_three_reverse_their_order_each_round() -> None:
    calls: list[str] = []
    fns = {name: (lambda name=name: calls.append(name)) for name in ("c", "a", "f")}
    rounds = measure._forward_rounds(fns, budget_s=0.0)
    assert len(rounds) == measure._MIN_ROUNDS and all(len(r) == 3 for r in rounds)
    assert calls[6:12] == ["c", "a", "f", "f", "a", "c"]  # after two warm-up calls of each
