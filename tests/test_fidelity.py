"""The fidelity harness (``benchmarks/fidelity.py``) in a small configuration: O1 and O2
within 1% of fp32's final loss, fp8 within 2% of O1 bf16's."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import fidelity  # noqa: E402

_SMALL = fidelity.Config(steps=40, batch=4, tail=10)


def test_corpus_is_deterministic():
    a, b = fidelity.batches(_SMALL), fidelity.batches(_SMALL)
    assert torch.equal(a, b) and a.shape == (40, 4, 33)


def test_mixed_precision_follows_fp32():
    names = ["fp32", "O1 bf16", "O1 fp16 + GradScaler", "O2 fp16 + MasterWeights", "fp8"]
    results = fidelity.run(_SMALL, only=names, with_torchao=False)
    fp32, bf16 = results["fp32"].final, results["O1 bf16"].final
    assert results["fp32"].losses[-1] < 0.85 * results["fp32"].losses[0]  # it learns
    for name in names[1:4]:
        assert abs(results[name].final / fp32 - 1) < 0.01, (name, results[name].final, fp32)
    assert abs(results["fp8"].final / bf16 - 1) < 0.02, (results["fp8"].final, bf16)
    assert "fp8" in fidelity.table(results)


def test_side_by_side_with_torchao():
    pytest.importorskip("torchao.float8")
    cfg = fidelity.Config(steps=20, batch=4, tail=5)
    results = fidelity.run(cfg, only=["fp8", "torchao fp8 (emulate)"], with_torchao=True)
    ours, theirs = results["fp8"].final, results["torchao fp8 (emulate)"].final
    assert abs(ours / theirs - 1) < 0.02, (ours, theirs)
    rows = fidelity.layer_errors(cfg)
    assert len(rows) == 2 * 7 - 1  # every linear of the layers but the first; not the head
    for name, mine, ao in rows:
        assert mine < 0.1 and ao < 0.1, (name, mine, ao)
        assert mine < 2 * ao + 1e-3, (name, mine, ao)  # no worse than torchao's recipe
