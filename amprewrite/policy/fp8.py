"""Which linear layers run in fp8: the rules torchao's float8 training applies, as data.

:class:`Fp8Rules` is the ``fp8`` field of a :class:`amprewrite.Policy` (built with
``Policy.fp8(...)``); :func:`fp8_verdict` applies it to one linear layer and says why, in
the words ``explain()`` prints in its ``rule`` column:

* ``modules`` / ``exclude``: globs over the layer's qualified name (``"model.layers.*"``,
  ``"*.mlp.*"``); a layer must match one of ``modules`` and none of ``exclude``
  (torchao's ``module_filter_fn``, as data).
* ``skip_first_last``: the first and the last linear layer a forward calls stay in bf16 (the
  input projection and the output head are the most sensitive to quantisation).
* ``dim_multiple``: both dimensions of the weight must be divisible by it (16: the shapes
  fp8 tensor cores take as they are; torchao's filter example skips the others). A layer
  that passes with a smaller value is still valid on CUDA: its scaled matmuls pad the
  weight's dimensions with zeros at each call (:func:`amprewrite.runtime.fp8.scaled_mm_2d`),
  which costs a copy of the operands.
"""

from __future__ import annotations

import dataclasses
import fnmatch
from typing import Iterable

__all__ = ["Fp8Rules", "fp8_verdict"]


def _globs(name: str, value: object) -> tuple[str, ...]:
    if isinstance(value, str):
        value = (value,)
    if not isinstance(value, Iterable):
        raise TypeError(f"Policy.fp8({name}={value!r}): expected a glob or a list of globs "
                        "over module qualified names, e.g. ['model.layers.*']")
    out = tuple(value)
    bad = [v for v in out if not isinstance(v, str) or not v]
    if bad:
        raise TypeError(f"Policy.fp8({name}=...): {bad[0]!r} is not a non-empty string; "
                        "expected globs over module qualified names, e.g. 'model.layers.*'")
    return out


@dataclasses.dataclass(frozen=True)
class Fp8Rules:
    """The fp8 choices of a policy (see the module docstring).

    Attributes:
        modules: globs; a linear layer runs in fp8 only if its qualified name matches one.
        exclude: globs; a linear layer whose qualified name matches one stays in bf16.
        skip_first_last: keep the first and the last linear layer of a forward in bf16.
        dim_multiple: both weight dimensions must be divisible by this (1 turns it off: the
            matmuls of other shapes are padded at each call).
    """

    modules: tuple[str, ...] = ("*",)
    exclude: tuple[str, ...] = ()
    skip_first_last: bool = True
    dim_multiple: int = 16

    def __post_init__(self) -> None:
        object.__setattr__(self, "modules", _globs("modules", self.modules))
        object.__setattr__(self, "exclude", _globs("exclude", self.exclude))
        if not isinstance(self.skip_first_last, bool):
            raise TypeError(f"Policy.fp8(skip_first_last={self.skip_first_last!r}): expected "
                            "True or False")
        m = self.dim_multiple
        if isinstance(m, bool) or not isinstance(m, int) or m < 1:
            raise ValueError(f"Policy.fp8(dim_multiple={m!r}): expected an int >= 1 (16 is "
                             "what fp8 tensor cores take without padding; 1 turns the "
                             "check off)")

    def describe(self) -> str:
        parts = ["fp8 linears (e4m3, e5m2 grads, per-tensor scales)"]
        if self.modules != ("*",):
            parts.append(f"modules {list(self.modules)}")
        if self.exclude:
            parts.append(f"exclude {list(self.exclude)}")
        if not self.skip_first_last:
            parts.append("first/last included")
        return ", ".join(parts)


def fp8_verdict(rules: Fp8Rules, path: str, shape: tuple[int, ...], position: str | None
                ) -> tuple[bool, str]:
    """``(runs in fp8, why)`` for the linear layer named ``path`` with weight ``shape``
    (``[out, in]``); ``position`` is ``"first"``, ``"last"`` or None."""
    if not any(fnmatch.fnmatchcase(path, g) for g in rules.modules):
        return False, f"fp8 skipped: {path!r} matches none of modules {list(rules.modules)}"
    hit = next((g for g in rules.exclude if fnmatch.fnmatchcase(path, g)), None)
    if hit is not None:
        return False, f"fp8 skipped: {path!r} excluded by {hit!r}"
    if rules.skip_first_last and position is not None:
        return False, f"fp8 skipped: {position} linear"
    odd = [d for d in shape if d % rules.dim_multiple]
    if odd:
        return False, (f"fp8 skipped: weight {list(shape)} has dims not divisible by "
                       f"{rules.dim_multiple}")
    return True, "fp8: e4m3 per-tensor dynamic"
