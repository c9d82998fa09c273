"""Captures run alone and outside the caller's modes.

A capture made at a call (a new state, new input sizes, the first call) runs the model's
Python under torch.export's fake tensors, with the model's classes swapped for recording ones
and its parameters replaced by fakes for the duration. Two things must not see that:

* **another thread** calling the same converted module (or the model, through the tensor
  dicts the module shares with it). :data:`CAPTURE_LOCK` is a readers-writer lock: a call runs
  its graph as a reader (many at once), a capture as the writer (alone, after the running
  calls finish). A thread that holds the writer may read (a capture that calls a converted
  submodule), and a reader may capture: it sets its reads aside while it waits and takes
  them back when its capture ends. A read is never upgraded in place: two readers that both
  need a capture (a dynamic batcher's threads, each with a new batch size) would each wait
  for the other's read forever. What a reader looked up before it waited may have changed by
  then: every capture looks again first (another thread may have captured what it needs).
* **the modes active at the call**: the auditor's dispatch mode, a user's
  ``TorchFunctionMode`` or ``TorchDispatchMode``. A capture under them would record fake
  tensors into the audit, or trace the mode's own code, or dead-lock (a dispatch mode seeing
  torch.export's fake tensors). :func:`outside_modes` takes them off the stack for the capture
  and puts them back, so the mode sees the call exactly as it sees an eager one.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Iterator

import torch
from torch.overrides import _get_current_function_mode_stack
from torch.utils._device import DeviceContext
from torch.utils._python_dispatch import _disable_current_modes

__all__ = ["CAPTURE_LOCK", "CaptureLock", "outside_modes"]


class CaptureLock:
    """Many calls, or one capture (module docstring). Re-entrant per thread."""

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._writer: int | None = None
        self._writes = 0
        self._readers: dict[int, int] = {}
        """Thread id -> how many reads it holds."""

    def acquire_read(self) -> None:
        """Before a call runs its graph (a plain method pair, not a context manager: it is
        on every call's path)."""
        me = threading.get_ident()
        with self._cond:
            while self._writer is not None and self._writer != me:
                self._cond.wait()
            self._readers[me] = self._readers.get(me, 0) + 1

    def release_read(self) -> None:
        me = threading.get_ident()
        with self._cond:
            left = self._readers[me] - 1
            if left:
                self._readers[me] = left
            else:
                del self._readers[me]
                self._cond.notify_all()

    def written_here(self) -> bool:
        """Whether this thread holds the lock for a capture now (what runs then is traced,
        not computed: :mod:`.methods` does not count it as the model running eagerly)."""
        return self._writer == threading.get_ident()

    @contextlib.contextmanager
    def writing(self) -> Iterator[None]:
        me = threading.get_ident()
        with self._cond:
            # This thread's reads are set aside, not upgraded (module docstring); a nested
            # write (the writer already) keeps them.
            set_aside = self._readers.pop(me, 0) if self._writer != me else 0
            if set_aside:
                self._cond.notify_all()  # a writer waiting for this read may go first
            try:
                while (self._writer is not None and self._writer != me) or \
                        any(t != me for t in self._readers):
                    self._cond.wait()
            except BaseException:  # interrupted while waiting: the reads are the caller's
                if set_aside:
                    self._readers[me] = self._readers.get(me, 0) + set_aside
                raise
            self._writer = me
            self._writes += 1
        try:
            yield
        finally:
            with self._cond:
                self._writes -= 1
                if not self._writes:
                    self._writer = None
                if set_aside:
                    self._readers[me] = self._readers.get(me, 0) + set_aside
                self._cond.notify_all()


CAPTURE_LOCK = CaptureLock()
"""One for the process: captures of two converted modules of one model swap the same
modules' classes."""


@contextlib.contextmanager
def outside_modes() -> Iterator[None]:
    """Run the block with no ``TorchFunctionMode`` or ``TorchDispatchMode`` active, and put
    back the ones that were (module docstring)."""
    function_modes = _get_current_function_mode_stack()
    # NB: ``with torch.device(...)`` is a function mode too, and one the model's code obeys
    # (where its factories put tensors): it stays.
    kept = [m for m in function_modes if isinstance(m, DeviceContext)]
    with contextlib.ExitStack() as stack:
        for _ in function_modes:
            torch._C._pop_torch_function_stack()
        stack.callback(_push, function_modes)
        _push(kept)
        stack.callback(_pop, len(kept))
        stack.enter_context(_disable_current_modes())
        stack.enter_context(outside_saved_tensors_hooks())
        yield


@contextlib.contextmanager
def outside_saved_tensors_hooks() -> Iterator[None]:
    """Run the block with none of the caller's ``saved_tensors_hooks``: a block captured at
    its first call inside ``torch.utils.checkpoint`` (``checkpoint_wrapper``) would otherwise
    count what the capture computes (its tracing, the proofs of its code's bindings) as
    tensors of the forward, and the recomputation, which does not capture, fails
    checkpoint's check ("a different number of tensors was saved"). NB: torch has no public
    way to set them aside; these are its own push and pop."""
    autograd = torch._C._autograd
    held = []
    while (top := autograd._top_saved_tensors_default_hooks(True)) is not None:
        held.append(top)
        autograd._pop_saved_tensors_default_hooks()
    try:
        yield
    finally:
        for pack, unpack in reversed(held):
            autograd._push_saved_tensors_default_hooks(pack, unpack)


def _push(modes: list) -> None:
    for mode in modes:
        torch._C._push_on_torch_function_stack(mode)


def _pop(count: int) -> None:
    for _ in range(count):
        torch._C._pop_torch_function_stack()
