"""The code a person reads: ``gm.code`` of a CNN and a small transformer, by each capture
path (export, symbolic, the compile backend), against files under ``tests/golden/``, so that
a change that makes the code worse shows in review.

``AMPREWRITE_UPDATE_GOLDEN=1 python -m pytest tests/test_golden_code.py`` writes the files
instead of comparing. The files are shared by the supported torch releases; where a release
prints a graph otherwise, it has a file of its own, ``<name>.torch-2.11.txt``, written only
where its code differs from the shared file (which the release CI installs first, torch
2.13, writes).

The readable code's rules are checked on every listing as well: no line longer than
:data:`amprewrite.graph.layout.WIDTH`, the weights read in one statement, one name a line
(none in the compile backend's graphs, whose parameters are arguments), a dtype and shape
comment on each line that makes a floating tensor, and ``print_readable()`` the same
program as ``gm.code``.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Callable

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F
from _versions import TORCH_RELEASE

import amprewrite
from amprewrite.code_view import code_lines
from amprewrite.graph.layout import WIDTH, tensor_dtype

GOLDEN = Path(__file__).parent / "golden"
REFERENCE_RELEASE = (2, 13)
"""The release whose code the shared files hold (the one CI installs first)."""
UPDATE = os.environ.get("AMPREWRITE_UPDATE_GOLDEN") == "1"


class SmallCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1)
        self.fc = nn.Linear(8 * 4 * 4, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.max_pool2d(F.relu(self.bn1(self.conv1(x))), 2)
        h = F.max_pool2d(F.relu(self.conv2(h)), 2)
        return F.log_softmax(self.fc(torch.flatten(h, 1)), dim=-1)


class Block(nn.Module):
    def __init__(self, dim: int = 16, heads: int = 2) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.fc1, self.fc2 = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)
        self.heads = heads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).chunk(3, dim=-1)
        q, k, v = (y.view(b, t, self.heads, d // self.heads).transpose(1, 2) for y in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class SmallTransformer(nn.Module):
    def __init__(self, vocab: int = 32, dim: int = 16) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList([Block(dim), Block(dim)])
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.emb(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


MODELS: dict[str, tuple[Callable[[], nn.Module], Callable[[], torch.Tensor]]] = {
    "cnn": (SmallCNN, lambda: torch.randn(2, 3, 16, 16)),
    "transformer": (SmallTransformer, lambda: torch.randint(0, 32, (2, 8))),
}


def _model(name: str) -> tuple[nn.Module, torch.Tensor]:
    build, example = MODELS[name]
    torch.manual_seed(0)
    return build().eval(), example()


def _listing(gm: fx.GraphModule) -> str:
    return "\n".join(line.rstrip() for line in gm.code.strip("\n").splitlines()) + "\n"


def _code(name: str, capture: str) -> tuple[str, list[fx.GraphModule]]:
    model, x = _model(name)
    if capture == "compile":
        torch._dynamo.reset()
        compiled = amprewrite.compile(model, eager=True)
        with torch.no_grad():
            compiled(x)
        graphs = list(compiled.amprewrite_backend.graphs)
        torch._dynamo.reset()
        return "".join(f"# graph {i}\n{_listing(gm)}" for i, gm in enumerate(graphs)), graphs
    gm = amprewrite.convert(model, (x,) if capture == "export" else None, capture=capture)
    return _listing(gm), [gm]


def _golden(stem: str) -> Path:
    own = GOLDEN / f"{stem}.torch-{TORCH_RELEASE[0]}.{TORCH_RELEASE[1]}.txt"
    return own if own.exists() or (UPDATE and TORCH_RELEASE != REFERENCE_RELEASE) \
        else GOLDEN / f"{stem}.txt"


@pytest.mark.parametrize("capture", ["export", "symbolic", "compile"])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_code_matches_the_golden_file(name: str, capture: str) -> None:
    code, _ = _code(name, capture)
    path = _golden(f"{name}.{capture}")
    if UPDATE:
        shared = GOLDEN / f"{name}.{capture}.txt"
        if path != shared and shared.exists() and shared.read_text() == code:
            path.unlink(missing_ok=True)  # this release prints what the shared file holds
        else:
            path.parent.mkdir(exist_ok=True)
            path.write_text(code)
        return
    assert path.exists(), f"no golden file {path}: run with AMPREWRITE_UPDATE_GOLDEN=1"
    expected = path.read_text()
    assert code == expected, (
        f"gm.code of the {name} ({capture} capture) differs from {path.name}; if the change "
        "is meant, review the diff and run with AMPREWRITE_UPDATE_GOLDEN=1")


@pytest.mark.parametrize("capture", ["export", "symbolic"])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_the_code_reads_top_down(name: str, capture: str) -> None:
    code, [gm] = _code(name, capture)
    lines = code.splitlines()
    # the weights: one statement, one name a line, before the first op
    read = next(i for i, line in enumerate(lines) if "self._amp_weights.fetch(" in line)
    assert lines[1].startswith("    (") and lines[read].startswith("    ) = self._amp_weights")
    names = lines[1:read]
    assert len(names) == sum(1 for n in gm.graph.nodes if n.op == "call_function"
                             and n.args and getattr(n.args[0], "name", None) == "weights")
    assert all(re.match(r"^    [ (]\w+,", line) for line in names)
    assert "weights[" not in code and "torch.ops.aten.sym_size" not in code
    _check_readable(gm, lines, annotated=capture == "export")


@pytest.mark.parametrize("name", sorted(MODELS))
def test_the_compile_backends_graphs_read_top_down(name: str) -> None:
    """The Dynamo graphs the backend rewrote print as converted modules do: parameters as
    arguments named as in the body (no ``l_x_ = L_x_`` lines), no weight read."""
    code, graphs = _code(name, "compile")
    assert graphs
    for gm in graphs:
        lines = _listing(gm).splitlines()
        assert "_amp_weights" not in gm.code and " = L_" not in gm.code
        _check_readable(gm, lines, annotated=True)


def _check_readable(gm: fx.GraphModule, lines: list[str], annotated: bool) -> None:
    """The rules every listing follows: the width, ``torch.*`` spellings, a dtype and shape
    comment on each line that makes a floating tensor (where the values' dtypes are known:
    ``annotated``), ``print_readable()`` the same program as ``gm.code``."""
    assert max(map(len, lines)) <= WIDTH, [line for line in lines if len(line) > WIDTH]
    assert "torch._C._nn." not in gm.code
    if annotated:
        text: dict[str, str] = {}
        for line in code_lines(gm):
            text[line.node] = text.get(line.node, "") + line.text
        for node in gm.graph.nodes:
            val = node.meta.get("val")
            if node.name in text and isinstance(val, torch.Tensor) and val.is_floating_point():
                assert f"# {tensor_dtype(val.dtype)}[" in text[node.name], text[node.name]
    readable = gm.print_readable(print_output=False)
    body = [line[4:].rstrip() for line in readable.splitlines()[1:] if line.strip()]
    assert body == [line for line in lines if line.strip()]


def test_recompile_keeps_the_readable_code() -> None:
    model, x = _model("transformer")
    gm = amprewrite.convert(model, (x,))
    code = gm.code
    with torch.no_grad():
        out = gm(x)
        gm.recompile()
        assert gm.code == code and torch.equal(gm(x), out)
