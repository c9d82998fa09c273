"""amprewrite.audit(): planted faults are found, named and attributed; no per-op host sync."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn as nn

import amprewrite
from amprewrite.audit.stats import output_stats
from amprewrite import AuditReport, GradHistogram, OpRecord


class Net(nn.Module):
    """fc1 -> ReLU -> fc2; ``big=True`` plants an fp16 overflow in fc1's matmul.

    NB: ReLU, not GELU: relu(+inf) is +inf on every kernel, while the vectorised GELU of some
    CPUs (AVX-512) turns +inf into NaN, and would rightly be reported as a producer there."""

    def __init__(self, big: bool = False) -> None:
        super().__init__()
        self.fc1 = nn.Linear(4, 4)
        self.act = nn.ReLU()
        self.fc2 = nn.Linear(4, 2)
        with torch.no_grad():
            for p, v in ((self.fc1.weight, 300.0 if big else 0.1), (self.fc1.bias, 0.0),
                         (self.fc2.weight, 0.2), (self.fc2.bias, 0.1)):
                p.fill_(v)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class Head(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 3)
        with torch.no_grad():
            self.fc.weight.copy_(torch.arange(12.0).reshape(3, 4) / 10)
            self.fc.bias.fill_(0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log_softmax(self.fc(x), -1)


def _x(value: float = 1.0) -> torch.Tensor:
    return torch.full((2, 4), value)


def test_forward_overflow_producer_is_named_and_passers_on_are_not_blamed():
    x = _x(100.0)  # 4 * 100 * 300 = 120000 > 65504
    gm = amprewrite.convert(Net(big=True), (x,), dtype=torch.float16)
    with amprewrite.audit() as report:
        gm(x).float().sum()
    first = report.first_nonfinite
    assert (first.op, first.node, first.module, first.phase) == ("addmm", "linear", "fc1",
                                                                  "forward")
    assert (first.nonfinite, first.fp16_overflow, first.out_dtype) == (8, 8, "float16")
    assert report.producers == [first]
    # relu, the second matmul and the sum see inf/NaN but only pass it on.
    passers = [r for r in report.records if r.nonfinite and r is not first]
    assert [r.op for r in passers] == ["relu", "addmm", "_to_copy", "sum"]
    assert not any(r.produced_nonfinite for r in passers)
    assert [r.node for r in passers[:2]] == ["relu", "linear_1"]


def test_forward_overflow_in_eager_autocast_model_names_the_module():
    model, x = Net(big=True), _x(100.0)
    with amprewrite.audit() as report:
        with torch.autocast("cpu", dtype=torch.float16):
            model(x)
    first = report.first_nonfinite
    assert (first.op, first.node, first.module, first.out_dtype) == ("addmm", None, "fc1", "float16")
    assert [r.module for r in report.producers] == ["fc1"]


def test_backward_only_overflow_is_found_in_backward_and_attributed():
    x = _x()
    gm = amprewrite.convert(Head(), (x,), dtype=torch.float16)
    with amprewrite.audit() as report:
        out = gm(x)
        # The loss is fine in fp32; its scaled gradient (2**24) overflows when cast to fp16.
        (-out[:, 0].sum() * 2.0**24).backward()
    assert all(r.nonfinite == 0 for r in report.records if r.phase == "forward")
    first = report.first_nonfinite
    assert (first.phase, first.cast, first.op, first.grad_fn) == (
        "backward", True, "_to_copy", "ToCopyBackward0")
    assert (first.node, first.in_dtypes, first.out_dtype) == ("log_softmax", ("float32",), "float16")
    assert first.nonfinite == 6 and first.fp16_overflow == 6
    backward_nodes = {r.node for r in report.records if r.phase == "backward"}
    assert {"linear", "log_softmax"} <= backward_nodes
    mm = [r for r in report.records if r.phase == "backward" and r.op == "mm"]
    assert [(r.node, r.module, r.grad_fn) for r in mm] == [("linear", "fc", "AddmmBackward0")]
    assert not mm[0].produced_nonfinite


def test_nan_from_a_fully_masked_row_is_blamed_not_the_mask_constant():
    class MaskedSoftmax(nn.Module):
        def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
            neg = torch.full((), float("-inf"))  # intended -inf: a source, not a fault
            return torch.where(mask, neg, x).softmax(-1)

    x = torch.randn(2, 3)
    mask = torch.tensor([[False, True, True], [True, True, True]])  # row 2 fully masked
    with amprewrite.audit() as report:
        MaskedSoftmax()(x, mask)
    assert [(r.op, r.nonfinite, r.produced_nonfinite) for r in report.records] == [
        ("full", 1, False), ("where", 5, False), ("_softmax", 3, True)]
    assert report.first_nonfinite is report.records[2]


def test_underflow_counts_tiny_activations():
    class Tiny(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * 1e-6

    x = torch.ones(3, 5, dtype=torch.float16)
    with amprewrite.audit() as report:
        Tiny()(x)
    (mul,) = report.records
    assert (mul.op, mul.module, mul.out_dtype, mul.shape) == ("mul", "", "float16", (3, 5))
    assert mul.fp16_underflow == 15 and mul.nonfinite == 0 and mul.fp16_overflow == 0
    assert mul.max_abs == mul.min_nonzero_abs == float(torch.tensor(1e-6, dtype=torch.float16))


def test_statistics_are_exact_for_each_dtype():
    inf, nan = float("inf"), float("nan")
    values = [0.0, -0.0, 1e-6, -3.0, 7e4, inf, nan, -1e-3]
    for dtype, over in ((torch.float32, 1), (torch.bfloat16, 1), (torch.float16, 2)):
        t = torch.tensor(values).to(dtype)
        with amprewrite.audit() as report:
            t.clone()
        (r,) = report.records
        assert r.nonfinite == 2 + (dtype == torch.float16)  # 7e4 is inf in fp16
        # The statistics count 7e4 past fp16's max in every dtype; the record flags it only
        # where fp16 holds the value (fp16), or would under the fp16 policy (bf16).
        vec, _ = output_stats(t)
        assert vec[4] == over, dtype
        held = dtype != torch.float32
        assert (r.fp16_overflow, r.fp16_underflow) == ((over, 1) if held else (0, 0)), dtype
        assert vec[5] - vec[3] == 1  # 1e-6 underflows (1e-3 is a normal fp16 value)
        assert (r.headroom_bits is None) == (not held)
        assert r.max_abs == (3.0 if dtype == torch.float16 else float(t[4]))
        assert r.min_nonzero_abs == float(t[2])


def test_clean_model_has_no_nonfinite_records():
    x = _x()
    gm = amprewrite.convert(Net(), (x,), dtype=torch.bfloat16)
    with amprewrite.audit() as report:
        gm(x).float().sum().backward()
    assert report.records and report.first_nonfinite is None and report.producers == []
    assert all(r.nonfinite == 0 and r.fp16_overflow == 0 for r in report.records)
    assert {r.phase for r in report.records} == {"forward", "backward"}


def test_converted_graph_rows_carry_nodes_and_casts_are_labelled():
    x = _x()
    gm = amprewrite.convert(Net(), (x,), dtype=torch.bfloat16)
    with amprewrite.audit() as report:
        gm(x)
    forward = [(r.label, r.node, r.module) for r in report.records]
    # Each parameter is cast where its layer uses it, by its own cast node (in grad mode: the
    # cast's backward then runs right after its consumer's); an op's arguments are cast last
    # first, in the order autocast casts them.
    assert forward == [
        ("cast (_to_copy)", "fc1_bias_bf16", "fc1"), ("cast (_to_copy)", "fc1_weight_bf16", "fc1"),
        ("cast (_to_copy)", "x_bf16", "fc1"), ("addmm", "linear", "fc1"),
        ("relu", "relu", "act"), ("cast (_to_copy)", "fc2_bias_bf16", "fc2"),
        ("cast (_to_copy)", "fc2_weight_bf16", "fc2"), ("addmm", "linear_1", "fc2")]
    casts = [r for r in report.records if r.cast]
    # 30 weights and x's 8 values, cast to 2 bytes each
    assert sum(r.cast_bytes for r in casts) == 2 * (30 + 8)
    assert report.summary()["casts"] == {"count": 5, "bytes": 76}


def test_symbolic_capture_without_example_inputs_is_attributed():
    gm = amprewrite.convert(Net(), dtype=torch.float16)
    with amprewrite.audit() as report:
        gm(_x())
    assert ("addmm", "linear", "fc1") in [(r.op, r.node, r.module) for r in report.records]
    assert [r.node for r in report.records if r.cast] == [
        "fc1_bias_f16", "fc1_weight_f16", "x_f16", "fc2_bias_f16", "fc2_weight_f16"]


def test_inference_mode_and_no_grad():
    x = _x()
    gm = amprewrite.convert(Net(), (x,), dtype=torch.bfloat16)
    with amprewrite.audit() as report:
        with torch.inference_mode():
            gm(x)
    # The first inference forward makes the cached weight copies (one cast each); under
    # inference_mode aten.to is not decomposed into _to_copy: still a cast row.
    casts = [(r.label, r.node) for r in report.records if r.cast]
    assert casts == [("cast (_to_copy)", "weights")] * 4 + [("cast (to)", "x_bf16")]
    with amprewrite.audit() as report:
        with torch.no_grad():
            gm(x)
    # The weight casts were cached by the inference forward: only x is cast.
    assert [r.node for r in report.records if r.cast] == ["x_bf16"]
    assert all(r.phase == "forward" for r in report.records)


def test_eager_autocast_model_is_audited_with_module_paths():
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Sequential(nn.Linear(4, 2)))
    with amprewrite.audit() as report:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = model(_x())
        y.float().sum().backward()
    fwd = [(r.label, r.module, r.out_dtype) for r in report.records if r.phase == "forward"]
    assert ("addmm", "0", "bfloat16") in fwd and ("addmm", "2.0", "bfloat16") in fwd
    assert ("relu", "1", "bfloat16") in fwd
    assert sum(1 for r in report.records if r.cast and r.phase == "forward") == 6
    bwd = {(r.op, r.module) for r in report.records if r.phase == "backward"}
    assert ("mm", "2.0") in bwd and ("threshold_backward", "1") in bwd and ("mm", "0") in bwd
    # A second backward accumulates into .grad: AccumulateGrad's add_ goes to the module.
    with amprewrite.audit() as report:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = model(_x())
        y.float().sum().backward()
    assert sorted((r.module, r.shape) for r in report.records if r.op == "add_") == [
        ("0", (4,)), ("0", (4, 4)), ("2.0", (2,)), ("2.0", (2, 4))]
    flops = report.summary()["flops"]
    # forward 2*2*4*4 + 2*2*4*2; backward mm: input grad of 2.0 + both weight grads.
    assert flops["by_dtype"] == {"bfloat16": 64 + 32 + 32 + 64 + 32}
    assert flops["low_precision_share"] == 1.0


def test_no_host_sync_per_op(monkeypatch):
    """Statistics stay tensors until exit, then one ``.tolist()`` reads them (CPU: one
    device). Counted through the Python entry points of every host read."""
    x = _x()
    gm = amprewrite.convert(Net(), (x,), dtype=torch.float16)
    calls = {"tolist": 0, "item": 0, "bool": 0, "float": 0, "int": 0}
    for name, attr in (("tolist", "tolist"), ("item", "item"), ("bool", "__bool__"),
                       ("float", "__float__"), ("int", "__int__")):
        original = getattr(torch.Tensor, attr)

        def counted(self, *a, _name=name, _original=original, **k):
            calls[_name] += 1
            return _original(self, *a, **k)

        monkeypatch.setattr(torch.Tensor, attr, counted)
    session = amprewrite.audit()
    with session as report:
        for _ in range(3):
            gm(x).float().sum().backward()
        assert calls == {k: 0 for k in calls}
        pending = [v for g in session._recorder.groups for v in g.raw]
        assert len(pending) == len(session._recorder.groups) > 50
        assert all(isinstance(v, torch.Tensor) and v.shape == (10,) for v in pending)
        assert report.records == []  # nothing read yet
    assert calls == {"tolist": 1, "item": 0, "bool": 0, "float": 0, "int": 0}
    assert len(report.records) == len(pending)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_no_host_sync_on_cuda():
    model = Net().cuda()
    x = _x().cuda()
    gm = amprewrite.convert(model, (x,), dtype=torch.float16)
    torch.cuda.set_sync_debug_mode("error")
    try:
        with amprewrite.audit(aggregate=True) as report:
            for _ in range(3):
                gm(x).float().sum().backward()
            torch.cuda.set_sync_debug_mode(0)  # the read-back at exit syncs, by design
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert report.records and report.first_nonfinite is None


def test_aggregate_keeps_one_row_per_key_with_counts():
    x = _x()
    gm = amprewrite.convert(Net(), (x,), dtype=torch.float16)
    with amprewrite.audit() as once:
        gm(x).float().sum()
    with amprewrite.audit(aggregate=True) as report:
        for _ in range(70):  # more than one fold of pending vectors
            gm(x).float().sum()
    assert [(r.op, r.node) for r in report.records] == [(r.op, r.node) for r in once.records]
    assert {r.count for r in report.records} == {70}
    assert [r.max_abs for r in report.records] == [r.max_abs for r in once.records]
    assert report.records[0].flops == 0 and report.records[3].flops == 70 * once.records[3].flops


def test_aggregate_finds_the_first_producer():
    x = _x(100.0)
    gm = amprewrite.convert(Net(big=True), (x,), dtype=torch.float16)
    clean = amprewrite.convert(Net(), (x,), dtype=torch.float16)
    with amprewrite.audit(aggregate=True) as report:
        for _ in range(3):
            clean(x)
        gm(x)
    # Both graphs name their first matmul "linear": one row, 4 calls, the last one overflowed.
    first = report.first_nonfinite
    assert (first.op, first.node, first.count, first.nonfinite) == ("addmm", "linear", 4, 8)
    assert report.producers == [first]


def test_grad_histogram_and_loss_scale():
    bf16 = torch.bfloat16
    w = torch.tensor([1.0, 2.0**-30, 2.0**-20, 3.0], dtype=bf16, requires_grad=True)
    with amprewrite.audit() as report:
        (w * torch.ones(4, dtype=bf16)).sum().backward()
    hist = report.grad_histogram
    # The one recorded backward op is mul(expanded ones, other): four gradients equal to 1.
    assert hist.max_abs == 1.0 and hist.dtype == "bfloat16" and hist.what_if
    assert hist.recommended_loss_scale == 2.0**15  # 1 * 2**15 = 32768 <= 65504
    assert set(hist.counts) == {0}
    v = torch.tensor([2.0**-30, 2.0**-20, 3.0, 0.0], dtype=bf16, requires_grad=True)
    with amprewrite.audit() as report:
        (v * torch.ones(4, dtype=bf16)).backward(
            torch.tensor([2.0**-30, 2.0**-20, 3.0, 0.0], dtype=bf16))
    hist = report.grad_histogram
    assert hist.counts == {-30: 1, -20: 1, 1: 1}
    assert hist.fp16_flush_fraction == pytest.approx(1 / 3)
    assert hist.recommended_loss_scale == 2.0**14  # 3 * 2**14 = 49152 <= 65504 < 3 * 2**15
    text = hist.table()
    assert "2^-30" in text and "flush to 0" in text and "2^14 = 16384 (fp16 what-if" in text


def test_loss_scale_counts_only_what_fp16_holds():
    # fp32 backward values (a formula's internals, the loss's own gradient) never limit it.
    w = torch.tensor([1e6, 2.0], requires_grad=True)
    with amprewrite.audit() as report:
        (w.rsqrt() * 1e5).sum().backward()
    assert report.grad_histogram is None
    h = torch.tensor([1e6, 2.0], requires_grad=True)
    with amprewrite.audit() as report:
        (h.half() * 4).float().mul(1e5).sum().backward()
    # The backward casts the fp32 gradient 1e5 to fp16 (inf: 2 values), mul's backward
    # passes them on (2 more); the fp32 ones are not counted.
    hist = report.grad_histogram
    assert (hist.dtype, hist.nonfinite, hist.overflowed) == ("float16", 4, True)
    assert hist.recommended_loss_scale is None and "overflowed at the audited scale" in \
        hist.advice()
    # fp16 that held only subnormal gradients flushed others: an upper bound, and how to probe
    t = torch.tensor([1.0, 2.0], dtype=torch.float16, requires_grad=True)
    with amprewrite.audit() as report:
        (t * 1.0).backward(torch.tensor([2.0**-20, 2.0**-30], dtype=torch.float16))
    hist = report.grad_histogram
    assert hist.needs_probe and hist.max_abs == 2.0**-20
    assert hist.recommended_loss_scale == 2.0**35
    assert "an upper bound" in hist.advice() and "multiplied by 3.43597e+10" in hist.advice()
    assert not GradHistogram.from_dict(hist.to_dict()).what_if
    assert GradHistogram.from_dict(hist.to_dict()) == hist


def test_grad_histogram_plot(tmp_path):
    pytest.importorskip("matplotlib")
    x = _x()
    gm = amprewrite.convert(Net(), (x,), dtype=torch.float16)
    with amprewrite.audit() as report:
        gm(x).float().sum().backward()
    path = report.grad_histogram.plot(str(tmp_path / "grads.png"))
    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_json_round_trip():
    x = _x(100.0)
    gm = amprewrite.convert(Net(big=True), (x,), dtype=torch.float16)
    with amprewrite.audit() as report:
        gm(x).float().sum().backward()
    data = report.to_dict()
    text = json.dumps(data, allow_nan=False)
    loaded = json.loads(text)
    assert loaded == data
    back = AuditReport.from_dict(loaded)
    assert back.records == report.records
    assert back.first_nonfinite == report.first_nonfinite and back.first_nonfinite is not None
    assert back.grad_histogram == report.grad_histogram
    assert back.to_dict() == data
    assert isinstance(back.records[0], OpRecord)


def test_errors_name_the_argument():
    with pytest.raises(TypeError, match="aggregate=1"):
        amprewrite.audit(aggregate=1)
    with pytest.raises(ValueError, match="unknown keys"):
        OpRecord.from_dict({"op": "mm", "bogus": 1})
    session = amprewrite.audit()
    with session:
        pass
    with pytest.raises(RuntimeError, match="not reentrant"):
        with session:
            pass


def test_hooks_are_removed_after_exit():
    hooks = torch.nn.modules.module
    before = (len(hooks._global_forward_pre_hooks), len(hooks._global_forward_hooks))
    with pytest.raises(ZeroDivisionError):
        with amprewrite.audit():
            Net()(_x())
            1 / 0
    assert (len(hooks._global_forward_pre_hooks), len(hooks._global_forward_hooks)) == before


def test_empty_tensors_are_skipped() -> None:
    """An empty KV cache, or the empty saved statistics of an eval-mode batch norm's
    backward: nothing to measure, and nothing may break the step."""

    class Cache(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)
            self.bn = nn.BatchNorm1d(4).eval()

        def forward(self, x: torch.Tensor, past: torch.Tensor) -> torch.Tensor:
            h = self.bn(self.fc(x))
            return torch.cat([past, h], 0)

    model, x, past = Cache(), torch.randn(3, 4), torch.empty(0, 4)
    with amprewrite.audit() as report:
        model(x, past).sum().backward()
    cats = [r for r in report.records if r.op == "cat"]
    assert cats and cats[0].max_abs is not None and report.first_nonfinite is None
    assert any(r.phase == "backward" for r in report.records)


def test_a_recording_failure_never_breaks_the_step(monkeypatch) -> None:
    from amprewrite.audit import mode

    def broken(t):
        raise RuntimeError("planted statistics failure")

    monkeypatch.setattr(mode, "output_stats", broken)
    model, x = Net(), _x()
    with pytest.warns(UserWarning, match="could not be recorded.*planted"):
        with amprewrite.audit():
            out = model(x)
            out.sum().backward()
    assert torch.isfinite(out).all() and model.fc1.weight.grad is not None


class TinyAttention(nn.Module):
    """Scores masked with ``finfo(dtype).min`` (as HF models do), and an RMSNorm-like
    ``pow`` whose backward overflows fp16 for a large input: the real risk (in bf16, what
    fp16 would meet)."""

    def __init__(self, fill: float) -> None:
        super().__init__()
        self.q = nn.Linear(8, 8)
        self.fill = fill

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[1]
        mask = torch.ones(n, n, dtype=torch.bool).triu(1)
        q = self.q(x)
        scores = (q @ q.transpose(-1, -2)).masked_fill(mask, self.fill)
        return scores.softmax(-1) @ x + x.pow(2) * 1e3


def test_mask_sentinels_are_masking_not_overflow() -> None:
    model = TinyAttention(torch.finfo(torch.bfloat16).min).to(torch.bfloat16)
    x = (torch.randn(2, 4, 8) * 20).to(torch.bfloat16)
    x.requires_grad_()
    with amprewrite.audit() as report:
        model(x).sum().backward()
    (fill,) = [r for r in report if r.op == "masked_fill" and r.phase == "forward"]
    assert fill.mask_fill and fill.is_mask and fill.mask_values == 2 * 6
    assert fill.fp16_overflow == 0 and fill.max_abs < 1e6  # the sentinels are left out
    summary = report.summary()
    assert fill.is_mask and report.records.index(fill) in summary["masks"]
    risk = [report.records[item["record"]] for item in summary["top_overflow_risk"]]
    assert risk[0].fp16_overflow and not risk[0].is_mask  # real risk first
    flags = [r.is_mask for r in risk]
    assert flags == sorted(flags)  # masks after every real risk
    assert all(item["what_if"] for item in summary["top_overflow_risk"])
    text = report.table()
    assert "masking, not overflow" in text and "masked_fill at" in text


def test_a_mask_of_inf_is_not_a_nonfinite_producer() -> None:
    model = TinyAttention(float("-inf"))
    with amprewrite.audit() as report:
        model(torch.randn(2, 4, 8)).sum()
    (fill,) = [r for r in report if r.op == "masked_fill" and r.phase == "forward"]
    assert fill.nonfinite == 12 and fill.mask_fill and not fill.produced_nonfinite
    assert report.first_nonfinite is None
