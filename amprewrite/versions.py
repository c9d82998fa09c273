"""The torch and transformers releases amprewrite is tested on, and a warning outside them.

amprewrite reads what torch.export, torch.fx and Dynamo record (node meta, graph signatures,
higher-order ops), which changes from release to release. The range below is the one CI runs
the whole test suite on, at both ends; ``pyproject.toml`` declares the same. Outside it the
package may still work, so it warns once instead of refusing: for torch when amprewrite is
imported, for transformers when a model is first captured with it loaded.
"""

from __future__ import annotations

import sys
import warnings

import torch
from torch.torch_version import TorchVersion

from .errors import user_stacklevel

__all__ = ["TORCH_RANGE", "TRANSFORMERS_RANGE", "check_torch", "check_transformers"]

TORCH_RANGE = ("2.11", "2.15")
"""Supported torch releases: at least the first, below the second (2.11.0 to 2.14.x)."""
TRANSFORMERS_RANGE = ("5.17", "5.26")
"""Supported transformers releases on the HF paths (5.17.0 to 5.25.x)."""

_warned: set[str] = set()


def _outside(version: str, bounds: tuple[str, str]) -> bool:
    parsed = TorchVersion(version.split("+")[0])
    return not bounds[0] <= parsed < bounds[1]


def _warn_once(package: str, version: str, bounds: tuple[str, str]) -> None:
    if package in _warned or not _outside(version, bounds):
        return
    _warned.add(package)
    warnings.warn(
        f"amprewrite is tested with {package} >={bounds[0]},<{bounds[1]}; this is {package} "
        f"{version}. Conversion may fail or differ on it: install a {package} release in that "
        f"range (pip install '{package}>={bounds[0]},<{bounds[1]}').", stacklevel=user_stacklevel())


def check_torch() -> None:
    """Warn once if the installed torch is outside :data:`TORCH_RANGE`."""
    _warn_once("torch", torch.__version__, TORCH_RANGE)


def check_transformers() -> None:
    """Warn once if an imported transformers is outside :data:`TRANSFORMERS_RANGE`."""
    module = sys.modules.get("transformers")
    version = getattr(module, "__version__", None)
    if isinstance(version, str):
        _warn_once("transformers", version, TRANSFORMERS_RANGE)


check_torch()  # on import: ``import amprewrite`` imports this module first
