"""Which nodes of an exported ONNX model ONNX Runtime cannot load, found right after export.

``torch.onnx.export(gm, ...)`` of a converted module writes every activation cast as a ``Cast``
node and every lowered op in the policy's low dtype. ONNX Runtime places each node on a kernel
that its execution provider registered for the node's op, opset and tensor types. Its CPU
provider has ``MatMul``, ``Gemm``, ``Conv``, ``Relu``, ``Sqrt``, ... for float, double and
integers only: a float16 node without a float16 kernel still runs there (the provider computes
it in fp32 through casts it inserts itself), a bfloat16 node does not, and a session fails when
it loads the model, naming one node and not its dtype (``Could not find an implementation for
MatMul(13) node with name 'node_linear'``), possibly at deployment on another machine.

:func:`missing_kernels` asks ONNX Runtime about each node of the main graph on its own (a
session of one node, its inputs declared by type: no weights are read), so the answer is ONNX
Runtime's own, its fp16 fallback and the ops it expands into others (``Gelu``, ``LogSoftmax``)
included, and follows ONNX Runtime as kernels are added: every node that would fail, with its
dtypes, the module it came from and ONNX Runtime's reason. :func:`check_kernels` raises with the
list and the fixes.

NB: nodes that carry subgraphs (``If``, ``Loop``) are not judged (their bodies read values of
the outer graph). Optimisations that a whole-model session applies before it places kernels
(fusions into contrib ops) are not seen: a fused op may have a kernel where its parts have none.
"""

from __future__ import annotations

import ast
import dataclasses
import os
import re
from collections import Counter
from typing import TYPE_CHECKING, Any, Union

from ..errors import AmpRewriteError

try:
    import onnx
    import onnxruntime
except ImportError as e:  # the optional extra
    raise ImportError(f"amprewrite.integrations.onnx needs onnx and onnxruntime ({e}): "
                      f"pip install 'amprewrite[onnx]'") from e

if TYPE_CHECKING:
    from torch.onnx import ONNXProgram

__all__ = ["MissingKernel", "missing_kernels", "check_kernels", "CPU"]

CPU = "CPUExecutionProvider"

OnnxModel = Union[onnx.ModelProto, "ONNXProgram", "os.PathLike[str]", str]
"""An ``onnx.ModelProto``, a path to a ``.onnx`` file, or what ``torch.onnx.export`` returns."""

_SUBGRAPHS = (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS)


@dataclasses.dataclass(frozen=True)
class MissingKernel:
    """One node that a session on ``provider`` cannot load, and ONNX Runtime's ``reason``.

    ``dtypes`` are the element types of the node's floating inputs and outputs
    (``("bfloat16",)``); ``module`` is the qualified name of the module the node was exported
    from (``"model.layers.0.self_attn.q_proj"``), ``""`` when the exporter recorded none.
    """

    node: str
    op_type: str
    dtypes: tuple[str, ...]
    module: str
    provider: str
    reason: str

    def __str__(self) -> str:
        where = f" in {self.module}" if self.module else ""
        return f"{self.op_type} {self.node!r}{where} [{', '.join(self.dtypes)}]: {self.reason}"


def missing_kernels(model: OnnxModel, provider: str = CPU) -> list[MissingKernel]:
    """The nodes of ``model``'s main graph that a session made with ``providers=[provider]``
    cannot load, in graph order (an empty list when it can load every node).

    ``model`` is an ``onnx.ModelProto``, a path, or the ``ONNXProgram`` that
    ``torch.onnx.export`` returns; ``provider`` an execution provider of the installed
    onnxruntime (``onnxruntime.get_available_providers()``).
    """
    proto = _as_proto(model)
    if provider not in onnxruntime.get_available_providers():
        raise ValueError(
            f"provider={provider!r} is not in the installed onnxruntime "
            f"{onnxruntime.__version__}, which has {onnxruntime.get_available_providers()}. "
            f"Pass one of those, or install the onnxruntime build that ships {provider!r}")
    infos = _value_infos(proto)
    options = onnxruntime.SessionOptions()
    options.log_severity_level = 4  # the reasons come back as exceptions; no log lines
    missing = []
    for node in proto.graph.node:
        values = [v for v in (*node.input, *node.output) if v]
        if any(a.type in _SUBGRAPHS for a in node.attribute) or \
                any(v not in infos for v in values):
            continue  # a control-flow body, or a value of unknown type: not judged
        reason = _load_error(_one_node_model(node, proto, infos), options, provider)
        if reason is not None:
            lacking = _NO_KERNEL.search(reason)
            if lacking and lacking.group(1) != node.op_type:
                reason += f" (an op ONNX Runtime expands {node.op_type} into)"
            dtypes = sorted({_elem_name(infos[v]) for v in values} & _FLOATING)
            missing.append(MissingKernel(node.name, node.op_type, tuple(dtypes),
                                         _module_of(node), provider, reason))
    return missing


def check_kernels(model: OnnxModel, provider: str = CPU) -> None:
    """Raise :class:`~amprewrite.AmpRewriteError` if a session on ``provider`` cannot load
    ``model``: what :func:`missing_kernels` found, grouped by op and dtype, and the fixes. Call
    it right after ``torch.onnx.export``, where a bf16 graph bound for the CPU provider is
    cheapest to fix."""
    missing = missing_kernels(model, provider)
    if not missing:
        return
    groups = Counter((m.op_type, "/".join(m.dtypes) or "non-floating types") for m in missing)
    summary = "; ".join(f"{op} in {dtypes} x{n}" for (op, dtypes), n in groups.most_common())
    first = "\n".join(f"  {m}" for m in missing[:5]) + ("\n  ..." if len(missing) > 5 else "")
    if provider == CPU and any("bfloat16" in m.dtypes for m in missing):
        fix = ("ONNX Runtime's CPU provider has almost no bfloat16 kernels. Convert with "
               "dtype=torch.float16 for it (it computes float16 nodes without a float16 kernel "
               "in fp32, through casts it inserts), or deploy on a provider with bfloat16 "
               "kernels (check it with missing_kernels(model, provider=...) where that provider "
               "is installed)")
    else:
        fix = ("See the reasons above: export with optimize=False if an optimisation of "
               "torch.onnx made a node of mixed types, or keep these ops in fp32 "
               "(Policy.override(ops={...: OpCategory.FP32}))")
    raise AmpRewriteError(
        f"onnxruntime {onnxruntime.__version__}: a session on {provider} cannot load "
        f"{len(missing)} node(s) of this model: {summary}. First nodes:\n{first}\n{fix}.")


def _as_proto(model: OnnxModel) -> onnx.ModelProto:
    if isinstance(model, onnx.ModelProto):
        return model
    if isinstance(model, (str, os.PathLike)):
        return onnx.load(os.fspath(model), load_external_data=False)  # the weights are not read
    proto = getattr(model, "model_proto", None)  # torch.onnx.ONNXProgram
    if isinstance(proto, onnx.ModelProto):
        return proto
    raise TypeError(f"expected an onnx.ModelProto, a path to an .onnx file or the ONNXProgram "
                    f"that torch.onnx.export returns; got {type(model).__name__}")


def _value_infos(proto: onnx.ModelProto) -> dict[str, onnx.ValueInfoProto]:
    """Type (and shape) of every value of the main graph, inferred where the exporter left it
    out; initializers as typed values, without their data."""
    graph = proto.graph
    produced = {o for n in graph.node for o in n.output if o}
    if not produced <= {v.name for v in (*graph.output, *graph.value_info)}:
        graph = onnx.shape_inference.infer_shapes(proto).graph
    infos = {t.name: onnx.helper.make_tensor_value_info(t.name, t.data_type, list(t.dims))
             for t in graph.initializer}
    for info in (*graph.input, *graph.output, *graph.value_info):
        if info.type.HasField("tensor_type") and info.type.tensor_type.elem_type:
            infos[info.name] = info
    return infos


def _one_node_model(node: onnx.NodeProto, proto: onnx.ModelProto,
                    infos: dict[str, onnx.ValueInfoProto]) -> onnx.ModelProto:
    inputs = list(dict.fromkeys(v for v in node.input if v))  # a value may feed two inputs
    graph = onnx.helper.make_graph([node], node.name or node.op_type,
                                   [infos[v] for v in inputs],
                                   [infos[v] for v in node.output if v])
    return onnx.helper.make_model(graph, opset_imports=proto.opset_import,
                                  ir_version=proto.ir_version, functions=proto.functions)


def _load_error(model: onnx.ModelProto, options: Any, provider: str) -> str | None:
    """ONNX Runtime's message when a session on ``provider`` cannot load ``model``."""
    try:
        onnxruntime.InferenceSession(model.SerializeToString(), options, providers=[provider])
    except Exception as e:  # noqa: BLE001 - onnxruntime's error classes are not exported
        message = str(e).strip().splitlines()[0]
        return message.split(" : ", 2)[-1] if message.startswith("[ONNXRuntimeError]") \
            else message
    return None


_FLOATING = {"float16", "bfloat16", "float", "double"}
_NO_KERNEL = re.compile(r"Could not find an implementation for (\w+)\(")


def _elem_name(info: onnx.ValueInfoProto) -> str:
    name = onnx.helper.tensor_dtype_to_string(info.type.tensor_type.elem_type)
    return name.removeprefix("TensorProto.").lower()


def _module_of(node: onnx.NodeProto) -> str:
    """The innermost module scope torch.onnx recorded for the node (its last scope is the
    node's own name)."""
    for prop in node.metadata_props:
        if prop.key == "pkg.torch.onnx.name_scopes":
            try:
                scopes = [s for s in ast.literal_eval(prop.value) if s]  # a list's repr
            except (ValueError, SyntaxError, TypeError):  # another exporter's metadata
                return ""
            return scopes[-2] if len(scopes) > 1 else ""
    return ""
