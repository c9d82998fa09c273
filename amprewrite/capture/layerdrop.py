"""LayerDrop with a drop probability of 0 or 1, decided while tracing instead of guarded on.

Models with LayerDrop draw a number per layer and skip the layer if it falls below the drop
probability::

    if self.training:
        dropout_probability = torch.rand([])
        if dropout_probability < self.layerdrop:  # skip the layer
            continue

torch.export cannot branch on a random value (*Could not guard on data-dependent expression
Eq(u0, 1)*), so such a model does not capture in train mode, even with ``layerdrop=0.0``,
where the branch is never taken (transformers' BART, Whisper, OPT and wav2vec2 before they
test ``self.layerdrop > 0`` first). A draw ``u`` of ``torch.rand`` lies in ``[0, 1)``, so
``u < 0.0`` is False and ``u < 1.0`` True whatever was drawn. :class:`DecidedDraws` gives such
comparisons their value: ``bool()`` of the comparison returns the known answer without a guard.
The draw stays in the graph, so the converted module consumes the random stream as eager does
(dropout masks after it are eager's); the comparison's node is dead and removed. A comparison whose answer
depends on the draw (``0 < p < 1``) is left as it is, and export fails as before: LayerDrop
that really drops layers changes the graph from call to call, which no captured graph holds.
"""

from __future__ import annotations

import operator
from typing import Any, Callable

import torch

__all__ = ["DecidedDraws"]

_UNIFORM_ATTR = "_amprewrite_uniform_draw"
_DECIDED_ATTR = "_amprewrite_decided"

# For u in [0, 1): the comparison's answer when it is the same for every u, else None.
_ANSWERS: dict[Callable[..., Any], Callable[[float], bool | None]] = {}
for _compare, _always_false, _always_true in (
        (operator.lt, lambda p: p <= 0, lambda p: p >= 1),
        (operator.le, lambda p: p < 0, lambda p: p >= 1),
        (operator.gt, lambda p: p >= 1, lambda p: p < 0),
        (operator.ge, lambda p: p >= 1, lambda p: p <= 0)):
    def _answer(p: float, f: Callable[[float], bool] = _always_false,
                t: Callable[[float], bool] = _always_true) -> bool | None:
        return False if f(p) else True if t(p) else None

    name = _compare.__name__
    for func in (getattr(torch.Tensor, f"__{name}__"), getattr(torch.Tensor, name),
                 getattr(torch, name)):
        _ANSWERS[func] = _answer


def _is_draw(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and getattr(x, _UNIFORM_ATTR, False)


class DecidedDraws(torch.overrides.TorchFunctionMode):
    """Answer comparisons of a scalar ``torch.rand`` draw with a bound outside ``(0, 1)``
    (module docstring); every other call runs unchanged."""

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.Tensor.__bool__ and args and hasattr(args[0], _DECIDED_ATTR):
            return getattr(args[0], _DECIDED_ATTR)
        out = func(*args, **kwargs)
        if func is torch.rand and isinstance(out, torch.Tensor) and out.dim() == 0 \
                and out.is_floating_point():
            setattr(out, _UNIFORM_ATTR, True)
        elif func in _ANSWERS and len(args) == 2 and not kwargs and _is_draw(args[0]) \
                and isinstance(args[1], (int, float)) and isinstance(out, torch.Tensor):
            answer = _ANSWERS[func](float(args[1]))
            if answer is not None:
                setattr(out, _DECIDED_ATTR, answer)
        return out
