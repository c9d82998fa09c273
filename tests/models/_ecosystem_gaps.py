"""What does not work yet on the ecosystem zoo (``_ecosystem_zoo.py``).

``KNOWN_GAPS`` cases are strict xfails in ``test_ecosystem_zoo.py`` that expect their symptom
(a fix makes them fail until the entry is removed; a different failure fails too) and
footnotes in ``tools/support_matrix.py --zoo ecosystem``.
"""

from __future__ import annotations

import dataclasses

__all__ = ["Gap", "KNOWN_GAPS"]


@dataclasses.dataclass(frozen=True)
class Gap:
    """Why a capability does not hold on a model yet.

    Attributes:
        symptom: a regular expression that the failure's message, or the message of one of
            the exceptions it was raised from, matches.
        reason: the symptom in words, with what is known of the cause.
    """

    symptom: str
    reason: str


KNOWN_GAPS: dict[tuple[str, str], Gap] = {
    ("hf_llava", "preset_grads"): Gap(
        r"preset_grads: \d+ of 39 parameter gradients differ from autocast's; "
        r"first: model\.vision_tower\.",
        "29 of 39 parameter gradients differ from autocast's (max |diff| ~1e-5 against max "
        "|grad| ~1e-3; the vision tower's first, reached through the image features); the "
        "outputs are bitwise autocast's. The cause is the text model's grouped-query SDPA "
        "attention (1 key/value head for 2 query heads): under export transformers builds "
        "an explicit causal mask and repeats the key/value heads, where eager passes "
        "is_causal and enable_gqa to SDPA, whose backward sums the heads in another order. "
        "With as many key/value heads as query heads, or eager attention, the gradients are "
        "bitwise."),
}
"""(model, capability) -> its gap."""
