"""The policy: which op computes in which precision, plus the user's overrides.

One frozen dataclass. Build it from a preset and refine it with :meth:`Policy.override`::

    Policy()                                  # CUDA AMP rules on every device (the default)
    Policy.autocast("cpu", torch.bfloat16)    # exactly torch.autocast("cpu")'s op lists
    Policy().override(ops={"softmax": OpCategory.LOWER}, keep_fp32=["lm_head"])

Precedence, most specific first: **node** override > **module** override (the innermost module
of the node whose qualified name matches a glob; ``keep_fp32`` is a module override to FP32) >
**op** override > the model's own ``torch.autocast`` regions > the preset's table > PASSTHROUGH.
With ``convert(..., calibrate=...)``, the range rule (an op whose calibrated values exceed the
low dtype's range computes in fp32) comes right after the op override: it wins over regions,
tables and ``register_op``; the user's overrides win over it.
"""

from __future__ import annotations

import dataclasses
import difflib
import fnmatch
from typing import Callable, Iterable, Mapping

import torch

from .fp8 import Fp8Rules
from .kernels import takes_mixed_input
from .opkey import callable_key
from .registry import registered
from .tables import (
    CPU_COMPOSITES,
    CPU_TABLE,
    CUDA_COMPOSITES,
    CUDA_TABLE,
    DEFAULT_TABLE,
    O2_TABLE,
    O3_TABLE,
    OpCategory,
)

__all__ = ["Policy", "OpCategory"]

_LOW_DTYPES = (torch.float16, torch.bfloat16)
_PRESET_TABLES = {"default": DEFAULT_TABLE, "cpu": CPU_TABLE, "cuda": CUDA_TABLE,
                  "O2": O2_TABLE, "O3": O3_TABLE}
_PRESET_COMPOSITES = {"cpu": CPU_COMPOSITES, "cuda": CUDA_COMPOSITES}


def check_low_dtype(dtype: object, where: str) -> torch.dtype:
    """Validate a low-precision dtype argument (fp16 or bf16)."""
    if dtype not in _LOW_DTYPES:
        raise ValueError(
            f"{where}: dtype={dtype!r} is not supported; expected torch.float16 or "
            "torch.bfloat16 (the low-precision dtype matmuls and convolutions run in)."
        )
    return dtype  # type: ignore[return-value]


def default_low_dtype(device_type: str) -> torch.dtype:
    """The low dtype when none is given: fp16 on CUDA, bf16 elsewhere, as ``torch.autocast``
    defaults (fp16 is what tensor cores were built for; a CPU has no fast fp16 matmul, and
    bf16 needs no loss scaling). The one place this rule is written."""
    return torch.float16 if device_type == "cuda" else torch.bfloat16


def _as_pairs(name: str, value: Mapping | None) -> tuple[tuple[str, OpCategory], ...]:
    if value is None:
        return ()
    if not isinstance(value, Mapping):
        raise TypeError(f"Policy.override({name}=...) expects a dict of name -> OpCategory, "
                        f"got {type(value).__name__}")
    out = []
    for key, category in value.items():
        if not isinstance(category, OpCategory):
            raise TypeError(
                f"Policy.override({name}=...): the category for {key!r} is {category!r}; "
                f"expected an OpCategory member, e.g. OpCategory.FP32 "
                f"(one of {', '.join(c.name for c in OpCategory)})."
            )
        out.append((_op_name(key) if name == "ops" else _check_str(name, key), category))
    return tuple(out)


def _check_str(name: str, key: object) -> str:
    if not isinstance(key, str) or not key:
        raise TypeError(f"Policy.override({name}=...): keys must be non-empty strings, "
                        f"got {key!r}")
    return key


def _op_name(key: object) -> str:
    """Op override keys may be names or the callables / torch.library ops themselves."""
    if isinstance(key, str):
        return key
    if isinstance(key, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)) or callable(key):

        return callable_key(key)
    raise TypeError(f"Policy.override(ops=...): {key!r} is not an op name, a function or a "
                    "torch.library op")


def _custom_op_names(namespace: str) -> list[str]:
    try:
        ns = getattr(torch.ops, namespace)
        return [f"{namespace}::{n}" for n in dir(ns) if not n.startswith("_")
                and isinstance(getattr(ns, n, None), torch._ops.OpOverloadPacket)]
    except (AttributeError, RuntimeError):
        return []


def _resolves(key: str) -> bool:
    """Whether ``key`` names an existing ``torch.library`` op ("ns::name") or a Python function
    ("module.qualname", as :func:`amprewrite.policy.opkey.callable_key` spells user functions)."""
    import importlib
    import sys

    if "::" in key:
        namespace, _, name = key.partition("::")
        return key in _custom_op_names(namespace)
    module, _, qualname = key.partition(".")
    while qualname:
        mod = sys.modules.get(module)
        if mod is None:
            try:
                mod = importlib.import_module(module)
            except Exception:  # not a module path: try a longer prefix
                mod = None
        if mod is not None:
            obj: object = mod
            for part in qualname.split("."):
                obj = getattr(obj, part, None)
            if callable(obj):
                return True
        head, _, qualname = qualname.partition(".")
        module = f"{module}.{head}"
    return False


def _near_pool(key: str) -> set[str]:
    if "::" in key:
        return set(_custom_op_names(key.partition("::")[0]))
    return _known_op_names() | set(_registered_names())


def _known_op_names() -> set[str]:
    names = set(DEFAULT_TABLE) | set(CPU_TABLE) | set(CUDA_TABLE)
    names |= {n for n in dir(torch.ops.aten) if not n.startswith("__")}
    names |= {n for n in dir(torch) if not n.startswith("_")}
    names |= {n for n in dir(torch.Tensor) if not n.startswith("__")}
    names |= {n for n in dir(torch.nn.functional) if not n.startswith("_")}
    return names


@dataclasses.dataclass(frozen=True)
class Policy:
    """Op → precision rules for :func:`amprewrite.convert`.

    Attributes:
        preset: ``"default"`` (CUDA AMP rules everywhere), ``"cpu"`` or ``"cuda"`` (mirror of
            ``torch.autocast`` on that device); ``"O2"`` / ``"O3"`` are the rules of those opt
            levels, which ``convert(opt_level=...)`` applies. Use the constructors, not this
            field.
        dtype: the low dtype (fp16 or bf16); None lets ``convert`` pick fp16 for models on
            CUDA and bf16 otherwise.
        device_type: only tensors on this device type are cast (autocast's eligibility rule);
            None casts tensors on any device.
        op_overrides / module_overrides / node_overrides: ``(name, OpCategory)`` pairs.
        share_activation_casts: one cast per (activation, dtype) shared by all consumers.
            The autocast presets turn it off: autocast casts an activation once per use, and
            sharing would sum gradients in low precision instead of fp32, changing bits.
            Parameter casts are always shared (autocast caches them too).
        fold_rounding_casts: let cast elimination drop narrowing round trips
            (fp32→bf16→fp32), which changes numerics; off by default.
        range_headroom_bits: with ``convert(..., calibrate=...)``, an op whose calibrated
            max |x| exceeds ``finfo(low).max / 2**range_headroom_bits`` computes in fp32
            (0, the default: only values beyond the low dtype's max; 1: beyond half of it;
            0 to 15). Node, module and op overrides win over this range rule.
        fp8_rules: the linear layers that run in fp8 (:class:`amprewrite.policy.fp8.Fp8Rules`),
            None for none; set by :meth:`Policy.fp8`.
    """

    preset: str = "default"
    dtype: torch.dtype | None = None
    device_type: str | None = None
    op_overrides: tuple[tuple[str, OpCategory], ...] = ()
    module_overrides: tuple[tuple[str, OpCategory], ...] = ()
    node_overrides: tuple[tuple[str, OpCategory], ...] = ()
    share_activation_casts: bool = True
    fold_rounding_casts: bool = False
    range_headroom_bits: int = 0
    fp8_rules: Fp8Rules | None = None

    def __post_init__(self) -> None:
        if self.fp8_rules is not None:
            if not isinstance(self.fp8_rules, Fp8Rules):
                raise TypeError(f"Policy(fp8_rules={self.fp8_rules!r}): expected None or an "
                                "Fp8Rules; "
                                "build the policy with Policy.fp8(...)")
            if self.dtype is not torch.bfloat16:
                raise ValueError(f"Policy(fp8_rules=..., dtype={self.dtype}): fp8 matmuls "
                                 "write bf16 and everything else runs as under the bf16 "
                                 "policy; use "
                                 "Policy.fp8(...), whose dtype is torch.bfloat16")
        bits = self.range_headroom_bits
        if isinstance(bits, bool) or not isinstance(bits, int) or not 0 <= bits <= 15:
            raise ValueError(f"Policy(range_headroom_bits={bits!r}): expected an int from 0 to "
                             "15, the powers of two of margin kept below the low dtype's max")
        if self.preset not in _PRESET_TABLES:
            raise ValueError(f"Policy(preset={self.preset!r}): expected one of "
                             f"{sorted(_PRESET_TABLES)}; use Policy() or Policy.autocast(...)")
        if self.dtype is not None:
            check_low_dtype(self.dtype, "Policy")
        unknown = [k for k, _ in self.op_overrides if k not in _known_op_names()
                   and k not in _registered_names() and not _resolves(k)]
        if unknown:
            hints = {k: difflib.get_close_matches(k, _near_pool(k), n=3) for k in unknown}
            raise ValueError(
                "Policy op overrides name unknown ops: "
                + "; ".join(f"{k!r} (did you mean {', '.join(map(repr, h)) or 'nothing close'}?)"
                            for k, h in hints.items())
                + ". Use ATen op names such as 'linear', 'softmax', 'layer_norm', "
                "'namespace::name' for torch.library ops (defined before the Policy is built), "
                "or pass the function itself."
            )
        for field in ("op_overrides", "module_overrides", "node_overrides"):
            _check_conflicts(field, getattr(self, field))

    # -- presets -------------------------------------------------------------------------
    @classmethod
    def autocast(cls, device_type: str, dtype: torch.dtype | None = None) -> "Policy":
        """A preset that mirrors ``torch.autocast(device_type, dtype)`` op for op.

        The converted model computes bitwise what the model computes under
        ``torch.autocast`` on the same device, outputs and parameter gradients alike.
        ``dtype`` defaults to autocast's own default (bf16 on cpu, fp16 on cuda).
        """
        if device_type not in ("cpu", "cuda"):
            raise ValueError(f"Policy.autocast(device_type={device_type!r}): expected 'cpu' "
                             "or 'cuda' (the devices whose autocast op lists are mirrored)")
        if dtype is None:
            dtype = default_low_dtype(device_type)
        return cls(preset=device_type, dtype=check_low_dtype(dtype, "Policy.autocast"),
                   device_type=device_type, share_activation_casts=False)

    @classmethod
    def fp8(cls, *, modules: Iterable[str] | str = ("*",), exclude: Iterable[str] | str = (),
            skip_first_last: bool = True, dim_multiple: int = 16) -> "Policy":
        """The default policy in bf16, with the model's linear layers computed as fp8
        matmuls: ``torch._scaled_mm`` on e4m3 operands with dynamic per-tensor scales and a
        bf16 output; in training, the backward matmuls take an e5m2 output gradient. The fp32
        master weights stay the parameters. Every amax, scale, quantize and scaled matmul is a
        line of ``gm.code`` (:mod:`amprewrite.passes.fp8`).

        Which linears (torchao's rules, each a reason in ``explain()``): qualified name
        matching one of ``modules`` and none of ``exclude`` (globs), not the first or last
        linear of the forward (``skip_first_last``), both weight dimensions divisible by
        ``dim_multiple``. ``.override(...)`` refines the bf16 rules as usual.
        """
        return cls(dtype=torch.bfloat16, fp8_rules=Fp8Rules(
            modules=modules, exclude=exclude,  # type: ignore[arg-type]
            skip_first_last=skip_first_last, dim_multiple=dim_multiple))

    def override(
        self,
        *,
        ops: Mapping[str | Callable, OpCategory] | None = None,
        modules: Mapping[str, OpCategory] | None = None,
        nodes: Mapping[str, OpCategory] | None = None,
        keep_fp32: Iterable[str] = (),
    ) -> "Policy":
        """A copy with more overrides (later ones win over earlier ones of the same name).

        ``ops`` keys are op names (``"softmax"``), Python functions that the model calls
        (registered with :func:`amprewrite.register_op` or wrapped with ``torch.fx.wrap``), or
        ``torch.library`` ops. ``modules`` keys are globs over module qualified names
        (``"encoder.layer.*.attention"``); ``keep_fp32=["lm_head"]`` is shorthand for
        ``modules={"lm_head": OpCategory.FP32}``.
        """
        if isinstance(keep_fp32, str):
            keep_fp32 = [keep_fp32]
        mods = _as_pairs("modules", modules) + tuple(
            (_check_str("keep_fp32", m), OpCategory.FP32) for m in keep_fp32)
        return dataclasses.replace(
            self,
            op_overrides=_merge(self.op_overrides, _as_pairs("ops", ops)),
            module_overrides=_merge(self.module_overrides, mods),
            node_overrides=_merge(self.node_overrides, _as_pairs("nodes", nodes)),
        )

    # -- lookups used by ClassifyPass ----------------------------------------------------
    @property
    def table(self) -> Mapping[str, OpCategory]:
        return _PRESET_TABLES[self.preset]

    def _name(self) -> str:
        return {"default": "default (CUDA AMP rules)", "O2": "opt_level O2",
                "O3": "opt_level O3"}.get(self.preset, f"autocast({self.preset!r})")

    def describe(self) -> str:
        fp8 = f", {self.fp8_rules.describe()}" if self.fp8_rules is not None else ""
        return f"{self._name()}, {self.dtype}{fp8}"

    def summary(self) -> str:
        """The preset and how many overrides refine it: ``"default (CUDA AMP rules) + 2
        overrides"``."""
        name = self._name()
        n = len(self.op_overrides) + len(self.module_overrides) + len(self.node_overrides)
        fp8 = f" + {self.fp8_rules.describe()}" if self.fp8_rules is not None else ""
        return name + (f" + {n} override{'s' if n != 1 else ''}" if n else "") + fp8

    def table_rule(self, key: str, overload: str | None) -> tuple[OpCategory, str] | None:
        # A registration is the user's word on an op and beats the preset's table, as Apex's
        # register_float_function(torch, "sigmoid") did; op overrides beat both.
        reg = _registered_names().get(key)
        if reg is not None:
            return reg, "register_op"
        table = self.table
        for k in (overload, key):
            if k is not None and k in table:
                return table[k], f"{self.preset} table"
        return None

    def mirrored_autocast(self, device_type: str) -> torch.autocast | None:
        """The ``torch.autocast`` this policy mirrors on ``device_type``: the preset's own,
        where the preset is ``"cpu"`` or ``"cuda"`` and so is ``device_type``; else None.
        A composite op is run under it to learn the dtype autocast gives it while it waits to
        be split (its pieces cast, the op whole may refuse its inputs' mixed dtypes)."""
        if self.preset != device_type or self.dtype is None:
            return None
        return torch.autocast(device_type, dtype=self.dtype)

    def composite_rule(self, key: str) -> tuple[OpCategory, str] | None:
        """The rule for a composite op the preset's autocast runs piecewise, when its node
        could not be split into its pieces (see ``_tables.CUDA_COMPOSITES``)."""
        category = _PRESET_COMPOSITES.get(self.preset, {}).get(key)
        if category is None:
            return None
        return category, f"{self.preset} table (composite kept whole)"

    def unlisted_rule(self, key: str) -> tuple[OpCategory, str]:
        """The rule for an op no table lists. It runs as it comes, except under O2/O3 for a
        ``torch.library`` op of another namespace (``"namespace::name"``, e.g. a fused MoE
        matmul): O2/O3 store weights in the low dtype, so such an op can meet a low weight
        and an fp32 activation, which ATen ops would promote and custom kernels reject. Its
        floating inputs are cast to the widest of them (as autocast's promote list does)."""
        if self.preset in ("O2", "O3") and "::" in key:
            return OpCategory.PROMOTE, f"{self.preset}: custom op, one dtype for its inputs"
        return OpCategory.PASSTHROUGH, "not listed"

    def mixed_input_rule(self, key: str, device_type: str | None
                         ) -> tuple[OpCategory, str] | None:
        """O2's rule for a normalisation op whose kernel on ``device_type`` takes fp16/bf16
        input with fp32 parameters (``kernels.MIXED_INPUT_NORMS``): it runs on the activation
        as it arrives, with its fp32 master parameters and running statistics, no cast around
        it (Apex's ``keep_batchnorm_fp32``); None where O2 computes it in fp32 instead."""
        if self.preset != "O2" or not takes_mixed_input(key, device_type):
            return None
        return OpCategory.PASSTHROUGH, (f"O2: {key} on {device_type} takes low-precision "
                                        "input with fp32 parameters")

    def op_override(self, key: str) -> OpCategory | None:
        return dict(self.op_overrides).get(key)

    def module_override(self, module_paths: list[str]) -> tuple[OpCategory, str] | None:
        """The override of the innermost module (last in ``module_paths``) that matches."""
        for path in reversed(module_paths):
            for pattern, category in reversed(self.module_overrides):
                if fnmatch.fnmatchcase(path, pattern):
                    return category, f"module override {pattern!r}"
        return None

    def node_override(self, name: str) -> OpCategory | None:
        return dict(self.node_overrides).get(name)


def _merge(old: tuple, new: tuple) -> tuple:
    names = {k for k, _ in new}
    return tuple(p for p in old if p[0] not in names) + new


def _check_conflicts(field: str, pairs: tuple[tuple[str, OpCategory], ...]) -> None:
    seen: dict[str, OpCategory] = {}
    for key, category in pairs:
        if key in seen and seen[key] is not category:
            raise ValueError(f"Policy.{field}: {key!r} is given two categories "
                             f"({seen[key].name} and {category.name}); keep one.")
        seen[key] = category


# Functions and custom ops registered process-wide with amprewrite.register_op (what Apex's
# register_half/float/promote_function did). Read-only view; the registry lives in _registry.
def _registered_names() -> Mapping[str, OpCategory]:
    return registered()
