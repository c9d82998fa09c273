"""What every ``python -m amprewrite`` command shares: the one-line error, the dtype names and
the policy presets a flag can name."""

from __future__ import annotations

from typing import Any

import torch

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


from .parser import CAPTURES, POLICIES  # noqa: F401  (the names flags take)


class CliError(Exception):
    """A user error the CLI reports as one line, without a traceback."""


# -- the commands -----------------------------------------------------------------------------
def policy_for(name: str, dtype: torch.dtype) -> Any:
    from ..policy.policy import Policy

    if name == "default":
        return Policy(dtype=dtype)
    if name == "fp8":
        if dtype is not torch.bfloat16:
            raise CliError("--policy fp8 runs everything but its fp8 linears in bf16; drop "
                           "--dtype or pass --dtype bf16")
        return Policy.fp8()
    return Policy.autocast(name.split("-")[1], dtype)
