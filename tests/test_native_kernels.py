"""NativeKernelsPass and runtime.native_kernels: a converted module runs the kernel eager code
runs (``torch._grouped_mm``) where tracing took Hugging Face's fallback op, with the same
values and gradients, and anything that traces the converted module again gets the library's
op back."""

from __future__ import annotations

import collections
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode

import amprewrite
from amprewrite.passes.native_kernels import TRACE_FALLBACKS, NativeKernelsPass
from amprewrite.runtime import native_kernels

pytest.importorskip("transformers.integrations.moe")  # registers transformers::grouped_mm_fallback
pytestmark = pytest.mark.skipif(not native_kernels.GROUPED_MM_ON_CPU,
                                reason="torch._grouped_mm has no CPU kernel before torch 2.9")

BF16 = amprewrite.Policy.autocast("cpu", torch.bfloat16)
FALLBACK = "transformers.grouped_mm_fallback.default"
NATIVE = "aten._grouped_mm.default"


class Experts(nn.Module):
    """Three experts over sorted tokens, written as transformers writes them: the C++ kernel
    eagerly, the library's custom op while traced."""

    def __init__(self, features: int = 8) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.weight = nn.Parameter(torch.randn(3, features, 16) / 4)
        self.proj = nn.Linear(16, features)

    def forward(self, x: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            h = torch.ops.transformers.grouped_mm_fallback(x, self.weight, offs=offs)
        else:
            h = torch._grouped_mm(x, self.weight, offs=offs)
        return self.proj(h.relu())


def inputs(features: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(1)
    return torch.randn(10, features), torch.tensor([4, 4, 10], dtype=torch.int32)


class OpCounter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.ops[str(func)] += 1
        return func(*args, **(kwargs or {}))


def ops_of(fn: Any) -> collections.Counter:
    with OpCounter() as counter:
        fn()
    return counter.ops


def step(fn: Any, model: nn.Module) -> tuple[torch.Tensor, list[torch.Tensor]]:
    out = fn()
    out.float().square().mean().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return out, grads


def test_the_captured_graph_holds_the_library_op() -> None:
    """What the pass is for: torch.export records the traced branch."""
    ep = torch.export.export(Experts(), inputs())
    targets = [str(n.target) for n in ep.graph.nodes if n.op == "call_function"]
    assert FALLBACK in targets and NATIVE not in targets


def test_converted_module_runs_the_eager_kernel_with_autocasts_results() -> None:
    model = Experts()
    x, offs = inputs()
    gm = amprewrite.convert(model, (x, offs), policy=BF16)
    assert "amprewrite_runtime_native_kernels_grouped_mm(" in gm.code
    assert "grouped_mm_fallback.default(" not in gm.code
    ops = ops_of(lambda: gm(x, offs))
    assert ops[NATIVE] == 1 and ops[FALLBACK] == 0

    def autocast() -> torch.Tensor:
        with torch.autocast("cpu", torch.bfloat16):
            return model(x, offs)

    want, want_grads = step(autocast, model)
    got, got_grads = step(lambda: gm(x, offs), model)
    assert got.dtype == want.dtype == torch.bfloat16 and torch.equal(got, want)
    assert all(torch.equal(g, w) for g, w in zip(got_grads, want_grads))


@pytest.mark.parametrize("opt_level", ["O0", "O3"])
def test_every_opt_level_runs_the_eager_kernel(opt_level: str) -> None:
    model = Experts()
    x, offs = inputs()
    dtype = None if opt_level == "O0" else torch.bfloat16
    gm = amprewrite.convert(model, (x, offs), opt_level=opt_level, dtype=dtype)
    assert ops_of(lambda: gm(x, offs))[FALLBACK] == 0
    if opt_level == "O0":
        with torch.no_grad():
            assert torch.equal(gm(x, offs), model(x, offs))


def test_unaligned_rows_take_the_library_op() -> None:
    """Rows of 6 fp32 (24 bytes) are refused by ``_grouped_mm`` on the CPU: the library's op
    computes them, as it did in the captured graph."""
    model = Experts(features=6)
    x, offs = inputs(features=6)
    gm = amprewrite.convert(model, (x, offs), opt_level="O0")
    ops = ops_of(lambda: gm(x, offs))
    assert ops[FALLBACK] == 1 and ops[NATIVE] == 0
    with torch.no_grad():
        want = torch.ops.transformers.grouped_mm_fallback(x, model.weight, offs)
        assert torch.equal(gm(x, offs), model.proj(want.relu()))


def test_without_a_cpu_kernel_the_library_op_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    model = Experts()
    x, offs = inputs()
    gm = amprewrite.convert(model, (x, offs), opt_level="O0")
    monkeypatch.setattr(native_kernels, "GROUPED_MM_ON_CPU", False)
    assert ops_of(lambda: gm(x, offs))[FALLBACK] == 1


def test_tracing_the_converted_module_gets_the_library_op(fresh_dynamo: None) -> None:
    """torch.compile traces the converted module again; ``_grouped_mm``'s meta kernel refuses
    fp32, so the graph it compiles must hold the library's op (AOTAutograd runs it on fake
    tensors here)."""
    model = Experts()
    x, offs = inputs()
    gm = amprewrite.convert(model, (x, offs), policy=BF16)
    seen: list[str] = []

    def backend(graph: torch.fx.GraphModule, example: Any) -> Any:
        seen.extend(str(n.target) for n in graph.graph.nodes if n.op == "call_function")
        return torch._dynamo.backends.debugging.aot_eager(graph, example)

    compiled = torch.compile(gm, backend=backend)
    with torch.no_grad():
        got = compiled(x, offs)
        assert torch.equal(got, gm(x, offs))
    assert any("grouped_mm_fallback" in t for t in seen)
    assert not any("native_kernels" in t or "_grouped_mm" == t for t in seen)


@pytest.mark.parametrize("mode", ["fake", "symbolic"])
def test_fake_tensors_get_the_library_op(mode: str) -> None:
    """``make_fx`` runs the converted module on fake tensors without Dynamo: the runtime
    function sees them by type and records the library's op (the native kernel would read a
    data pointer they do not have)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    x, offs = inputs()
    gm = amprewrite.convert(Experts(), (x, offs), policy=BF16)
    traced = make_fx(gm, tracing_mode=mode, _allow_non_fake_inputs=True)(x, offs)
    targets = [str(n.target) for n in traced.graph.nodes if n.op == "call_function"]
    assert FALLBACK in targets and NATIVE not in targets


def test_pass_is_idempotent_and_names_its_table() -> None:
    assert set(TRACE_FALLBACKS) == {"transformers::grouped_mm_fallback"}
    x, offs = inputs()
    gm = torch.export.export(Experts(), (x, offs)).module()
    assert NativeKernelsPass()(gm).modified
    assert not NativeKernelsPass()(gm).modified
    assert "native_kernels_grouped_mm(" in gm.code


def test_mixtral_experts_run_the_eager_kernel() -> None:
    """The real case: a converted Mixtral (transformers' MoE experts) calls ``_grouped_mm``
    as it does eagerly, twice per layer."""
    sys.path.insert(0, str(Path(__file__).parent / "models"))
    from _hf_zoo import arch

    entry = arch("mixtral")
    model = entry.build()
    args, kwargs = entry.example()
    gm = amprewrite.convert(model, args, example_kwargs=kwargs, policy=BF16)
    ops = ops_of(lambda: gm(*args, **kwargs))
    eager = ops_of(lambda: model(*args, **kwargs))
    assert ops[FALLBACK] == 0 and ops[NATIVE] == eager[NATIVE] == 2 * model.config.num_hidden_layers
