"""What the Python between Dynamo's graphs sees, and what each rewritten graph runs under.

A model with graph breaks runs as alternating pieces: a rewritten graph, the model's own
Python (data-dependent branches, ``.item()``, a ``@torch._dynamo.disable`` function, a
torchvision ``nms``), the next graph. Two regimes keep that Python working:

* **The autocast regime** (the ``Policy.autocast(device, dtype)`` presets):
  ``amprewrite.compile`` calls the model under ``torch.autocast(device, dtype)``, so the
  Python between graphs runs exactly as under eager autocast, and Dynamo traces each graph
  with the dtypes autocast gives (its fake values, and the dtypes the Python reads off
  them). Dynamo keeps an autocast entered outside the compiled frame out of the graph: it
  is global state that its guards check, and the graph arrives without ``_enter_autocast``
  nodes. The rewrite makes the preset's casts explicit, so each graph then runs (and is
  compiled) with autocast *off* on that device (:func:`without_autocast`): otherwise the
  model's own ``autocast(enabled=False)`` regions, whose enter/exit nodes the rewrite drops,
  and the policy's overrides would be cast again by the outer autocast.

* **Outside it** (any other policy, or no autocast active around the call): the Python
  between graphs runs without autocast, on the dtypes Dynamo traced it with. Each graph's
  floating outputs are cast back to the dtype its un-rewritten trace gave them
  (:func:`restore_traced_dtypes`), so no op outside a graph meets a dtype that only the
  rewrite produced (a bf16 input to a convolution with fp32 weights, bf16 boxes to
  ``nms``). Before::

      linear = torch._C._nn.linear(x_bf16, w_bf16, b_bf16)
      return (linear,)

  After::

      linear = torch._C._nn.linear(x_bf16, w_bf16, b_bf16)
      linear_traced = linear.to(torch.float32)
      return (linear_traced,)
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from ..graph.meta import META_KEY, CastInfo

__all__ = ["Regime", "regime_of", "regime_available", "ambient_autocast", "under_regime",
           "without_autocast", "traced_output_dtypes", "restore_traced_dtypes"]

Regime = tuple[str, torch.dtype]
"""``(device_type, low dtype)`` of the ``torch.autocast`` a policy mirrors."""

_DEVICES = ("cpu", "cuda")


def regime_of(preset: str, dtype: torch.dtype | None) -> Regime | None:
    """The autocast a policy's preset mirrors (``"cpu"``/``"cuda"`` presets), else None."""
    if preset not in _DEVICES or dtype is None:
        return None
    return preset, dtype


def regime_available(regime: Regime) -> bool:
    """Whether ``torch.autocast(*regime)`` takes effect here (autocast on ``cuda`` disables
    itself, with a warning, on a machine without a GPU)."""
    device = regime[0]
    return device == "cpu" or (device == "cuda" and torch.cuda.is_available())


def ambient_autocast() -> dict[str, torch.dtype]:
    """The autocast enabled in this thread, per device type: what Dynamo's graphs were
    traced under when a backend is called, and what they run under."""
    return {d: torch.get_autocast_dtype(d) for d in _DEVICES if torch.is_autocast_enabled(d)}


def under_regime(forward: Callable[..., Any], regime: Regime) -> Callable[..., Any]:
    """``forward`` called under ``torch.autocast(*regime)``, as a user calls a model under
    eager autocast: the compiled frames are entered with autocast on."""
    device, dtype = regime

    @functools.wraps(forward)
    def call(*args: Any, **kwargs: Any) -> Any:
        with torch.autocast(device, dtype=dtype):
            return forward(*args, **kwargs)

    return call


def without_autocast(fn: Callable[..., Any], device: str) -> Callable[..., Any]:
    """``fn`` (a rewritten graph, eager or compiled) run with autocast off on ``device``:
    its casts are explicit. Dynamo calls a backend's result with the graph's inputs as
    positional arguments."""

    def call(*args: Any) -> Any:
        with torch.autocast(device, enabled=False):
            return fn(*args)

    return call


def _output_leaves(gm: fx.GraphModule) -> list[Any]:
    output = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    return pytree.tree_leaves(output.args[0])


def traced_output_dtypes(gm: fx.GraphModule) -> list[torch.dtype | None]:
    """The dtype of each output leaf as traced (before the rewrite), None for non-tensors."""
    dtypes: list[torch.dtype | None] = []
    for leaf in _output_leaves(gm):
        val = leaf.meta.get("val") if isinstance(leaf, fx.Node) else None
        dtypes.append(val.dtype if isinstance(val, torch.Tensor) else None)
    return dtypes


def restore_traced_dtypes(gm: fx.GraphModule, traced: list[torch.dtype | None]) -> int:
    """Cast each floating output whose dtype the rewrite changed back to its ``traced``
    dtype (see the module docstring); returns how many casts were added. One cast per
    value and dtype; consumers inside the graph keep the rewritten value."""
    output = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    leaves, spec = pytree.tree_flatten(output.args[0])
    if len(leaves) != len(traced):
        raise ValueError(f"amprewrite.backend: the rewritten graph has {len(leaves)} outputs, "
                         f"its trace had {len(traced)}; expected the same outputs.")
    casts: dict[tuple[fx.Node, torch.dtype], fx.Node] = {}
    restored = []
    for leaf, dtype in zip(leaves, traced):
        val = leaf.meta.get("val") if isinstance(leaf, fx.Node) else None
        if dtype is None or not isinstance(val, torch.Tensor) or val.dtype == dtype \
                or not val.is_floating_point() or not dtype.is_floating_point:
            restored.append(leaf)
            continue
        if (leaf, dtype) not in casts:
            with gm.graph.inserting_before(output):
                cast = gm.graph.create_node("call_method", "to", (leaf, dtype),
                                            name=f"{leaf.name}_traced")
            cast.meta["val"] = val.to(dtype)
            cast.meta[META_KEY] = CastInfo(dtype, guarded=False, weight=False)
            for key in ("nn_module_stack", "stack_trace"):
                if key in leaf.meta:
                    cast.meta[key] = leaf.meta[key]
            casts[(leaf, dtype)] = cast
        restored.append(casts[(leaf, dtype)])
    if casts:
        output.args = (pytree.tree_unflatten(restored, spec),)
        gm.graph.lint()
        gm.recompile()
    return len(casts)
