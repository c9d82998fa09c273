"""The one exception type amprewrite raises for problems it detects in a model or a graph."""

from __future__ import annotations

import sys
import types
import warnings

import torch

__all__ = ["AmpRewriteError", "RecaptureWarning", "AutocastOverrideWarning", "user_stacklevel",
           "report_recapture"]

_OWN_DIRS = (__file__.rsplit("/", 1)[0] + "/", torch.__file__.rsplit("/", 1)[0] + "/")
"""This package's files and torch's (whose wrappers some releases put around calls)."""


def user_stacklevel() -> int:
    """The ``stacklevel`` that makes a warning raised by the caller point at the innermost
    frame outside amprewrite and torch: the user's line (``convert``, a call, ``train()``,
    ``import amprewrite``). The one way this package finds that line: every warning it gives
    passes ``stacklevel=user_stacklevel()``.

    NB: ``warnings.warn`` steps over the import machinery's frames without counting them
    (``<frozen importlib._bootstrap>``), so they are not counted here either."""
    level, frame = 1, sys._getframe(1)
    while frame is not None and (_import_frame(frame)
                                 or frame.f_code.co_filename.startswith(_OWN_DIRS)):
        frame = frame.f_back
        if frame is not None and not _import_frame(frame):
            level += 1
    return level


def _import_frame(frame: types.FrameType) -> bool:
    """Whether ``warnings.warn`` skips ``frame`` when it counts a ``stacklevel``."""
    name = frame.f_code.co_filename
    return "importlib" in name and "_bootstrap" in name


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


def report_recapture(message: str) -> None:
    """The one channel recaptures are reported through: a :class:`RecaptureWarning` pointing
    at the user's line."""
    warnings.warn("amprewrite: " + message, RecaptureWarning, stacklevel=user_stacklevel())


class AutocastOverrideWarning(UserWarning):
    """A converted module was called inside an active ``torch.autocast`` of the device type its
    tensors are on (also what accelerate's ``mixed_precision="bf16"`` / ``"fp16"`` enters).

    Autocast then casts on top of the module's explicit casts, so an op the policy keeps in
    fp32 but autocast lists as low precision (a ``keep_fp32`` override, say) runs in autocast's
    dtype after all. Given once per converted module; filter it by this class.
    """
