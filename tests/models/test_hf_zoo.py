"""Every amprewrite capability on every architecture of the HuggingFace zoo (``_hf_zoo.py``).

One test per capability, parametrized over the zoo (ids are architecture names); the checks
live in ``_hf_checks.py``, which ``tools/support_matrix.py`` runs as well. Cases listed in
``KNOWN_GAPS`` are strict xfails with their reason.
"""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from _hf_checks import (  # noqa: E402  (needs transformers)
    CAPABILITIES,
    KNOWN_GAPS,
    check_audit,
    check_compile,
    check_default,
    check_o2_step,
    check_o3_step,
    check_preset_grads,
    check_preset_outputs,
    check_tiny_and_deterministic,
)
from _hf_zoo import ZOO, Arch  # noqa: E402

MAX_PARAMETERS = 100_000
"""Zoo models stay tiny: bf16 matmuls on CPUs without native bf16 are ~70x slower than fp32."""


def _cases(capability: str) -> list:
    assert capability in CAPABILITIES
    cases = []
    for arch in ZOO:
        reason = KNOWN_GAPS.get((arch.name, capability))
        marks = [pytest.mark.xfail(strict=True, reason=reason)] if reason else []
        cases.append(pytest.param(arch, id=arch.name, marks=marks))
    return cases


def test_known_gaps_name_real_cases() -> None:
    names = {arch.name for arch in ZOO}
    stale = [key for key in KNOWN_GAPS if key[0] not in names or key[1] not in CAPABILITIES]
    assert not stale, f"KNOWN_GAPS entries for unknown architectures/capabilities: {stale}"


@pytest.mark.parametrize("arch", [pytest.param(a, id=a.name) for a in ZOO])
def test_zoo_entry_is_tiny_and_deterministic(arch: Arch) -> None:
    check_tiny_and_deterministic(arch, MAX_PARAMETERS)


@pytest.mark.parametrize("arch", _cases("default"))
def test_default(arch: Arch) -> None:
    check_default(arch)


@pytest.mark.parametrize("arch", _cases("preset_outputs"))
def test_preset_outputs(arch: Arch) -> None:
    check_preset_outputs(arch)


@pytest.mark.parametrize("arch", _cases("preset_grads"))
def test_preset_grads(arch: Arch) -> None:
    check_preset_grads(arch)


@pytest.mark.parametrize("arch", _cases("o2_step"))
def test_o2_step(arch: Arch) -> None:
    check_o2_step(arch)


@pytest.mark.parametrize("arch", _cases("o3_step"))
def test_o3_step(arch: Arch) -> None:
    check_o3_step(arch)


@pytest.mark.parametrize("arch", _cases("compile"))
def test_compile(arch: Arch) -> None:
    check_compile(arch)


@pytest.mark.parametrize("arch", _cases("audit"))
def test_audit(arch: Arch) -> None:
    check_audit(arch)


def test_export_capture_names_where_transformers_checkpoints() -> None:
    """Converting with example inputs records a checkpointed layer as ordinary ops, so the
    capture says so, naming transformers' checkpoint call; in eval mode nothing is
    checkpointed and nothing is said."""
    import warnings

    import amprewrite

    arch = next(a for a in ZOO if a.gradient_checkpointing)
    args, kwargs = arch.example()
    with pytest.warns(UserWarning, match=r"calls torch\.utils\.checkpoint \(at \S+"
                                         r"transformers\S+\.py:\d+ in \w+\)") as caught:
        amprewrite.convert(arch.build().train(), args, example_kwargs=kwargs)
    assert sum("torch.utils.checkpoint" in str(w.message) for w in caught) == 1
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        amprewrite.convert(arch.build().eval(), args, example_kwargs=kwargs)
    assert not [w for w in caught if "torch.utils.checkpoint" in str(w.message)]

