"""torch's own log records of a capture, kept out of the user's terminal unless they asked.

While ``torch.export`` traces with dynamic dimensions, torch's shape reasoning logs what it
could not do, pages of it: ``symbolic_shapes.py: Failed to reduce inequalities`` with sympy's
tracebacks at WARNING, and fake tensors log every meta kernel that rejects its inputs at
ERROR (a dtype the passes then fix, a symbolic size they then make concrete), and export
reports each dimension of size 1 it specialized in terms of its own ``Dim.AUTO``. None of it is
the user's to act on: a capture that fails raises amprewrite's own error, and a fallback
(static shapes, fp32 tracing) warns in amprewrite's words.

:func:`quiet_capture_logs` drops those loggers' records while a conversion runs, in the
converting thread only (a :class:`logging.Filter` on each logger: other threads log as
before), and not at all where the user configured them: a logger whose level someone set
(``logging.getLogger("torch.fx.experimental.symbolic_shapes").setLevel(...)``,
``torch._logging.set_logs(dynamic=...)``), or any logger when ``TORCH_LOGS`` is set.

One report is no log record: when an export fails on data-dependent control flow
(``if x.sum() > 0:``), torch prints the partial graph it traced straight to ``sys.stderr``,
once per nested wrapper of ``torch.export.export`` and so several times per export, and again
for each export a conversion retries (static sizes, fp32 tracing): about 80 lines before
amprewrite's error. :func:`without_partial_graphs` holds the converting thread's writes to
stderr during one export and passes on all of them but that dump; the error names the
model's line the dump pointed at (:func:`partial_graph_line`).
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import sys
import threading
from typing import Any, Iterator

__all__ = ["CAPTURE_LOGGERS", "quiet_capture_logs", "without_partial_graphs",
           "partial_graph_line"]

CAPTURE_LOGGERS = (
    "torch.fx.experimental.symbolic_shapes",
    "torch.fx.experimental.recording",
    "torch._subclasses.fake_tensor",
    "torch._export.non_strict_utils",  # "dimension ... specialized; Dim.AUTO was specified"
)
"""torch's loggers that report its internal reasoning during a capture."""


class _ThisThread(logging.Filter):
    """Drops the records logged by one thread."""

    def __init__(self) -> None:
        super().__init__()
        self.thread = threading.get_ident()

    def filter(self, record: logging.LogRecord) -> bool:
        return record.thread != self.thread


@contextlib.contextmanager
def quiet_capture_logs() -> Iterator[None]:
    """Drop :data:`CAPTURE_LOGGERS`' records of this thread inside the block, except those of
    loggers the user configured (see the module docstring)."""
    if os.environ.get("TORCH_LOGS"):
        yield
        return
    quiet = [logger for logger in map(logging.getLogger, CAPTURE_LOGGERS)
             if logger.level == logging.NOTSET]
    only_here = _ThisThread()
    for logger in quiet:
        logger.addFilter(only_here)
    try:
        yield
    finally:
        for logger in quiet:
            logger.removeFilter(only_here)


class _HeldStderr(io.TextIOBase):
    """``sys.stderr`` for a block: the writes of one thread are held, those of other threads
    go to the stream it replaced at once."""

    def __init__(self, real: Any) -> None:
        super().__init__()
        self.real = real
        self.thread = threading.get_ident()
        self.held: list[str] = []

    def write(self, text: str) -> int:
        if threading.get_ident() != self.thread:
            return self.real.write(text)
        self.held.append(text)
        return len(text)

    def flush(self) -> None:
        self.real.flush()

    def __getattr__(self, name: str) -> Any:  # encoding, fileno, isatty...: the real one's
        return getattr(self.real, name)


@contextlib.contextmanager
def without_partial_graphs() -> Iterator[None]:
    """Run one ``torch.export.export`` with this thread's stderr held; afterwards write what
    was held, less the partial graph the failed export printed (its exception's
    ``partial_fx_graph``, each time with the newline ``print`` adds). The model's own prints
    come out whole, after the export."""
    if sys.stderr is None:  # pythonw: nothing is printed anyway
        yield
        return
    held = _HeldStderr(sys.stderr)
    sys.stderr = held
    dump: str | None = None
    try:
        yield
    except BaseException as exc:
        dump = getattr(exc, "partial_fx_graph", None)
        raise
    finally:
        if sys.stderr is held:  # NB: else someone replaced it meanwhile: leave theirs
            sys.stderr = held.real
        texts, skip_newline = [], False
        for text in held.held:
            if dump is not None and text == dump:
                skip_newline = True
                continue
            if not (skip_newline and text == "\n"):
                texts.append(text)
            skip_newline = False
        if texts:
            held.real.write("".join(texts))


def partial_graph_line(exc: BaseException) -> str | None:
    """The model's line the partial graph of a failed export last points at
    (``/path/model.py:12 in forward, code: if x.sum() > 0:``), or None."""
    dump = getattr(exc, "partial_fx_graph", None)
    if not isinstance(dump, str):
        return None
    places = [line.strip().removeprefix("# File: ") for line in dump.splitlines()
              if line.strip().startswith("# File: ")]
    return places[-1] if places else None
