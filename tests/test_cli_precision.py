"""``python -m amprewrite compare | search | memory``: output, JSON and exit codes."""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

import pytest

from amprewrite.cli.main import main

FACTORIES = textwrap.dedent('''
    import torch
    import torch.nn as nn

    class Overflow(nn.Module):
        """A Linear whose outputs overflow fp16, then a LayerNorm."""

        def __init__(self):
            super().__init__()
            self.big, self.norm = nn.Linear(8, 8), nn.LayerNorm(8)
            self.head = nn.Linear(8, 2)
            with torch.no_grad():
                self.big.weight.mul_(1e5)

        def forward(self, x):
            return self.head(self.norm(self.big(x)))

    def overflow():
        torch.manual_seed(0)
        return Overflow(), (torch.randn(2, 8),)

    def mlp():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4)), (torch.randn(2, 8),)

    class Checkpointed(nn.Module):
        """Dropout in train mode (compare warns), in a checkpoint (convert warns)."""

        def __init__(self):
            super().__init__()
            self.block = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Dropout(0.5))
            self.head = nn.Linear(8, 4)

        def forward(self, x):
            return self.head(torch.utils.checkpoint.checkpoint(self.block, x,
                                                               use_reentrant=False))

    def checkpointed():
        torch.manual_seed(0)
        return Checkpointed().train(), (torch.randn(2, 8),)

    class ThreeHot(nn.Module):
        """Three Linears that overflow fp16: a search needs all three in fp32."""

        def __init__(self):
            super().__init__()
            self.a, self.b, self.c = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)
            with torch.no_grad():
                for layer in (self.a, self.b, self.c):
                    layer.weight.mul_(1e5)

        def forward(self, x):
            h = torch.layer_norm(self.a(x), (8,))
            return self.c(torch.layer_norm(self.b(h), (8,)))

    def three_hot():
        torch.manual_seed(0)
        return ThreeHot(), (torch.randn(2, 8),)
''')

CHECKPOINT_WARNING = "amprewrite: warning: Checkpointed calls torch.utils.checkpoint (at "
DROPOUT_WARNING = ("amprewrite: warning: amprewrite.{}: dropout draw random numbers, which "
                   "differ between the converted and the reference run: their errors and "
                   "everything downstream are meaningless. Pass the model in eval() mode "
                   "(model.eval()).\n")


@pytest.fixture
def project(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    (tmp_path / "precisionfactories.py").write_text(FACTORIES)
    monkeypatch.chdir(tmp_path)
    yield tmp_path
    sys.modules.pop("precisionfactories", None)


def run(capsys: pytest.CaptureFixture, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_compare_prints_both_tables(project: Path, capsys: pytest.CaptureFixture) -> None:
    code, out, err = run(capsys, "compare", "precisionfactories:overflow", "--dtype", "fp16")
    assert code == 0, err
    assert out.startswith("output error inf (f16 vs f64 reference); 3 op nodes; adds most: "
                          "linear (inf)")
    ops = out.split("== ops, worst added error first ==\n")[1].split("\n\n")[0].splitlines()
    assert ops[0].split()[:5] == ["node", "op", "dtype", "error", "added"]
    worst = ops[2].split()
    assert worst[:5] == ["linear", "linear", "f16", "inf", "inf"] and worst[-1].startswith("-")
    grads = out.split("== gradients ==\n")[1].splitlines()
    assert [line.split()[0] for line in grads[2:]] == [
        "big.weight", "big.bias", "norm.weight", "norm.bias", "head.weight", "head.bias"]


def test_compare_json_and_top(project: Path, capsys: pytest.CaptureFixture) -> None:
    code, out, _ = run(capsys, "compare", "precisionfactories:mlp", "--json", "--no-backward")
    assert code == 0
    data = json.loads(out)
    assert data["low_dtype"] == "bf16" and data["grads"] == []
    assert [n["node"] for n in data["nodes"]] == ["linear", "relu", "linear_1"]
    assert next(n for n in data["nodes"] if n["node"] == "relu")["added"] == 0
    code, out, _ = run(capsys, "compare", "precisionfactories:mlp", "--top", "1")
    assert code == 0 and "... 2 more nodes" in out


def test_search(project: Path, capsys: pytest.CaptureFixture) -> None:
    code, out, err = run(capsys, "search", "precisionfactories:overflow", "--dtype", "fp16",
                         "--tol", "1e-2")
    assert code == 0, err
    assert out.startswith("1 node to fp32: linear; error inf -> ")
    assert "use it: Policy(...).override(nodes={'linear': OpCategory.FP32})" in out
    code, out, _ = run(capsys, "search", "precisionfactories:overflow", "--dtype", "fp16",
                       "--json")
    data = json.loads(out)
    assert data["nodes"] == ["linear"] and data["runs"] == len(data["history"]) == 2  # shadow run, top 1


def test_search_that_cannot_reach_tol(project: Path, capsys: pytest.CaptureFixture) -> None:
    code, out, err = run(capsys, "search", "precisionfactories:mlp", "--tol", "1e-12")
    assert code == 2 and out == ""
    assert err.startswith("amprewrite: error: search: tol=1e-12 was not reached")
    assert len(err.strip().splitlines()) == 1


def test_memory(project: Path, capsys: pytest.CaptureFixture) -> None:
    code, out, err = run(capsys, "memory", "precisionfactories:mlp")
    assert code == 0, err
    header = out.splitlines()[0].split()
    assert header == ["B", "fp32", "autocast", "O1", "O2", "O3"]
    assert any(line.startswith("total") for line in out.splitlines())
    code, out, _ = run(capsys, "memory", "precisionfactories:mlp", "--json")
    data = json.loads(out)
    assert list(data) == ["fp32", "autocast", "O1", "O2", "O3"]
    assert data["fp32"]["weights"] == (8 * 8 + 8 + 8 * 4 + 4) * 4


@pytest.mark.parametrize("command", ["compare", "search", "memory"])
def test_bad_target_is_one_line_and_exit_2(project: Path, capsys: pytest.CaptureFixture,
                                          command: str) -> None:
    code, out, err = run(capsys, command, "precisionfactories:mpl")
    assert code == 2 and out == ""
    assert err == ("amprewrite: error: module 'precisionfactories' has no attribute 'mpl'; "
                   "did you mean 'mlp'?\n")


def test_capture_compile_is_refused(project: Path, capsys: pytest.CaptureFixture) -> None:
    code, _, err = run(capsys, "search", "precisionfactories:mlp", "--capture", "symbolic")
    assert code == 2 and "search cannot use --capture symbolic" in err


# -- the library's warnings reach the shell ---------------------------------------------------
def test_compare_keeps_the_warnings_of_a_model_in_train_mode(project: Path,
                                                             capsys: pytest.CaptureFixture) -> None:
    code, out, err = run(capsys, "compare", "precisionfactories:checkpointed")
    assert code == 0 and out.startswith("output error ")
    lines = err.splitlines(keepends=True)
    assert len(lines) == 2, err  # each once, after the output
    assert lines[0].startswith(CHECKPOINT_WARNING)
    assert lines[1] == DROPOUT_WARNING.format("compare")
    # --json keeps stdout JSON: the warnings go to stderr all the same
    code, out, err = run(capsys, "compare", "precisionfactories:checkpointed", "--json")
    assert code == 0 and json.loads(out)["low_dtype"] == "bf16"
    assert DROPOUT_WARNING.format("compare") in err


def test_search_keeps_its_warnings(project: Path, capsys: pytest.CaptureFixture) -> None:
    code, out, err = run(capsys, "search", "precisionfactories:three_hot", "--dtype", "fp16",
                         "--max-runs", "4")
    assert code == 0 and out.startswith("3 nodes to fp32: ")
    assert err == ("amprewrite: warning: amprewrite.search: max_runs=4 ran out while pruning; "
                   "the policy meets tol with 3 fp32 nodes, possibly more than needed. Pass a "
                   "larger max_runs for the smallest set.\n")
    # a search that fails still shows what the conversion said before its one-line error
    code, out, err = run(capsys, "search", "precisionfactories:checkpointed", "--tol", "1e-12")
    assert code == 2 and out == ""
    checkpoint, dropout, error = err.splitlines(keepends=True)
    assert checkpoint.startswith(CHECKPOINT_WARNING)
    assert dropout == DROPOUT_WARNING.format("search")  # the model is in train mode
    assert error.startswith("amprewrite: error: search: tol=1e-12 was not reached")
