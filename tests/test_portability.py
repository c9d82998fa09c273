"""What must hold on every supported torch and transformers release: the declared range, no
global patching of torch during capture, LayerDrop with a fixed answer, clear errors for
inputs a capture does not fit, and no op lowered into a dtype its device has no kernel for."""

from __future__ import annotations

import re
import sys
import threading
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import amprewrite
from amprewrite import versions
from amprewrite.policy.kernels import MISSING_LOW_KERNELS

ROOT = Path(__file__).resolve().parents[1]


# -- the declared range ------------------------------------------------------------------------
def _requirement(spec: list[str], package: str) -> str:
    return next(r for r in spec if re.match(rf"{package}\b", r))


def test_pyproject_declares_the_tested_range() -> None:
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    low, high = versions.TORCH_RANGE
    assert _requirement(project["dependencies"], "torch") == f"torch>={low},<{high}"
    low, high = versions.TRANSFORMERS_RANGE
    for extra in ("demo", "test"):
        assert _requirement(project["optional-dependencies"][extra], "transformers") == \
            f"transformers>={low},<{high}"


def test_this_torch_is_in_the_range() -> None:
    assert not versions._outside(torch.__version__, versions.TORCH_RANGE), torch.__version__


@pytest.mark.parametrize("version,outside", [
    ("2.10.0", True), ("2.11.0+cu130", False), ("2.13.0+cpu", False), ("2.14.1", False),
    ("2.15.0", True)])
def test_a_torch_outside_the_range_warns_once(monkeypatch: pytest.MonkeyPatch, version: str,
                                               outside: bool) -> None:
    monkeypatch.setattr(versions, "_warned", set())
    monkeypatch.setattr(versions.torch, "__version__", version)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        versions.check_torch()
        versions.check_torch()
    messages = [str(w.message) for w in seen]
    if outside:
        assert len(messages) == 1
        assert f"torch {version}" in messages[0] and "torch>=2.11,<2.15" in messages[0]
    else:
        assert messages == []


def test_the_range_warning_points_at_the_users_import_line(tmp_path: Path) -> None:
    import subprocess
    script = tmp_path / "user.py"
    script.write_text("import warnings, torch\ntorch.__version__ = '2.10.0'\n"
                      "warnings.simplefilter('always')\nimport amprewrite\n")
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          cwd=ROOT, env={"PYTHONPATH": str(ROOT), "PATH": ""}, timeout=120)
    assert done.returncode == 0, done.stderr
    assert f"{script}:4: UserWarning: amprewrite is tested with torch" in done.stderr


def test_the_slow_dtype_warning_points_at_the_convert_line(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from amprewrite import hardware
    monkeypatch.setattr(hardware, "slow_reason", lambda device, dtype: "no fast kernels")
    monkeypatch.setattr(hardware, "_WARNED", set())
    with pytest.warns(UserWarning, match="no fast kernels") as seen:
        amprewrite.convert(nn.Linear(2, 2), (torch.randn(1, 2),))
    assert [w.filename for w in seen if "no fast kernels" in str(w.message)] == [__file__]


def test_a_transformers_outside_the_range_warns_once(monkeypatch: pytest.MonkeyPatch) -> None:
    class FakeTransformers:
        __version__ = "4.57.1"

    monkeypatch.setattr(versions, "_warned", set())
    monkeypatch.setitem(sys.modules, "transformers", FakeTransformers)
    with pytest.warns(UserWarning, match=r"transformers 4\.57\.1.*>=5\.17,<5\.26"):
        versions.check_transformers()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        versions.check_transformers()


# -- capture patches nothing of torch ------------------------------------------------------------
class _Double(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return x * 2

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return grad * 2


def test_capture_leaves_function_apply_alone_while_the_model_runs() -> None:
    """Another thread running autograd Functions during a conversion sees torch's own apply."""
    apply = torch.autograd.Function.__dict__["apply"]
    seen: list[object] = []

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            seen.append(torch.autograd.Function.__dict__["apply"])
            other = threading.Thread(target=lambda: seen.append(
                torch.autograd.Function.__dict__["apply"]))
            other.start()
            other.join()
            return _Double.apply(self.lin(x))

    with pytest.warns(UserWarning, match=r"custom torch\.autograd\.Function.*_Double"):
        amprewrite.convert(Model(), (torch.randn(2, 4),))
    assert seen and all(s is apply for s in seen)


# -- LayerDrop ---------------------------------------------------------------------------------
class LayerDropStack(nn.Module):
    """The LayerDrop loop of BART, Whisper and OPT in transformers before 5.18."""

    def __init__(self, layerdrop: float) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))
        self.layerdrop = layerdrop

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            if self.training:
                dropout_probability = torch.rand([])
                if dropout_probability < self.layerdrop:
                    continue
            x = F.dropout(torch.relu(layer(x)), 0.25, self.training)
        return x


class LayerDropAnd(LayerDropStack):
    """wav2vec2's spelling: ``skip = self.training and torch.rand([]) < p``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            skip = self.training and torch.rand([]) < self.layerdrop
            if not skip:
                x = F.dropout(torch.relu(layer(x)), 0.25, self.training)
        return x


@pytest.mark.parametrize("cls", [LayerDropStack, LayerDropAnd])
@pytest.mark.parametrize("layerdrop", [0.0, 1.0])
def test_layerdrop_with_a_fixed_answer_converts_in_train_mode(cls: type, layerdrop: float) -> None:
    torch.manual_seed(0)
    model = cls(layerdrop).train()
    x = torch.randn(4, 8)
    gm = amprewrite.convert(model, (x,), policy=amprewrite.Policy.autocast("cpu", torch.bfloat16))
    torch.manual_seed(1)
    with torch.autocast("cpu", torch.bfloat16):
        want = model(x)
    torch.manual_seed(1)
    got = gm(x)
    # bitwise, dropout masks included: the converted module draws as many numbers as eager
    assert torch.equal(got, want)
    if layerdrop == 1.0:
        assert torch.equal(got, x)  # every layer dropped
    targets = [n.target for n in gm.graph.nodes]
    assert targets.count(torch.ops.aten.rand.default) == 3
    assert torch.ops.aten.lt.Scalar not in targets


def test_layerdrop_that_really_drops_cannot_be_captured() -> None:
    with pytest.raises(amprewrite.AmpRewriteError, match="could not capture LayerDropStack"):
        amprewrite.convert(LayerDropStack(0.5).train(), (torch.randn(4, 8),))


def test_hf_layerdrop_model_converts_in_train_mode() -> None:
    transformers = pytest.importorskip("transformers")
    cfg = transformers.BartConfig(
        vocab_size=64, d_model=16, encoder_layers=2, decoder_layers=2,
        encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=32,
        decoder_ffn_dim=32, max_position_embeddings=32, encoder_layerdrop=0.0,
        decoder_layerdrop=0.0, dropout=0.0, attention_dropout=0.0, activation_dropout=0.0)
    torch.manual_seed(0)
    model = transformers.BartForConditionalGeneration(cfg).train()
    ids = torch.randint(0, 64, (2, 8))
    policy = amprewrite.Policy.autocast("cpu", torch.bfloat16)
    gm = amprewrite.convert(model, (), example_kwargs=dict(input_ids=ids, labels=ids),
                            policy=policy)
    with torch.autocast("cpu", torch.bfloat16):
        want = model(input_ids=ids, labels=ids).loss
    got = gm(input_ids=ids, labels=ids)["loss"]
    assert torch.equal(got, want)
    got.backward()
    assert model.model.encoder.layers[0].fc1.weight.grad is not None


# -- inputs the capture does not fit -----------------------------------------------------------
class Gelu(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return self.lin(F.gelu(x)) * scale


def test_wrong_dtype_is_named() -> None:
    gm = amprewrite.convert(Gelu(), (torch.randn(2, 8), torch.ones(4)))
    with pytest.raises(amprewrite.AmpRewriteError) as info:
        gm(torch.randint(0, 3, (2, 8)), torch.ones(4))
    message = str(info.value)
    assert "the converted Gelu was called with inputs its capture does not fit" in message
    assert re.search(r"  x: captured for float32 of shape \(any, 8\), called with int64 of "
                     r"shape \(2, 8\)", message), message
    assert "scale" not in message  # only the arguments that differ
    assert "convert again with example inputs" in message


def test_wrong_size_is_named() -> None:
    gm = amprewrite.convert(Gelu(), (torch.randn(2, 8), torch.ones(4)))
    with pytest.raises(amprewrite.AmpRewriteError,
                       match=r"x: captured for float32 of shape \(any, 8\), called with float32 "
                             r"of shape \(3, 9\)"):
        gm(torch.randn(3, 9), torch.ones(4))
    assert gm(torch.randn(5, 8), torch.ones(4)).shape == (5, 4)  # the batch is dynamic


def test_keyword_inputs_are_named_by_their_keyword() -> None:
    gm = amprewrite.convert(Gelu(), (torch.randn(2, 8),), example_kwargs={"scale": torch.ones(4)})
    with pytest.raises(amprewrite.AmpRewriteError,
                       match=r"scale: captured for float32 of shape \(4\), called with float32 "
                             r"of shape \(5\)"):
        gm(torch.randn(2, 8), scale=torch.ones(5))


def test_a_failure_with_fitting_inputs_is_the_models_own() -> None:
    class Fails(nn.Module):
        def forward(self, x: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
            return x.repeat(2, 1)[: n.shape[0]] + n

    gm = amprewrite.convert(Fails(), (torch.randn(2, 8), torch.randn(4, 8)))
    assert gm(torch.randn(2, 8), torch.randn(4, 8)).shape == (4, 8)


# -- ops without a low-precision kernel --------------------------------------------------------
class SpectralMixer(nn.Module):
    """FNet's token mixing: a Fourier transform of a Linear's output."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.fft.fftn(self.lin(x), dim=(1, 2)).real + x


def test_fft_without_a_bf16_kernel_runs_in_fp32_under_the_default_policy() -> None:
    torch.manual_seed(0)
    model, x = SpectralMixer(), torch.randn(2, 4, 8)
    gm = amprewrite.convert(model, (x,))  # CUDA rules on the CPU: fftn is not listed there
    got = gm(x)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, model(x), atol=0.1, rtol=0.05)
    fft = next(n for n in gm.graph.nodes if "fft" in str(n.target))
    decision = fft.meta["amprewrite"]
    assert decision.category is amprewrite.OpCategory.FP32
    assert decision.rule == "no bfloat16 kernel on cpu"
    assert "no bfloat16 kernel on cpu" in amprewrite.explain(gm)


def test_an_override_into_a_missing_kernel_is_refused() -> None:
    policy = amprewrite.Policy().override(ops={"fft_fftn": amprewrite.OpCategory.LOWER})
    with pytest.raises(amprewrite.AmpRewriteError,
                       match=r"op override 'fft_fftn' lowers .*fft_fftn.* to torch\.bfloat16, but "
                             r"fft_fftn has no torch\.bfloat16 kernel on cpu"):
        amprewrite.convert(SpectralMixer(), (torch.randn(2, 4, 8),), policy=policy)


_PUBLIC_FFTS = {name: getattr(torch.fft, name.removeprefix("fft_"))
                for name in MISSING_LOW_KERNELS["cpu"][torch.bfloat16] if name.startswith("fft_")}


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", sorted(_PUBLIC_FFTS))
def test_the_kernel_table_is_true_on_this_torch(name: str, dtype: torch.dtype) -> None:
    """Each listed op raises in the listed dtype on a CPU and runs in fp32."""
    fn = _PUBLIC_FFTS[name]
    x = torch.randn(4, 8)
    fn(x)
    with pytest.raises(RuntimeError, match="Unsupported dtype"):
        fn(x.to(dtype))
