"""compare_memory on a small HuggingFace transformer (tiny Llama, AdamW, its own loss).

The relations asserted are the ones mixed precision must give whatever the model; the one
measured bound (O1's saved activations against torch.autocast's) is explained in
docs/precision-tools.md, "Memory: what AMP buys".
"""

from __future__ import annotations

import os
import sys

import pytest

pytest.importorskip("transformers")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))

from bench_memory import compare  # noqa: E402

FP32_BYTES, ADAMW_STEP = 4, 4  # a 0-dim fp32 `step` tensor per parameter tensor
EMBEDDING = 256 * 64  # vocab_size x hidden_size of bench_memory's tiny Llama


@pytest.fixture(scope="module")
def m() -> dict:
    return {k: r.to_dict() for k, r in compare().items()}


def test_weights_gradients_optimizer(m: dict) -> None:
    fp32, n_tensors = m["fp32"], 21  # embed, 2 x (7 projections + 2 norms), norm, lm_head
    trained = fp32["gradients"]  # fp32 .grad of every trained parameter: 4 B each
    buffers = fp32["weights"] - trained  # the rotary frequencies
    assert 0 < buffers < 1024
    assert fp32["optimizer_state"] == 2 * trained + n_tensors * ADAMW_STEP  # two fp32 moments
    for v in ("autocast", "O1", "O2"):  # fp32 master weights: the same three rows as fp32
        assert (m[v]["weights"], m[v]["gradients"], m[v]["optimizer_state"]) == \
            (fp32["weights"], trained, fp32["optimizer_state"])
    # one bf16 copy per trained parameter but the embedding table, looked up in fp32
    assert m["O2"]["low_precision_copies"] == (trained - EMBEDDING * FP32_BYTES) // 2
    assert m["O2"]["weight_casts"] == 0  # ... read from the store, not cast per forward
    o3 = m["O3"]
    assert o3["weights"] == 0  # no fp32 tensor at all
    assert o3["low_precision_copies"] == fp32["weights"] // 2  # parameters and buffers
    assert o3["gradients"] == trained // 2
    assert o3["optimizer_state"] == trained + n_tensors * ADAMW_STEP  # bf16 moments


def test_weight_casts_are_those_autograd_saves(m: dict) -> None:
    # autocast and O1 save the same bf16 casts of the matmul weights for backward (2 B per
    # element of every projection and of lm_head; the embedding's cast is not saved).
    assert m["O1"]["weight_casts"] == m["autocast"]["weight_casts"] > 0
    assert m["O1"]["weight_casts"] < m["O2"]["low_precision_copies"]


def test_activations(m: dict) -> None:
    fp32, ac, o1 = (m[v]["activations"] for v in ("fp32", "autocast", "O1"))
    assert ac < 0.8 * fp32 and o1 < 0.8 * fp32
    # Measured: O1 = 0.951 x autocast. O1 casts an activation once for all its consumers
    # (q/k/v and gate/up projections: -48 KiB per layer) where autocast casts per use, and the
    # exported graph repeats K/V heads and builds the causal mask where eager uses sdpa's
    # enable_gqa and is_causal (+24 KiB per layer).
    assert 0.9 * ac <= o1 <= ac
    assert m["O2"]["activations"] == o1  # the same graph of casts, weights read from copies
    assert m["O3"]["activations"] < o1  # its norms save bf16 inputs too


def test_totals_ordered(m: dict) -> None:
    t = {k: v["total"] for k, v in m.items()}
    assert t["O3"] < 0.6 * t["fp32"]
    assert t["O1"] < t["autocast"] < t["fp32"]
    assert t["O1"] < t["O2"] < t["fp32"]  # O2's bf16 copies outweigh O1's saved casts
