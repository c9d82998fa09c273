"""Opt levels O0, O2 and O3 (O1, the per-op policy, is
:func:`amprewrite.passes.pipeline.run_passes`).

Apex's four levels, as graph rewrites of a captured model:

* ``O0``: fp32, no casts; the captured graph as it is (the faithful baseline), but for the
  two speed passes every level runs: constant subgraphs computed once, traced-only fallback
  ops routed to eager code's kernel.
* ``O1``: the per-op policy (autocast's lists).
* ``O2``: "almost fp16". Floating inputs are cast to the low dtype at the entry and every
  parameter is read as a stored low-precision copy of its fp32 master
  (:mod:`amprewrite.runtime.low_copies`), but for embedding tables, whose lookups read the
  fp32 master and round the rows they return (the same bits, without a stored copy of the
  whole vocabulary); then the same passes as O1 run with the O2 rules
  (``_tables.O2_TABLE``): ops run in whatever dtype arrives, except the ops that need one dtype
  for all their floating inputs (matmuls, convolutions, attention), whose inputs are cast to
  the low dtype, and normalisation ops (batch/instance/layer/group/RMS norm), which read the
  fp32 masters of their own weights: where the device's kernel takes fp16/bf16 input with fp32
  parameters and statistics (``kernels.MIXED_INPUT_NORMS``: batch norm on CPU and CUDA, layer,
  group and instance norm on CPU), the norm runs on the low-precision activation as it arrives
  and returns the low dtype, no cast around it (Apex's ``keep_batchnorm_fp32``); elsewhere it
  computes in fp32, its input cast up and its output cast back down. So the graph is
  type-correct by construction: an fp32 activation the model makes on purpose
  (``x.float()``, ``pixel_values.to(weight.dtype)`` traced in fp32) meets a low-precision
  weight only in an op that casts it. Buffers (rotary frequencies, masks, running statistics)
  keep their dtype. Floating outputs are cast to fp32 so that the loss computes in fp32, as
  Apex does. The fp32 masters stay the module's parameters, shared with the user's model;
  :class:`amprewrite.MasterWeights` binds them to the optimizer.
* ``O3``: pure low precision, no masters: the GraphModule owns low-precision *copies* of the
  parameters and buffers (:func:`low_precision_twin`: the model is traced on a copy of itself
  in the low dtype; the user's model keeps its fp32 tensors); inputs cast down and outputs up
  as in O2, normalisation in the low dtype too (``_tables.O3_TABLE``). The speed baseline.

After (O2, fp16; ``Linear → LayerNorm → Linear``, symbolic capture with example inputs, on a
device whose layer norm kernel wants one dtype: CUDA)::

    x_f16 = x.to(torch.float16)
    fc1_weight_f16 = _amp_low_copies.get(fc1_weight, torch.float16)
    fc1_bias_f16 = _amp_low_copies.get(fc1_bias, torch.float16)
    linear = torch._C._nn.linear(x_f16, fc1_weight_f16, fc1_bias_f16)
    linear_f32 = linear.to(torch.float32)
    layer_norm = torch.nn.functional.layer_norm(linear_f32, (8,), weight = ln_weight, ...)
    layer_norm_f16 = layer_norm.to(torch.float16)
    fc2_weight_f16 = _amp_low_copies.get(fc2_weight, torch.float16)
    fc2_bias_f16 = _amp_low_copies.get(fc2_bias, torch.float16)
    linear_1 = torch._C._nn.linear(layer_norm_f16, fc2_weight_f16, fc2_bias_f16)
    linear_1_f32 = linear_1.to(torch.float32)
    return linear_1_f32

On a CPU, whose layer norm takes fp16 input with fp32 weights, ``linear_f32`` and
``layer_norm_f16`` are not there: ``layer_norm(linear, (8,), weight = ln_weight, ...)`` reads
the fp16 activation and returns fp16. O3 has the same activation casts, no norm casts, and
plain ``get_attr`` weights (its own fp16 parameters).
"""

from __future__ import annotations

import copy
import dataclasses
import operator
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

from ..capture.facts import GRAD_KEY
from ..capture.guards import is_input_guards
from ..graph.meta import CONVERTED_KEY, META_KEY, CastInfo
from ..graph.queries import attr_at
from ..policy.policy import Policy
from ..policy.opkey import op_key
from ..policy.tables import NORM_OPS, OpCategory
from ..runtime.functions import guarded_cast
from ..runtime.low_copies import LOW_COPIES_ATTR, LowPrecisionCopies
from .classify import ClassifyPass
from .eliminate_casts import EliminateCastsPass
from .gather_weights import gather_weights
from .pipeline import run_in_order, run_passes, speed_passes

__all__ = ["OPT_LEVELS", "OPT_LEVEL_KEY", "OptLevel", "apply_opt_level", "check_opt_level",
           "low_precision_twin", "opt_level_of"]

OPT_LEVELS = ("O0", "O1", "O2", "O3")
OPT_LEVEL_KEY = "amprewrite_opt_level"
"""``gm.meta[OPT_LEVEL_KEY]``: the :class:`OptLevel` a GraphModule was converted with."""

_CALLS = ("call_function", "call_method", "call_module")
_SHORT = {torch.float16: "f16", torch.bfloat16: "bf16", torch.float32: "f32"}


@dataclasses.dataclass(frozen=True)
class OptLevel:
    """How a GraphModule was converted: the level and its low dtype (None for O0)."""

    level: str
    dtype: torch.dtype | None

    @property
    def master_weights(self) -> bool:
        return self.level == "O2"


def opt_level_of(gm: nn.Module) -> OptLevel | None:
    """The :class:`OptLevel` of a converted module (O1 included), None for other modules."""
    meta = getattr(gm, "meta", None)
    if not isinstance(meta, dict):
        return None
    if OPT_LEVEL_KEY in meta:
        return meta[OPT_LEVEL_KEY]
    if CONVERTED_KEY in meta:
        return OptLevel("O1", meta[CONVERTED_KEY][1])
    return None


def check_opt_level(level: object, policy: Any, dtype: torch.dtype | None) -> None:
    """Validate ``convert``'s ``opt_level`` against the other options it was given with."""
    if level not in OPT_LEVELS:
        raise ValueError(
            f"amprewrite.convert: opt_level={level!r} does not exist; expected one of "
            f"{', '.join(map(repr, OPT_LEVELS))} (Apex's levels: 'O0' fp32, 'O1' per-op "
            "mixed precision, 'O2' low-precision weights with fp32 masters, 'O3' pure low "
            "precision).")
    if level == "O1":
        return
    if policy != Policy():
        raise ValueError(
            f"amprewrite.convert: a policy was given with opt_level={level!r}; the per-op "
            "policy is what opt_level='O1' applies. Drop policy=..., or use opt_level='O1'.")
    if level == "O0" and dtype is not None:
        raise ValueError(
            f"amprewrite.convert: dtype={dtype} was given with opt_level='O0', which runs in "
            "fp32 without casts. Drop dtype=..., or pick opt_level 'O1', 'O2' or 'O3'.")


def apply_opt_level(gm: fx.GraphModule, model: nn.Module, level: str,
                    dtype: torch.dtype) -> fx.GraphModule:
    """Rewrite a freshly captured ``gm`` for ``level`` (``"O0"``, ``"O2"`` or ``"O3"``)."""
    if level == "O0":
        # O0 computes what the model computes eagerly, at its speed
        run_in_order(speed_passes(), gm)
        gm.meta[OPT_LEVEL_KEY] = OptLevel("O0", None)
        gm.recompile()
        return gm
    _LowPrecisionRewrite(gm, dtype, masters=level == "O2").run()
    gm.meta[OPT_LEVEL_KEY] = OptLevel(level, dtype)
    gm.graph.lint()
    gm.recompile()
    return gm


class _LowPrecisionRewrite:
    """The O2 / O3 rewrite of one GraphModule (see the module docstring)."""

    def __init__(self, gm: fx.GraphModule, dtype: torch.dtype, masters: bool) -> None:
        self.gm, self.dtype, self.masters = gm, dtype, masters
        self.graph = gm.graph
        self.policy = Policy(preset="O2" if masters else "O3", dtype=dtype)
        self.static = all("val" in n.meta for n in gm.graph.nodes if n.op == "placeholder") \
            and any("val" in n.meta for n in gm.graph.nodes)
        self.inputs = [n for n in gm.graph.nodes if n.op == "placeholder"]
        self.master_lookups: set[fx.Node] = set()
        """O2's embedding lookups of a parameter's fp32 master (:meth:`_gathers_master`)."""

    def run(self) -> None:
        if self.masters:
            setattr(self.gm, LOW_COPIES_ATTR, LowPrecisionCopies())
            self._read_low_copies()
        self._cast_inputs()
        if self.masters:
            self._master_outputs_down()
        run_passes(self.gm, self.policy, self.dtype, mark_converted=False)
        self._cast_outputs()
        run_in_order([EliminateCastsPass(self.policy)], self.gm)  # the outputs' casts
        gather_weights(self.gm)

    # -- weights ---------------------------------------------------------------------------
    def _attr(self, qualname: str) -> Any:
        return attr_at(self.gm, qualname)

    def _castable(self, value: Any) -> bool:
        return (isinstance(value, torch.Tensor) and value.is_floating_point()
                and value.dtype not in (torch.float64, self.dtype))

    def _in_fp32(self, node: fx.Node) -> bool:
        """Whether the O2 rules run ``node`` in fp32 (a normalisation op)."""
        if node.op not in _CALLS:
            return False
        return ClassifyPass(self.policy, self.dtype).classify(node).category is OpCategory.FP32

    def _reads_master(self, node: fx.Node) -> bool:
        """Whether ``node`` reads the fp32 masters of its parameters under O2: a normalisation
        op, computing in fp32 or on the low-precision input (``MIXED_INPUT_NORMS``), or an
        embedding lookup (:meth:`_gathers_master`)."""
        return self._in_fp32(node) or (node.op in _CALLS and op_key(node) in NORM_OPS) \
            or self._gathers_master(node)

    @staticmethod
    def _gathers_master(node: fx.Node) -> bool:
        """Whether ``node`` is an embedding lookup, which O2 runs on the fp32 master table and
        whose rows it then rounds to the low dtype (:meth:`_master_outputs_down`).

        Why: rounding commutes with a gather, so the rows are bit for bit those of a stored
        low-precision table, but a stored table is a full copy of the vocabulary, rewritten
        after every optimizer step (for a 32k x 4096 table, 256 MB written to round the few
        thousand rows a batch reads), and its gradient would be a dense low-precision table
        cast to fp32 once more. Read from the master, the rows are the only cast, and the
        lookup's backward sums repeated tokens' gradients in fp32, into the master's fp32
        gradient directly."""
        return node.op in _CALLS and op_key(node) == "embedding"

    def _read_low_copies(self) -> None:
        """O2: every floating parameter is read through the low-copy store, except by the
        normalisation ops, which read their fp32 master."""
        store = None
        for node in list(self.graph.nodes):
            if node.op != "get_attr":
                continue
            value = self._attr(str(node.target))
            if not isinstance(value, nn.Parameter) or not self._castable(value):
                continue
            users = [u for u in node.users if not self._reads_master(u)]
            self.master_lookups.update(u for u in node.users if self._gathers_master(u))
            if not users:
                continue
            if store is None:
                with self.graph.inserting_before(next(iter(self.graph.nodes))):
                    # NB: create_node: the store is a plain attribute, which get_attr warns on.
                    store = self.graph.create_node("get_attr", LOW_COPIES_ATTR)
            with self.graph.inserting_after(node):
                low = self._new_cast_node("call_method", "get", (store, node, self.dtype),
                                          node, weight=True)
            for user in users:
                user.replace_input_with(node, low)

    # -- activations at the boundaries -----------------------------------------------------
    def _master_outputs_down(self) -> None:
        """O2: the output of a normalisation op computing in fp32, or of an embedding lookup
        on its fp32 master, goes back to the low dtype for the ops after it (Apex's O2 keeps
        only the norm itself in fp32; the rows of a master table rounded are those of a
        stored low-precision one). An output that leaves the graph stays fp32: rounding it
        only for the output cast to widen it again would lose bits."""
        for node in list(self.graph.nodes):
            if not (self._in_fp32(node) or node in self.master_lookups):
                continue
            for out in self._tensor_outputs(node):
                users = [u for u in out.users if u.op != "output"]
                if not users:
                    continue
                with self.graph.inserting_after(out):
                    down = self._activation_cast(out, self.dtype, node)
                for user in users:
                    user.replace_input_with(out, down)

    def _tensor_outputs(self, node: fx.Node) -> list[fx.Node]:
        """The node itself, or for norms returning tuples (``native_layer_norm``) the
        ``getitem`` of their first result (the normalised tensor)."""
        val = node.meta.get("val")
        if isinstance(val, (tuple, list)):
            return [u for u in node.users if u.op == "call_function"
                    and u.target is operator.getitem and u.args[1] == 0]
        return [node]

    def _cast_inputs(self) -> None:
        if not self.inputs:
            return
        # NB: after the last placeholder, not before the first other node: export puts
        # get_attr nodes ahead of the placeholders.
        anchor = self.inputs[-1]
        for node in self.inputs:
            if not node.users or (self.static and not self._needs(node, self.dtype)):
                continue
            # export's shape guard keeps checking the caller's own tensor
            users = [u for u in node.users if not is_input_guards(u)]
            with self.graph.inserting_after(anchor):
                down = self._activation_cast(node, self.dtype, node)
            for user in users:
                user.replace_input_with(node, down)

    def _cast_outputs(self) -> None:
        output = next(n for n in self.graph.nodes if n.op == "output")
        made: dict[fx.Node, fx.Node] = {}

        def up(arg: fx.Node) -> fx.Node:
            if arg in made:
                return made[arg]
            if self.static:
                val = arg.meta.get("val")
                if not (isinstance(val, torch.Tensor) and val.dtype == self.dtype):
                    return arg
            with self.graph.inserting_before(output):
                made[arg] = self._activation_cast(arg, torch.float32, output)
            return made[arg]

        output.args = fx.node.map_arg(output.args, up)

    def _needs(self, node: fx.Node, dtype: torch.dtype) -> bool:
        val = node.meta.get("val")
        return (isinstance(val, torch.Tensor) and val.is_floating_point()
                and val.dtype not in (torch.float64, dtype))

    # -- cast nodes ------------------------------------------------------------------------
    def _activation_cast(self, value: fx.Node, dtype: torch.dtype, near: fx.Node) -> fx.Node:
        if self.static:
            return self._new_cast_node("call_method", "to", (value, dtype), near)
        # Dtypes unknown (no example inputs): cast floating, non-fp64 tensors at run time.
        return self._new_cast_node("call_function", guarded_cast, (value, dtype, None), near)

    def _new_cast_node(self, op: str, target: Any, args: tuple, near: fx.Node,
                       weight: bool = False) -> fx.Node:
        value, dtype = (args[1], args[2]) if weight else (args[0], args[1])
        name = f"{value.name}_{_SHORT[dtype]}"
        node = self.graph.create_node(op, target, args, name=name)
        node.meta[META_KEY] = CastInfo(dtype, guarded=not self.static and not weight,
                                       weight=weight)
        for key in ("nn_module_stack", "stack_trace", GRAD_KEY):
            if key in near.meta:
                node.meta[key] = near.meta[key]
        source = value.meta.get("val")
        if isinstance(source, FakeTensor):
            with source.fake_mode:
                node.meta["val"] = source.to(dtype)
        elif weight and self.static:
            node.meta["val"] = _fake_like(None, dtype, self._attr(str(value.target)))
        return node


def low_precision_twin(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """O3's own copy of ``model`` with every floating parameter and buffer in ``dtype`` (fp64
    ones excepted, as autocast never casts them); the user's model is not touched.

    O3 is traced on this twin, so model code that reads a dtype off its parameters (HF's
    attention masks: ``torch.finfo(self.dtype).min``) sees the low dtype the graph runs in.
    """
    twin = copy.deepcopy(model)
    for module in twin.modules():
        for store in (module._parameters, module._buffers):
            for name, value in list(store.items()):
                if value is None or not value.is_floating_point() or \
                        value.dtype in (torch.float64, dtype):
                    continue
                low = value.detach().to(dtype)
                store[name] = nn.Parameter(low, value.requires_grad) \
                    if isinstance(value, nn.Parameter) else low
    return twin


def _fake_like(val: Any, dtype: torch.dtype, real: torch.Tensor | None = None) -> Any:
    """A fake tensor like ``val`` (or like the real tensor ``real``) in ``dtype``."""
    if isinstance(val, FakeTensor):
        with val.fake_mode:
            return val.to(dtype)
    if real is not None:
        mode = FakeTensorMode(allow_non_fake_inputs=True)
        return mode.from_tensor(real).to(dtype)
    return val
