"""The torch and transformers releases under test, for skips and gaps that name a version."""

from __future__ import annotations

import torch

__all__ = ["TORCH_RELEASE", "TRANSFORMERS_RELEASE"]


def _release(version: str) -> tuple[int, int]:
    major, minor = version.split("+")[0].split(".")[:2]
    return int(major), int(minor)


TORCH_RELEASE = _release(torch.__version__)
"""(major, minor) of the installed torch: (2, 11) for 2.11.0+cu130."""

try:
    from importlib.metadata import version as _version

    TRANSFORMERS_RELEASE: tuple[int, int] | None = _release(_version("transformers"))
except Exception:  # not installed
    TRANSFORMERS_RELEASE = None
"""(major, minor) of the installed transformers, None without it: (5, 24) for 5.24.0."""
