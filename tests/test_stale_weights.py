"""A converted module keeps up with its model: every way real code changes weights after
conversion is either followed (the output equals torch.autocast's on the model as it is now,
bitwise under the CPU preset) or reported once, by default and inside
``amprewrite.cache_weights`` (which follows all but writes that move no version counter).
Hooks registered on the model after conversion warn once; converted modules pickle."""

from __future__ import annotations

import io
import pickle
import warnings
from typing import Any, Callable

import pytest
import torch
import torch.nn as nn
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

import amprewrite
from amprewrite import Policy
from amprewrite.capture.guards import InputGuards, _rebuilt_guards
from amprewrite.runtime.low_copies import LOW_COPIES_ATTR
from amprewrite.module.model_watch import changes as _changes

bf16 = torch.bfloat16
PRESET = Policy.autocast("cpu", bf16)
X = torch.randn(3, 8, generator=torch.Generator().manual_seed(1))


def mlp(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))


def convert(model: nn.Module, **kwargs: Any) -> torch.fx.GraphModule:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # this CPU may lack a fast bf16 path
        if "opt_level" in kwargs:
            return amprewrite.convert(model, (X,), dtype=bf16, **kwargs)
        return amprewrite.convert(model, (X,), policy=PRESET, **kwargs)


def autocast_out(model: nn.Module) -> torch.Tensor:
    with torch.no_grad(), torch.autocast("cpu", bf16):
        return model(X)


def infer(gm: nn.Module, kept: bool) -> torch.Tensor:
    """A ``no_grad`` forward: by default, or inside ``cache_weights`` after one forward there
    (so that a copy made before the change is what a stale module would return)."""
    with torch.no_grad():
        if not kept:
            return gm(X)
        with amprewrite.cache_weights(gm):
            gm(X)
            return gm(X)


def changed(model: nn.Module, gm: nn.Module, kept: bool, change: Callable[[], Any]) -> None:
    """``change`` moves the model's output, and the converted module follows it."""
    with amprewrite.cache_weights(gm) if kept else _nothing():
        before = infer(gm, False)
        assert torch.equal(before, autocast_out(model))
        change()
        after = infer(gm, False)
    assert not torch.equal(before, after)
    assert torch.equal(after, autocast_out(model))


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None


def train_step(gm: nn.Module, opt: torch.optim.Optimizer) -> None:
    gm(X).float().square().mean().backward()
    opt.step()
    opt.zero_grad()


OPTIMIZERS = [(cls, kind) for cls in (torch.optim.AdamW, torch.optim.Adam, torch.optim.SGD)
              for kind in ("default", "foreach", "fused")]


@pytest.mark.parametrize("kept", [False, True], ids=["default", "cache_weights"])
@pytest.mark.parametrize("cls,kind", OPTIMIZERS,
                         ids=[f"{c.__name__}-{k}" for c, k in OPTIMIZERS])
def test_optimizer_steps_are_followed(cls: type, kind: str, kept: bool) -> None:
    """Fused optimizers move no version counter; a step is followed all the same."""
    model = mlp()
    gm = convert(model)
    opt = cls(model.parameters(), lr=0.1, **({} if kind == "default" else {kind: True}))
    changed(model, gm, kept, lambda: train_step(gm, opt))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("kept", [False, True], ids=["default", "cache_weights"])
@pytest.mark.parametrize("kind", ["foreach", "fused"])
def test_optimizer_steps_are_followed_on_cuda(kind: str, kept: bool) -> None:
    """On a GPU, under the CUDA preset: a fused step (no version counter moves) and a
    foreach step are followed, bitwise against torch.autocast("cuda") after the step."""
    model, x = mlp().cuda(), X.cuda()
    gm = amprewrite.convert(model, (x,), policy=Policy.autocast("cuda", bf16))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, **{kind: True})

    def reference() -> torch.Tensor:
        with torch.no_grad(), torch.autocast("cuda", bf16):
            return model(x)

    with amprewrite.cache_weights(gm) if kept else _nothing():
        with torch.no_grad():
            before = gm(x)
        assert torch.equal(before, reference())
        gm(x).float().square().mean().backward()
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            after = gm(x)
    assert after.is_cuda and not torch.equal(before, after)
    assert torch.equal(after, reference())


@pytest.mark.parametrize("kept", [False, True], ids=["default", "cache_weights"])
def test_ema_updated_in_place_is_followed(kept: bool) -> None:
    model, source = mlp(), mlp(1)
    gm = convert(model)

    def ema() -> None:
        with torch.no_grad():
            for p, q in zip(model.parameters(), source.parameters()):
                p.mul_(0.5).add_(q, alpha=0.5)

    changed(model, gm, kept, ema)


def test_writes_through_data_are_followed_by_default() -> None:
    """EMA and weight loading written with ``.data``: no version counter moves."""
    model, source = mlp(), mlp(1)
    gm = convert(model)

    def ema() -> None:
        for p, q in zip(model.parameters(), source.parameters()):
            p.data.mul_(0.5).add_(q.data, alpha=0.5)

    changed(model, gm, False, ema)
    changed(model, gm, False, lambda: model[0].weight.data.copy_(torch.randn(8, 8)))


def test_writes_through_data_inside_cache_weights_need_clear_weight_cache() -> None:
    """The documented contract of the fast path: such a write is not seen until
    ``clear_weight_cache``; leaving the region is enough as well."""
    model = mlp()
    gm = convert(model)
    with torch.no_grad(), amprewrite.cache_weights(gm):
        before = gm(X)
        model[0].weight.data.mul_(2)
        assert torch.equal(gm(X), before)  # the promise was broken: the old copies
        amprewrite.clear_weight_cache(gm)
        assert torch.equal(gm(X), autocast_out(model))
        model[0].weight.data.mul_(2)
    assert torch.equal(infer(gm, False), autocast_out(model))


@pytest.mark.parametrize("kept", [False, True], ids=["default", "cache_weights"])
def test_averaged_model_is_followed(kept: bool) -> None:
    model = mlp()
    average = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.5))
    gm = convert(average.module)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, fused=True)

    def update() -> None:
        train_step(model, opt)
        average.update_parameters(model)

    changed(average.module, gm, kept, update)


@pytest.mark.parametrize("kept", [False, True], ids=["default", "cache_weights"])
@pytest.mark.parametrize("assign", [False, True])
def test_load_state_dict_on_the_model_is_followed(kept: bool, assign: bool) -> None:
    model = mlp()
    gm = convert(model)
    changed(model, gm, kept, lambda: model.load_state_dict(mlp(1).state_dict(), assign=assign))
    if assign:
        assert gm.get_submodule("0").weight is model[0].weight


def test_load_state_dict_assign_on_the_converted_module_reaches_the_model() -> None:
    """The converted module's submodules hold the model's own tensor dicts: tensors assigned
    on either are the other's too, so the two never diverge (nothing to warn about)."""
    model = mlp()
    gm = convert(model)
    gm.load_state_dict(mlp(1).state_dict(), assign=True)
    assert gm.get_submodule("0").weight is model[0].weight
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = infer(gm, False)
    fresh = convert(mlp(1))
    assert torch.equal(out, infer(fresh, False))  # gm computes with what it was given


@pytest.mark.parametrize("kept", [False, True], ids=["default", "cache_weights"])
def test_module_to_after_conversion_is_followed(kept: bool) -> None:
    """``model.to(...)`` gives the same parameters new storage (``p.data = ...``)."""
    model = mlp()
    gm = convert(model)
    changed(model, gm, kept, lambda: model.half().float())  # values rounded to fp16


@pytest.mark.parametrize("kept", [False, True], ids=["default", "cache_weights"])
def test_parameter_replaced_on_the_model_is_followed(kept: bool) -> None:
    model = mlp()
    gm = convert(model)
    changed(model, gm, kept, lambda: setattr(model[2], "weight", nn.Parameter(torch.randn(4, 8))))
    assert gm.get_submodule("2").weight is model[2].weight
    # an optimizer built over the model's parameters now trains what gm reads
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    changed(model, gm, kept, lambda: train_step(gm, opt))


def o2(model: nn.Module, capture: str = "export") -> torch.fx.GraphModule:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # this CPU may lack a fast bf16 path
        return amprewrite.convert(model, (X,) if capture == "export" else None, dtype=bf16,
                                  opt_level="O2")


class _Ops(torch.utils._python_dispatch.TorchDispatchMode):
    """Records every ATen op a region runs."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[Any] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        self.seen.append(func)
        return func(*args, **(kwargs or {}))


def _step(model: nn.Module, fused: bool) -> Callable[[], None]:
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, fused=fused, foreach=not fused)
    return lambda: train_step(model, opt)


def _load(model: nn.Module) -> Callable[[], Any]:
    return lambda: model.load_state_dict(mlp(1).state_dict())


def _mul(model: nn.Module) -> Callable[[], None]:
    def mul() -> None:
        with torch.no_grad():
            model[0].weight.mul_(0.5)
    return mul


O2_CHANGES = {
    "fused step, unbound": lambda model: _step(model, fused=True),
    "foreach step, unbound": lambda model: _step(model, fused=False),
    "load_state_dict": _load,
    "p.mul_ under no_grad": _mul,
    "model.half().float()": lambda model: lambda: model.half().float(),
    "parameter replaced": lambda model: lambda: setattr(model[2], "weight",
                                                        nn.Parameter(torch.randn(4, 8))),
}


@pytest.mark.parametrize("capture", ["export", "symbolic"])
@pytest.mark.parametrize("change", list(O2_CHANGES))
def test_o2_copies_follow_every_write_a_counter_sees(change: str, capture: str) -> None:
    """O2's stored copies are rewritten only after their masters were written, and every
    write that moves a version counter, the storage or an optimizer's step count is one."""
    model = mlp()
    gm = o2(model, capture)
    before = infer(gm, False)
    O2_CHANGES[change](model)()
    after = infer(gm, False)
    assert not torch.equal(before, after)
    assert torch.equal(after, infer(o2(model, capture), False))  # a fresh conversion's


def test_o2_steady_inference_casts_no_weight() -> None:
    """Like O3: with nothing written, a forward neither casts nor copies any weight."""
    model = mlp()
    gm = o2(model)
    ops = _Ops()
    with torch.no_grad():
        gm(X)
        with ops:
            gm(X)
    casts = [f for f in ops.seen if f in (torch.ops.aten._to_copy.default,
                                          torch.ops.aten._foreach_copy_.default,
                                          torch.ops.aten.copy_.default)]
    assert casts == [torch.ops.aten._to_copy.default] * 2  # the input's and the output's
    # and a step makes the next forward rewrite the trained copies, in one batched copy
    opt = torch.optim.SGD(gm.parameters(), lr=0.5, fused=True)
    amprewrite.MasterWeights(gm, opt)
    train_step(gm, opt)
    ops.seen.clear()
    with torch.no_grad(), ops:
        gm(X)
    assert ops.seen.count(torch.ops.aten._foreach_copy_.default) == 1
    assert torch.equal(infer(gm, False), infer(o2(model), False))


def test_o2_steps_leave_frozen_masters_copies_alone() -> None:
    """Only parameters with gradients are stepped: the copies of frozen masters (a LoRA
    model's base weights) are not rewritten at every step."""
    model = mlp()
    model[0].requires_grad_(False)
    gm = o2(model)
    opt = torch.optim.AdamW([p for p in gm.parameters() if p.requires_grad], lr=0.1,
                            fused=True)
    amprewrite.MasterWeights(gm, opt)
    train_step(gm, opt)
    store = getattr(gm, LOW_COPIES_ATTR)
    copies = {id(m): c for m, c in store.copies()}
    versions = {name: copies[id(p)]._version for name, p in gm.named_parameters()}
    train_step(gm, opt)
    train_step(gm, opt)
    moved = {name for name, p in gm.named_parameters()
             if copies[id(p)]._version != versions[name]}
    assert moved == {"2.weight", "2.bias"}
    assert torch.equal(infer(gm, False), infer(o2(model), False))


@pytest.mark.parametrize("capture", ["export", "symbolic"])
@pytest.mark.parametrize("refresh", ["MasterWeights.refresh", "clear_weight_cache"])
def test_o2_writes_through_data_need_a_refresh(capture: str, refresh: str) -> None:
    """A write through ``.data`` moves no counter: the copies keep the old values until
    ``refresh`` (the documented contract, docs/training.md), inside ``cache_weights`` too."""
    model = mlp()
    gm = o2(model, capture)
    opt = torch.optim.AdamW(gm.parameters(), lr=0.1, fused=True)
    masters = amprewrite.MasterWeights(gm, opt)
    train_step(gm, opt)
    before = infer(gm, False)
    for p in model.parameters():
        p.data.mul_(0.5)
    assert torch.equal(infer(gm, False), before)
    assert torch.equal(infer(gm, True), before)
    masters.refresh() if refresh == "MasterWeights.refresh" else \
        amprewrite.clear_weight_cache(gm)
    fresh = infer(o2(model, capture), False)
    assert not torch.equal(fresh, before)
    assert torch.equal(infer(gm, False), fresh)
    with torch.no_grad():
        reference = o2(model, capture)(X)
    assert torch.equal(gm(X).detach(), reference)  # grad mode reads the same copies


def test_o2_embedding_reads_its_master() -> None:
    """O2 looks rows up in the fp32 table and rounds them: bit for bit the rows of a
    low-precision table, without storing one; the lookup's gradient reaches the master in
    fp32, summed in fp32 over repeated tokens."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(50, 8), nn.Linear(8, 4))
    ids = torch.tensor([[1, 1, 1, 2], [1, 3, 1, 1]])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        gm = amprewrite.convert(model, (ids,), dtype=bf16, opt_level="O2")
    assert "torch.embedding(_0_weight, " in gm.code
    assert [m for m, _ in getattr(gm, LOW_COPIES_ATTR).copies()] == []  # none before a call
    with torch.no_grad():
        out = gm(ids)
    rows = model[0].weight.to(bf16)[ids]
    with torch.no_grad():
        want = nn.functional.linear(rows, model[1].weight.to(bf16), model[1].bias.to(bf16))
    assert torch.equal(out, want.float())
    stored = {id(m) for m, _ in getattr(gm, LOW_COPIES_ATTR).copies()}
    assert id(model[0].weight) not in stored and id(model[1].weight) in stored
    masters = amprewrite.MasterWeights(gm, torch.optim.SGD(gm.parameters(), lr=0.1))
    gm(ids).sum().backward()
    grad = model[0].weight.grad
    assert grad is not None and grad.dtype == torch.float32
    masters.close()


def test_two_forwards_before_backward_still_backpropagate() -> None:
    """The per-call rewrite goes through ``.data``: a graph that saved a copy (frozen
    weights, grad mode) still backpropagates after a later forward."""
    model = mlp().requires_grad_(False)
    gm = convert(model)
    x = X.clone().requires_grad_()
    first = gm(x)
    gm(x)
    first.float().sum().backward()
    assert x.grad is not None


def test_cache_weights_skips_the_rewrite() -> None:
    model = mlp()
    gm = convert(model)
    seen: list[Any] = []

    class Copies(torch.utils._python_dispatch.TorchDispatchMode):
        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                               kwargs: Any = None) -> Any:
            seen.append(func)
            return func(*args, **(kwargs or {}))

    with torch.no_grad():
        gm(X)
        with Copies():
            gm(X)
        assert seen.count(torch.ops.aten._foreach_copy_.default) == 1  # one batched rewrite
        seen.clear()
        with amprewrite.cache_weights(gm), amprewrite.cache_weights(gm):  # regions nest
            gm(X)
            with Copies():
                gm(X)
    assert torch.ops.aten._foreach_copy_.default not in seen
    assert seen.count(torch.ops.aten._to_copy.default) == 1  # the input's cast: no weight's
    with pytest.raises(TypeError, match="cache_weights"):
        with amprewrite.cache_weights(gm.code):  # type: ignore[arg-type]
            pass


@pytest.mark.parametrize("register", ["register_forward_hook", "register_forward_pre_hook"])
def test_hooks_registered_on_the_model_after_conversion_warn_once(register: str) -> None:
    model = mlp()
    gm = convert(model)
    calls: list[int] = []
    getattr(model[0], register)(lambda *a: calls.append(1))
    with pytest.warns(UserWarning, match=r"registered on submodule '0' \(Linear\) after "
                                         r"conversion; the converted module does not run it"):
        gm(X)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        gm(X)
    assert not calls


def test_a_hook_on_a_layer_the_graph_calls_runs_without_a_warning() -> None:
    """The symbolic capture calls the model's own batch-norm layer: a hook registered on it
    after conversion runs at each call, as in eager, and is not reported."""
    model = nn.Sequential(nn.Linear(X.shape[1], 4), nn.BatchNorm1d(4)).eval()
    gm = convert(model, capture="symbolic")
    calls: list[int] = []
    model[1].register_forward_hook(lambda *a: calls.append(1))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        gm(X)
    assert calls == [1]


def test_hooks_registered_before_conversion_do_not_warn() -> None:
    model = mlp()
    model[0].register_forward_hook(lambda *a: None)
    gm = convert(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        gm(X)


def test_the_change_stamp_moves_on_registrations() -> None:
    """The private counter the watch reads (``RemovableHandle.next_id``) still moves on this
    torch release, as do the registration hooks it installs."""
    model = mlp()
    convert(model)
    stamp = _changes()
    handle = model[0].register_forward_hook(lambda *a: None)
    assert _changes() != stamp
    stamp = _changes()
    model[0].bias = nn.Parameter(torch.zeros(8))
    assert _changes() != stamp
    handle.remove()


@pytest.mark.parametrize("capture", ["export", "symbolic"])
@pytest.mark.parametrize("level", ["O1", "O2", "O3"])
def test_converted_modules_pickle(level: str, capture: str) -> None:
    model = mlp()
    inputs = (X,) if capture == "export" else None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        gm = amprewrite.convert(model, inputs, dtype=bf16, opt_level=level)
    buffer = io.BytesIO()
    torch.save(gm, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    with torch.no_grad():
        assert torch.equal(loaded(X), gm(X))
        assert torch.equal(pickle.loads(pickle.dumps(gm))(X), gm(X))
        # the loaded module reads its own parameters, not constants of the old values
        next(loaded.parameters()).mul_(0)
        assert not torch.equal(loaded(X), gm(X))


def test_input_check_from_another_python_says_so() -> None:
    model = mlp()
    gm = convert(model)
    guards = gm.get_submodule("_guards_fn")
    assert isinstance(guards, InputGuards)
    code = guards.__reduce__()[1][0]
    with pytest.raises(TypeError, match="pickled on Python 2.7"):
        _rebuilt_guards(code, (2, 7))


@pytest.mark.parametrize("kept", [False, True], ids=["default", "cache_weights"])
def test_serving_under_inference_mode_follows_updates(kept: bool) -> None:
    """The serving pattern: ``inference_mode`` forwards between weight updates (O1 and O2)."""
    for level in ("O1", "O2"):
        model, source = mlp(), mlp(1)
        gm = convert(model) if level == "O1" else convert(model, opt_level="O2")
        with amprewrite.cache_weights(gm) if kept else _nothing():
            with torch.inference_mode():
                before = gm(X)
            with torch.no_grad():
                for p, q in zip(model.parameters(), source.parameters()):
                    p.copy_(q)  # moves the version counters: followed either way
            with torch.inference_mode():
                after = gm(X)
        fresh = convert(source) if level == "O1" else convert(source, opt_level="O2")
        assert not torch.equal(before, after)
        assert torch.equal(after, infer(fresh, False)), level


def test_o2_a_replaced_trained_master_remakes_the_copies_it_shares_a_node_with() -> None:
    """The copies of trained masters share one autograd node; a new parameter makes them all
    again, and later steps rewrite the copies the forward reads."""
    model = mlp()
    gm = o2(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    amprewrite.MasterWeights(gm, opt)
    train_step(gm, opt)
    model[2].weight = nn.Parameter(torch.randn(4, 8))
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    amprewrite.MasterWeights(gm, opt)
    for _ in range(3):
        train_step(gm, opt)
        assert torch.equal(infer(gm, False), infer(o2(model), False))
    store = getattr(gm, LOW_COPIES_ATTR)
    nodes = {c.grad_fn for _, c in store.copies()}
    assert len(nodes) == 1 and len(store.copies()) == 4
