"""The keywords a call binds to a forward's ``**kwargs``, named in its signature for torch.export.

A forward with ``**kwargs`` (every HF model's: ``**kwargs: Unpack[TransformersKwargs]``) is
called with keywords it does not name: ``generate`` passes ``return_dict=True`` at each step.
With dynamic shapes, torch.export 2.11 to 2.13 then fails after tracing: where it matches
the shapes to the inputs (``_get_range_constraints``), it lists each such keyword twice, under
the ``**kwargs`` name and on its own, and the structures differ ("Must provide a tree_name
when there might be a mismatch"). So a decode step with a growing KV cache could not be
captured with the cache's length symbolic, and each length was a capture of its own.

:func:`named_keywords` presents the model's forward to torch.export with those keywords as
keyword-only parameters, for the duration of the export::

    forward(input_ids=None, ..., logits_to_keep=0, **kwargs)           # the model's
    forward(input_ids=None, ..., logits_to_keep=0, *, return_dict=None)  # what export reads

and the dynamic shapes to match (``{"kwargs": {"return_dict": None}}`` becomes
``{"return_dict": None}``). The call itself is the model's forward, with the same keywords:
the graph is the same, and so is its input spec (the keywords are keys of the call's kwargs
either way). The presented forward is an instance attribute of the model while export runs
(torch.export reads ``inspect.signature(model.forward)``), removed after, errors included;
the capture's record of reads skips it (:func:`is_presented`).
"""

from __future__ import annotations

import contextlib
import inspect
from typing import Any, Callable, Iterator

import torch.nn as nn

__all__ = ["named_keywords", "is_presented"]

_PRESENTED = "_amp_presented_forward"


def is_presented(forward: Any) -> bool:
    """Whether ``forward`` is a forward :func:`named_keywords` set (not the model's)."""
    return getattr(forward, _PRESENTED, False)


@contextlib.contextmanager
def named_keywords(model: nn.Module, kwargs: dict[str, Any], shapes: Any) -> Iterator[Any]:
    """Within the block, ``model.forward`` names the keywords of ``kwargs`` that its
    ``**kwargs`` would take (module docstring); yields ``shapes`` to match. Nothing changes
    where there are no such keywords or no dynamic shapes."""
    try:
        signature = inspect.signature(model.forward)
    except (TypeError, ValueError):
        yield shapes
        return
    params = list(signature.parameters.values())
    var = next((p for p in params if p.kind is inspect.Parameter.VAR_KEYWORD), None)
    extra = [k for k in kwargs if var is not None and k not in signature.parameters]
    if not extra or not isinstance(shapes, dict):
        yield shapes
        return
    forward = model.forward
    presented = _presented(forward, signature.replace(parameters=[
        *(p for p in params if p is not var),
        *(inspect.Parameter(k, inspect.Parameter.KEYWORD_ONLY, default=None) for k in extra)]))
    spread = {k: v for k, v in shapes.items() if k != var.name}
    spread.update(shapes.get(var.name) or {k: None for k in extra})
    own = object.__getattribute__(model, "__dict__")
    before = own.get("forward", _MISSING)
    own["forward"] = presented
    try:
        yield spread
    finally:
        if before is _MISSING:
            own.pop("forward", None)
        else:
            own["forward"] = before


_MISSING = object()


def _presented(forward: Callable[..., Any], signature: inspect.Signature) -> Callable[..., Any]:
    def presented(*args: Any, **kwargs: Any) -> Any:
        return forward(*args, **kwargs)

    presented.__signature__ = signature  # type: ignore[attr-defined]
    setattr(presented, _PRESENTED, True)
    return presented
