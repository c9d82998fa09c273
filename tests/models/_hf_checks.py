"""One check per amprewrite capability, run on any zoo entry (``_zoo_entry.ZooEntry``): the
architectures of ``_hf_zoo.py`` and the models of ``_ecosystem_zoo.py``.

Each check builds its own model (cheap), compares against a deep copy of it run eagerly, and
raises :class:`CheckFailed` with the numbers that matter (the max |diff|, the first parameter
that differs) when the capability does not hold. ``test_hf_zoo.py`` and
``test_ecosystem_zoo.py`` run them as tests and ``tools/support_matrix.py`` as a table, so the
three cannot drift apart. ``KNOWN_GAPS`` and :data:`INDUCTOR` name HuggingFace architectures;
the ecosystem zoo lists its gaps in its own module, and its ``compile`` checks run the rewritten
graphs eagerly.
"""

from __future__ import annotations

import copy
import math
from typing import Any, Callable

import torch
import torch.nn as nn
from _zoo_entry import Example, ZooEntry, tensor_leaves
from _versions import TORCH_RELEASE, TRANSFORMERS_RELEASE

import amprewrite
from amprewrite import Policy

__all__ = ["CAPABILITIES", "CHECKS", "CheckFailed", "INDUCTOR", "KNOWN_GAPS", "run_check",
           "check_tiny_and_deterministic"]

LOW = torch.bfloat16

ABS_FLOOR = 1e-5
"""Absolute error always allowed, so that an output autocast computes exactly in fp32 does
not make the 2x-autocast bound zero."""

O2_LOSS_RTOL = 0.05
"""How far the O2 loss may be from eager autocast's loss, relative to it: bf16 weights carry
about 3 significant digits, so the first loss differs in the second or third digit."""

INDUCTOR = frozenset({"llama"})
"""Architectures whose ``compile`` check runs full Inductor: Inductor takes tens of seconds
per model on a small CPU (on two cores without native bf16, 20 to 30 s each), so the others
run the rewritten Dynamo graphs eagerly (``eager=True``), which exercises the same capture
and rewrite; one decoder through Inductor shows the rewritten HF graphs compile. Inductor
forward and backward on a model with its own autocast regions, and AOTInductor on an exported
converted module, are ``test_backend.py``'s and ``test_distributed.py``'s."""

KNOWN_GAPS: dict[tuple[str, str], str] = {
    ("bloom", "preset_grads"):
        "Bloom's GeLU is a custom torch.autograd.Function; torch.export records its forward "
        "ops, so autograd differentiates those instead of its own backward (convert warns). "
        "Outputs are bitwise; gradients differ in the 5th digit.",
    **({("dinov2", "preset_grads"):
        "transformers >= 5.18, any torch: Dinov2 builds its attention mask with "
        "create_bidirectional_mask, which skips the mask in eager but never under torch.export "
        "(the graph adds a zero fp32 mask to the bf16 attention scores: the same outputs, "
        "another rounding in the backward): torch.export's own graph gives gradients that "
        "differ from eager's in the last bits "
        "under torch.autocast, with no amprewrite involved; outputs are bitwise. transformers "
        "5.17 is bitwise."} if TRANSFORMERS_RELEASE >= (5, 18) else {}),
}
"""(architecture, capability) -> why it does not work yet. Tests of these cases are strict
xfails (a fix makes them fail until the entry is removed); the support matrix shows the
reason as the footnote."""


class CheckFailed(AssertionError):
    """A capability does not hold for an architecture; the message says by how much."""


def _expect(ok: bool, message: Callable[[], str]) -> None:
    # NB: an explicit raise, not ``assert``: the checks also run outside pytest (where
    # ``python -O`` would strip asserts); the message is built only on failure.
    if not ok:
        raise CheckFailed(message())


# -- running models -------------------------------------------------------------------------


def _call(model: Callable[..., Any], example: Example) -> Any:
    args, kwargs = example
    return model(*args, **kwargs)


def _convert(model: nn.Module, example: Example, **options: Any) -> nn.Module:
    args, kwargs = example
    return amprewrite.convert(model, args, example_kwargs=kwargs, **options)


def _eager_outputs(arch: ZooEntry, model: nn.Module,
                   example: Example) -> tuple[torch.Tensor, torch.Tensor]:
    """The compared output of ``model`` in fp32 and under CPU autocast, without gradients."""
    with torch.no_grad():
        fp32 = arch.output(_call(model, example))
        with torch.autocast("cpu", dtype=LOW):
            autocast = arch.output(_call(model, example))
    return fp32, autocast


def _snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


# -- comparisons ----------------------------------------------------------------------------


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.numel() == 0:
        return 0.0
    return (a.double() - b.double()).abs().max().item()


def _expect_finite(what: str, t: torch.Tensor) -> None:
    _expect(bool(torch.isfinite(t).all()),
            lambda: f"{what}: {int((~torch.isfinite(t)).sum())} of {t.numel()} values are "
                    f"inf/NaN (dtype {t.dtype})")


def _expect_close_to_fp32(what: str, out: torch.Tensor, fp32: torch.Tensor,
                          autocast: torch.Tensor) -> None:
    """``out`` is finite and at most twice as far from fp32 as torch.autocast is."""
    _expect(out.shape == fp32.shape,
            lambda: f"{what}: output shape {tuple(out.shape)} != fp32 {tuple(fp32.shape)}")
    _expect_finite(what, out)
    err, err_autocast = _max_diff(out, fp32), _max_diff(autocast, fp32)
    bound = max(2 * err_autocast, ABS_FLOOR)
    _expect(err <= bound,
            lambda: f"{what}: max |out - fp32| = {err:.3g} > {bound:.3g} "
                    f"(2 x autocast's max |diff| {err_autocast:.3g}, floor {ABS_FLOOR:g})")


def _expect_same_tensors(what: str, got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    """Same number of tensors, each with the same dtype, shape and bits."""
    _expect(len(got) == len(want),
            lambda: f"{what}: {len(got)} output tensors, autocast returns {len(want)}")
    bad = [i for i, (g, w) in enumerate(zip(got, want))
           if g.dtype != w.dtype or g.shape != w.shape or not torch.equal(g, w)]

    def message() -> str:
        i = bad[0]
        g, w = got[i], want[i]
        if g.dtype != w.dtype or g.shape != w.shape:
            detail = f"{g.dtype} {tuple(g.shape)} vs autocast's {w.dtype} {tuple(w.shape)}"
        else:
            detail = f"max |diff| {_max_diff(g, w):.3g}"
        return (f"{what}: {len(bad)} of {len(want)} output tensors differ from autocast; "
                f"first: tensor {i}, {detail}")

    _expect(not bad, message)


def _grad_mismatch(got: torch.Tensor | None, want: torch.Tensor | None) -> str | None:
    """Why two gradients differ, or None when they are bitwise equal (or both missing)."""
    if got is None or want is None:
        return None if got is None and want is None else \
            f"gradient is {'missing' if got is None else 'present'}, autocast's is not"
    if got.dtype != want.dtype:
        return f"dtype {got.dtype} vs autocast's {want.dtype}"
    if not torch.equal(got, want):
        return f"max |diff| {_max_diff(got, want):.3g} (autocast's max |grad| " \
               f"{want.abs().max().item():.3g})"
    return None


def _expect_same_grads(model: nn.Module, twin: nn.Module) -> None:
    pairs = list(zip(model.named_parameters(), twin.named_parameters()))
    _expect(any(p.grad is not None for (_, p), _ in pairs),
            lambda: "preset_grads: no parameter received a gradient")
    bad = [(name, why) for (name, p), (_, q) in pairs
           if (why := _grad_mismatch(p.grad, q.grad)) is not None]
    _expect(not bad, lambda: f"preset_grads: {len(bad)} of {len(pairs)} parameter gradients "
                             f"differ from autocast's; first: {bad[0][0]}: {bad[0][1]}")


def _expect_unchanged(what: str, model: nn.Module, before: dict[str, torch.Tensor]) -> None:
    after = model.state_dict()
    changed = [k for k, v in before.items() if not torch.equal(after[k], v)]
    _expect(not changed, lambda: f"{what} modified the user's model: {len(changed)} "
                                 f"parameters/buffers changed, first {changed[0]!r}")


# -- the checks -----------------------------------------------------------------------------


def check_tiny_and_deterministic(arch: ZooEntry, max_parameters: int) -> None:
    """What every check relies on: two builds are equal, the model has at most
    ``max_parameters`` parameters, its forward and loss are finite in fp32, and train mode
    draws no random numbers (no active dropout or drop path: two forwards under different
    seeds are bitwise equal), so that a model and its deep copy train identically."""
    model, twin = arch.build(), arch.build()
    n = sum(p.numel() for p in model.parameters())
    _expect(n <= max_parameters, lambda: f"{arch.name}: {n} parameters > {max_parameters}")
    differ = [name for (name, p), (_, q) in zip(model.state_dict().items(),
                                                twin.state_dict().items())
              if not torch.equal(p, q)]
    _expect(not differ, lambda: f"{arch.name}: two builds differ in {differ[0]}")
    example = arch.example()
    with torch.no_grad():
        out = _call(model, example)
        for i, t in enumerate(tensor_leaves(out)):
            if t.is_floating_point():
                _expect_finite(f"{arch.name}: output tensor {i}", t)
        _expect_finite(f"{arch.name}: loss", arch.loss(out))
        model.train()
        runs = []
        for seed in (1, 2):
            with torch.random.fork_rng(devices=[]):  # the caller's random state is kept
                torch.manual_seed(seed)
                runs.append(tensor_leaves(_call(model, example)))
    same = len(runs[0]) == len(runs[1]) and all(torch.equal(a, b) for a, b in zip(*runs))
    _expect(same, lambda: f"{arch.name}: two train-mode forwards under different seeds differ: "
                          "a dropout or drop path rate is not 0")


def check_default(arch: ZooEntry) -> None:
    """``convert`` with the default policy, eval mode: finite, within 2x autocast's error,
    the user's model is left as it was, and the converted module saves the model's keys."""
    model, example = arch.build(), arch.example()
    fp32, autocast = _eager_outputs(arch, copy.deepcopy(model), example)
    before = _snapshot(model)
    gm = _convert(model, example)
    with torch.no_grad():
        out = arch.output(_call(gm, example))
    _expect_close_to_fp32("default", out, fp32, autocast)
    _expect_unchanged("convert + forward", model, before)
    extra = sorted(set(gm.state_dict()) - set(before))
    _expect(not extra, lambda: f"the converted module's state_dict has {len(extra)} keys the "
                               f"model's has not (they would not load into it): {extra[:3]}")


def check_preset_outputs(arch: ZooEntry) -> None:
    """``Policy.autocast("cpu")``, eval mode: every output tensor bitwise equal to eager
    torch.autocast's, under ``no_grad`` and under ``inference_mode`` (as servers run models;
    there the cached weight copies, made under ``no_grad``, are read by inference tensors)."""
    model, example = arch.build(), arch.example()
    twin = copy.deepcopy(model)
    gm = _convert(model, example, policy=Policy.autocast("cpu", LOW))
    for mode in (torch.no_grad, torch.inference_mode):
        with mode(), torch.autocast("cpu", dtype=LOW):
            want = tensor_leaves(_call(twin, example))
        with mode():
            got = tensor_leaves(_call(gm, example))
        _expect_same_tensors(f"preset_outputs under {mode.__name__}", got, want)


def check_preset_grads(arch: ZooEntry) -> None:
    """``Policy.autocast("cpu")``, train mode: every parameter gradient of one backward
    bitwise equal to eager torch.autocast's (the loss is computed in fp32 outside it)."""
    model, example = arch.build().train(), arch.example()
    twin = copy.deepcopy(model)
    gm = _convert(model, example, policy=Policy.autocast("cpu", LOW))
    arch.loss(_call(gm, example)).backward()
    with torch.autocast("cpu", dtype=LOW):
        out = _call(twin, example)
    arch.loss(out).backward()
    _expect_same_grads(model, twin)


def _autocast_loss(arch: ZooEntry, model: nn.Module, example: Example) -> float:
    # NB: eager autocast, not an O1 conversion: the reference needs no capture of its own
    # (O1's closeness to fp32 is check_default's).
    with torch.no_grad(), torch.autocast("cpu", dtype=LOW):
        out = _call(model, example)
    with torch.no_grad():
        return arch.loss(out).item()


def check_o2_step(arch: ZooEntry) -> None:
    """O2 (bf16 weights, fp32 masters) and AdamW bound with ``MasterWeights``: one step with
    a finite loss close to eager autocast's, fp32 masters, and refreshed low-precision copies
    after it."""
    model, example = arch.build().train(), arch.example()
    reference = _autocast_loss(arch, copy.deepcopy(model), example)
    gm = _convert(model, example, opt_level="O2", dtype=LOW)
    opt = torch.optim.AdamW(gm.parameters(), lr=1e-3)
    amprewrite.MasterWeights(gm, opt)
    loss = arch.loss(_call(gm, example))
    value = loss.item()
    _expect(math.isfinite(value), lambda: f"o2_step: loss is {value}")
    _expect(abs(value - reference) <= O2_LOSS_RTOL * abs(reference),
            lambda: f"o2_step: loss {value:.6g} vs autocast's {reference:.6g}: relative difference "
                    f"{abs(value - reference) / abs(reference):.3g} > {O2_LOSS_RTOL}")
    loss.backward()
    opt.step()
    low = [n for n, p in gm.named_parameters() if p.dtype != torch.float32]
    _expect(not low, lambda: f"o2_step: {len(low)} master weights are not fp32, first {low[0]!r}")
    with torch.no_grad():
        after = arch.loss(_call(gm, example)).item()
    _expect(math.isfinite(after) and after != value,
            lambda: f"o2_step: loss after the step is {after} (before: {value}); the step "
                    "did not reach the low-precision copies")


def check_o3_step(arch: ZooEntry) -> None:
    """O3 (everything bf16, on the module's own copies): one SGD step with a finite loss,
    gradients on the copies, and the user's model untouched."""
    model, example = arch.build().train(), arch.example()
    before = _snapshot(model)
    gm = _convert(model, example, opt_level="O3", dtype=LOW)
    opt = torch.optim.SGD(gm.parameters(), lr=0.01)
    loss = arch.loss(_call(gm, example))
    value = loss.item()
    _expect(math.isfinite(value), lambda: f"o3_step: loss is {value}")
    loss.backward()
    _expect(any(p.grad is not None for p in gm.parameters()),
            lambda: "o3_step: no parameter of the converted module received a gradient")
    opt.step()
    _expect_unchanged("an O3 training step", model, before)


def check_compile(arch: ZooEntry) -> None:
    """``amprewrite.compile`` (Dynamo capture + rewrite; Inductor for :data:`INDUCTOR`),
    eval mode: at least one graph rewritten, output within 2x autocast's error."""
    torch._dynamo.reset()  # one model class appears in several entries: no stale guards
    model, example = arch.build(), arch.example()
    fp32, autocast = _eager_outputs(arch, copy.deepcopy(model), example)
    compiled = amprewrite.compile(model, dtype=LOW, eager=arch.name not in INDUCTOR)
    with torch.no_grad():
        out = arch.output(_call(compiled, example))
    graphs = compiled.amprewrite_backend.graphs
    _expect(bool(graphs), lambda: "compile: Dynamo handed no graph to the amprewrite backend")
    _expect_close_to_fp32("compile", out, fp32, autocast)


def check_audit(arch: ZooEntry) -> None:
    """``amprewrite.audit()`` around forward + backward of the converted model (default
    policy, train mode): a non-empty table, and records of both phases."""
    model, example = arch.build().train(), arch.example()
    gm = _convert(model, example)
    with amprewrite.audit() as report:
        arch.loss(_call(gm, example)).backward()
    table = report.table()
    _expect(isinstance(table, str) and bool(table.strip()),
            lambda: f"audit: report.table() returned {table!r}")
    phases = {r.phase for r in report.records}
    _expect({"forward", "backward"} <= phases,
            lambda: f"audit: {len(report.records)} records, phases {sorted(phases)}; "
                    "expected forward and backward")


CHECKS: dict[str, Callable[[ZooEntry], None]] = {
    "default": check_default,
    "preset_outputs": check_preset_outputs,
    "preset_grads": check_preset_grads,
    "o2_step": check_o2_step,
    "o3_step": check_o3_step,
    "compile": check_compile,
    "audit": check_audit,
}
CAPABILITIES: tuple[str, ...] = tuple(CHECKS)


def run_check(arch: ZooEntry, capability: str) -> None:
    """Run one capability's check on one architecture (raises when it does not hold)."""
    CHECKS[capability](arch)
