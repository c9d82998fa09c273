"""A converted module's submodules are its model's, at every moment (``amprewrite.module.tree``):
what an optimizer, a checkpoint or a library reads from the converted module is what the model
holds now, not what it held at the capture or at the last call. Compared with eager
``torch.autocast`` under the CPU preset, bitwise."""

from __future__ import annotations

import copy
import subprocess
import sys
import warnings

import pytest
import torch
import torch.nn as nn

import amprewrite
from amprewrite import RecaptureWarning

PRESET = amprewrite.Policy.autocast("cpu", torch.bfloat16)
X = torch.randn(4, 8, generator=torch.Generator().manual_seed(0))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.ReLU())
        self.head = nn.Linear(16, 4)
        self.scale = nn.Parameter(torch.ones(4))
        self.act = nn.ReLU()  # holds no tensor: no capture makes a module for it

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x)) * self.scale


def _convert(model: nn.Module, route: str, **kw: object) -> torch.fx.GraphModule:
    if route == "export":
        return amprewrite.convert(model, (X,), policy=PRESET, **kw)
    return amprewrite.convert(model, policy=PRESET, capture="symbolic", **kw)


def _eager(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.autocast("cpu", torch.bfloat16):
        return model(x)


def _quiet_call(gm: nn.Module, x: torch.Tensor) -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RecaptureWarning)
        return gm(x)


ROUTES = ["export", "symbolic"]


@pytest.mark.parametrize("route", ROUTES)
def test_the_children_and_tensors_are_the_models(route: str) -> None:
    model = Net()
    gm = _convert(model, route)
    assert gm.body is model.body and gm.head is model.head and gm.act is model.act
    assert gm.body[0] is model.body[0]
    assert list(gm.state_dict()) == list(model.state_dict())
    assert all(gm.state_dict(keep_vars=True)[k] is v
               for k, v in model.state_dict(keep_vars=True).items())
    mine = dict(gm.named_parameters())
    assert {k: id(v) for k, v in mine.items()} == \
        {k: id(v) for k, v in model.named_parameters()}
    assert {type(m) for _, m in gm.named_modules() if m is not gm} >= {nn.Linear, nn.LayerNorm}


@pytest.mark.parametrize("route", ROUTES)
def test_a_head_replaced_before_the_optimizer_is_built_trains(route: str) -> None:
    """The row of the drop-in issue: replace the head, build the optimizer over
    ``gm.parameters()`` before any call, train: the new head trains, bitwise with eager."""
    torch.manual_seed(0)
    model = Net()
    twin = copy.deepcopy(model)
    gm = _convert(model, route)
    model.head = nn.Linear(16, 3)
    model.scale = nn.Parameter(torch.full((3,), 0.5))
    twin.head = copy.deepcopy(model.head)
    twin.scale = copy.deepcopy(model.scale)
    assert gm.head is model.head and gm.scale is model.scale  # at once, before any call
    assert gm.state_dict(keep_vars=True)["head.weight"] is model.head.weight
    opt = torch.optim.SGD(gm.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(twin.parameters(), lr=0.1)
    before = model.head.weight.detach().clone()
    for step in range(3):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
        out, ref = _quiet_call(gm, x), _eager(twin, x)
        assert out.shape == (4, 3) and torch.equal(out, ref), step
        out.square().mean().backward()
        ref.square().mean().backward()
        opt.step(), ref_opt.step()
        opt.zero_grad(), ref_opt.zero_grad()
    assert not torch.equal(model.head.weight, before)
    for (name, p), q in zip(model.named_parameters(), twin.parameters()):
        assert torch.equal(p, q), name


def test_load_state_dict_reaches_the_models_new_head() -> None:
    model = Net()
    gm = _convert(model, "export")
    model.head = nn.Linear(16, 4)
    saved = {k: torch.full_like(v, 0.25) for k, v in model.state_dict().items()}
    gm.load_state_dict(saved)
    assert torch.equal(model.head.weight, saved["head.weight"])
    assert torch.equal(gm(X), _eager(model, X))


def test_a_child_added_to_the_model_is_the_converted_modules() -> None:
    model = Net()
    gm = _convert(model, "export")
    model.extra = nn.Linear(2, 2)
    assert gm.extra is model.extra
    assert "extra.weight" in gm.state_dict()
    assert any(p is model.extra.weight for p in gm.parameters())


@pytest.mark.parametrize("route", ROUTES)
def test_the_table_of_children_is_the_models_and_holds_no_helper(route: str) -> None:
    """The converted module's children are the model's ``_modules`` itself: no module of the
    graph's own (torch.export's input check, a fused-attention sub-graph) is a child, so
    ``named_modules()`` lists the model's modules and none in eval mode that the model has
    in train mode (Lightning counts those)."""
    model = Net()
    gm = _convert(model, route)
    assert gm._modules is model._modules
    assert [n for n, _ in gm.named_modules()][1:] == [n for n, _ in model.named_modules()][1:]
    assert all(m.training for m in gm.modules())
    attention = nn.MultiheadAttention(8, 2, batch_first=True).eval()

    class Self(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attn = attention

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.attn(x, x, x, need_weights=False)[0]

    fused = amprewrite.convert(Self(), (torch.randn(2, 3, 8),), policy=PRESET)
    assert "multi_head_attention(" in fused.code  # its composite ops: a sub-graph
    assert [n for n, _ in fused.named_children()] == ["attn"]
    assert list(fused.state_dict()) == [f"attn.{k}" for k in attention.state_dict()]


@pytest.mark.parametrize("route", ROUTES)
def test_a_child_deleted_or_set_on_either_is_the_others(route: str) -> None:
    """``del model.head`` leaves the converted module without one, and ``gm.head = ...`` is
    the model's head (the view's table is the model's): the next call computes with it,
    bitwise, and an optimizer over ``gm.parameters()`` trains it."""
    torch.manual_seed(0)
    model = Net()
    gm = _convert(model, route)
    del model.head
    assert not hasattr(gm, "head") and "head.weight" not in gm.state_dict()
    gm.head = nn.Linear(16, 4)
    assert model.head is gm.head
    twin = copy.deepcopy(model)
    opt = torch.optim.SGD(gm.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(twin.parameters(), lr=0.1)
    for step in range(2):
        out, ref = _quiet_call(gm, X), _eager(twin, X)
        assert torch.equal(out, ref), step
        out.square().mean().backward()
        ref.square().mean().backward()
        opt.step(), ref_opt.step(), opt.zero_grad(), ref_opt.zero_grad()
    assert torch.equal(model.head.weight, twin.head.weight)
    del gm.head
    assert "head" not in model._modules


@pytest.mark.parametrize("route", ROUTES)
def test_tensors_added_to_the_models_root_are_the_converted_modules(route: str) -> None:
    """A parameter and buffers registered on the model's root after conversion: in
    ``gm.parameters()`` and ``gm.state_dict()`` as in the model's (a non-persistent buffer in
    neither), and a state dict round-trips between the two, strictly."""
    model = Net()
    gm = _convert(model, route)
    model.bonus = nn.Parameter(torch.ones(2))
    model.register_buffer("seen", torch.zeros(3))
    model.register_buffer("scratch", torch.zeros(3), persistent=False)
    assert gm.bonus is model.bonus and gm.seen is model.seen and gm.scratch is model.scratch
    assert any(p is model.bonus for p in gm.parameters())
    assert list(gm.state_dict()) == list(model.state_dict())
    assert "scratch" not in gm.state_dict()
    saved = {k: torch.full_like(v, 0.5) for k, v in model.state_dict().items()}
    gm.load_state_dict(saved)  # strict: the same keys
    assert torch.equal(model.bonus, saved["bonus"]) and torch.equal(model.seen, saved["seen"])
    model.load_state_dict(gm.state_dict())
    twin = copy.deepcopy(gm)
    assert list(twin.state_dict()) == list(model.state_dict())


def test_every_kept_graph_reads_the_models_tree_when_its_state_returns() -> None:
    """Replace the head (a new graph), put the old head back (the first graph again): each
    call computes with the head the model holds, bitwise."""
    model = Net()
    gm = _convert(model, "export")
    old, new = model.head, nn.Linear(16, 4)
    for head in (new, old, new):
        model.head = head
        assert gm.head is head
        assert torch.equal(_quiet_call(gm, X), _eager(model, X))
    assert len(amprewrite.module.cache.cache_of(gm).entries) == 2


def test_modes_are_the_models() -> None:
    model = Net().train()
    gm = _convert(model, "export")
    gm.eval()
    assert not model.training and not model.body[1].training
    model.train()
    _quiet_call(gm, X)
    assert gm.training
    model.body.eval()  # a submodule's flag is the converted module's submodule's
    assert not gm.body.training


def test_a_deep_copy_is_a_view_of_its_own_copy_of_the_model() -> None:
    model = Net()
    gm = _convert(model, "export")
    twin = copy.deepcopy(gm)
    assert twin.head is not model.head and isinstance(twin.head, nn.Linear)
    assert torch.equal(twin(X), gm(X))
    model.head = nn.Linear(16, 4)
    assert twin.head is not model.head
    with torch.no_grad():
        twin.head.weight.zero_()
    assert not torch.equal(model.head.weight, twin.head.weight)


def test_o3_runs_on_copies_of_its_own() -> None:
    model = Net()
    gm = amprewrite.convert(model, (X,), opt_level="O3")
    assert gm.head is not model.head
    model.head = nn.Linear(16, 4)
    assert gm.head is not model.head


def test_the_first_conversion_in_a_process_holds_its_guards_at_once() -> None:
    """Following the model's tree installs torch's global registration hooks (once per
    process), which make hook handles: the cache's stamp is taken after them, so the first
    call of the first conversion takes the fast path."""
    code = ("import torch, torch.nn as nn, amprewrite\n"
            "from amprewrite.module.cache import cache_of\n"
            "model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())\n"
            "gm = amprewrite.convert(model, (torch.randn(2, 4),))\n"
            "assert gm.get_submodule('0') is model[0]\n"
            "assert cache_of(gm).holds(gm), 'guards fail right after conversion'\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]


# ---------------------------------------------------------------------------------------------
# every path is the model's, where a capture's child holds constants torch.export lifted
class _Scaled(nn.Module):
    """A child whose forward makes a tensor constant: torch.export lifts it, and its unlifted
    module holds it under this child's path, which the model's child does not hold."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * torch.tensor([2.0, 1.0, 0.5, 1.0, 2.0, 1.0, 0.5, 1.0])


class _Lifting(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = nn.Sequential(_Scaled(), nn.ReLU())
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.block(x))


def _assert_every_path_is_the_models(gm: nn.Module, model: nn.Module) -> None:
    paths = [(path, module) for path, module in model.named_modules() if path]
    assert paths
    for path, module in paths:
        assert gm.get_submodule(path) is module, path
        parent, _, name = path.rpartition(".")
        if name:  # attribute access, as user code reads it (gm.model.layers)
            assert getattr(gm.get_submodule(parent), name) is module, path
    assert [n for n, _ in gm.named_modules()][1:] == [n for n, _ in model.named_modules()][1:]
    assert [(n, id(p)) for n, p in gm.named_parameters()] == \
        [(n, id(p)) for n, p in model.named_parameters()]
    assert list(gm.state_dict()) == list(model.state_dict())


def test_a_child_holding_lifted_constants_is_the_models() -> None:
    """The capture's ``block.0`` holds a constant the model's does not: the graph reads it
    from a root buffer, and ``gm.block`` is the model's, at every path, bitwise as eager."""
    model = _Lifting()
    signature = torch.export.export(model, (X,)).graph_signature
    lifted = [n for n in signature.lifted_tensor_constants if n.startswith("block.")]
    assert lifted, "this torch lifts the constant elsewhere: the test checks nothing"
    gm = _convert(model, "export")
    _assert_every_path_is_the_models(gm, model)
    assert type(gm.block) is nn.Sequential and list(gm.block) == list(model.block)
    assert not any(isinstance(v, nn.Module) for k, v in vars(gm).items() if k in model._modules)
    assert torch.equal(gm(X), _eager(model, X))
    moved = [n for n, _ in gm.named_buffers(recurse=False) if n.startswith("block_")]
    assert len(moved) == 1 and moved[0] not in gm.state_dict()  # a root buffer, not saved
    gm.double()  # which follows the module
    assert gm.get_buffer(moved[0]).dtype == torch.float64
    gm.float()
    assert torch.equal(gm(X), _eager(model, X))
    twin = copy.deepcopy(gm)  # a copy reads its own copy of the constant
    _assert_every_path_is_the_models(twin, amprewrite.module.tree.view_model(twin))
    assert torch.equal(twin(X), gm(X))
    model.head = nn.Linear(8, 4)  # a new state: captured again, the tree still the model's
    assert torch.equal(_quiet_call(gm, X), _eager(model, X))
    _assert_every_path_is_the_models(gm, model)


def test_every_path_of_an_hf_llama_is_the_models() -> None:
    """The rotary and attention code of an HF Llama makes tensor constants that torch.export
    lifts into its attention blocks; ``gm.model`` is still the model's ``LlamaModel``, its
    layers a ``ModuleList`` that FSDP2's ``fully_shard`` can take one by one."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    gm = amprewrite.convert(model, (ids,), policy=PRESET)
    _assert_every_path_is_the_models(gm, model)
    assert gm.model is model.model and list(gm.model.layers) == list(model.model.layers)
    with torch.autocast("cpu", torch.bfloat16):
        expected = model(ids).logits
    assert torch.equal(gm(ids).logits, expected)


# ---------------------------------------------------------------------------------------------
# a hook of the converted module runs once per call, a call that captures included
class _Gained(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.gain = 2.0  # read by the capture: a new value is a new state

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x) * self.gain
        return torch.relu(y) if self.training else y  # mode-dependent code


def _count_hooks(gm: nn.Module) -> dict[str, int]:
    counts = dict.fromkeys(["pre", "pre_kwargs", "forward", "forward_kwargs", "backward_pre",
                            "backward"], 0)

    def counter(name: str) -> object:
        def hook(*_: object) -> None:
            counts[name] += 1
        return hook

    gm.register_forward_pre_hook(counter("pre"))
    gm.register_forward_pre_hook(counter("pre_kwargs"), with_kwargs=True)
    gm.register_forward_hook(counter("forward"))
    gm.register_forward_hook(counter("forward_kwargs"), with_kwargs=True)
    gm.register_full_backward_pre_hook(counter("backward_pre"))
    gm.register_full_backward_hook(counter("backward"))
    return counts


@pytest.mark.parametrize("route", ["export", "symbolic", "first_call"])
def test_each_hook_runs_once_per_call_that_captures(route: str) -> None:
    """Calls that capture (the first call of ``capture="export"``, a new state, the model
    switched to eval by hand, a new batch size) run each forward, forward-pre and backward
    hook of the converted module once, as calls that do not."""
    model = _Gained().train()
    if route == "export":  # keyword inputs: captured with the example's sizes
        gm = amprewrite.convert(model, (), example_kwargs={"x": X}, policy=PRESET)
    elif route == "symbolic":
        gm = amprewrite.convert(model, policy=PRESET, capture="symbolic")
    else:
        gm = amprewrite.convert(model, capture="export", policy=PRESET)
    counts = _count_hooks(gm)
    cache = amprewrite.module.cache.cache_of(gm)

    def change(step: str) -> torch.Tensor:
        if step == "state":
            model.gain = 3.0
        elif step == "mode":
            model.eval()
        return torch.randn(6 if step == "size" else 4, 8, requires_grad=True)

    for calls, step in enumerate(["first", "again", "state", "mode", "size"], start=1):
        x = change(step)
        before = cache.describe()  # the entries and why each was captured
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RecaptureWarning)
            gm(x=x).sum().backward()
        captured = cache.describe() != before
        expected = {"first": route == "first_call", "again": False, "state": True,
                    "mode": True, "size": route != "symbolic"}[step]
        assert captured == expected, (step, cache.describe())
        assert counts == dict.fromkeys(counts, calls), step
