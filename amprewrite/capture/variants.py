"""A converted module follows the model it was converted from: the one check at each call.

What a captured graph depends on besides its inputs:

* the tensors: the converted module holds the model's own parameter and buffer dicts
  (:func:`amprewrite.runtime.model_watch.share_tensor_dicts`), so there is nothing to check;
* the mode (``gm.train()`` / ``gm.eval()``): one graph per mode (:mod:`.modes`);
* the Python state the capture read: attributes, configs, which submodule sits where
  (:mod:`.reads`, frozen in a :class:`~amprewrite.capture.snapshot.StateSnapshot` under
  ``graph.meta[STATE_KEY]``);
* hooks registered on the model's modules after conversion, which no graph runs (reported by
  :class:`~amprewrite.runtime.model_watch.ModelWatch`).

:class:`CallGuard` checks all of them at once at the start of each call (:meth:`CallGuard.holds`:
the mode, a stamp of registrations, the active graph's snapshot; about 25 ns per attribute read
by the capture). Where one no longer holds, :meth:`CallGuard.follow` brings the module up to
date before the call runs:

* another mode: the graph of that mode (captured at the first switch, :mod:`.modes`);
* another state: a graph captured earlier for it, if one matches; else, with
  ``on_change="recapture"`` (the default), a new capture of the model as it is now, with the
  call's inputs, warning once with what changed (``block.use_gate: True -> False``); with
  ``on_change="raise"``, an :class:`~amprewrite.errors.AmpRewriteError` naming what changed.
  At most :data:`MAX_STATES` states are kept: past that the call raises, since a model whose
  state changes at every call is converted again at every call.

Each state's graphs form a *core*: a converted GraphModule holding that state's graph and its
other mode (``_amp_by_mode``). The module holds the active core; the others wait in
:attr:`CallGuard.cores`, and :func:`swap_cores` exchanges them (a few dict writes, like a mode
switch). All cores share the module's root tensors and its runtime stores; each has its own
tree of submodules (a replaced head is another tree), whose tensor dicts are the model's.

NB: ``torch.compile`` of a converted module traces whichever graph the module holds; the check
itself runs only eagerly (a call outside ``torch.compile``, or ``gm.train()``/``gm.eval()``).
"""

from __future__ import annotations

import copy
from typing import Any, Callable, Protocol

import torch
import torch.fx as fx

from ..errors import AmpRewriteError, RecaptureWarning, report_recapture
from ..graph.inputs import (captured_size, changed_dims, input_mismatch, other_arguments,
                            scalar_changes)
from ..runtime.low_copies import LOW_COPIES_ATTR
from ..runtime.tracing import tracing
from ..runtime.model_watch import ModelWatch, changes, report_global_hooks
from ..runtime.weight_cache import CACHE_ATTR
from .snapshot import StateSnapshot
from .modes import MODES_ATTR, exchange_graphs, switch_graph

__all__ = ["CallGuard", "RefitFailed", "GUARD_ATTR", "STATE_KEY", "MAX_STATES", "ON_CHANGE",
           "swap_cores", "state_of"]

GUARD_ATTR = "_amp_guard"
"""``gm.__dict__[GUARD_ATTR]``: the module's :class:`CallGuard`."""

STATE_KEY = "amprewrite_state"
"""``graph.meta[STATE_KEY]``: the :class:`StateSnapshot` of what its capture read."""

MAX_STATES = 8
"""The most model states one converted module keeps a graph for."""

ON_CHANGE = ("recapture", "raise")

class Recapture(Protocol):
    """How a module captures its model again (``convert``'s ``_Recapture``)."""

    model: torch.nn.Module
    has_inputs: bool
    """Whether a capture takes the call's inputs (else the symbolic tracer needs none)."""

    def __call__(self, gm: fx.GraphModule, args: tuple, kwargs: dict[str, Any],
                 varying: frozenset[tuple[str, int]] = frozenset()) -> fx.GraphModule:
        """A new core for the model as it is now, in ``gm``'s mode, captured with the call's
        inputs (``varying``: their dimensions to make dynamic), sharing ``gm``'s root state."""

    def watch(self, gm: fx.GraphModule) -> ModelWatch | None: ...


def state_of(graph: fx.GraphModule, training: bool) -> StateSnapshot | None:
    """The snapshot of the graph that ``graph`` (a core) runs in ``training`` mode: its own,
    or its captured sibling's; None where that mode is not captured yet."""
    entry = graph.__dict__.get(MODES_ATTR, (None, None))[training]
    if entry is None:
        return graph.meta.get(STATE_KEY)
    if isinstance(entry, fx.GraphModule):
        return entry.meta.get(STATE_KEY)
    return None


class CallGuard:
    """The per-call check of a converted module (module docstring)."""

    def __init__(self, gm: fx.GraphModule, recapture: Recapture | None, on_change: str,
                 watch: ModelWatch | None, first_call: bool = False) -> None:
        # NB: ``on_change`` is one of ON_CHANGE: convert checks it before any capture.
        self.recapture = recapture
        self.model = recapture.model if recapture is not None else None
        """The model, whose switches of mode (``model.eval()``) the module follows."""
        self.model_mode = None if self.model is None else self.model.training
        """The model's ``training`` flag as last seen: a change is followed at the next call."""
        self.on_change = on_change
        self.watch = watch
        self.cores: list[fx.GraphModule] = []
        self.snapshot: StateSnapshot | _NotCaptured | None = \
            _NOT_CAPTURED if first_call else gm.meta.get(STATE_KEY)
        self.stamp = changes()
        self.captures: list[str] = [] if first_call else ["at conversion"]
        """Why each graph the module captured was made, oldest first (``explain`` lists
        them)."""
        self.first_call = first_call
        """Captured at the first call, from its inputs: a call whose inputs do not fit the
        graph is captured again for them (:meth:`refit`)."""
        self.varying: frozenset[tuple[str, int]] = frozenset()
        """Input dimensions made dynamic after a call changed their size (:meth:`refit`)."""
        self.fixed_dims: frozenset[tuple[str, int]] = frozenset()
        """Input dimensions the model could not take symbolic: one graph per size."""

    # -- the hot path ------------------------------------------------------------------------
    def holds(self, gm: fx.GraphModule) -> bool:
        """Whether ``gm`` holds the graph for its mode and the model's state, as last seen,
        and the model's mode is as last seen (``model.eval()`` switches the converted module
        too; a flag set on the converted module alone, as Lightning restores flags, is the
        converted module's).
        NB: an int index: Dynamo on torch 2.11 cannot index a tuple with a bool."""
        snapshot, model = self.snapshot, self.model
        return (gm.__dict__[MODES_ATTR][1 if gm.training else 0] is None
                and (model is None or model.training is self.model_mode)
                and self.stamp == changes()
                and (snapshot is None or snapshot.holds()))

    def switched(self, gm: fx.GraphModule) -> None:
        """``gm`` switched mode (``gm.train()``/``gm.eval()``, its own: the model's flags are
        left as they are): check its new graph's state; a later switch of the model's is
        followed from here."""
        if self.model is not None:
            self.model_mode = self.model.training
        if self.snapshot is not _NOT_CAPTURED:
            self.snapshot = gm.meta.get(STATE_KEY)

    # -- bringing the module up to date --------------------------------------------------------
    def follow(self, gm: fx.GraphModule, args: tuple, kwargs: dict[str, Any]) -> None:
        """Make ``gm`` hold the graph of its mode and the model's current state (module
        docstring)."""
        if self.model is not None and self.model.training is not self.model_mode:
            gm.train(self.model.training)  # ``model.eval()`` / ``model.train()`` since
        if self.snapshot is _NOT_CAPTURED:
            assert self.recapture is not None
            _refuse_while_tracing(gm)
            swap_cores(gm, self.recapture(gm, args, kwargs))  # the placeholder is dropped
            self.captures.append("at the first call, from its inputs")
            self.watch = self.recapture.watch(gm)
            self.stamp = changes()
            self.snapshot = gm.meta.get(STATE_KEY)
            return
        slots_changed = False
        if self.stamp != changes():
            report_global_hooks()
            if self.watch is not None:
                self.watch.check()
            self.stamp = changes()
            slots_changed = self.snapshot is not None and not self.snapshot.slots_hold()
        switch_graph(gm, gm.training)
        self.snapshot = gm.meta.get(STATE_KEY)
        if self.snapshot is None or (self.snapshot.holds() and not slots_changed):
            return
        what = self.snapshot.changes() or ["a tensor slot the forward found empty was filled"]
        store = gm.__dict__.get(LOW_COPIES_ATTR)
        if store is not None:
            # A change of Python state can come with weight writes no counter sees (PEFT's
            # merge_adapter adds the adapters into the base weights through .data and flips
            # their `merged` flags): O2's stored copies are rewritten from their masters.
            store.refresh()

        def fits(core: fx.GraphModule) -> bool:
            state = state_of(core, gm.training) or core.meta.get(STATE_KEY)
            return state is not None and state.holds() and state.slots_hold()

        if self._hold_kept(gm, fits):
            switch_graph(gm, gm.training)
        else:
            self._refuse(gm, what)
            self._capture_new(
                gm, args, kwargs,
                f"the model's state changed since this {type(gm).__name__} was captured, so "
                f"it was captured again for the new state ({self._kept()}): "
                + "; ".join(what) + ". "
                "The earlier graph is kept for when the state returns. convert(..., "
                "on_change='raise') makes such a change an error instead.")
        self.snapshot = gm.meta.get(STATE_KEY)

    def refit(self, gm: fx.GraphModule, args: tuple, kwargs: dict[str, Any]) -> bool:
        """After a call that failed on inputs its graph does not fit: hold a graph that fits
        them, captured now if none was. Returns whether the call should be tried again.

        * **Another size** in a dimension the graph fixed (a sequence length, a partial last
          batch): captured once more with that dimension symbolic (automatic dynamic sizes,
          as ``torch.compile`` does), which later sizes reuse; where the model cannot take a
          symbolic size there, one graph per size, said once.
        * **Another Python scalar** (``temperature=0.5``), which the graph holds as a
          constant: a new capture, as for a change of state (``on_change``).
        * **Other arguments** (a keyword the capture did not have, or one it had missing):
          a new capture for them.
        * **Another dtype or rank**: a new capture for a module captured at its first call;
          for one converted from example inputs, the call raises (they name the kind of
          inputs the module takes).
        """
        if self.recapture is None or not self.recapture.has_inputs:
            return False

        def fits(core: fx.GraphModule) -> bool:
            state = state_of(core, gm.training)
            return state is not None and state.holds() and \
                input_mismatch(core, "", args, kwargs) is None

        if self._hold_kept(gm, fits):
            self.snapshot = gm.meta.get(STATE_KEY)
            return True
        dims = changed_dims(gm, args, kwargs)
        scalars = scalar_changes(gm, args, kwargs)
        if dims is None and not scalars and not self.first_call and \
                not other_arguments(gm, args, kwargs):
            return False  # another kind of tensor: the mismatch error names it
        message = input_mismatch(gm, type(gm).__name__, args, kwargs) or ""
        what = "; ".join(line.strip() for line in message.splitlines()[1:]
                         if line.startswith("  ")) or "other inputs"
        wanted = frozenset(dims or ()) - self.fixed_dims
        if dims and not scalars:  # never refused: a size the model fixes evicts the oldest graph
            self._refuse(gm, [what], state=False, bound=False)
            if len(self.cores) + 1 >= MAX_STATES:
                self.cores.pop(0)
        else:
            self._refuse(gm, [what], state=bool(scalars))
        try:
            if wanted:
                self._capture_dynamic(gm, args, kwargs, wanted, what)
            else:
                self._capture_new(gm, args, kwargs, self._recaptured(type(gm).__name__, what))
        except RecaptureWarning:
            raise  # the user made recaptures errors
        except Exception as exc:
            raise RefitFailed(exc) from exc
        self.snapshot = gm.meta.get(STATE_KEY)
        return True

    def _capture_dynamic(self, gm: fx.GraphModule, args: tuple, kwargs: dict[str, Any],
                         wanted: frozenset[tuple[str, int]], what: str) -> None:
        """Capture with the ``wanted`` dimensions symbolic; the new graph replaces the one
        ``gm`` holds (it takes every input that one took)."""
        assert self.recapture is not None
        varying = self.varying | wanted
        core = self.recapture(gm, args, kwargs, varying)
        swap_cores(gm, core)
        sizes = {key: captured_size(gm, *key) for key in varying}
        dynamic = {key for key, size in sizes.items() if size is None}
        self.varying = frozenset(dynamic)
        # NB: torch.export always fixes a size of 0 or 1 (a decode step's length 1): that is
        # the example's doing, and the next call of another size tries again
        fixed = {key for key in wanted - dynamic if sizes[key] not in (0, 1)}
        self.fixed_dims |= fixed
        if wanted - dynamic:
            self.cores.append(core)  # the graph of the earlier size stays right for it
        name = type(gm).__name__
        made = ", ".join(f"{n} dimension {d}" for n, d in sorted(wanted & dynamic))
        if made:
            self._report(f"this {name} was called with another size ({what}), so it was "
                             f"captured again with {made} dynamic; later sizes there reuse "
                             "that graph.")
        elif not fixed:
            self._report(self._recaptured(name, what))
        if fixed:
            self._report(
                f"{name} cannot take a symbolic size in "
                + ", ".join(f"{n} dimension {d}" for n, d in sorted(fixed))
                + f" (torch.export specialised it, or failed on it); the module keeps one "
                f"graph per size there, the last {MAX_STATES}, and captures again for "
                "others. Pad those inputs to a few fixed sizes.")

    def _report(self, message: str) -> None:
        """Log a capture (:attr:`captures`) and report it (:func:`report_recapture`)."""
        self.captures.append(message.removeprefix("this "))
        report_recapture(message)

    def _recaptured(self, name: str, what: str) -> str:
        return (f"this {name} was called with inputs its graph was not captured for ({what}), "
                f"so it was captured again for them ({self._kept()}).")

    def _hold_kept(self, gm: fx.GraphModule, fits: Callable[[fx.GraphModule], bool]) -> bool:
        """Make ``gm`` hold the first kept core that ``fits``; whether there was one."""
        for i, core in enumerate(self.cores):
            if fits(core):
                self.cores[i] = swap_cores(gm, core)
                return True
        return False

    def _kept(self) -> str:
        """How many states are kept once one more is captured, of the bound."""
        return f"{len(self.cores) + 2} of at most {MAX_STATES} kept"

    def _capture_new(self, gm: fx.GraphModule, args: tuple, kwargs: dict[str, Any],
                     warning: str) -> None:
        """Capture the model as it is now with the call's inputs, hold it, keep the core
        ``gm`` held, and warn."""
        assert self.recapture is not None  # _refuse raised otherwise
        core = self.recapture(gm, args, kwargs, self.varying)
        self._report(warning)
        self.cores.append(swap_cores(gm, core))

    def _refuse(self, gm: fx.GraphModule, what: list[str], state: bool = True,
                bound: bool = True) -> None:
        """Raise where no new capture may be made: the module cannot capture, the user asked
        for errors (``on_change="raise"``, for changes of ``state`` only), or the bound."""
        changed = "; ".join(what)
        name = type(gm).__name__
        if self.recapture is None:
            raise AmpRewriteError(
                f"the model this converted {name} was captured from has changed ({changed}), "
                "and this module cannot capture it again: it rewrote the graph of an already "
                "converted module, not the model. Convert the model itself again "
                "(amprewrite.convert(model, ...)).")
        if self.on_change == "raise" and state:
            raise AmpRewriteError(
                f"the model this converted {name} was captured from has changed since the "
                f"capture: {changed}. Its graph computes the model as it was, so the call is "
                "refused (convert(..., on_change='raise')). Put the model back as it was, "
                "convert it again (amprewrite.convert) after the change, or convert with "
                "on_change='recapture' to capture each new state at its first call.")
        if bound and len(self.cores) + 1 >= MAX_STATES:
            raise AmpRewriteError(
                f"the model this converted {name} was captured from has changed again "
                f"({changed}) after {MAX_STATES} states were captured. A model whose state "
                "changes at every call would be captured at every call. Keep that state out of "
                "the forward (pass it as an input), convert again once the model is set up, "
                "or use amprewrite.compile(model), whose guards follow Python state.")

    def __deepcopy__(self, memo: dict[int, Any]) -> CallGuard:
        new = object.__new__(CallGuard)
        for key, value in self.__dict__.items():
            new.__dict__[key] = copy.deepcopy(value, memo) if key != "stamp" else value
        return new

    def __reduce__(self) -> Any:
        return (_no_guard, ())


def _no_guard() -> None:
    return None


def _refuse_while_tracing(gm: fx.GraphModule) -> None:
    if tracing():
        raise AmpRewriteError(gm.meta.get("amprewrite_not_captured_yet", "not captured yet"))


class RefitFailed(Exception):
    """The model could not be captured for a call's inputs (most often: the model itself
    does not take them); the call raises what does not fit, with this as a note."""

    def __init__(self, cause: BaseException) -> None:
        first = str(cause).splitlines()[0] if str(cause) else ""
        super().__init__(f"{type(cause).__name__}: {first}")


class _NotCaptured:
    """The state of a module not captured yet: it never holds."""

    def holds(self) -> bool:
        return False

    def __deepcopy__(self, memo: dict[int, Any]) -> _NotCaptured:
        return self


_NOT_CAPTURED = _NotCaptured()


def swap_cores(gm: fx.GraphModule, core: fx.GraphModule) -> fx.GraphModule:
    """Make ``gm`` hold ``core``'s graphs and tree and ``core`` hold ``gm``'s; returns ``core``
    (which now holds what ``gm`` held). The runtime stores stay ``gm``'s (an O2 module's
    store is the one ``MasterWeights`` bound), taken from ``core`` where ``gm`` has none yet
    (a module captured at its first call)."""
    for attr in (CACHE_ATTR, LOW_COPIES_ATTR):
        if attr in core.__dict__:
            gm.__dict__.setdefault(attr, core.__dict__[attr])
    exchange_graphs(gm, core, extra=(MODES_ATTR,))
    return core
