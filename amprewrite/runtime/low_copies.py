"""Low-precision working copies of fp32 master weights (``opt_level="O2"``).

An O2 module computes with fp16/bf16 weights while the fp32 master weights stay its
parameters (shared with the user's model). The forward's weight read names them (entries
``('fc1.weight', torch.float16, 'low copy')`` of the weight table)::

    (fc1_weight_f16,   # f16[16, 8] stored copy (O2)
     ...
    ) = self._amp_weights.fetch(store=self._amp_low_copies)

and :meth:`LowPrecisionCopies.get_many` returns the stored low-precision copies. The copy is
*stored*, not cast per forward (what O2 means: weights held in low precision).

Staleness: a copy is rewritten only after its master was written. Each forward's read
compares the masters with what the last read handed over (their ids, version counters,
storage addresses and ``requires_grad``: four list comparisons, no check per weight) and
checks the process-wide count of ``torch.optim`` steps (:mod:`.optimizer_steps`: fused
optimizers move no version counter). So with nothing written, a forward neither casts nor
copies a weight, as O3's; an in-place write (``load_state_dict``, ``p.mul_`` under
``no_grad``, an optimizer step) rewrites the copy in place, new storage (``model.to``,
``p.data = t``) or a replaced parameter makes a new one. A step rewrites only the copies of
masters that require grad (an optimizer skips parameters without gradients: a LoRA model's
frozen base weights are not copied again at every step), all in one
``torch._foreach_copy_``. A write through ``.data`` (``p.data.mul_``) moves no counter and is
not seen: :meth:`LowPrecisionCopies.refresh` (``MasterWeights.refresh``,
``amprewrite.clear_weight_cache``) rewrites every copy.

Gradients: the copy of a master that requires grad is made *with* autograd, when it is
first stored (``master.to(dtype)`` in grad mode), so it carries a ``ToCopyBackward`` node whose
backward hands its low-precision gradient to the master converted to fp32, and autograd
accumulates it in fp32 in ``master.grad``: micro-batches of gradient accumulation sum in
fp32, ``GradScaler.unscale_`` and clipping see fp32 gradients, and
``torch.autograd.grad(loss, gm.parameters())`` works as usual. That node saves no tensor, so
every forward can backpropagate through it; a forward adds nothing for the weights, neither a
cast nor an autograd node.

Refresh: a step makes the copies of its masters stale (:meth:`LowPrecisionCopies.mark_stepped`,
from :class:`amprewrite.MasterWeights`' post-step hook, moves their version counters), and the
next forward brings them up to date because the step count moved. So a training step casts
each weight once, not once in the step and again in the forward. Copies are rewritten *in
place* and keep their autograd nodes. Like the fp32 parameters that the optimizer updates in
place, a copy that a graph saved for backward moves to a new version at the step, and a
backward through a graph recorded before the step fails with autograd's "modified by an
inplace operation" error, exactly as it would in fp32 training; the usual order (forward,
backward, step) is unaffected.
"""

from __future__ import annotations

import weakref
from typing import Any, NamedTuple

import torch

from ..errors import AmpRewriteError
from .optimizer_steps import count_steps, steps_taken
from .tracing import tracing
from .weight_cache import cast_batch, rewrite_copies

__all__ = ["LowPrecisionCopies", "LOW_COPIES_ATTR"]

LOW_COPIES_ATTR = "_amp_low_copies"


class _Entry:
    """One master's copy, and the master's state (version, storage, shape, autograd role) it
    was made from."""

    __slots__ = ("master", "version", "data_ptr", "shape", "requires_grad", "copy")

    def __init__(self, master: torch.Tensor, copy: torch.Tensor, on_death: Any) -> None:
        self.master = weakref.ref(master, on_death)
        self.version = master._version
        self.data_ptr = master.data_ptr()
        self.shape = master.shape
        self.requires_grad = master.requires_grad
        self.copy = copy

    def fits(self, master: torch.Tensor) -> bool:
        """Whether the copy can be rewritten in place from ``master``: same storage, shape and
        autograd role (a remade parameter, ``p.data = t`` or ``requires_grad_`` need a new one)."""
        return (self.data_ptr == master.data_ptr() and self.shape == master.shape
                and self.requires_grad == master.requires_grad)


_UNBOUND = (
    "an opt_level='O2' module ran a forward that needs gradients, but no optimizer is bound to "
    "its fp32 master weights, so its low-precision copies would not follow the optimizer's "
    "updates (fused optimizers update in place without telling autograd). Bind it before "
    "training: masters = amprewrite.MasterWeights(gm, optimizer); or run under "
    "torch.no_grad() for inference.")


class _Copies(torch.autograd.Function):
    """``[m.to(dtype) for m in masters]`` as one autograd node: its backward hands all the
    low-precision gradients to their fp32 masters in one ``torch._foreach_copy_`` (one
    multi-tensor kernel on a GPU) instead of one cast node, and one launch, per weight.

    It saves no tensor, so every forward may backpropagate through it, as through a cast.
    Autograd runs it when the gradients of all its copies are complete: it is older than
    every node of a forward, so it runs at the end of backward, as the casts it replaces did.
    A copy a forward does not use gets no gradient (None, not zeros), and neither does its
    master."""

    @staticmethod
    def forward(ctx: Any, dtype: torch.dtype, *masters: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.set_materialize_grads(False)
        ctx.dtypes = [m.dtype for m in masters]
        return tuple(m.to(dtype) for m in masters)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        if torch.is_grad_enabled():  # create_graph=True: a cast autograd can differentiate
            return (None, *(None if g is None else g.to(d) for g, d in zip(grads, ctx.dtypes)))
        outs: list[torch.Tensor | None] = [None] * len(grads)
        sources = []
        for i, (g, d) in enumerate(zip(grads, ctx.dtypes)):
            if g is not None:
                outs[i] = torch.empty_like(g, dtype=d)
                sources.append(g)
        if sources:
            torch._foreach_copy_([o for o in outs if o is not None], sources)
        return (None, *outs)


class _Handed(NamedTuple):
    """The copies one forward's read handed over, and the state of the masters they were
    handed for: while that state holds, the next read hands the same copies."""

    ids: list[int]
    versions: list[int]
    data_ptrs: list[int]
    grads: list[bool]
    copies: list[torch.Tensor]
    """The list the read returned, returned again: callers read it, never modify it."""


class LowPrecisionCopies:
    """The low-precision copies of one O2 GraphModule's master weights."""

    def __init__(self) -> None:
        self._entries: dict[tuple[int, torch.dtype], _Entry] = {}
        self._handed: dict[torch.dtype, _Handed] = {}
        """What the last read of each dtype handed over; dropped whenever an entry is made,
        remade or dropped, and when a master dies (its id may go to another tensor)."""
        self.bindings = 0
        """How many :class:`amprewrite.MasterWeights` are bound to these copies' masters."""
        self._trained: list[torch.Tensor] | None = None
        """The copies of masters that require grad, for :meth:`mark_stepped`; None: to be
        listed again (entries changed)."""
        count_steps()
        self.steps = steps_taken()
        """The optimizer step count the copies were last brought up to date for."""
        # NB: a weakref callback that holds the store weakly: no reference cycle.
        self_ref = weakref.ref(self)

        def forget_handed(_: weakref.ref) -> None:
            store = self_ref()
            if store is not None:
                store._changed()

        self._on_death = forget_handed

    def get(self, master: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The copy of ``master`` in ``dtype``; tracked back to ``master`` in grad mode."""
        if master.dtype == dtype or tracing(master):
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
        if masters and tracing(masters[0]):
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
        if self.steps != steps_taken():
            # an optimizer stepped since (fused ones move no version counter)
            self._refresh(trained_only=True)
        handed = self._handed.get(dtype)
        # The same masters as last time (a master that died dropped the record, so equal ids
        # are the same tensors), none written in place, given new storage or another
        # autograd role: the same copies, after four list comparisons instead of a check
        # per master (module docstring, "Staleness").
        if handed is not None and handed.ids == list(map(id, masters)) and \
                handed.versions == [m._version for m in masters] and \
                handed.data_ptrs == [m.data_ptr() for m in masters] and \
                handed.grads == [m.requires_grad for m in masters]:
            return handed.copies
        out: list[Any] = []
        stale = []
        for i, master in enumerate(masters):
            key = (id(master), dtype)
            entry = self._entries.get(key)
            # NB: _Entry.fits and the version check, inlined: this runs for every weight of
            # a forward whose masters changed.
            if (entry is not None and entry.master() is master
                    and entry.version == master._version
                    and entry.data_ptr == master.data_ptr()
                    and entry.requires_grad == master.requires_grad):
                out.append(entry.copy)
            elif master.dtype == dtype:
                out.append(master)  # already low precision: it is its own copy, never stored
            else:
                out.append(None)
                stale.append((i, key, entry if entry is not None and entry.master() is master
                               else None, master))
        if stale:
            if every and any(entry is None for _, _, entry, _ in stale):
                self._forget_unread(masters, dtype)
            self._update([(key, entry, master) for _, key, entry, master in stale])
            # NB: every copy read again: a new trained copy remakes its dtype's others too
            # (:meth:`_trained_group`)
            entries = self._entries
            out = [m if m.dtype == dtype else entries[(id(m), dtype)].copy for m in masters]
        if every:
            self._remember(masters, dtype, out)
        return out

    def _remember(self, masters: list[torch.Tensor], dtype: torch.dtype,
                  copies: list[torch.Tensor]) -> None:
        """Keep what the forward's read of ``masters`` handed over, for the next read's
        list comparisons. Not kept where a master is its own copy (already in ``dtype``):
        the record must hold no master alive."""
        if any(c is m for c, m in zip(copies, masters)):
            self._handed.pop(dtype, None)
            return
        self._handed[dtype] = _Handed(list(map(id, masters)), [m._version for m in masters],
                                      [m.data_ptr() for m in masters],
                                      [m.requires_grad for m in masters], copies)

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
        self._changed()

    def _current(self, master: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return self._current_many([master], dtype)[0]

    def _store_many(self, items: list[tuple[tuple[int, torch.dtype], torch.Tensor]]) -> None:
        """Make new copies of ``(key, master)`` pairs (first use, or a master that changed
        storage, shape or ``requires_grad``)."""
        with torch.inference_mode(False):
            # Copies of trained masters carry one autograd node per dtype (:class:`_Copies`):
            # not a batched cast, which would put a cat and a view per weight between copy
            # and master, and each view's backward would fill a whole flat buffer.
            made = []
            with torch.enable_grad():
                for dtype in {key[1] for key, m in items if m.requires_grad}:
                    group = self._trained_group(dtype, items)
                    copies = _Copies.apply(dtype, *(m for _, m in group))
                    made += [(key, m, c) for (key, m), c in zip(group, copies)]
            with torch.no_grad():
                for dtype in {key[1] for key, m in items if not m.requires_grad}:
                    group = [(key, m) for key, m in items
                             if key[1] == dtype and not m.requires_grad]
                    copies = cast_batch([m for _, m in group], dtype)
                    made += [(key, m, c) for (key, m), c in zip(group, copies)]
        for key, master, copy in made:
            self._entries[key] = _Entry(master, copy, self._on_death)
        self._changed()

    def _trained_group(self, dtype: torch.dtype,
                       items: list[tuple[tuple[int, torch.dtype], torch.Tensor]]
                       ) -> list[tuple[tuple[int, torch.dtype], torch.Tensor]]:
        """The trained masters whose copies in ``dtype`` one new :class:`_Copies` node makes:
        those of ``items``, and every trained master already stored in ``dtype``, made again.

        Why all: the node holds every master it was made from (through their
        ``AccumulateGrad`` nodes), so a copy made next to the old ones would leave the old
        node, and a replaced parameter it holds, alive for as long as the other copies live.
        Made again, the old copies and their node go with the graphs that still use them
        (:meth:`_forget_unread` dropped the masters no longer read before)."""
        new = [(key, m) for key, m in items if key[1] == dtype and m.requires_grad]
        making = {key for key, _ in new}
        for key, entry in self._entries.items():
            master = entry.master()
            if key[1] == dtype and key not in making and master is not None and \
                    master.requires_grad and entry.copy.grad_fn is not None:
                new.append((key, master))
        return new

    def mark_stepped(self) -> None:
        """An optimizer has just updated the masters: the copies of trained masters are
        stale, and the next forward brings them up to date (the step count it checks has
        moved). Nothing is copied now: a copy here and another in the forward would cast every
        weight twice per step. The copies' version counters move now, as the masters' do, so
        a backward through a graph recorded before the step raises autograd's "modified by an
        inplace operation" error, as in fp32 training. One call for all copies, from a list
        kept between steps: no per-parameter Python on the step's path."""
        if self._trained is None:
            self._trained = [e.copy for e in self._entries.values() if e.requires_grad]
        torch.autograd.graph.increment_version(self._trained)

    def refresh(self) -> None:
        """Recompute every copy from its master's current value, whatever the version
        counters say (one batched copy), and count the steps taken so far as seen."""
        self._refresh(trained_only=False)

    def _refresh(self, trained_only: bool) -> None:
        """:meth:`refresh`, or after optimizer steps (``trained_only``) only the copies of
        masters that require grad: an optimizer updates only parameters that have gradients,
        so the copies of frozen masters (a LoRA model's base weights) are not rewritten at
        every step; their in-place changes move version counters, which each forward checks."""
        self.steps = steps_taken()
        stale = []
        for key, entry in list(self._entries.items()):
            if trained_only and not entry.requires_grad:
                continue
            master = entry.master()
            if master is None:
                del self._entries[key]
                self._changed()
            else:
                stale.append((key, entry, master))
        self._update(stale)

    def release(self) -> None:
        """Drop every copy (the next forward makes them anew, from its masters): for a module
        whose masters exist in full only during its own forward and backward (FSDP2 gathers
        them before and frees them after), so that its copies are not held between steps
        either. A copy a graph saved for backward lives on until that backward."""
        if self._entries:
            self._entries.clear()
            self._changed()

    def _changed(self) -> None:
        """Entries were made, remade or dropped: the lists kept from them go."""
        self._handed.clear()
        self._trained = None

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
