"""What does not work yet on the ecosystem zoo (``_ecosystem_zoo.py``), and which models take
too long to convert to be checked by default.

``KNOWN_GAPS`` cases are strict xfails in ``test_ecosystem_zoo.py`` that expect their symptom
(a fix makes them fail until the entry is removed; a different failure fails too) and
footnotes in ``tools/support_matrix.py --zoo ecosystem``.
``SLOW_TO_CONVERT`` models stay in the zoo; the tests skip them unless
``AMPREWRITE_ZOO_SLOW=1`` is set, until conversion is fast enough to check them in CI's
time by default.
"""

from __future__ import annotations

import dataclasses

__all__ = ["Gap", "KNOWN_GAPS", "SLOW_TO_CONVERT"]


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
        r"preset_grads: \d+ of 64 parameter gradients differ from autocast's; "
        r"first: model\.vision_tower\.",
        "with the default (sdpa) attention, 54 of 64 parameter gradients (the CLIP vision "
        "tower's) differ from autocast's, max |diff| ~1e-5 against max |grad| ~2e-3; the "
        "outputs are bitwise autocast's, and with eager attention so are the gradients."),
    **{("tv_googlenet", capability): Gap(
        r"torch\.export could not capture GoogLeNet: NotImplementedError",
        "convert raises AmpRewriteError \"torch.export could not capture GoogLeNet: "
        "NotImplementedError:\" (and points to amprewrite.compile for data-dependent control "
        "flow): the export with dynamic dimensions fails in torch's constraint solver (sympy "
        "cannot solve -x/4 + 2*(((x/2)//4)) - 2 < 0, from the ceil-mode max pools of a 32x32 "
        "input), and convert does not fall back to a static export, which succeeds.")
       for capability in ("default", "preset_outputs", "preset_grads", "o2_step", "o3_step",
                          "audit")},
    **{("tv_mvit", capability): Gap(
        r"expected scalar type Float but found BFloat16",
        "the converted module raises \"expected scalar type Float but found BFloat16\" at "
        "aten.einsum('bythwc,hkc->bythwk') of the relative position embeddings (bf16 queries, "
        "an fp32 table) under Policy.autocast('cpu'); eager autocast runs it, and the default "
        "policy converts it.")
       for capability in ("preset_outputs", "preset_grads")},
    ("timm_ghostnetv2", "o3_step"): Gap(
        r"torch\.export could not capture GhostNet: NotImplementedError",
        "convert at O3 raises AmpRewriteError \"torch.export could not capture GhostNet: "
        "NotImplementedError:\" (sympy cannot solve an inequality of the dynamic sizes); O1 and "
        "O2 convert."),
    **{("timm_sequencer2d", capability): Gap(
        r"could not create a primitive descriptor for the LSTM forward propagation primitive",
        "the converted module raises oneDNN's \"could not create a primitive descriptor for "
        "the LSTM forward propagation primitive\" at torch.lstm (in the default policy's "
        "graph: bf16 input and hidden states, fp32 weights); an nn.Linear followed by an "
        "nn.LSTM shows it, and eager autocast runs both.")
       for capability in ("default", "preset_outputs", "preset_grads", "o2_step", "audit")},
}
"""(model, capability) -> its gap."""

SLOW_TO_CONVERT: dict[str, str] = {
    "tv_swin": "30 s of CPU per conversion",
    "tv_mvit": "34 s of CPU per conversion",
    "tv_googlenet": "fails after 21 s of CPU (see KNOWN_GAPS)",
    "timm_coatnet": "11 s of CPU per conversion",
    "timm_levit": "7 s of CPU per conversion",
    "timm_efficientformerv2": "8 s of CPU per conversion",
    "timm_poolformer": "7 s of CPU per conversion",
    "timm_ghostnetv2": "28 s of CPU per conversion",
    "timm_sequencer2d": "11 s of CPU per conversion",
}
"""model -> how long one conversion takes today: more than 5 s of CPU (torch 2.14.1, one
thread, eval mode; the other models of the zoo take 0.7-4 s, and a default run converts
each model once, a representative one eight times)."""
