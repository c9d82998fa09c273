"""ONNX: ``torch.onnx.export`` of a converted module and ONNX Runtime's CPU provider.

An fp16-converted HF Llama exports with every activation cast as a ``Cast`` node (the weight
casts folded into fp16 initializers by the exporter) and runs in ONNX Runtime within a float16
rounding of the converted module. A bf16 graph does not load on the CPU provider:
``amprewrite.integrations.onnx`` lists the nodes that fail, with their module and the fix,
right after export. Needs the ``onnx`` extra (onnx, onnxruntime, onnxscript); skipped without
it.
"""

from __future__ import annotations

import pathlib
import warnings
from collections import Counter

import pytest
import torch

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")
pytest.importorskip("onnxscript")  # torch.onnx.export's translator

import amprewrite  # noqa: E402
from amprewrite.graph.queries import cast_source  # noqa: E402
from amprewrite.integrations.onnx import CPU, check_kernels, missing_kernels  # noqa: E402

from _zoo import zoo_case  # noqa: E402

_FLOAT, _FLOAT16 = onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16


def _convert_and_export(model: torch.nn.Module, args: tuple, kwargs: dict, dtype: torch.dtype,
                        **options: object) -> tuple[torch.fx.GraphModule, onnx.ModelProto]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        gm = amprewrite.convert(model, args, example_kwargs=kwargs, dtype=dtype)
        program = torch.onnx.export(gm, args, kwargs=kwargs, dynamo=True, verbose=False,
                                    **options)
    return gm, program.model_proto


@pytest.fixture(scope="module")
def llama_fp16() -> tuple[torch.fx.GraphModule, torch.Tensor, onnx.ModelProto]:
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, use_cache=False)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    gm, proto = _convert_and_export(model, (), {"input_ids": ids}, torch.float16)
    return gm, ids, proto


def _val(node: torch.fx.Node) -> torch.Tensor | None:
    val = node.meta.get("val")
    return val if isinstance(val, torch.Tensor) else None


def test_fp16_llama_casts_are_cast_nodes(llama_fp16: tuple) -> None:
    """Every ONNX ``Cast`` is accounted for: one per activation cast of ``gm`` (to fp16), one
    per fp16 operand of an op that mixes fp16 and fp32 (torch promotes those inside the kernel,
    ONNX needs the cast written out), and each weight cast is folded into an fp16 initializer."""
    gm, _, proto = llama_fp16
    casts = [n for n in gm.graph.nodes if cast_source(n)]
    weight_casts = [n for n in casts if n.args[0].op == "get_attr"]
    activation_casts = [n for n in casts if n not in weight_casts]
    promoted = 0
    for node in gm.graph.nodes:
        if node.op in ("call_function", "call_method") and not cast_source(node):
            floats = [v.dtype for v in map(_val, node.all_input_nodes)
                      if v is not None and v.is_floating_point()]
            if {torch.float16, torch.float32} <= set(floats):
                promoted += floats.count(torch.float16)
    onnx_casts = Counter(next(a.i for a in n.attribute if a.name == "to")
                         for n in proto.graph.node if n.op_type == "Cast")
    fp16_initializers = [t for t in proto.graph.initializer if t.data_type == _FLOAT16
                         and len(t.dims) == 2]  # the lowered weight matrices
    assert (len(activation_casts), promoted, len(weight_casts)) == (9, 12, 15)
    assert onnx_casts == {_FLOAT16: len(activation_casts), _FLOAT: promoted}
    assert sum(onnx_casts.values()) == 21
    assert len(fp16_initializers) == len(weight_casts)


def test_fp16_llama_runs_in_onnx_runtime_within_fp16_rounding(llama_fp16: tuple) -> None:
    gm, ids, proto = llama_fp16
    assert missing_kernels(proto) == []
    check_kernels(proto)  # nothing to report
    session = ort.InferenceSession(proto.SerializeToString(), providers=[CPU])
    (logits,) = session.run(None, {"input_ids": ids.numpy()})
    expected = gm(input_ids=ids).logits.detach()
    got = torch.from_numpy(logits)
    assert got.dtype == expected.dtype == torch.float16
    # ONNX Runtime computes the fp16 MatMuls in fp32 and rounds (casts it inserts itself), as
    # torch's CPU kernels do, in another order of summation: within 2 fp16 epsilons of the
    # largest logit (measured: 2e-4, one fp16 ulp at its magnitude).
    bound = 2 * torch.finfo(torch.float16).eps * expected.abs().max().float()
    assert (got.float() - expected.float()).abs().max() <= bound


def _session_error(proto: onnx.ModelProto) -> str | None:
    try:
        ort.InferenceSession(proto.SerializeToString(), providers=[CPU])
    except Exception as e:  # noqa: BLE001 - onnxruntime's error classes are not exported
        return str(e)
    return None


def _zoo_export(name: str, dtype: torch.dtype, **options: object
                ) -> tuple[torch.nn.Module, torch.Tensor, onnx.ModelProto]:
    case = zoo_case(name)
    x, = case.make_inputs()
    gm, proto = _convert_and_export(case.make_model().eval(), (x,), {}, dtype, **options)
    return gm, x, proto


def test_bf16_graph_is_refused_before_a_session_fails() -> None:
    """ONNX Runtime's CPU provider has no bf16 Gemm (nor the Sqrt and ReduceMax that it expands
    Gelu and LogSoftmax into): a session fails when it loads the model, naming one node and not
    its dtype. ``missing_kernels`` lists every such node with its module, and only those (the
    bf16 Cast, Add and LayerNormalization have kernels); ``check_kernels`` raises with the dtype
    and the fix. The same model in fp16 loads."""
    _, _, proto = _zoo_export("mlp_residual", torch.bfloat16)
    missing = missing_kernels(proto)
    assert sorted(m.op_type for m in missing) == ["Gelu", "Gemm", "Gemm", "Gemm", "LogSoftmax"]
    assert all(m.dtypes == ("bfloat16",) and m.provider == CPU for m in missing)
    assert {m.module for m in missing if m.op_type == "Gemm"} == {"up", "down", "head"}
    assert "Could not find an implementation for Sqrt" in \
        next(m.reason for m in missing if m.op_type == "Gelu")
    error = _session_error(proto)
    assert error is not None and "Could not find an implementation for Gemm(13)" in error
    assert any(f"node with name '{m.node}'" in error for m in missing)
    with pytest.raises(amprewrite.AmpRewriteError,
                       match=r"(?s)CPUExecutionProvider cannot load 5 node.*Gemm in bfloat16 x3"
                             r".*'node_linear' in up.*Convert with dtype=torch\.float16"):
        check_kernels(proto)
    _, _, fp16 = _zoo_export("mlp_residual", torch.float16)
    assert missing_kernels(fp16) == [] and _session_error(fp16) is None


def test_conv_batch_norm_fold_makes_mixed_types_export_without_optimize() -> None:
    """Conv then BatchNorm (eval): torch.onnx's optimizer folds the batch norm's fp32 parameters
    into the fp16 convolution's weights as fp32, a Conv of fp16 input and fp32 weight that no
    session loads. ``check_kernels`` names it; exported with ``optimize=False`` the model runs
    within fp16 rounding of the converted module."""
    _, _, folded = _zoo_export("conv_bn_eval", torch.float16)
    (conv,) = missing_kernels(folded)
    assert (conv.op_type, conv.dtypes) == ("Conv", ("float", "float16"))
    assert "bound to different types" in conv.reason
    assert "bound to different types" in _session_error(folded)
    with pytest.raises(amprewrite.AmpRewriteError, match="optimize=False"):
        check_kernels(folded)
    gm, x, plain = _zoo_export("conv_bn_eval", torch.float16, optimize=False)
    assert missing_kernels(plain) == []
    session = ort.InferenceSession(plain.SerializeToString(), providers=[CPU])
    (got,) = session.run(None, {session.get_inputs()[0].name: x.numpy()})
    expected = gm(x).detach()
    bound = 2 * torch.finfo(torch.float16).eps * expected.abs().max().float()
    assert (torch.from_numpy(got).float() - expected.float()).abs().max() <= bound


def test_paths_and_bad_arguments(tmp_path: pathlib.Path) -> None:
    _, _, proto = _zoo_export("mlp_residual", torch.bfloat16)
    path = tmp_path / "model.onnx"
    onnx.save(proto, path)
    assert missing_kernels(path) == missing_kernels(str(path)) == missing_kernels(proto) != []
    with pytest.raises(ValueError, match="provider='CUDAExecutionProvide' is not in the installed "
                                         "onnxruntime.*CPUExecutionProvider"):
        missing_kernels(proto, provider="CUDAExecutionProvide")
    with pytest.raises(TypeError, match="ONNXProgram .*got int"):
        missing_kernels(42)
