"""Weight casts: none per inference forward (kept copies, remade when weights change and
otherwise rewritten by one batched copy per call, ``tests/test_stale_weights.py``),
autograd-tracked casts in training, copies released with the module or on demand."""

from __future__ import annotations

import copy
import gc
import weakref
from typing import Any, Callable

import pytest
import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode
from _counting import CountingDict

import amprewrite
from amprewrite import Policy
from amprewrite.runtime.weight_cache import CACHE_ATTR, WeightCastCache

bf16 = torch.bfloat16


class WeightCasts(TorchDispatchMode):
    """Counts the weights cast: dtype conversions whose source is one of ``weights`` (by
    storage), and weights packed by a batched cast (``cat`` of their flat views, then one
    conversion of the packed buffer).

    NB: under inference mode ``x.to(dtype)`` reaches the mode as ``aten.to.dtype``, not yet
    decomposed into ``_to_copy``."""

    def __init__(self, weights: list[torch.Tensor]) -> None:
        super().__init__()
        self.storages = {w.untyped_storage().data_ptr() for w in weights}
        self.count = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func in (torch.ops.aten._to_copy.default, torch.ops.aten.to.dtype) and \
                args[0].untyped_storage().data_ptr() in self.storages:
            self.count += 1
        if func is torch.ops.aten.cat.default:
            self.count += sum(t.untyped_storage().data_ptr() in self.storages for t in args[0])
        return func(*args, **(kwargs or {}))


def weight_casts(model: nn.Module, fn: Callable[[], Any]) -> int:
    mode = WeightCasts(list(model.parameters()))
    with mode:
        fn()
    return mode.count


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))


def converted(model: nn.Module, policy: Policy | None = None) -> torch.fx.GraphModule:
    return amprewrite.convert(model, (torch.randn(3, 8),),
                              policy=policy or Policy.autocast("cpu", bf16))


def autocast_out(model: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad(), torch.autocast("cpu", bf16):
        return model(x)


def cache_of(gm: nn.Module) -> WeightCastCache:
    return gm.__dict__[CACHE_ATTR]


@pytest.mark.parametrize("context", [torch.no_grad, torch.inference_mode])
def test_inference_forward_casts_no_weights(context: Callable[[], Any]) -> None:
    model = mlp()
    gm = converted(model)
    x = torch.randn(3, 8)
    with context():
        assert weight_casts(model, lambda: gm(x)) == 4  # first forward: copies made
        assert weight_casts(model, lambda: gm(x)) == 0
        assert weight_casts(model, lambda: gm(x)) == 0
        assert torch.equal(gm(x), autocast_out(model, x))
    assert len(cache_of(gm)) == 4


def test_frozen_weights_cached_with_grad_enabled() -> None:
    model = mlp().requires_grad_(False)
    gm = converted(model)
    x = torch.randn(3, 8, requires_grad=True)
    gm(x)
    assert weight_casts(model, lambda: gm(x)) == 0
    out = gm(x)
    out.float().sum().backward()  # the cached copies may be saved for backward
    assert x.grad is not None


def test_training_casts_stay_in_autograd_graph() -> None:
    model = mlp()
    gm = converted(model)
    x = torch.randn(3, 8)
    for _ in range(2):  # no caching with grad: one cast per weight per forward
        assert weight_casts(model, lambda: gm(x).float().square().mean().backward()) == 4
    assert len(cache_of(gm)) == 0
    model.zero_grad()
    with torch.autocast("cpu", bf16):
        out = model(x)
    out.float().square().mean().backward()
    want = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    gm(x).float().square().mean().backward()
    for w, p in zip(want, model.parameters()):  # gradients reach the fp32 master weights
        assert p.grad.dtype == torch.float32
        assert torch.equal(w, p.grad)


class Blocks(nn.Module):
    """Pre-norm residual blocks, and a layer the forward never uses."""

    def __init__(self, depth: int = 3) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.norms = nn.ModuleList(nn.LayerNorm(8) for _ in range(depth))
        self.fcs = nn.ModuleList(nn.Linear(8, 8) for _ in range(depth))
        self.unused = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for norm, fc in zip(self.norms, self.fcs):
            x = x + fc(norm(x))
        return x


def _gradient_arrivals(model: nn.Module, run: Callable[[], torch.Tensor]) -> list[str]:
    """The layers (``norms.2``, ``fcs.2``, ...) in the order their gradients reach ``.grad``."""
    order: list[str] = []
    hooks = [p.register_post_accumulate_grad_hook(
        lambda p, name=name.rpartition(".")[0]: order.append(name))
        for name, p in model.named_parameters()]
    try:
        run().float().square().mean().backward()
    finally:
        for hook in hooks:
            hook.remove()
    return list(dict.fromkeys(order))  # each layer once, where its first gradient arrived


@pytest.mark.parametrize("policy", [Policy.autocast("cpu", bf16), Policy(dtype=bf16)],
                         ids=["preset", "default"])
def test_weight_gradients_arrive_as_backward_reaches_their_layer(policy: Policy) -> None:
    """A weight cast's backward runs right after its consumer's, as under torch.autocast, not
    at the end of backward: each low-precision gradient is freed as soon as it is made, and
    DDP can all-reduce a layer's gradients while the backward computes the earlier layers'."""
    model, x = Blocks(), torch.randn(2, 8)
    gm = amprewrite.convert(model, (x,), policy=policy)

    def autocast_run() -> torch.Tensor:
        with torch.autocast("cpu", bf16):
            return model(x)

    want = _gradient_arrivals(model, autocast_run)
    assert want == ["fcs.2", "norms.2", "fcs.1", "norms.1", "fcs.0", "norms.0"]
    want_grads = [p.grad for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    assert _gradient_arrivals(model, lambda: gm(x)) == want
    for w, p in zip(want_grads, model.parameters()):
        assert (w is None) == (p.grad is None)  # the unused layer gets no gradient
        assert w is None or (p.grad.dtype == torch.float32 and torch.equal(w, p.grad))
    assert model.unused.weight.grad is None


def test_each_weight_cast_is_made_where_the_weight_is_used() -> None:
    model, x = Blocks(), torch.randn(2, 8)
    code = amprewrite.convert(model, (x,), policy=Policy.autocast("cpu", bf16)).code
    lines = [line.strip() for line in code.splitlines()]
    for i in range(3):
        suffix = f"_{i}" if i else ""
        cast = lines.index(f"fcs_{i}_weight_bf16 = fcs_{i}_weight.bfloat16()  "
                           "# bf16[8, 8] kept copy or autograd cast")
        assert lines[cast + 2].startswith(f"linear{suffix} = ")  # after the bias's cast


@pytest.mark.parametrize("make_opt", [
    lambda ps: torch.optim.SGD(ps, lr=0.1),
    lambda ps: torch.optim.AdamW(ps, lr=0.1, foreach=True),
])
def test_cache_refreshed_after_optimizer_step(make_opt: Callable[[Any], Any]) -> None:
    model = mlp()
    gm = converted(model)
    x = torch.randn(3, 8)
    opt = make_opt(model.parameters())
    with torch.no_grad():
        before = gm(x)
    gm(x).float().square().mean().backward()
    opt.step()
    with torch.no_grad():
        assert weight_casts(model, lambda: gm(x)) == 4  # every weight changed: all recast
        after = gm(x)
    assert not torch.equal(before, after)
    assert torch.equal(after, autocast_out(model, x))


def test_only_changed_weights_recast() -> None:
    model = mlp()
    gm = converted(model)
    x = torch.randn(3, 8)
    with torch.no_grad():
        gm(x)
        model[2].bias.add_(1)
        assert weight_casts(model, lambda: gm(x)) == 1
        assert torch.equal(gm(x), autocast_out(model, x))


def test_cache_refreshed_after_load_state_dict() -> None:
    model = mlp()
    gm = converted(model)
    x = torch.randn(3, 8)
    with torch.no_grad():
        gm(x)
    torch.manual_seed(1)
    other = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))
    model.load_state_dict(other.state_dict())
    with torch.no_grad():
        assert torch.equal(gm(x), autocast_out(other, x))


def test_cache_refreshed_after_parameter_replaced_or_data_swapped() -> None:
    model = nn.Sequential(nn.Linear(8, 4))
    gm = amprewrite.convert(model, capture="symbolic", policy=Policy.autocast("cpu", bf16))
    gm.train()  # NB: until the other mode is captured, gm holds the model to capture it from
    gm.eval()
    x = torch.randn(3, 8)
    layer = gm.get_submodule("0")  # holds the weights the graph reads

    def reference() -> torch.Tensor:
        return autocast_out(lambda v: torch.nn.functional.linear(v, layer.weight, layer.bias), x)

    with torch.no_grad():
        gm(x)
        old = layer.weight
        layer.weight = nn.Parameter(torch.randn(4, 8))  # replaced tensor: new identity
        assert torch.equal(gm(x), reference())
        layer.bias.data = torch.randn(4)  # same object, new storage, same _version
        assert torch.equal(gm(x), reference())
    ref = weakref.ref(old)
    del old, model  # the user's model shares the replaced weight
    gc.collect()
    assert ref() is None
    assert len(cache_of(gm)) == 2  # the dead weight's copy went with it


def test_clear_weight_cache() -> None:
    model = mlp()
    gm = converted(model)
    x = torch.randn(3, 8)
    with torch.no_grad():
        gm(x)
        assert cache_of(gm).nbytes() > 0
        assert amprewrite.clear_weight_cache(gm) == 4
        assert len(cache_of(gm)) == 0
        # what clear_weight_cache is for inside cache_weights: a write through .data keeps
        # _version (outside the region every call rewrites the copies anyway)
        with amprewrite.cache_weights(gm):
            gm(x)
            model[0].weight.data.copy_(torch.randn(16, 8))
            amprewrite.clear_weight_cache(gm)
            assert weight_casts(model, lambda: gm(x)) == 4
            assert torch.equal(gm(x), autocast_out(model, x))
    assert amprewrite.clear_weight_cache(nn.Linear(2, 2)) == 0
    with pytest.raises(TypeError, match="clear_weight_cache"):
        amprewrite.clear_weight_cache(gm.code)  # type: ignore[arg-type]


def test_copies_released_with_module() -> None:
    gm = converted(mlp())
    with torch.no_grad():
        gm(torch.randn(3, 8))
    copy_ref = weakref.ref(next(iter(cache_of(gm)._entries.values())).copy)
    cache_ref = weakref.ref(cache_of(gm))
    del gm
    gc.collect()
    assert cache_ref() is None and copy_ref() is None


def test_deepcopy_starts_with_empty_cache() -> None:
    gm = converted(mlp())
    with torch.no_grad():
        gm(torch.randn(3, 8))
    clone = copy.deepcopy(gm)
    assert len(cache_of(clone)) == 0 and len(cache_of(gm)) == 4
    x = torch.randn(3, 8)
    with torch.no_grad():
        assert torch.equal(clone(x), gm(x))


def test_inference_tensor_weights_are_cast_each_time() -> None:
    with torch.inference_mode():
        model = mlp()
    gm = amprewrite.convert(model, capture="symbolic", policy=Policy.autocast("cpu", bf16))
    x = torch.randn(3, 8)
    with torch.inference_mode():
        gm(x)
        assert weight_casts(model, lambda: gm(x)) == 4  # no version counter: never cached
        model[0].weight.add_(1)
        assert torch.equal(gm(x), autocast_out(model, x))


def test_unchanged_weights_get_the_copies_handed_last_time() -> None:
    """A second inference lookup of unchanged weights hands the same copies without a lookup
    per weight; an in-place update, new storage or a weight's death makes it look again."""
    cache = WeightCastCache()
    ws = [torch.randn(4, 4) for _ in range(3)]
    with torch.no_grad():
        first = cache.lookup_many(ws, bf16)
        cache._entries = CountingDict(cache._entries)
        assert all(a is b for a, b in zip(cache.lookup_many(ws, bf16), first))
        assert cache._entries.reads == 0
        ws[1].add_(1)  # in place: version moves
        assert torch.equal(cache.lookup_many(ws, bf16)[1], ws[1].to(bf16))
        ws[2].data = torch.randn(4, 4)  # new storage
        assert torch.equal(cache.lookup_many(ws, bf16)[2], ws[2].to(bf16))
        assert cache._handed
        del ws[0]  # dies: its id may go to the next tensor, which must not get its copy
        assert not cache._handed  # and no record keeps its copy alive
        ws.insert(0, torch.randn(4, 4))
        assert torch.equal(cache.lookup_many(ws, bf16)[0], ws[0].to(bf16))


def test_handed_copies_are_not_kept_for_weights_already_low_or_inference_tensors() -> None:
    cache = WeightCastCache()
    low = torch.randn(4, 4, dtype=bf16)
    with torch.no_grad():
        assert cache.lookup_many([torch.randn(4, 4), low], bf16)[1] is low
    assert not cache._handed  # the record would hold ``low`` alive
    with torch.inference_mode():
        w = torch.randn(4, 4)
        cache.lookup_many([w], bf16)
        assert not cache._handed  # no version counter to check it against
        w.add_(1)
        assert torch.equal(cache.lookup_many([w], bf16)[0], w.to(bf16))
