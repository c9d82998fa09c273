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
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from typing import Iterator

__all__ = ["CAPTURE_LOGGERS", "quiet_capture_logs"]

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
