"""The one exception type amprewrite raises for problems it detects in a model or a graph."""

from __future__ import annotations

__all__ = ["AmpRewriteError", "RecaptureWarning"]


class AmpRewriteError(RuntimeError):
    """A model, graph or configuration that amprewrite cannot convert as asked.

    Raised when correctness is at stake (an op the policy bans, a graph the tracer cannot
    capture). The message names what was passed, where, what was expected, and how to fix it.
    Bad arguments to public functions raise ``TypeError`` / ``ValueError`` instead.
    """


class RecaptureWarning(UserWarning):
    """A converted module captured its model again at a call: the model's state changed, or a
    call's inputs differ from every graph's (another size, dtype or Python scalar).

    The one channel for recaptures: ``warnings.filterwarnings("ignore",
    category=amprewrite.RecaptureWarning)`` silences them, ``"error"`` makes each one an
    exception (``convert(..., on_change="raise")`` refuses state changes outright).
    """
