"""convert(opt_level=...): O0 / O2 / O3 graphs, their dtypes, and the user's model untouched."""

from __future__ import annotations

import contextlib
import gc
import re
import weakref

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import amprewrite
from _graphs import weight_entries
from amprewrite import AmpRewriteError, Policy
from amprewrite.graph.meta import cast_info
from amprewrite.runtime.low_copies import LOW_COPIES_ATTR, LowPrecisionCopies

pytestmark = pytest.mark.usefixtures("one_thread")


class Net(nn.Module):
    def __init__(self, norm: str = "layer") -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc1 = nn.Linear(8, 16)
        self.norm = {"layer": nn.LayerNorm, "batch": nn.BatchNorm1d, "rms": nn.RMSNorm}[norm](16)
        self.fc2 = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.norm(F.gelu(self.fc1(x))))


def _state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


def _same_state(model: nn.Module, before: dict[str, torch.Tensor]) -> bool:
    now = model.state_dict()
    return now.keys() == before.keys() and all(
        now[k].dtype == v.dtype and torch.equal(now[k], v) for k, v in before.items())


X = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))


# -- errors -----------------------------------------------------------------------------------
def test_unknown_opt_level() -> None:
    with pytest.raises(ValueError, match=r"opt_level='O4' does not exist; expected one of "
                                         r"'O0', 'O1', 'O2', 'O3'"):
        amprewrite.convert(Net(), (X,), opt_level="O4")


def test_opt_level_is_not_case_folded() -> None:
    with pytest.raises(ValueError, match="opt_level='o2' does not exist"):
        amprewrite.convert(Net(), (X,), opt_level="o2")


def test_policy_only_with_o1() -> None:
    with pytest.raises(ValueError, match="a policy was given with opt_level='O2'"):
        amprewrite.convert(Net(), (X,), opt_level="O2",
                           policy=Policy.autocast("cpu", torch.bfloat16))


def test_dtype_not_with_o0() -> None:
    with pytest.raises(ValueError, match=r"dtype=torch.float16 was given with opt_level='O0'"):
        amprewrite.convert(Net(), (X,), opt_level="O0", dtype=torch.float16)


# -- O0 and O1 --------------------------------------------------------------------------------
@pytest.mark.parametrize("inputs", [(X,), None], ids=["export", "symbolic"])
def test_o0_runs_exactly_as_the_model(inputs: tuple | None) -> None:
    model = Net()
    gm = amprewrite.convert(model, inputs, opt_level="O0")
    assert not [n for n in gm.graph.nodes if cast_info(n) is not None]
    assert ".to(" not in gm.code and "cast" not in gm.code
    out, ref = gm(X), model(X)
    assert out.dtype == torch.float32 and torch.equal(out, ref)
    out.sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    model(X).sum().backward()
    assert all(torch.equal(g, p.grad) for g, p in zip(grads, model.parameters()))


def test_o1_is_the_default() -> None:
    model = Net()
    assert amprewrite.convert(model, (X,)).code == \
        amprewrite.convert(model, (X,), opt_level="O1").code


# -- O2 ---------------------------------------------------------------------------------------
def test_o2_graph() -> None:
    model = Net()
    before = _state(model)
    gm = amprewrite.convert(model, (X,), opt_level="O2", dtype=torch.float16)
    code = gm.code
    entries = weight_entries(gm)
    for weight in ("fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"):
        assert (weight, torch.float16, "low copy") in entries  # read as stored fp16 copies
        name = weight.replace(".", "_")
        assert re.search(rf"\n    [ (]{name}_f16, +# f16\[[0-9, ]+\] stored copy \(O2\)\n", code)
    assert ("norm.weight",) in entries and re.search(r"\n    [ (]norm_weight, +# f32\[16\]\n", code)
    vals = {n.name: n.meta["val"].dtype for n in gm.graph.nodes
            if isinstance(n.meta.get("val"), torch.Tensor)}
    assert vals["x_f16"] == vals["linear"] == vals["gelu"] == torch.float16
    # a CPU's layer norm takes the fp16 activation with its fp32 master weight, no cast
    assert vals["layer_norm"] == torch.float16 and "linear_f32" not in vals
    assert vals["linear_1"] == torch.float16
    # the masters are the model's own fp32 parameters; nothing of the model changed
    assert [id(p) for p in gm.parameters()] == [id(p) for p in model.parameters()]
    assert _same_state(model, before)
    with torch.no_grad():
        out = gm(X)
    assert out.dtype == torch.float32 and out.shape == (4, 4)


def test_o2_norm_without_mixed_kernel_computes_in_fp32() -> None:
    gm = amprewrite.convert(Net(norm="rms"), (X,), opt_level="O2", dtype=torch.float16)
    assert ("norm.weight",) in weight_entries(gm)  # the fp32 master
    vals = {n.name: n.meta["val"].dtype for n in gm.graph.nodes
            if isinstance(n.meta.get("val"), torch.Tensor)}
    assert vals["gelu_f32"] == vals["rms_norm"] == torch.float32  # cast up, fp32 norm
    assert vals["rms_norm_f16"] == vals["linear_1"] == torch.float16  # cast back down


def test_o2_symbolic_matches_export_bitwise() -> None:
    model = Net()
    static = amprewrite.convert(model, (X,), opt_level="O2", dtype=torch.float16)
    guarded = amprewrite.convert(model, opt_level="O2", dtype=torch.float16)
    assert "guarded_cast" in guarded.code
    with torch.no_grad():
        assert torch.equal(static(X), guarded(X))


@pytest.mark.parametrize("inputs", [(X,), None], ids=["export", "symbolic"])
def test_o2_batchnorm_keeps_fp32_params_and_stats(inputs: tuple | None) -> None:
    model = Net(norm="batch")
    before = _state(model)
    gm = amprewrite.convert(model, inputs, opt_level="O2", dtype=torch.float16)
    assert _same_state(model, before)  # conversion ran no real batch statistics
    opt = torch.optim.SGD(gm.parameters(), lr=0.1)
    amprewrite.MasterWeights(gm, opt)
    gm(X).sum().backward()
    assert model.norm.weight.grad.dtype == torch.float32
    assert model.norm.running_mean.dtype == torch.float32
    assert not torch.equal(model.norm.running_mean, before["norm.running_mean"])
    assert model.fc1.weight.grad.dtype == torch.float32


def test_o2_forward_with_grad_needs_bound_optimizer() -> None:
    gm = amprewrite.convert(Net(), (X,), opt_level="O2", dtype=torch.float16)
    with pytest.raises(AmpRewriteError, match=r"amprewrite.MasterWeights\(gm, optimizer\)"):
        gm(X)
    with torch.no_grad():
        gm(X)  # inference needs no optimizer


def test_o2_store_hands_masters_already_low_as_they_are() -> None:
    """A master already in the low dtype is its own copy: never stored, and no reason for the
    unbound-optimizer error (nothing would go stale)."""
    store = LowPrecisionCopies()
    low = torch.randn(3, dtype=torch.bfloat16, requires_grad=True)
    high = torch.randn(3, requires_grad=True)
    assert store.get_many([low], torch.bfloat16)[0] is low  # unbound, grad mode: no error
    with pytest.raises(AmpRewriteError, match="no optimizer is bound"):
        store.get_many([low, high], torch.bfloat16)
    store.bindings = 1
    got = store.get_many([low, high], torch.bfloat16)
    assert got[0] is low and torch.equal(got[1], high.bfloat16())
    assert [m is high for m, _ in store.copies()] == [True]


def test_o2_store_keeps_nothing_made_under_a_fake_mode() -> None:
    """Fake-tensor propagation (at conversion, in tracers) sees plain casts of real masters,
    and no fake copy is left in the store."""
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    store = LowPrecisionCopies()
    store.bindings = 1
    master = torch.randn(3, requires_grad=True)
    with FakeTensorMode(allow_non_fake_inputs=True):
        got = store.get_many([master], torch.bfloat16)
    assert isinstance(got[0], FakeTensor) and got[0].dtype == torch.bfloat16
    assert not store.copies()
    real = store.get_many([master], torch.bfloat16)[0]
    assert not isinstance(real, FakeTensor) and torch.equal(real, master.detach().bfloat16())


def test_o2_copies_follow_fused_steps_and_loads() -> None:
    model = Net()
    gm = amprewrite.convert(model, (X,), opt_level="O2", dtype=torch.bfloat16)
    # NB: fused AdamW updates in place without moving the version counter.
    opt = torch.optim.AdamW(gm.parameters(), lr=0.1, fused=True)
    amprewrite.MasterWeights(gm, opt)
    store = getattr(gm, LOW_COPIES_ATTR)
    gm(X).sum().backward()
    opt.step()
    with torch.no_grad():
        gm(X)  # the step marked the copies stale; the forward rewrites them
    pairs = store.copies()
    assert len(pairs) == 4
    assert all(torch.equal(copy_, master.detach().to(torch.bfloat16)) for master, copy_ in pairs)
    # load_state_dict writes in place: the next forward notices
    other = Net()
    torch.nn.init.constant_(other.fc1.weight, 0.5)
    gm.load_state_dict(other.state_dict())
    with torch.no_grad():
        gm(X)
    copy_ = next(c for m, c in store.copies() if m is model.fc1.weight)
    assert torch.equal(copy_, torch.full_like(copy_, 0.5))


class _Ops(torch.utils._python_dispatch.TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.ops.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def test_o2_step_rewrites_every_copy_in_place_with_one_batched_copy() -> None:
    gm = amprewrite.convert(Net(), (X,), opt_level="O2", dtype=torch.float16)
    opt = torch.optim.SGD(gm.parameters(), lr=0.1)
    amprewrite.MasterWeights(gm, opt)
    store = getattr(gm, LOW_COPIES_ATTR)
    gm(X).float().square().mean().backward()
    before = {id(m): c for m, c in store.copies()}
    nodes = {id(m): c.grad_fn for m, c in store.copies()}
    with torch.no_grad():
        opt.step()  # SGD writes the masters in place (foreach or not), then the hook refreshes
    ops = _Ops()
    with ops:
        store.refresh()
    # one batched copy for the four copies, no per-weight cast and no new tensor
    assert ops.ops == ["_foreach_copy_"]
    after = store.copies()
    assert len(after) == 4
    for master, copy_ in after:
        assert copy_ is before[id(master)] and copy_.grad_fn is nodes[id(master)]
        assert torch.equal(copy_, master.detach().to(torch.float16))  # bitwise: same rounding
    # the rewritten copies still route gradients to the masters, in fp32
    opt.zero_grad()
    gm(X).float().square().mean().backward()
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in gm.parameters())


def _copies_match(store: LowPrecisionCopies, dtype: torch.dtype) -> bool:
    return all(torch.equal(c, m.detach().to(dtype)) for m, c in store.copies())


@pytest.mark.parametrize("fused", [False, True], ids=["foreach", "fused"])
@pytest.mark.parametrize("kept", [False, True], ids=["default", "cache_weights"])
def test_o2_a_training_step_casts_each_weight_once(fused: bool, kept: bool) -> None:
    """The step marks the copies stale and copies nothing; the next forward brings every copy
    up to date (the step count moved): one cast of each weight per step, and the copies equal
    the masters cast, fused optimizers (no version counter) included; the backward hands
    every gradient to its master in one batched copy."""
    bf16 = torch.bfloat16
    model = Net()
    gm = amprewrite.convert(model, (X,), opt_level="O2", dtype=bf16)
    opt = torch.optim.AdamW(gm.parameters(), lr=0.1, fused=fused, foreach=not fused)
    amprewrite.MasterWeights(gm, opt)
    store = getattr(gm, LOW_COPIES_ATTR)
    with amprewrite.cache_weights(gm) if kept else contextlib.nullcontext():
        for _ in range(3):
            gm(X).float().square().mean().backward()
            with _Ops() as step:
                opt.step()
            opt.zero_grad()
            assert "_foreach_copy_" not in step.ops and "_to_copy" not in step.ops
            with _Ops() as forward:
                gm(X).float().square().mean().backward()
            opt.zero_grad()
            # all four copies rewritten in one call, and all four low-precision gradients
            # handed to the fp32 masters in another
            assert forward.ops.count("_foreach_copy_") == 2
            assert "_to_copy" not in forward.ops[forward.ops.index("_foreach_copy_", 1):]
            assert _copies_match(store, bf16)
    assert torch.is_grad_enabled()


def test_o2_refresh_rewrites_every_copy_in_place() -> None:
    bf16 = torch.bfloat16
    store = LowPrecisionCopies()
    # NB: frozen masters: a trained master's copy keeps it alive through its autograd node
    masters = [torch.randn(4), torch.randn(3)]
    copies = store.get_many(masters, bf16)
    with torch.no_grad():
        masters[0].add_(1)
        masters[1].add_(1)
    store.refresh()
    assert all(torch.equal(store.get(m, bf16), m.detach().to(bf16)) for m in masters)
    assert all(store.get(m, bf16) is c for m, c in zip(masters, copies))
    with torch.inference_mode():  # the copies are normal tensors, rewritten outside it
        with torch.no_grad():
            masters[1].add_(1)
        store.refresh()
    assert torch.equal(store.get(masters[1], bf16), masters[1].detach().to(bf16))
    assert not store.get(masters[1], bf16).is_inference()


def test_o2_store_lets_a_replaced_trained_master_go() -> None:
    """A trained master's copy holds the master through its autograd node: when the module
    gets a new parameter in its place, the next forward drops the old copy, and the old master
    is freed with the user's last reference to it."""
    bf16 = torch.bfloat16
    gm = amprewrite.convert(Net(), (X,), opt_level="O2", dtype=bf16)
    gm.eval()  # NB: until the other mode is captured, gm holds the model to capture it from
    gm.train()
    store = getattr(gm, LOW_COPIES_ATTR)

    def train_step() -> None:
        opt = torch.optim.SGD(gm.parameters(), lr=0.1)
        amprewrite.MasterWeights(gm, opt)
        gm(X).float().square().mean().backward()
        opt.step()

    train_step()
    old = weakref.ref(gm.fc1.weight)
    assert old().requires_grad and store.copies()[0][1].grad_fn is not None
    gm.fc1.weight = nn.Parameter(torch.randn(16, 8))
    train_step()
    with torch.no_grad():
        gm(X)  # the copies of the last step's masters, brought up to date
    gc.collect()
    assert old() is None
    linears = [gm.fc1.weight, gm.fc1.bias, gm.fc2.weight, gm.fc2.bias]  # the norm stays fp32
    assert sorted(id(m) for m, _ in store.copies()) == sorted(map(id, linears))
    assert len(store._entries) == 4 and _copies_match(store, bf16)
    assert store.nbytes() == sum(p.numel() * 2 for p in linears)
    assert gm.fc1.weight.grad is not None and gm.fc1.weight.grad.dtype == torch.float32


def test_o2_backward_after_a_step_fails_as_in_fp32() -> None:
    """A graph recorded before an optimizer step cannot be backpropagated after it: the step
    rewrites the copies the graph saved, as it rewrites an fp32 model's parameters."""
    def forward_step_backward(module: nn.Module, o2: bool) -> None:
        opt = torch.optim.SGD(module.parameters(), lr=0.1)
        if o2:
            amprewrite.MasterWeights(module, opt)
        module(X).float().square().mean().backward()
        loss = module(X).float().square().mean()
        opt.step()
        loss.backward()

    def linears() -> nn.Module:  # no norm: only the low-precision copies are saved
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))

    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        forward_step_backward(linears(), o2=False)
    gm = amprewrite.convert(linears(), (X,), opt_level="O2", dtype=torch.float16)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        forward_step_backward(gm, o2=True)


# -- O3 ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("inputs", [(X,), None], ids=["export", "symbolic"])
def test_o3_owns_low_precision_copies(inputs: tuple | None) -> None:
    model = Net(norm="batch")
    before = _state(model)
    gm = amprewrite.convert(model, inputs, opt_level="O3", dtype=torch.float16)
    params = list(gm.parameters())
    assert all(p.dtype == torch.float16 and p.requires_grad for p in params)
    assert not {id(p) for p in params} & {id(p) for p in model.parameters()}
    assert gm.get_submodule("norm").running_var.dtype == torch.float16 if inputs is None \
        else gm.get_buffer("norm.running_var").dtype == torch.float16
    opt = torch.optim.SGD(gm.parameters(), lr=0.1)
    out = gm(X)
    assert out.dtype == torch.float32
    out.sum().backward()
    opt.step()
    assert _same_state(model, before)
    assert all(p.grad.dtype == torch.float16 for p in params)


# -- type-correct by construction --------------------------------------------------------------
class Fp32Meets(nn.Module):
    """The O2 failures of real models: an fp32 activation the model makes on purpose meets a
    low-precision weight (clip/dinov2: ``pixel_values.to(weight.dtype)``, traced in fp32), and
    bloom's alibi: an fp32 bias in a ``baddbmm`` of low-precision activations."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.patch = nn.Conv2d(3, 8, 2, stride=2)
        self.q = nn.Linear(8, 8)
        self.register_buffer("alibi", torch.randn(1, 4, 4), persistent=False)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        x = self.patch(pixels.to(self.patch.weight.dtype)).flatten(2).transpose(1, 2)
        q = self.q(x)
        scores = torch.baddbmm(self.alibi.expand(q.shape[0], -1, -1), q, q.transpose(1, 2))
        return scores.float().softmax(-1) @ x.float()


@pytest.mark.parametrize("opt_level", ["O2", "O3"])
def test_o2_o3_cast_what_meets_a_low_precision_weight(opt_level: str) -> None:
    model, pixels = Fp32Meets(), torch.randn(2, 3, 4, 4)
    before = _state(model)
    gm = amprewrite.convert(model, (pixels,), opt_level=opt_level, dtype=torch.bfloat16)
    ops = {str(n.target): n for n in gm.graph.nodes if n.op == "call_function"}
    for name in ("aten.conv2d.default", "aten.baddbmm.default"):
        node = ops[name]
        dtypes = {a.meta["val"].dtype for a in node.all_input_nodes}
        assert dtypes == {torch.bfloat16}, (name, dtypes)
    if opt_level == "O2":
        amprewrite.MasterWeights(gm, torch.optim.AdamW(gm.parameters()))
    out = gm(pixels)
    assert out.dtype == torch.float32 and torch.isfinite(out).all()
    out.sum().backward()
    assert _same_state(model, before)  # gradients only; no weight of the model changed
    with torch.no_grad():
        reference = model(pixels)
    assert (out - reference).abs().max() < 0.1 * reference.abs().max()


def test_o0_keeps_same_dtype_conversions_as_aliases() -> None:
    """O0 runs the graph exactly as the model: ``h.float()`` on an fp32 ``h`` is ``h`` itself
    there (no copy node, which would change how autograd sums the gradients of h)."""

    class Twice(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.lin = nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.lin(x)
            return (h.float() * 3 + h * h.float()).sum()

    model, x = Twice(), torch.randn(4, 8)
    gm = amprewrite.convert(model, (x,), opt_level="O0")
    assert not any(n.target is torch.ops.aten._to_copy.default for n in gm.graph.nodes)
    gm(x).backward()
    got = model.lin.weight.grad.clone()
    model.zero_grad()
    model(x).backward()
    assert torch.equal(got, model.lin.weight.grad)


@torch.library.custom_op("amprewrite_test::expert_mm", mutates_args=())
def _expert_mm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """A custom kernel that, like transformers' grouped-mm fallback, needs one dtype."""
    return torch.mm(x, weight)


@_expert_mm.register_fake
def _(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[0], weight.shape[1])


def _expert_mm_backward(ctx: object, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    x, weight = ctx.saved_tensors  # type: ignore[attr-defined]
    return grad @ weight.T.to(grad.dtype), (x.T @ grad).to(weight.dtype)


def _expert_mm_setup(ctx: object, inputs: tuple, output: torch.Tensor) -> None:
    ctx.save_for_backward(*inputs)  # type: ignore[attr-defined]


_expert_mm.register_autograd(_expert_mm_backward, setup_context=_expert_mm_setup)


class CustomExpert(nn.Module):
    """An fp32 activation (the model's own ``.float()``) meets a weight in a custom op."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(8, 8)
        self.expert = nn.Parameter(torch.randn(8, 8) / 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _expert_mm(self.inp(x).float(), self.expert)


@pytest.mark.parametrize("opt_level", ["O2", "O3"])
def test_o2_o3_promote_custom_ops_with_mixed_inputs(opt_level: str) -> None:
    """ATen ops promote mixed dtypes themselves; a custom kernel may reject them, so O2/O3
    cast its inputs to the widest (here the low weight up to fp32). Under O1 it is left alone."""
    model, x = CustomExpert(), torch.randn(4, 8)
    gm = amprewrite.convert(model, (x,), opt_level=opt_level, dtype=torch.bfloat16)
    (node,) = [n for n in gm.graph.nodes if "expert_mm" in str(n.target)]
    assert {a.meta["val"].dtype for a in node.all_input_nodes} == {torch.float32}
    rec = amprewrite.graph.meta.decision(node)
    assert rec.category is amprewrite.OpCategory.PROMOTE and "custom op" in rec.rule
    if opt_level == "O2":
        amprewrite.MasterWeights(gm, torch.optim.SGD(gm.parameters(), lr=0.1))
    out = gm(x)
    out.sum().backward()
    with torch.no_grad():
        reference = model(x)
    assert (out - reference).abs().max() < 0.05 * reference.abs().max()
    o1 = amprewrite.convert(model, (x,), dtype=torch.bfloat16)
    (node,) = [n for n in o1.graph.nodes if "expert_mm" in str(n.target)]
    assert amprewrite.graph.meta.decision(node).category is amprewrite.OpCategory.PASSTHROUGH
