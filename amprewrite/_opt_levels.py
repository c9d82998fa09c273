"""Opt levels O0, O2 and O3 (O1, the per-op policy, is :func:`amprewrite._convert.run_passes`).

Apex's four levels, as graph rewrites of a captured model:

* ``O0``: fp32, no casts; the captured graph unchanged (the faithful baseline).
* ``O1``: the per-op policy (autocast's lists).
* ``O2``: "almost fp16". Floating inputs are cast to the low dtype at the entry, every weight
  is read as a stored low-precision copy of its fp32 master (:mod:`amprewrite._low_copies`),
  every op runs in what arrives (low precision), except normalisation layers (BatchNorm,
  InstanceNorm, LayerNorm, GroupNorm, RMSNorm): their weights stay fp32 and they compute in
  fp32 (input cast up, output cast back down). Floating outputs are cast to fp32 so that the
  loss computes in fp32, as Apex does. The fp32 masters stay the module's parameters, shared
  with the user's model; :class:`amprewrite.MasterWeights` binds them to the optimizer.
* ``O3``: pure low precision, no masters: the GraphModule owns low-precision *copies* of the
  parameters and buffers (the user's model keeps its fp32 tensors; nothing calls ``.half()``
  on it); inputs cast down and outputs up as in O2. The speed baseline.

After (O2, fp16; ``Linear → LayerNorm → Linear``, symbolic capture with example inputs)::

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

O3 has the same activation casts, no norm casts, and plain ``get_attr`` weights (its own
fp16 parameters).
"""

from __future__ import annotations

import dataclasses
import operator
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn
from torch._guards import detect_fake_mode
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

from ._meta import CastInfo, META_KEY
from ._low_copies import LOW_COPIES_ATTR, LowPrecisionCopies
from ._opkey import op_key
from ._runtime import guarded_cast
from .policy import Policy

__all__ = ["OPT_LEVELS", "OPT_LEVEL_KEY", "OptLevel", "NORM_MODULES", "apply_opt_level",
           "check_opt_level", "opt_level_of"]

OPT_LEVELS = ("O0", "O1", "O2", "O3")
OPT_LEVEL_KEY = "amprewrite_opt_level"
"""``gm.meta[OPT_LEVEL_KEY]``: the :class:`OptLevel` a GraphModule was converted with."""

NORM_MODULES: tuple[type[nn.Module], ...] = (
    nn.modules.batchnorm._BatchNorm, nn.modules.instancenorm._InstanceNorm, nn.LayerNorm,
    nn.GroupNorm, nn.RMSNorm)
_NORM_OPS = frozenset({
    "batch_norm", "instance_norm", "layer_norm", "group_norm", "rms_norm", "native_layer_norm",
    "native_group_norm", "native_batch_norm", "_native_batch_norm_legit",
    "_native_batch_norm_legit_functional", "_native_batch_norm_legit_no_training"})
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
    if "amprewrite_policy" in meta:
        return OptLevel("O1", meta["amprewrite_policy"][1])
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
        gm.meta[OPT_LEVEL_KEY] = OptLevel("O0", None)
        gm.recompile()
        return gm
    _LowPrecisionRewrite(gm, model, dtype, masters=level == "O2").run()
    gm.meta[OPT_LEVEL_KEY] = OptLevel(level, dtype)
    gm.graph.lint()
    gm.recompile()
    return gm


class _LowPrecisionRewrite:
    """The O2 / O3 rewrite of one GraphModule (see the module docstring)."""

    def __init__(self, gm: fx.GraphModule, model: nn.Module, dtype: torch.dtype,
                 masters: bool) -> None:
        self.gm, self.model, self.dtype, self.masters = gm, model, dtype, masters
        self.graph = gm.graph
        self.static = all("val" in n.meta for n in gm.graph.nodes
                          if n.op in ("placeholder", "call_function", "call_method"))
        self.inputs = [n for n in gm.graph.nodes if n.op == "placeholder"]

    def run(self) -> None:
        # With static dtypes each step decides from meta["val"], so the values are
        # re-propagated after every step that changes dtypes.
        if self.masters:
            setattr(self.gm, LOW_COPIES_ATTR, LowPrecisionCopies())
            self._read_low_copies()
        else:
            self._own_low_copies()
        self._cast_inputs()
        self._repropagate()
        if self.masters:
            self._norms_in_fp32()
            self._repropagate()
        self._cast_outputs()
        self._repropagate()

    # -- weights ---------------------------------------------------------------------------
    def _owner(self, qualname: str) -> nn.Module | None:
        prefix = qualname.rpartition(".")[0]
        try:
            return self.model.get_submodule(prefix)
        except AttributeError:
            return None

    def _attr(self, qualname: str) -> Any:
        obj: Any = self.gm
        for part in qualname.split("."):
            obj = getattr(obj, part)
        return obj

    def _castable(self, value: Any) -> bool:
        return (isinstance(value, torch.Tensor) and value.is_floating_point()
                and value.dtype not in (torch.float64, self.dtype))

    def _read_low_copies(self) -> None:
        """O2: every non-norm floating weight is read through the low-copy store."""
        store = None
        for node in list(self.graph.nodes):
            if node.op != "get_attr" or not self._castable(self._attr(str(node.target))):
                continue
            if isinstance(self._owner(str(node.target)), NORM_MODULES):
                continue
            if store is None:
                with self.graph.inserting_before(next(iter(self.graph.nodes))):
                    # NB: create_node: the store is a plain attribute, which get_attr warns on.
                    store = self.graph.create_node("get_attr", LOW_COPIES_ATTR)
            users = list(node.users)
            with self.graph.inserting_after(node):
                low = self._new_cast_node("call_method", "get", (store, node, self.dtype),
                                          node, weight=True)
            for user in users:
                user.replace_input_with(node, low)

    def _own_low_copies(self) -> None:
        """O3: the GraphModule's parameters and buffers become its own copies, floating ones
        in the low dtype (get_attr targets and the tensors of leaf modules such as BatchNorm
        alike)."""
        made: dict[int, torch.Tensor] = {}

        def low_copy(value: torch.Tensor) -> torch.Tensor:
            if id(value) not in made:
                # Non-floating buffers (BatchNorm's num_batches_tracked) are copied too, so
                # that training the GraphModule never writes into the user's model.
                data = value.detach().to(self.dtype) if self._castable(value) else \
                    value.detach().clone()
                made[id(value)] = (nn.Parameter(data, requires_grad=value.requires_grad)
                                   if isinstance(value, nn.Parameter) else data)
            return made[id(value)]

        for node in self.graph.nodes:
            if node.op == "get_attr" and isinstance(self._attr(str(node.target)), torch.Tensor):
                prefix, _, name = str(node.target).rpartition(".")
                owner = self.gm.get_submodule(prefix)
                _replace_tensor(owner, name, low_copy(self._attr(str(node.target))))
            elif node.op == "call_module":
                leaf = self.gm.get_submodule(str(node.target))
                # Leaf modules are the GraphModule's own shallow copies (see _capture), so
                # replacing their tensors leaves the user's module alone.
                for name, value in list(leaf.named_parameters(recurse=False)) + \
                        list(leaf.named_buffers(recurse=False)):
                    _replace_tensor(leaf, name, low_copy(value))

    # -- activations -----------------------------------------------------------------------
    def _norms_in_fp32(self) -> None:
        for node in list(self.graph.nodes):
            if not self._is_norm(node):
                continue
            for arg in node.all_input_nodes:
                if arg.op == "get_attr":
                    continue
                if _is_low_copy(arg):  # a non-norm weight used by a norm: its fp32 master
                    node.replace_input_with(arg, arg.args[1])
                    continue
                if self.static and not self._needs(arg, torch.float32):
                    continue
                with self.graph.inserting_before(node):
                    up = self._activation_cast(arg, torch.float32, node)
                node.replace_input_with(arg, up)
            for out in self._tensor_outputs(node):
                # A norm output that leaves the graph stays fp32: rounding it to the low
                # dtype only for the output cast to widen it again would lose bits for nothing.
                users = [u for u in out.users if u.op != "output"]
                if not users:
                    continue
                with self.graph.inserting_after(out):
                    down = self._activation_cast(out, self.dtype, node)
                for user in users:
                    user.replace_input_with(out, down)

    def _is_norm(self, node: fx.Node) -> bool:
        if node.op == "call_module":
            return isinstance(self.gm.get_submodule(str(node.target)), NORM_MODULES)
        return node.op in ("call_function", "call_method") and op_key(node) in _NORM_OPS

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
            users = [u for u in node.users if u.target != "_guards_fn"]
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
        for key in ("nn_module_stack", "stack_trace"):
            if key in near.meta:
                node.meta[key] = near.meta[key]
        source = value.meta.get("val")
        if isinstance(source, FakeTensor):
            # Later decisions of the same step read this dtype before re-propagation.
            with source.fake_mode:
                node.meta["val"] = source.to(dtype)
        return node

    def _repropagate(self) -> None:
        """Recompute every ``meta["val"]`` from the inputs' fake values (dtypes changed)."""
        if not self.static:
            return
        vals = [n.meta["val"] for n in self.inputs]
        mode = detect_fake_mode(vals)
        if mode is None:
            mode = FakeTensorMode(allow_non_fake_inputs=True)
            vals = [mode.from_tensor(v) if isinstance(v, torch.Tensor) else v for v in vals]
        _FakeProp(self.gm, mode).propagate_dont_convert_inputs(*vals)


class _FakeProp(FakeTensorProp):
    """FakeTensorProp that runs on fake copies of the weights and buffers: the graph's
    in-place updates (BatchNorm's running statistics) must not touch the real tensors."""

    def __init__(self, gm: fx.GraphModule, mode: FakeTensorMode) -> None:
        super().__init__(gm, mode)
        self._fakes: dict[int, torch.Tensor] = {}

    def _fake(self, value: Any) -> Any:
        if not isinstance(value, torch.Tensor) or isinstance(value, FakeTensor):
            return value
        if id(value) not in self._fakes:
            self._fakes[id(value)] = self._mode.from_tensor(value, static_shapes=True)
        return self._fakes[id(value)]

    def fetch_attr(self, target: str) -> Any:
        return self._fake(super().fetch_attr(target))

    def call_module(self, target: Any, args: Any, kwargs: Any) -> Any:
        module = super().fetch_attr(target)
        if not isinstance(module, nn.Module):
            return module(*args, **kwargs)
        state = {name: self._fake(t) for name, t in
                 list(module.named_parameters()) + list(module.named_buffers())}
        return torch.func.functional_call(module, state, args, kwargs)


def _is_low_copy(node: fx.Node) -> bool:
    return (node.op == "call_method" and node.target == "get" and len(node.args) == 3
            and isinstance(node.args[0], fx.Node) and node.args[0].target == LOW_COPIES_ATTR)


def _replace_tensor(owner: nn.Module, name: str, value: torch.Tensor) -> None:
    if name in owner._parameters:
        owner._parameters[name] = value  # type: ignore[assignment]
    elif name in owner._buffers:
        owner._buffers[name] = value
    else:
        setattr(owner, name, value)
