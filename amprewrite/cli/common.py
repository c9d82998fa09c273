"""What every ``python -m amprewrite`` command shares: the one-line error, the dtype names and
the policy presets a flag can name."""

from __future__ import annotations

from typing import Any

import torch

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


POLICIES = ("default", "autocast-cpu", "autocast-cuda")


CAPTURES = ("export", "symbolic", "compile")


class CliError(Exception):
    """A user error the CLI reports as one line, without a traceback."""


# -- the commands -----------------------------------------------------------------------------
def policy_for(name: str, dtype: torch.dtype) -> Any:
    from ..policy.policy import Policy

    if name == "default":
        return Policy(dtype=dtype)
    return Policy.autocast(name.split("-")[1], dtype)
