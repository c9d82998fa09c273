"""A converted module's graphs: one guarded cache, as ``torch.compile`` keeps one per frame.

A converted graph computes the model as its capture saw it. Besides its inputs' values, it
assumed

* a **mode**: torch.export records dropout, batch-norm statistics and every
  ``if self.training:`` branch of the mode it ran in (the symbolic tracer records the branches
  and functional calls it traces through);
* a **Python state**: the attributes, configs and submodules the capture read (:mod:`.reads`,
  frozen in a :class:`~.snapshot.StateSnapshot`, ``graph.meta[STATE_KEY]``);
* its **inputs**: which arguments, their kinds, dtypes, ranks and fixed sizes, and the Python
  scalars it holds as constants (``graph.meta[INPUTS_KEY]``, :mod:`amprewrite.graph.inputs`).

A converted module keeps a list of :class:`Entry`, each one converted graph and those
assumptions, its guards. It *holds* one entry: its ``graph``, ``code`` and generated forward
are that entry's (:func:`~.modes.exchange_graphs`, a few dict writes), so everything that
reads the module (``gm.code``, ``torch.export.export(gm)``, ``explain``, the auditor) reads
the graph a call runs. When a guard of the held entry fails, the module holds the first entry
whose guards hold, or captures a new one, all through :class:`GraphCache`:

* **mode**: checked at ``gm.train()`` / ``gm.eval()`` (:meth:`GraphCache.switch`), and at each
  call for a flag set by hand or a switch of the model's; the first switch to a mode captures
  it with the held entry's inputs. Where it gives the same code (no mode-dependent op), the
  held entry serves both modes.
* **state**: checked at each call (:meth:`GraphCache.holds`, about 25 ns per attribute the
  capture read); a new state is captured with the call's inputs and reported once, naming
  what changed (``on_change="raise"``: an :class:`~amprewrite.errors.AmpRewriteError`).
* **inputs**: checked by the graph itself (torch.export's input check); a call it rejects is
  captured again for its inputs (:meth:`GraphCache.refit`): another size is captured once
  with that dimension symbolic, and later sizes reuse it (automatic dynamic sizes).
* **nothing captured yet** (``convert(model, capture="export")`` without example inputs):
  the first call captures (:mod:`.first_call`).

The entries captured together (one state and one set of inputs, one per mode) form a *group*;
at most :data:`MAX_STATES` groups are kept (a new size the model cannot take symbolic drops the
group held least recently, as an LRU cache: the sizes a loop keeps using stay captured, a
one-off does not push them out). Every capture after the first is reported through
one channel, :class:`~amprewrite.errors.RecaptureWarning`, and :meth:`GraphCache.describe`
lists the entries and why each was made (``explain`` prints it). The guard that fails writes
the message: :meth:`.snapshot.StateSnapshot.changes` for the state,
:func:`~amprewrite.graph.inputs.input_mismatch` for the inputs.

All entries share the module's root tensors and runtime stores (the weight-cast cache, O2's
low-precision copies); each keeps the submodules its own capture made (a replaced head is
another tree), whose tensor dicts are the model's.

NB: ``torch.compile`` of a converted module traces the entry the module holds; the checks run
only eagerly (a call outside ``torch.compile``, or ``gm.train()``/``gm.eval()``).
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any, Callable, Protocol

import torch.fx as fx
import torch.nn as nn

from ..errors import AmpRewriteError, RecaptureWarning, report_recapture
from ..graph.inputs import (captured_size, changed_dims, input_mismatch, other_arguments,
                            scalar_changes)
from ..runtime.low_copies import LOW_COPIES_ATTR
from .model_watch import ModelWatch, changes, report_global_hooks
from ..runtime.tracing import tracing
from ..runtime.weight_cache import CACHE_ATTR
from .modes import NOT_CAPTURED_KEY, mode_name
from .sharing import exchange_graphs, own_modules, relink_graph, share_runtime
from ..capture.snapshot import StateSnapshot

__all__ = ["GraphCache", "Entry", "Recipe", "RefitFailed", "CACHE_KEY", "SERVES_ATTR",
           "STATE_KEY", "MAX_STATES", "ON_CHANGE", "cache_of"]

CACHE_KEY = "_amp_graphs"
"""``gm.__dict__[CACHE_KEY]``: the converted module's :class:`GraphCache`."""

SERVES_ATTR = "_amp_serves"
"""``gm.__dict__[SERVES_ATTR]``: ``(eval, train)``, whether the graph the module holds computes
each mode: what a compiled call reads (one tuple index, which Dynamo guards on)."""

STATE_KEY = "amprewrite_state"
"""``graph.meta[STATE_KEY]``: the :class:`StateSnapshot` of what its capture read."""

MAX_STATES = 8
"""The most groups of graphs (model states, sets of inputs) one converted module keeps."""

ON_CHANGE = ("recapture", "raise")


@dataclasses.dataclass(eq=False)
class Entry:
    """One converted graph of the cache and what its capture assumed."""

    holder: fx.GraphModule | None
    """The finished GraphModule holding the graph; None while the converted module holds it
    (a switch exchanges the two modules' graphs)."""
    modes: tuple[bool, ...]
    """The modes (``training`` flags) it computes: one, or both where they gave one code."""
    source: nn.Module
    """What it was captured from: the model, its O3 low-precision twin, a converted module."""
    inputs: tuple[tuple | None, dict[str, Any] | None]
    """The ``(args, kwargs)`` it was captured with; a capture of its other mode takes them."""
    varying: frozenset[tuple[str, int]] = frozenset()
    """The input dimensions it was captured with symbolic."""
    raw_code: str = ""
    """Its code as captured, before the passes: a capture of the other mode with the same code
    is one graph for both."""
    group: int = 0
    why: str = ""

    def graph(self, gm: fx.GraphModule) -> fx.GraphModule:
        """The module holding this entry's graph now: ``gm`` or :attr:`holder`."""
        return gm if self.holder is None else self.holder

    def state(self, gm: fx.GraphModule) -> StateSnapshot | None:
        return self.graph(gm).meta.get(STATE_KEY)


class Recipe(Protocol):
    """How a converted module captures its model (:class:`amprewrite.recipe.CaptureRecipe`)."""

    model: nn.Module
    has_inputs: bool
    """Whether a capture takes the call's inputs (else the symbolic tracer needs none)."""
    can_recapture: bool
    """False for a converted module converted again: only its other mode can be captured."""
    view: bool
    """Whether the converted module's submodules are the model's (:mod:`.tree`)."""

    def __call__(self, gm: fx.GraphModule, args: tuple, kwargs: dict[str, Any],
                 varying: frozenset[tuple[str, int]] = frozenset()) -> list[Entry]:
        """New entries for the model as it is now, in ``gm``'s mode, captured with the call's
        inputs (``varying``: their dimensions to make symbolic), sharing ``gm``'s root tensors;
        the first is the one to hold."""

    def part(self, module: nn.Module) -> fx.GraphModule:
        """``module`` (a submodule of the model, or one that runs a method of it) converted as
        the model was, captured at its first call (:mod:`.methods`)."""

    def capture_mode(self, gm: fx.GraphModule, training: bool, like: Entry) -> Entry | None:
        """The entry of ``training`` mode for ``like``'s group (which ``gm`` holds), captured
        with its inputs; None where it is ``like``'s code."""

    def watch(self, gm: fx.GraphModule) -> ModelWatch | None: ...


def cache_of(gm: nn.Module) -> GraphCache | None:
    return gm.__dict__.get(CACHE_KEY)


class GraphCache:
    """The converted graphs of one module, and the checks that pick one (module docstring)."""

    def __init__(self, recipe: Recipe, on_change: str, first_call: bool = False) -> None:
        # NB: ``on_change`` is one of ON_CHANGE: convert checks it before any capture.
        self.recipe = recipe
        self.first_call = first_call
        """Captured at the first call, from its inputs: a call whose inputs do not fit the
        graph is captured again for them, another dtype or rank included (:meth:`refit`)."""
        self.model = recipe.model if recipe.can_recapture else None
        """The model, whose switches of mode (``model.eval()``) the module follows."""
        self.model_mode = None if self.model is None else self.model.training
        """The model's ``training`` flag as last seen: a change is followed at the next call."""
        self.on_change = on_change
        self.watch: ModelWatch | None = None
        self.entries: list[Entry] = []
        """Oldest first; the held one among them."""
        self.held: Entry | None = None
        """None until the first capture of a module captured at its first call."""
        self.snapshot: StateSnapshot | None = None
        """The held entry's state, checked at each call."""
        self.stamp = changes()
        self.varying: frozenset[tuple[str, int]] = frozenset()
        """Input dimensions made dynamic after a call changed their size (:meth:`refit`)."""
        self.fixed_dims: frozenset[tuple[str, int]] = frozenset()
        """Input dimensions the model could not take symbolic: one group per size."""
        self._groups = 0
        self._last_held: dict[int, int] = {}
        """Group -> when it was last let go of (a tick of :meth:`_hold`): which to drop."""
        self._ticks = 0
        self.autocast_warned = False
        self.methods: Any = None
        """The entries of the model's other methods and of the submodules its code hands
        out (:class:`~.methods.MethodEntries`), made at their first call."""
        """Whether the module warned that it was called under ``torch.autocast`` (once)."""

    def attach(self, gm: fx.GraphModule) -> None:
        """Make this the cache of ``gm``, which holds no entry yet where none was started (a
        module captured at its first call: its guards never hold)."""
        gm.__dict__[CACHE_KEY] = self
        if self.held is None:
            gm.__dict__[SERVES_ATTR] = (False, False)

    # -- the hot path ------------------------------------------------------------------------
    def holds(self, gm: fx.GraphModule) -> bool:
        """Whether the held entry's guards hold: it computes ``gm``'s mode, the model's mode is
        as last seen (``model.eval()`` switches the converted module too; a flag set on the
        converted module alone, as Lightning restores flags, is the converted module's), no
        tensor or hook was registered anywhere since the last check, and the Python state
        the capture read is as it was.
        NB: an int index: Dynamo on torch 2.11 cannot index a tuple with a bool."""
        snapshot, model = self.snapshot, self.model
        return (gm.__dict__[SERVES_ATTR][1 if gm.training else 0]
                and (model is None or model.training is self.model_mode)
                and self.stamp == changes()
                and (snapshot is None or snapshot.holds()))

    # -- holding an entry ----------------------------------------------------------------------
    def start(self, gm: fx.GraphModule, entries: list[Entry], why: str,
              watch: ModelWatch | None) -> None:
        """``gm`` is the first entry's module (a converted module made at conversion): hold
        it, keep the others; ``watch``: its watch over the model, made after its capture."""
        group = self._new_group()
        for entry in entries:
            entry.group, entry.why = group, entry.why or why
        self.entries = list(entries)
        self.held = entries[0]
        self.held.holder = None
        for entry in entries[1:]:
            share_runtime(gm, entry.holder)
        self._held_changed(gm)
        self.watch = watch
        self.stamp = changes()  # NB: after the watch, whose first one registers hooks

    def _new_group(self) -> int:
        self._groups += 1
        return self._groups

    def _add(self, gm: fx.GraphModule, entries: list[Entry], why: str,
             group: int | None = None) -> None:
        """Keep ``entries`` (of a new group, or of ``group``) and hold the first."""
        group = self._new_group() if group is None else group
        for entry in entries:
            entry.group, entry.why = group, why
            for attr in (CACHE_ATTR, LOW_COPIES_ATTR):  # one store per module (swap below)
                if attr in entry.holder.__dict__:
                    gm.__dict__.setdefault(attr, entry.holder.__dict__[attr])
            share_runtime(gm, entry.holder)
        self.entries.extend(entries)
        self._hold(gm, entries[0])

    def _hold(self, gm: fx.GraphModule, entry: Entry) -> None:
        if entry is self.held:
            return
        holder = entry.holder
        assert holder is not None
        exchange_graphs(gm, holder)
        if self.held is not None:
            self.held.holder = holder  # it now holds what gm held
            self._ticks += 1
            self._last_held[self.held.group] = self._ticks
        entry.holder = None
        self.held = entry
        self._held_changed(gm)

    def _held_changed(self, gm: fx.GraphModule) -> None:
        assert self.held is not None
        gm.__dict__[SERVES_ATTR] = (False in self.held.modes, True in self.held.modes)
        self.snapshot = gm.meta.get(STATE_KEY)

    def _hold_first(self, gm: fx.GraphModule, fits: Callable[[Entry], bool]) -> bool:
        """Hold the first entry that ``fits``; whether there was one."""
        for entry in self.entries:
            if fits(entry):
                self._hold(gm, entry)
                return True
        return False

    def _hold_nearest(self, gm: fx.GraphModule, args: tuple, kwargs: dict[str, Any]) -> None:
        """Hold, of the entries that take the call's arguments and scalars and differ from it
        in sizes only, the one held last (if the held one is not such an entry): what the
        call changed is then a size of that entry, not another set of arguments. A decoding
        loop alternates between them: ``generate`` of an encoder-decoder calls its decoder
        without a KV cache at the first step and with one of another length at each later
        step; each length is a size (dropped least recently used at the bound), where a
        comparison with the cache-less entry would count every step as a new state."""
        def near(entry: Entry) -> bool:
            graph = entry.graph(gm)
            state = entry.state(gm)
            return gm.training in entry.modes and state is not None and state.holds() and \
                not other_arguments(graph, args, kwargs, named_by=gm) and \
                not scalar_changes(graph, args, kwargs, named_by=gm) and \
                changed_dims(graph, args, kwargs, named_by=gm) is not None

        held = self.held
        if held is not None and near(held):
            return
        nearest = [e for e in self.entries if e is not held and near(e)]
        if nearest:
            self._hold(gm, max(nearest, key=lambda e: (self._last_held.get(e.group, 0),
                                                       e.group)))

    def _drop_group(self, group: int) -> None:
        self.entries = [e for e in self.entries if e.group != group or e is self.held]

    def _drop_least_recent(self) -> None:
        """Drop the group, not the held one, let go of longest ago (never held: oldest)."""
        held = self.held.group if self.held is not None else None
        groups = [e.group for e in self.entries if e.group != held]
        if groups:
            self._drop_group(min(groups, key=lambda g: (self._last_held.get(g, 0), g)))

    def _group_count(self) -> int:
        return len({e.group for e in self.entries})

    # -- modes ---------------------------------------------------------------------------------
    def switch(self, gm: fx.GraphModule, training: bool) -> None:
        """Hold the entry of ``training`` mode in the held entry's group, capturing it at the
        first switch to that mode (with the held entry's inputs: no call's inputs are at hand
        at ``gm.eval()``). Called by ``gm.train()``/``gm.eval()`` and by a call whose module's
        flag was set without them. The graph's own modules (a sub-graph whose flag a fused
        kernel reads) take the mode: they are no children for ``train()`` to reach."""
        self._switch(gm, training)
        for module in own_modules(gm):
            if module.training is not training:
                module.train(training)

    def _switch(self, gm: fx.GraphModule, training: bool) -> None:
        held = self.held
        if held is None or training in held.modes:
            return
        if self._hold_first(gm, lambda e: e.group == held.group and training in e.modes):
            return
        _refuse_switch_while_tracing(training)
        entry = self.recipe.capture_mode(gm, training, held)
        if entry is None:  # the same code: the held graph serves both modes
            held.modes = (False, True)
            self._held_changed(gm)
            return
        why = f"{mode_name(training)} mode, at the first switch to it"
        if NOT_CAPTURED_KEY in entry.holder.meta:
            why = f"{mode_name(training)} mode could not be captured: its graph raises"
        self._add(gm, [entry], why, group=held.group)

    def switched(self, gm: fx.GraphModule) -> None:
        """``gm`` switched mode by its own ``train()``/``eval()`` (the model's flags are left
        as they are): a later switch of the model's is followed from here."""
        if self.model is not None:
            self.model_mode = self.model.training

    def _follow_model_mode(self, gm: fx.GraphModule) -> None:
        """The model switched mode since the last call (``model.eval()``): so does ``gm``.
        Where ``gm``'s submodules are the model's, its own flag only: they were switched
        with the model, and a submodule switched back since (``model.bn.eval()`` after
        ``model.train()``) stays as the user left it, as in eager; :meth:`follow` then holds
        the graph of the mode (its switch for a flag set without ``train()``)."""
        mode = self.model.training
        if self.recipe.view:
            gm.training = mode
        else:
            gm.train(mode)
        self.model_mode = mode

    def graph_in(self, gm: fx.GraphModule, training: bool) -> fx.GraphModule:
        """The module holding the graph of ``training`` mode in the held group (``gm`` itself
        where it holds it), captured now if it was not, ``gm`` left holding what it held
        (``convert`` of a converted module reads it)."""
        held = self.held
        assert held is not None
        if training not in held.modes:
            self.switch(gm, training)
            self._hold(gm, held)
        for entry in self.entries:
            if entry.group == held.group and training in entry.modes:
                return entry.graph(gm)
        raise AssertionError("a switched-to mode has an entry")  # pragma: no cover

    def mode_graphs(self, gm: fx.GraphModule) -> list[tuple[bool, fx.GraphModule]]:
        """``[(mode, graph), ...]`` of the held group where its modes run different graphs,
        the held one first; ``[]`` where one graph serves both (or the other mode is not
        captured yet). A graph with ``meta[NOT_CAPTURED_KEY]`` raises."""
        held = self.held
        if held is None or len(held.modes) == 2:
            return []
        own = held.modes[0]
        other = [e for e in self.entries if e.group == held.group and (not own) in e.modes]
        return [(own, gm), (not own, other[0].graph(gm))] if other else []

    def pending_mode(self) -> bool | None:
        """The mode of the held group not captured yet, or None."""
        held = self.held
        if held is None:
            return None
        served = {m for e in self.entries if e.group == held.group for m in e.modes}
        missing = {False, True} - served
        return missing.pop() if missing else None

    # -- bringing the module up to date --------------------------------------------------------
    def follow(self, gm: fx.GraphModule, args: tuple, kwargs: dict[str, Any]) -> None:
        """Make ``gm`` hold the entry of its mode and the model's current state (module
        docstring)."""
        if self.model is not None and self.model.training is not self.model_mode:
            self._follow_model_mode(gm)  # ``model.eval()`` / ``model.train()`` since
        if self.held is None:
            self._first_capture(gm, args, kwargs)
            return
        slots_changed = False
        if self.stamp != changes():
            report_global_hooks()
            if self.watch is not None:
                self.watch.check()
            self.stamp = changes()
            slots_changed = self.snapshot is not None and not self.snapshot.slots_hold()
        self.switch(gm, gm.training)  # a flag set without train()
        if self.snapshot is None or (self.snapshot.holds() and not slots_changed):
            return
        what = self.snapshot.changes() or ["a tensor slot the forward found empty was filled"]
        store = gm.__dict__.get(LOW_COPIES_ATTR)
        if store is not None:
            # A change of Python state can come with weight writes no counter sees (PEFT's
            # merge_adapter adds the adapters into the base weights through .data and flips
            # their `merged` flags): O2's stored copies are rewritten from their masters.
            store.refresh()

        def fits(entry: Entry) -> bool:
            state = entry.state(gm)
            return gm.training in entry.modes and state is not None and state.holds() \
                and state.slots_hold()

        if self._hold_first(gm, fits):
            return
        self._refuse(gm, what)
        self._capture_new(
            gm, args, kwargs,
            f"the model's state changed since this {type(gm).__name__} was captured, so "
            f"it was captured again for the new state ({self._kept()}): "
            + "; ".join(what) + ". "
            "The earlier graph is kept for when the state returns. convert(..., "
            "on_change='raise') makes such a change an error instead.")

    def _first_capture(self, gm: fx.GraphModule, args: tuple, kwargs: dict[str, Any]) -> None:
        if tracing():
            raise AmpRewriteError(gm.meta.get("amprewrite_not_captured_yet", "not captured yet"))
        entries = self.recipe(gm, args, kwargs)
        self._add(gm, entries, "at the first call, from its inputs")  # the placeholder goes
        self.watch = self.recipe.watch(gm)
        self.stamp = changes()

    def refit(self, gm: fx.GraphModule, args: tuple, kwargs: dict[str, Any]) -> bool:
        """After a call that failed on inputs its graph does not fit: hold an entry that fits
        them, captured now if none does. Returns whether the call should be tried again.

        * **Another size** in a dimension the graph fixed (a sequence length, a partial last
          batch): captured once more with that dimension symbolic (automatic dynamic sizes,
          as ``torch.compile`` does), which later sizes reuse; where the model cannot take a
          symbolic size there, one group per size, said once.
        * **Another Python scalar** (``temperature=0.5``), which the graph holds as a
          constant: a new capture, as for a change of state (``on_change``).
        * **Other arguments** (a keyword the capture did not have, or one it had missing):
          a new capture for them.
        * **Another dtype or rank**: a new capture for a module captured at its first call;
          for one converted from example inputs, the call raises (they name the kind of
          inputs the module takes).
        """
        if not self.recipe.can_recapture or not self.recipe.has_inputs:
            return False

        def fits(entry: Entry) -> bool:
            state = entry.state(gm)
            return gm.training in entry.modes and state is not None and state.holds() and \
                input_mismatch(entry.graph(gm), "", args, kwargs, named_by=gm) is None

        if self._hold_first(gm, fits):
            return True
        self._hold_nearest(gm, args, kwargs)
        dims = changed_dims(gm, args, kwargs)
        scalars = scalar_changes(gm, args, kwargs)
        if dims is None and not scalars and not self.first_call and \
                not other_arguments(gm, args, kwargs):
            return False  # another kind of tensor: the mismatch error names it
        message = input_mismatch(gm, type(gm).__name__, args, kwargs) or ""
        what = "; ".join(line.strip() for line in message.splitlines()[1:]
                         if line.startswith("  ")) or "other inputs"
        changed = frozenset(dims or ())
        wanted = changed - self.fixed_dims
        if dims and not scalars:  # never refused: a size the model fixes evicts the LRU
            self._refuse(gm, [what], state=False, bound=False)
            if self._group_count() >= MAX_STATES:
                self._drop_least_recent()
        else:
            self._refuse(gm, [what], state=bool(scalars))
        try:
            if wanted:  # NB: with the fixed ones that changed too: a size fixed by another
                # that was static then (a mask's length by the KV cache's) may be free now
                self._capture_dynamic(gm, args, kwargs, wanted | (changed & self.fixed_dims),
                                      what)
            else:
                self._capture_new(gm, args, kwargs, self._recaptured(type(gm).__name__, what))
        except RecaptureWarning:
            raise  # the user made recaptures errors
        except Exception as exc:
            raise RefitFailed(exc) from exc
        return True

    def _capture_dynamic(self, gm: fx.GraphModule, args: tuple, kwargs: dict[str, Any],
                         wanted: frozenset[tuple[str, int]], what: str) -> None:
        """Capture with the ``wanted`` dimensions symbolic; the new group replaces the held
        one (its graph takes every input that one took)."""
        assert self.held is not None
        varying = self.varying | wanted
        entries = self.recipe(gm, args, kwargs, varying)
        new = entries[0].holder
        sizes = {key: captured_size(new, *key) for key in varying}
        dynamic = {key for key, size in sizes.items() if size is None}
        self.varying = frozenset(dynamic)
        # NB: torch.export always fixes a size of 0 or 1 (a decode step's length 1): that is
        # the example's doing, and the next call of another size tries again
        fixed = {key for key in wanted - dynamic if sizes[key] not in (0, 1)}
        self.fixed_dims = (self.fixed_dims - dynamic) | fixed
        old = self.held.group
        name = type(gm).__name__
        made = ", ".join(f"{n} dimension {d}" for n, d in sorted(wanted & dynamic))
        if made:
            why = (f"this {name} was called with another size ({what}), so it was captured "
                   f"again with {made} dynamic; later sizes there reuse that graph.")
        else:
            why = self._recaptured(name, what)
        self._add(gm, entries, why.removeprefix("this "))
        if not wanted - dynamic:
            self._drop_group(old)  # the graph of the earlier size is the new one's case
        if made or not fixed:
            report_recapture(why)
        if fixed:
            report_recapture(
                f"{name} cannot take a symbolic size in "
                + ", ".join(f"{n} dimension {d}" for n, d in sorted(fixed))
                + f" (torch.export specialised it, or failed on it); the module keeps one "
                f"graph per size there, the {MAX_STATES} used last, and captures again for "
                "others. Pad those inputs to a few fixed sizes.")

    def _recaptured(self, name: str, what: str) -> str:
        return (f"this {name} was called with inputs its graph was not captured for ({what}), "
                f"so it was captured again for them ({self._kept()}).")

    def _kept(self) -> str:
        """How many groups are kept once one more is captured, of the bound."""
        return f"{self._group_count() + 1} of at most {MAX_STATES} kept"

    def _capture_new(self, gm: fx.GraphModule, args: tuple, kwargs: dict[str, Any],
                     warning: str) -> None:
        """Capture the model as it is now with the call's inputs, hold it, and report it."""
        entries = self.recipe(gm, args, kwargs, self.varying)
        self._add(gm, entries, warning.removeprefix("this "))
        report_recapture(warning)

    def _refuse(self, gm: fx.GraphModule, what: list[str], state: bool = True,
                bound: bool = True) -> None:
        """Raise where no new capture may be made: the module cannot capture, the user asked
        for errors (``on_change="raise"``, for changes of ``state`` only), or the bound."""
        changed = "; ".join(what)
        name = type(gm).__name__
        if not self.recipe.can_recapture:
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
        if bound and self._group_count() >= MAX_STATES:
            raise AmpRewriteError(
                f"the model this converted {name} was captured from has changed again "
                f"({changed}) after {MAX_STATES} states were captured. A model whose state "
                "changes at every call would be captured at every call. Keep that state out of "
                "the forward (pass it as an input), convert again once the model is set up, "
                "or use amprewrite.compile(model), whose guards follow Python state.")

    @property
    def recaptured(self) -> bool:
        """Whether the model was captured again since conversion (the first call included)."""
        return self._groups > 1 or self.first_call

    # -- what explain prints -------------------------------------------------------------------
    def describe(self) -> list[str]:
        """One line per entry, oldest first: its modes, whether the module holds it, and why
        it was made."""
        lines = []
        for entry in self.entries:
            modes = " and ".join(mode_name(m) for m in sorted(entry.modes, reverse=True))
            mark = ", held" if entry is self.held else ""
            lines.append(f"{modes} mode{'s' if len(entry.modes) == 2 else ''}, group "
                         f"{entry.group}{mark}: {entry.why}")
        if self.methods is not None:
            lines.extend(self.methods.describe())
        return lines

    # -- copies --------------------------------------------------------------------------------
    def relink(self, gm: fx.GraphModule) -> None:
        """Make every entry read ``gm``'s tensors again after ``gm`` was rebuilt
        (``copy.deepcopy`` builds the copy's dicts afresh)."""
        for entry in self.entries:
            if entry.holder is not None:
                relink_graph(gm, entry.holder)

    def __deepcopy__(self, memo: dict[int, Any]) -> GraphCache:
        new = object.__new__(GraphCache)
        memo[id(self)] = new
        for key, value in self.__dict__.items():
            new.__dict__[key] = copy.deepcopy(value, memo) if key != "stamp" else value
        return new

    def __reduce__(self) -> Any:
        return (_no_cache, ())


def _no_cache() -> None:
    return None


def _refuse_switch_while_tracing(training: bool) -> None:
    if tracing():
        name = mode_name(training)
        raise AmpRewriteError(
            f"this converted module was switched to {name} mode inside torch.compile, "
            f"torch.export or a fake/proxy tensor mode, but its {name}-mode graph is captured "
            f"the first time the module is switched to {name} mode, which cannot happen while "
            f"tracing. Call gm.{name}() once outside the compiled or traced region first "
            "(switching back and forth after that is cheap and works anywhere).")


class RefitFailed(Exception):
    """The model could not be captured for a call's inputs (most often: the model itself
    does not take them); the call raises what does not fit, with this as a note."""

    def __init__(self, cause: BaseException) -> None:
        first = str(cause).splitlines()[0] if str(cause) else ""
        super().__init__(f"{type(cause).__name__}: {first}")
