"""The torch and transformers releases under test, for skips and gaps that name a version."""

from __future__ import annotations

import torch

__all__ = ["TORCH_RELEASE"]

TORCH_RELEASE = tuple(int(part) for part in torch.__version__.split("+")[0].split(".")[:2])
"""(major, minor) of the installed torch: (2, 11) for 2.11.0+cu130."""
