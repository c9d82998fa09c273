"""The one exception type amprewrite raises for problems it detects in a model or a graph."""

from __future__ import annotations

__all__ = ["AmpRewriteError"]


class AmpRewriteError(RuntimeError):
    """A model, graph or configuration that amprewrite cannot convert as asked.

    Raised when correctness is at stake (an op the policy bans, a graph the tracer cannot
    capture). The message names what was passed, where, what was expected, and how to fix it.
    Bad arguments to public functions raise ``TypeError`` / ``ValueError`` instead.
    """
