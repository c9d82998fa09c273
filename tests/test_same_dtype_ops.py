"""Ops that write source values into a destination and require one dtype (``masked_scatter``,
``index_put``, ``scatter``...): their sources take the destination's dtype under every opt
level and policy (OpCategory.MATCH_SELF), and a node that does not run says why."""

from __future__ import annotations

import copy
from typing import Callable

import pytest
import torch
import torch.nn as nn

import amprewrite
from amprewrite import AmpRewriteError, OpCategory, Policy
from amprewrite.graph.meta import decision
from amprewrite.passes.classify import ClassifyPass
from amprewrite.passes.insert_casts import InsertCastsPass

pytestmark = pytest.mark.usefixtures("one_thread")

Write = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]

# (destination, token ids, source of the destination's shape) -> the destination written
WRITES: dict[str, Write] = {
    "masked_scatter": lambda h, ids, f: h.masked_scatter((ids == 3)[..., None], f),
    "masked_scatter_": lambda h, ids, f: h.clone().masked_scatter_((ids == 3)[..., None], f),
    "index_put": lambda h, ids, f: h.index_put((ids == 3,), f[ids == 3]),
    "index_put_": lambda h, ids, f: h.clone().index_put_((ids == 3,), f[ids == 3],
                                                        accumulate=True),
    "scatter": lambda h, ids, f: h.scatter(1, ids[..., None].expand_as(f) % 6, f),
    "scatter_add": lambda h, ids, f: h.scatter_add(1, ids[..., None].expand_as(f) % 6, f),
    "scatter_reduce": lambda h, ids, f: h.scatter_reduce(1, ids[..., None].expand_as(f) % 6,
                                                         f, "amax"),
    "index_add": lambda h, ids, f: h.index_add(1, torch.arange(6) % 3, f),
    "index_copy": lambda h, ids, f: h.index_copy(1, torch.arange(6), f),
    "lerp": lambda h, ids, f: torch.lerp(h, f, 0.25),
}


class Multimodal(nn.Module):
    """Token embeddings with projected features written over some positions, as LLaVA puts
    image features into the text embeddings. The features are converted to the embeddings'
    dtype as the model sees it, which under autocast is fp32: under O2 the bf16 embedding
    then meets fp32 features."""

    def __init__(self, write: Write) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(8, 16)
        self.proj = nn.Linear(4, 16)
        self.head = nn.Linear(16, 3)
        self.write = write

    def forward(self, ids: torch.Tensor, feats: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        f = self.proj(feats).to(h.dtype)
        return self.head(self.write(h, ids, f))


def _inputs() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 8, (2, 6), generator=g)
    ids[:, :2] = 3  # every row writes, so that a masked_scatter reads its source
    return ids, torch.randn(2, 6, 4, generator=g)


def _write_node(gm: torch.fx.GraphModule, op: str) -> torch.fx.Node:
    for node in gm.graph.nodes:
        rec = decision(node)
        if rec is not None and rec.op.removesuffix("_") == op.removesuffix("_"):
            return node
    raise AssertionError(f"no {op} node in\n{gm.code}")


@pytest.mark.parametrize("op", sorted(WRITES))
def test_o2_and_o3_cast_sources_to_the_destination(op: str) -> None:
    model, args = Multimodal(WRITES[op]), _inputs()
    # O2/O3 compute what the model computes with every weight in bf16
    low = copy.deepcopy(model).to(torch.bfloat16)
    want = low(args[0], args[1].to(torch.bfloat16)).float()
    for level in ("O2", "O3"):
        gm = amprewrite.convert(model, args, opt_level=level)
        node = _write_node(gm, op)
        rec = decision(node)
        assert rec.category is OpCategory.MATCH_SELF and rec.compute_dtype is torch.bfloat16
        assert rec.rule == f"{rec.op} requires its sources in its destination's dtype"
        # O2 traces the fp32 model, so the features are cast to fp32 as the embedding was;
        # ours back to bf16 cancels that out (a lossless chain). O3 traces a bf16 copy.
        assert len(rec.casts) == (level == "O2")
        assert "f32" not in gm.code.split(f"{node.name} = ")[1].split("\n")[0]
        assert [a.meta["val"].dtype for a in node.all_input_nodes
                if a.meta["val"].is_floating_point()] == [torch.bfloat16] * 2
        with torch.no_grad():
            got = gm(*args)
        assert got.dtype is torch.float32
        torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("op", ["masked_scatter", "index_put_", "scatter_add", "lerp"])
def test_autocast_preset_casts_nothing_and_matches_autocast(op: str) -> None:
    """Traced under autocast, destination and source already agree: no cast, and the bits of
    torch.autocast in outputs and gradients."""
    model, args = Multimodal(WRITES[op]), _inputs()
    ref = copy.deepcopy(model)
    gm = amprewrite.convert(model, args, policy=Policy.autocast("cpu"))
    assert decision(_write_node(gm, op)).casts == ()
    with torch.autocast("cpu", torch.bfloat16):
        want = ref(*args)
    got = gm(*args)
    assert torch.equal(got, want)
    got.float().pow(2).mean().backward()
    want.float().pow(2).mean().backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(p.grad, q.grad), name


class VectorWrite(nn.Module):
    """``masked_scatter`` of an ``mv`` result, which the default policy (CUDA's rules)
    lowers to bf16 and CPU autocast, which the export is traced under, keeps in fp32."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.w = nn.Parameter(torch.randn(12, 4))

    def forward(self, h: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return h.masked_scatter(h > 0, torch.mv(self.w, v))


def test_default_policy_casts_a_lowered_source_up_to_the_destination() -> None:
    h, v = torch.randn(3, 4), torch.randn(4)
    model = VectorWrite()
    gm = amprewrite.convert(model, (h, v))
    rec = decision(_write_node(gm, "masked_scatter"))
    assert rec.category is OpCategory.MATCH_SELF and rec.compute_dtype is torch.float32
    assert len(rec.casts) == 1
    want = h.masked_scatter(h > 0, torch.mv(model.w.bfloat16(), v.bfloat16()).float())
    assert torch.equal(gm(h, v), want)


def test_no_example_inputs_casts_at_run_time() -> None:
    """Symbolic capture knows no dtypes: the source is matched to the destination when the
    op runs (``guarded_match``), and a second run of the passes adds nothing."""

    class FloatFeatures(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.embed, self.proj = nn.Embedding(8, 16), nn.Linear(4, 16)

        def forward(self, ids: torch.Tensor, feats: torch.Tensor) -> torch.Tensor:
            h = self.embed(ids)  # bf16 under O2
            return h.masked_scatter((ids == 3)[..., None], self.proj(feats).float())

    model, args = FloatFeatures(), _inputs()
    gm = amprewrite.convert(model, opt_level="O2")
    assert "guarded_match(" in gm.code
    with torch.no_grad():
        got = gm(*args)
        want = amprewrite.convert(model, args, opt_level="O2")(*args)
    assert torch.equal(got, want)
    policy = Policy(preset="O2", dtype=torch.bfloat16)
    ClassifyPass(policy, torch.bfloat16)(gm)
    assert not InsertCastsPass(policy, torch.bfloat16)(gm).modified


def test_a_node_that_does_not_run_is_named_with_its_dtypes_and_a_fix() -> None:
    """The user's override keeps the op from matching its dtypes: the error names the node,
    the op, the dtypes its inputs have and the override that makes it run, not the pass."""
    policy = Policy().override(ops={"masked_scatter": OpCategory.PASSTHROUGH})
    with pytest.raises(AmpRewriteError) as info:
        amprewrite.convert(VectorWrite(), (torch.randn(3, 4), torch.randn(4)), policy=policy)
    message = str(info.value)
    assert "node %masked_scatter" in message and "(op masked_scatter: passthrough, op override" \
        in message
    assert "h: f32[3, 4]" in message and "bf16[12]" in message
    assert "expected self and source to have same dtypes" in message
    assert "Policy().override(ops={'masked_scatter': OpCategory.PROMOTE})" in message
    assert "InsertCastsPass" not in message
