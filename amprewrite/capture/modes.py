"""Both training modes of a converted module: one graph per mode, one set of tensors.

A capture runs the model's Python once and records the mode it ran in: ``torch.export``
records dropout with ``train=True`` or no dropout at all, batch norm with batch statistics
and running-stat updates or with the running statistics, and the branch of every
``if self.training:``; the symbolic tracer does the same for the code it traces through (it
keeps BatchNorm and Dropout as modules, which follow the flag, but not
``F.dropout(x, p, self.training)`` or a branch). So a converted module needs a graph for each
mode it runs in.

**Lazily.** ``convert`` captures the mode the model is in; the other mode is *pending*
(:class:`PendingMode`, which keeps what ``convert`` was given: the model, the example inputs,
the policy and options) and is captured the first time ``gm.train(mode)`` / ``gm.eval()``
switches to it (:func:`captured_mode`), with the model's flags set to that mode for the
capture and put back after. Conversion costs one capture; a module never switched pays
nothing more. A capture cannot run inside ``torch.compile``, ``torch.export`` or a fake or
proxy tensor mode: a switch there to a pending mode raises, asking for one switch outside.

The other mode's graph is a second converted GraphModule, its *sibling*, held in a plain
attribute (:data:`MODES_ATTR`), not as a child: the ``state_dict`` keys, ``named_modules()``
and ``parameters()`` are the ones a single graph has. The sibling reads every tensor from the
returned module: its root ``_parameters`` / ``_buffers`` dicts (and hook dicts) are the
returned module's own dict objects and its children are the returned module's children
(:func:`share_state`), so ``.to()``, ``load_state_dict`` and an optimizer's steps reach both
graphs, and so do the cached weight casts and O2's low-precision copies
(:func:`share_runtime`). Only what belongs to one graph is its own (:data:`_GRAPH_ATTRS`:
the graph, its code, its ``meta``, its weight table; torch.export's input check, the
sub-graphs of higher-order ops).

**Switching.** ``gm.train(mode)`` / ``gm.eval()`` exchange the two modules' own parts
(:func:`switch_graph`, a few dict writes, only when the mode changes), so the module *is* the
graph of its mode for everything that reads it: its call, ``gm.graph`` and ``gm.code``,
``torch.export.export(gm)`` (which interprets ``gm.graph`` and never calls ``gm``),
``explain`` and the auditor. Its call checks the mode once more (one tuple index), for a
flag set without ``train()``.

Where the two captures record the same code (a model without mode-dependent ops, or
symbolic capture of one whose only such ops are BatchNorm and Dropout modules) no sibling is
kept. Where the other mode cannot be captured, the switch warns and the sibling is a graph
that raises, naming the mode and the fix (:func:`not_captured_graph`), whether the module is
called, compiled or exported in that mode.
"""

from __future__ import annotations

import contextlib
import copy
import itertools
from typing import Any, Iterator

import torch
import torch.fx as fx
import torch.nn as nn

from ..errors import AmpRewriteError
from ..runtime.low_copies import LOW_COPIES_ATTR
from ..runtime.tracing import tracing
from ..runtime.weight_cache import CACHE_ATTR
from ..runtime.weight_table import WEIGHTS_ATTR, WeightTable
from .guards import InputGuards

__all__ = ["MODES_ATTR", "MODE_KEY", "NOT_CAPTURED_KEY", "PendingMode", "not_captured_graph",
           "in_mode", "mode_name", "share_state", "share_runtime", "attach_modes",
           "mode_graphs", "pending_mode", "captured_mode", "switch_graph", "exchange_graphs",
           "FORWARD_ATTR",
           "relink_modes", "share_root_state"]

MODES_ATTR = "_amp_by_mode"
"""``gm.__dict__[MODES_ATTR]``: ``(eval, train)``, what a call in each mode runs: None for
the module's own graph (or one graph serving both modes), a sibling GraphModule (whose
``meta[NOT_CAPTURED_KEY]`` says if it raises), or a :class:`PendingMode` not captured yet."""

MODE_KEY = "amprewrite_training"
"""``gm.meta[MODE_KEY]``: the mode (``model.training``) the graph was captured in."""

NOT_CAPTURED_KEY = "amprewrite_not_captured"
"""``gm.meta[NOT_CAPTURED_KEY]``: why the model could not be captured in this graph's mode
(the graph raises)."""

FORWARD_ATTR = "_amp_forward"
"""``gm.__dict__[FORWARD_ATTR]``: the generated forward of the graph ``gm`` holds, which the
class's ``forward`` calls (:func:`amprewrite.capture.calling.finish`)."""

_GRAPH_ATTRS = ("_graph", "_code", "_lineno_map", "_prologue_start", "meta", "_in_spec",
                "_out_spec", "_tracer_cls", "_tracer_extras", WEIGHTS_ATTR, FORWARD_ATTR)
"""What :func:`switch_graph` exchanges: one graph's own instance attributes."""

_SHARED_DICTS = ("_parameters", "_buffers", "_non_persistent_buffers_set",
                 "_forward_hooks", "_forward_hooks_with_kwargs", "_forward_hooks_always_called",
                 "_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_backward_hooks",
                 "_backward_pre_hooks", "_state_dict_hooks", "_state_dict_pre_hooks",
                 "_load_state_dict_pre_hooks", "_load_state_dict_post_hooks")
"""What the sibling shares with the returned module: its root tensors, and the hooks a user
or a library registers on the returned module (they run in either mode)."""


def mode_name(training: bool) -> str:
    return "train" if training else "eval"


def not_captured_message(model_name: str, training: bool, reason: str) -> str:
    mode, back = mode_name(training), "eval" if training else "train"
    return (f"this converted {model_name} was called in {mode} mode, but {model_name} could "
            f"not be captured in {mode} mode ({reason}); running its {back}-mode "
            f"graph instead would silently compute the other mode. Call gm.{back}() to run "
            f"the {back}-mode graph, make the model's {mode}-mode code capturable (the error "
            "above), or use amprewrite.compile(model), which captures each mode as it runs.")


def mode_not_captured(message: str) -> None:
    """The one op of a mode's graph that could not be captured (:func:`not_captured_graph`)."""
    raise AmpRewriteError(message)


def not_captured_graph(main: fx.GraphModule, training: bool, exc: BaseException | str
                       ) -> fx.GraphModule:
    """The graph of a mode ``main``'s model could not be captured in: the arguments of
    ``main``'s own (its signature, which ``Trainer`` reads), then a call that raises."""
    reason = exc if isinstance(exc, str) else \
        f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    graph = fx.Graph()
    graph._codegen = copy.deepcopy(main.graph._codegen)
    for node in main.graph.find_nodes(op="placeholder"):
        graph.node_copy(node)
    message = not_captured_message(type(main).__name__, training, reason)
    graph.output(graph.call_function(mode_not_captured, (message,)))
    stub = fx.GraphModule(main, graph, class_name=type(main).__name__)
    stub.meta.update({**main.meta, MODE_KEY: training, NOT_CAPTURED_KEY: reason})
    share_state(main, stub)
    return stub


class PendingMode:
    """A mode of a converted module not captured yet: :meth:`capture` captures it."""

    def capture(self, main: fx.GraphModule, training: bool) -> fx.GraphModule | None:
        """The finished graph of ``training`` mode for ``main`` (which holds the other mode's
        graph), reading ``main``'s tensors; None where it is ``main``'s code; a graph that
        raises (:func:`not_captured_graph`), with a warning, where the capture fails."""
        raise NotImplementedError


@contextlib.contextmanager
def in_mode(model: nn.Module, training: bool) -> Iterator[None]:
    """``model`` in ``training`` mode (``model.train(training)``) during the block, every
    module's flag put back after (a model may hold a frozen part in eval mode)."""
    flags = [(m, m.training) for m in model.modules()]
    model.train(training)
    try:
        yield
    finally:
        for module, flag in flags:
            module.training = flag


# ---------------------------------------------------------------------------------------------
# one set of tensors
def share_state(main: fx.GraphModule, other: fx.GraphModule) -> None:
    """Make ``other`` (a fresh capture of the other mode, before its passes) read its tensors
    and submodules from ``main``: the same root dicts, the same children. A tensor or child
    that ``main`` lacks is added to ``main`` (a parameter the other mode alone uses is still
    the model's); a root tensor of the same name but another value (a constant lifted out of
    the other mode's code) is added under a new name, read by ``other``'s graph."""
    share_root_state(main, other, suffix=mode_name(bool(other.meta.get(MODE_KEY))))
    own = {}
    for name, child in other._modules.items():
        held = main._modules.get(name)
        if held is None and _holds_state(child):
            main.add_module(name, child)
        elif held is None or (held is not child and not _merge(held, child)):
            own[name] = child  # a graph's own: its input check, a sub-graph
    other.__dict__["_modules"] = {**main._modules, **own}


def share_root_state(main: fx.GraphModule, other: fx.GraphModule, suffix: str) -> None:
    """Make ``other`` (a fresh capture, before its passes) read its root tensors from
    ``main``'s root dicts, and run ``main``'s root hooks; a root tensor that ``main`` holds
    under the same name with another value is added as ``<name>_<suffix>`` and read by
    ``other``'s graph. Its submodules stay its own."""
    for name, tensor in list(itertools.chain(other._parameters.items(), other._buffers.items())):
        held = main._parameters.get(name, main._buffers.get(name))
        if tensor is None or held is tensor or (held is not None and _same_constant(held, tensor)):
            continue
        if held is None:
            _register(main, name, tensor, name not in other._non_persistent_buffers_set)
            continue
        new = _free_name(main, f"{name}_{suffix}")
        _register(main, new, tensor, False)
        for node in other.graph.find_nodes(op="get_attr", target=name):
            node.target = new
    for attr in _SHARED_DICTS:
        other.__dict__[attr] = main.__dict__[attr]


def share_runtime(main: fx.GraphModule, other: fx.GraphModule) -> None:
    """One cache of weight casts and one store of O2 low-precision copies for both graphs
    (each graph's passes made its own): twice the copies would cost twice the memory."""
    for attr in (CACHE_ATTR, LOW_COPIES_ATTR):
        if attr in main.__dict__ and attr in other.__dict__:
            other.__dict__[attr] = main.__dict__[attr]


def _same_constant(a: torch.Tensor, b: torch.Tensor) -> bool:
    return not isinstance(a, nn.Parameter) and a.dtype == b.dtype and a.device == b.device \
        and a.shape == b.shape and torch.equal(a, b)


def _register(module: nn.Module, name: str, tensor: torch.Tensor, persistent: bool) -> None:
    if isinstance(tensor, nn.Parameter):
        module.register_parameter(name, tensor)
    else:
        module.register_buffer(name, tensor, persistent=persistent)


def _free_name(module: nn.Module, name: str) -> str:
    candidate, i = name, 1
    while hasattr(module, candidate):
        candidate, i = f"{name}_{i}", i + 1
    return candidate


def _holds_state(module: nn.Module) -> bool:
    """A part of the model (it holds parameters or buffers), not one graph's own module."""
    return not isinstance(module, (fx.GraphModule, InputGuards)) and \
        next(itertools.chain(module.parameters(), module.buffers()), None) is not None


def _tensors(module: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    return itertools.chain(module.named_parameters(remove_duplicate=False),
                           module.named_buffers(remove_duplicate=False))


def _merge(held: nn.Module, child: nn.Module) -> bool:
    """Whether ``child`` (the other capture's) is ``held`` (``main``'s) as far as ``child``'s
    graph can tell: the same kind of module, holding the same tensors where both hold one.
    If so, the tensors only ``child`` holds are added to ``held``."""
    if type(held) is not type(child) or not _holds_state(child):
        return False
    held_modules = dict(held.named_modules(remove_duplicate=False))
    if any(name in held_modules and type(held_modules[name]) is not type(sub)
           for name, sub in child.named_modules(remove_duplicate=False)):
        return False
    held_tensors = dict(_tensors(held))
    missing = []
    for name, tensor in _tensors(child):
        if name not in held_tensors:
            missing.append((name, tensor))
        elif held_tensors[name] is not tensor:
            return False
    for name, tensor in missing:
        prefix, _, attr = name.rpartition(".")
        # NB: where a submodule holds the model's own tensor dicts (model_watch), a tensor the
        # other capture found there is already in them: nothing is written.
        owner = held
        for part in prefix.split(".") if prefix else ():
            if part not in owner._modules:
                owner.add_module(part, nn.Module())
            owner = owner._modules[part]
        source = child.get_submodule(prefix)
        _register(owner, attr, tensor, attr not in source._non_persistent_buffers_set)
    return True


# ---------------------------------------------------------------------------------------------
# the modes of a converted module
def attach_modes(main: fx.GraphModule, other: fx.GraphModule | PendingMode | None) -> None:
    """Record what ``main`` runs in its other mode (None: its own graph serves both)."""
    _set_mode(main, not main.meta[MODE_KEY], other)


def _set_mode(gm: fx.GraphModule, training: bool,
              entry: fx.GraphModule | PendingMode | None) -> None:
    by_mode: list[Any] = [None, None]
    by_mode[training] = entry
    gm.__dict__[MODES_ATTR] = tuple(by_mode)
    if isinstance(entry, fx.GraphModule):
        entry.__dict__[MODES_ATTR] = (None, None)
        share_runtime(gm, entry)


def pending_mode(gm: fx.GraphModule) -> bool | None:
    """The mode of ``gm`` not captured yet (it has not been switched to), or None."""
    for training, entry in enumerate(gm.__dict__.get(MODES_ATTR, (None, None))):
        if isinstance(entry, PendingMode):
            return bool(training)
    return None


def captured_mode(gm: fx.GraphModule, training: bool) -> fx.GraphModule | None:
    """What ``gm`` runs in ``training`` mode besides its own graph (``gm.__dict__[MODES_ATTR]``),
    captured now if it was pending (and recorded: it is captured once)."""
    entry = gm.__dict__[MODES_ATTR][training]
    if not isinstance(entry, PendingMode):
        return entry
    _refuse_while_tracing(training)
    other = entry.capture(gm, training)
    _set_mode(gm, training, other)
    return other


def _refuse_while_tracing(training: bool) -> None:
    if tracing():
        name = mode_name(training)
        raise AmpRewriteError(
            f"this converted module was switched to {name} mode inside torch.compile, "
            f"torch.export or a fake/proxy tensor mode, but its {name}-mode graph is captured "
            f"the first time the module is switched to {name} mode, which cannot happen while "
            f"tracing. Call gm.{name}() once outside the compiled or traced region first "
            "(switching back and forth after that is cheap and works anywhere).")


def mode_graphs(gm: fx.GraphModule) -> list[tuple[bool, fx.GraphModule]]:
    """``[(mode, graph), ...]`` of a converted module whose modes run different graphs, the
    graph it holds now first; ``[]`` where one graph serves both modes. A graph with
    ``meta[NOT_CAPTURED_KEY]`` raises."""
    by_mode = gm.__dict__.get(MODES_ATTR, (None, None))
    own = bool(gm.meta.get(MODE_KEY, gm.training))
    other = by_mode[not own]
    return [(own, gm), (not own, other)] if isinstance(other, fx.GraphModule) else []


def switch_graph(gm: fx.GraphModule, training: bool) -> None:
    """Make ``gm`` hold the graph of ``training`` mode, its sibling the other (no-op where
    ``gm`` holds it already or one graph serves both); a pending mode is captured first."""
    other = captured_mode(gm, training)
    if other is None:
        return
    exchange_graphs(gm, other)
    by_mode: list[fx.GraphModule | None] = [None, None]
    by_mode[not training] = other
    gm.__dict__[MODES_ATTR] = tuple(by_mode)


def exchange_graphs(gm: fx.GraphModule, other: fx.GraphModule,
                    extra: tuple[str, ...] = ()) -> None:
    """Exchange what belongs to one graph (:data:`_GRAPH_ATTRS`, its generated forward among
    them, and ``extra``) and the submodules the two do not share, between ``gm`` and
    ``other``. NB: the classes' ``forward`` stay: a bound ``gm.forward`` that a library kept
    (accelerate's autocast wrapper) runs whatever graph ``gm`` holds when it is called."""
    mine, theirs = gm.__dict__, other.__dict__
    owned = tuple(_plain_attrs(gm) | _plain_attrs(other))
    for attr in _GRAPH_ATTRS + extra + owned:
        a, b = mine.pop(attr, _MISSING), theirs.pop(attr, _MISSING)
        if b is not _MISSING:
            mine[attr] = b
        if a is not _MISSING:
            theirs[attr] = a
    for name in set(gm._modules) | set(other._modules):  # the graphs' own modules
        a, b = gm._modules.get(name), other._modules.get(name)
        if a is not b:
            _put(gm._modules, name, b)
            _put(other._modules, name, a)


_MISSING = object()

_RUNTIME_ATTRS = (CACHE_ATTR, LOW_COPIES_ATTR)
"""One per module, whatever graph it holds (:func:`share_runtime`): never exchanged."""


def _plain_attrs(gm: fx.GraphModule) -> set[str]:
    """Plain attributes of ``gm`` its graph reads (a constant a pass stored with ``setattr``):
    the graph's own, exchanged with it."""
    own = gm.__dict__
    return {str(n.target) for n in gm.graph.find_nodes(op="get_attr")
            if "." not in str(n.target) and str(n.target) in own
            and str(n.target) not in _RUNTIME_ATTRS and str(n.target) not in _GRAPH_ATTRS}


def _put(modules: dict[str, Any], name: str, module: Any) -> None:
    if module is None:
        modules.pop(name, None)
    else:
        modules[name] = module


def relink_modes(main: fx.GraphModule) -> None:
    """Share ``main``'s tensors with its sibling again after ``main`` was rebuilt
    (``copy.deepcopy`` builds the copy's dicts afresh), and point both weight tables at the
    rebuilt modules."""
    for entry in main.__dict__.get(MODES_ATTR, ()):
        if not isinstance(entry, fx.GraphModule):
            continue
        own = {k: v for k, v in entry._modules.items() if main._modules.get(k) is not v}
        for attr in _SHARED_DICTS:
            entry.__dict__[attr] = main.__dict__[attr]
        entry.__dict__["_modules"] = {**main._modules, **own}
        share_runtime(main, entry)
        _rebind_table(entry)
    _rebind_table(main)


def _rebind_table(gm: fx.GraphModule) -> None:
    table = gm.__dict__.get(WEIGHTS_ATTR)
    if isinstance(table, WeightTable):
        table.rebind(gm)
