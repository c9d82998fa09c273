"""Low-precision working copies of fp32 master weights (``opt_level="O2"``).

An O2 module computes with fp16/bf16 weights while the fp32 master weights stay its
parameters (shared with the user's model). The forward's weight read names them::

    weights = _amp_weights.fetch(('fc1.weight', torch.float16, 'low copy'), ...,
                                 store = _amp_low_copies)

and :meth:`LowPrecisionCopies.get_many` returns the stored low-precision copies. The copy is
*stored*, not cast per forward (what O2 means: weights held in low precision), and is
refreshed from the master after each optimizer step by :class:`amprewrite.MasterWeights`, or
lazily when the master was changed in place (``load_state_dict``, an in-place update:
``_version`` moves). Besides, outside :func:`amprewrite.cache_weights` every forward rewrites
the copies from their masters before reading them (one ``torch._foreach_copy_`` through their
``.data``, which moves no version counter: :mod:`.weight_cache` says why), so masters changed
in ways no counter sees (``p.data.mul_``, a fused optimizer that no ``MasterWeights`` binds)
are followed too; inside it, copies are reused while the checks of :mod:`.weight_cache` hold.

Gradients: the copy of a master that requires grad is made *with* autograd, when it is
first stored (``master.to(dtype)`` in grad mode), so it carries a ``ToCopyBackward`` node whose
backward hands its low-precision gradient to the master converted to fp32, and autograd
accumulates it in fp32 in ``master.grad``: micro-batches of gradient accumulation sum in
fp32, ``GradScaler.unscale_`` and clipping see fp32 gradients, and
``torch.autograd.grad(loss, gm.parameters())`` works as usual. That node saves no tensor, so
every forward can backpropagate through it; a forward adds nothing for the weights, neither a
cast nor an autograd node.

Refresh: a step makes the copies of its masters stale (:meth:`LowPrecisionCopies.mark_stepped`,
from :class:`amprewrite.MasterWeights`' post-step hook), and the next forward brings them up to
date: outside :func:`amprewrite.cache_weights` by the rewrite every forward makes anyway, inside
it because the count of optimizer steps moved (:meth:`LowPrecisionCopies.refresh`, one
``torch._foreach_copy_`` for all). So a training step casts each weight once, not once in the
step and again in the forward. Copies are rewritten *in place* and keep their autograd nodes.
Like the fp32 parameters that the optimizer updates in place, a copy that a graph saved for
backward moves to a new version at the step, and a backward through a graph recorded before
the step fails with autograd's "modified by an inplace operation" error, exactly as it would
in fp32 training; the usual order (forward, backward, step) is unaffected.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.fx.experimental.proxy_tensor import get_proxy_mode

from ..errors import AmpRewriteError
from .optimizer_steps import steps_taken
from .weight_cache import cast_batch, rewrite_copies

__all__ = ["LowPrecisionCopies", "LOW_COPIES_ATTR"]

LOW_COPIES_ATTR = "_amp_low_copies"


class _Entry:
    """One master's copy, and the master's state (version, storage, shape, autograd role) it
    was made from."""

    __slots__ = ("master", "version", "data_ptr", "shape", "requires_grad", "copy", "alias")

    def __init__(self, master: torch.Tensor, copy: torch.Tensor) -> None:
        self.master = weakref.ref(master)
        self.version = master._version
        self.data_ptr = master.data_ptr()
        self.shape = master.shape
        self.requires_grad = master.requires_grad
        self.copy = copy
        self.alias = copy.data
        """What the rewrite of each forward writes through (module docstring)."""

    def fits(self, master: torch.Tensor) -> bool:
        """Whether the copy can be rewritten in place from ``master``: same storage, shape and
        autograd role (a remade parameter, ``p.data = t`` or ``requires_grad_`` need a new one)."""
        return (self.data_ptr == master.data_ptr() and self.shape == master.shape
                and self.requires_grad == master.requires_grad)


def _tracing(master: torch.Tensor) -> bool:
    # Fake-tensor propagation at conversion time and tracers must see a plain cast, and must
    # not leave fake copies in the store.
    if isinstance(master, torch._subclasses.FakeTensor) or torch._is_functional_tensor(master):
        return True
    # NB: a fake mode is looked up in its dispatch-mode slot (0.1 µs), not with
    # torch._guards.detect_fake_mode (5 µs, once per O2 forward): a tracing context's fake
    # mode matters only while a compiler traces, which get_many checks first.
    return get_proxy_mode() is not None or \
        torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE) is not None


_UNBOUND = (
    "an opt_level='O2' module ran a forward that needs gradients, but no optimizer is bound to "
    "its fp32 master weights, so its low-precision copies would not follow the optimizer's "
    "updates (fused optimizers update in place without telling autograd). Bind it before "
    "training: masters = amprewrite.MasterWeights(gm, optimizer); or run under "
    "torch.no_grad() for inference.")


class LowPrecisionCopies:
    """The low-precision copies of one O2 GraphModule's master weights."""

    def __init__(self) -> None:
        self._entries: dict[tuple[int, torch.dtype], _Entry] = {}
        self.bindings = 0
        """How many :class:`amprewrite.MasterWeights` refresh these copies after steps."""
        self.kept = 0
        """How many :func:`amprewrite.cache_weights` regions are open over these copies."""
        self.steps = -1
        """The optimizer step count the copies were last brought up to date for (-1: never)."""

    def get(self, master: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The copy of ``master`` in ``dtype``; tracked back to ``master`` in grad mode."""
        if master.dtype == dtype or _tracing(master):
            return master.to(dtype)
        if master.requires_grad and torch.is_grad_enabled() and self.bindings == 0:
            raise AmpRewriteError(_UNBOUND)
        return self._current(master, dtype)

    def get_many(self, masters: list[torch.Tensor], dtype: torch.dtype) -> list[torch.Tensor]:
        """:meth:`get` for many masters at once."""
        if torch.compiler.is_compiling():
            # A compiler sees plain casts (the same values: copies are the masters cast),
            # which it can fuse; the store's Python bookkeeping would break its graph.
            return [m.to(dtype) for m in masters]
        # NB: tracing is a property of the call, not of a master: checked once (it looks at
        # the dispatch mode stack, which costs microseconds).
        if masters and _tracing(masters[0]):
            return [self.get(m, dtype) for m in masters]
        if self.bindings == 0 and torch.is_grad_enabled() and \
                any(m.requires_grad and m.dtype != dtype for m in masters):
            raise AmpRewriteError(_UNBOUND)
        return self._current_many(masters, dtype, every=True)

    def _current_many(self, masters: list[torch.Tensor], dtype: torch.dtype,
                      every: bool = False) -> list[torch.Tensor]:
        """:meth:`_current` of each master; the stale ones are brought up to date together.

        ``every``: ``masters`` are all the masters that the module's forward reads in
        ``dtype`` (the weight table's call), so a copy of any other master in ``dtype`` is one
        of a parameter the forward no longer reads (:meth:`_forget_unread`)."""
        kept = self.kept
        if kept and self.steps != steps_taken():
            self.refresh()  # an optimizer stepped since (fused ones move no version counter)
        out: list[Any] = []
        stale = []
        aliases: list[torch.Tensor] = []
        sources: list[torch.Tensor] = []
        for i, master in enumerate(masters):
            key = (id(master), dtype)
            entry = self._entries.get(key)
            # NB: _Entry.fits and the version check, inlined: this runs for every weight of
            # every forward.
            if (entry is not None and entry.master() is master
                    and entry.version == master._version
                    and entry.data_ptr == master.data_ptr()
                    and entry.requires_grad == master.requires_grad):
                out.append(entry.copy)
                if not kept:
                    aliases.append(entry.alias)
                    sources.append(master)
            elif master.dtype == dtype:
                out.append(master)  # already low precision: it is its own copy, never stored
            else:
                out.append(None)
                stale.append((i, key, entry if entry is not None and entry.master() is master
                               else None, master))
        if aliases:
            rewrite_copies(aliases, sources)
        if stale:
            self._update([(key, entry, master) for _, key, entry, master in stale])
            for i, key, _, _ in stale:
                out[i] = self._entries[key].copy
            if every and any(entry is None for _, _, entry, _ in stale):
                self._forget_unread(masters, dtype)
        return out

    def _forget_unread(self, masters: list[torch.Tensor], dtype: torch.dtype) -> None:
        """Drop the copies in ``dtype`` of masters other than ``masters``.

        Run when the forward reads a master that has no copy yet: first use, or a replaced
        parameter (``module.weight = nn.Parameter(...)``). The copy of a trained master keeps
        that master alive (its ``ToCopyBackward`` node leads to the master's
        ``AccumulateGrad``, which holds it), so its entry would never see the master die: a
        replaced parameter would stay in memory with its copy for the module's lifetime."""
        read = {id(m) for m in masters}
        unread = [key for key in self._entries if key[1] == dtype and key[0] not in read]
        for key in unread:
            del self._entries[key]

    def _current(self, master: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return self._current_many([master], dtype)[0]

    def _store_many(self, items: list[tuple[tuple[int, torch.dtype], torch.Tensor]]) -> None:
        """Make new copies of ``(key, master)`` pairs (first use, or a master that changed
        storage, shape or ``requires_grad``)."""
        with torch.inference_mode(False):
            # Copies of trained masters carry their cast's autograd node (module docstring),
            # made one by one: a batched cast would put a cat and a view per weight between
            # copy and master, and each view's backward would fill a whole flat buffer.
            with torch.enable_grad():
                made = [(key, m, m.to(key[1])) for key, m in items if m.requires_grad]
            with torch.no_grad():
                for dtype in {key[1] for key, m in items if not m.requires_grad}:
                    group = [(key, m) for key, m in items
                             if key[1] == dtype and not m.requires_grad]
                    copies = cast_batch([m for _, m in group], dtype)
                    made += [(key, m, c) for (key, m), c in zip(group, copies)]
        for key, master, copy in made:
            self._entries[key] = _Entry(master, copy)

    def mark_stepped(self, masters: list[torch.Tensor]) -> None:
        """An optimizer has just updated ``masters``: their copies are stale, and the next
        forward brings them up to date (outside :func:`amprewrite.cache_weights` every forward
        rewrites its copies anyway; inside, the step count it checks has moved). Nothing is
        copied now: a copy here and another in the forward would cast every weight twice per
        step. The copies' version counters move now, as the masters' do, so a backward through
        a graph recorded before the step raises autograd's "modified by an inplace operation"
        error, as in fp32 training."""
        wanted = {id(m) for m in masters}
        torch.autograd.graph.increment_version(
            [entry.copy for key, entry in self._entries.items() if key[0] in wanted])

    def refresh(self) -> None:
        """Recompute every copy from its master's current value, whatever the version
        counters say (one batched copy), and count the steps taken so far as seen."""
        self.steps = steps_taken()
        stale = []
        for key, entry in list(self._entries.items()):
            master = entry.master()
            if master is None:
                del self._entries[key]
            else:
                stale.append((key, entry, master))
        self._update(stale)

    @staticmethod
    def _rewrite(entries: list[_Entry], copies: list[torch.Tensor],
                 sources: list[torch.Tensor]) -> None:
        """Copy each source into its entry's copy in place, in one batched copy."""
        if torch.is_inference_mode_enabled():
            with torch.inference_mode(False):
                LowPrecisionCopies._rewrite(entries, copies, sources)
            return
        rewrite_copies(copies, sources)  # NB: the copies themselves: their versions move
        for entry, master in zip(entries, sources):
            entry.version = master._version

    def _update(self, items: list[tuple[tuple[int, torch.dtype], _Entry | None, torch.Tensor]]
                ) -> None:
        """Bring the copies of ``(key, entry, master)`` triples up to date (``entry``: the
        stored one, None if there is none): rewritten in place by one batched copy where they
        fit (module docstring), made anew where not."""
        rewrite: list[_Entry] = []
        sources: list[torch.Tensor] = []
        remake = []
        for key, entry, master in items:
            if entry is not None and entry.fits(master):
                rewrite.append(entry)
                sources.append(master)
            else:
                remake.append((key, master))
        if rewrite:
            self._rewrite(rewrite, [e.copy for e in rewrite], sources)
        if remake:
            self._store_many(remake)

    def copies(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """``(master, copy)`` pairs currently stored."""
        out = []
        for entry in self._entries.values():
            master = entry.master()
            if master is not None:
                out.append((master, entry.copy))
        return out

    def nbytes(self) -> int:
        return sum(e.copy.numel() * e.copy.element_size() for e in self._entries.values())

    # A copy of the module starts with no copies and no bound optimizer of its own.
    def __deepcopy__(self, memo: dict) -> "LowPrecisionCopies":
        return LowPrecisionCopies()

    def __reduce__(self) -> Any:
        return (LowPrecisionCopies, ())
