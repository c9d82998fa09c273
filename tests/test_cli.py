"""``python -m amprewrite``: the demo, explain and audit commands, and their errors."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from amprewrite.cli.main import main

FACTORIES = textwrap.dedent('''
    import torch
    import torch.nn as nn

    def mlp():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4), nn.Softmax(-1))
        return model, (torch.randn(2, 8),)

    class Branchy(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, x):
            h = self.lin(x)
            return h.relu() if h.sum() > 0 else -h

    def branchy():
        torch.manual_seed(0)
        return Branchy(), (torch.randn(2, 8),)

    def model_only():
        return nn.Linear(2, 2)

    def tensor_inputs():
        return nn.Linear(2, 2), torch.randn(1, 2)

    def not_a_model():
        return "model", (torch.randn(1, 2),)

    def raises():
        raise KeyError("no such checkpoint")

    class Checkpointed(nn.Module):
        """Dropout in train mode, in a checkpoint that torch.export records as plain ops
        (convert warns); an RGB convolution and a 10-way head (not multiples of 8)."""

        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 8, 3)
            self.block = nn.Sequential(nn.Linear(8 * 36, 16), nn.ReLU(), nn.Dropout(0.5))
            self.head = nn.Linear(16, 10)

        def forward(self, x):
            h = self.conv(x).flatten(1)
            return self.head(torch.utils.checkpoint.checkpoint(self.block, h,
                                                               use_reentrant=False))

    def checkpointed():
        torch.manual_seed(0)
        return Checkpointed().train(), (torch.randn(2, 3, 8, 8),)

    def masked():
        class Masked(nn.Module):
            def __init__(self):
                super().__init__()
                self.q = nn.Linear(16, 16)

            def forward(self, x, mask):
                q = self.q(x)
                return (q @ q.transpose(-1, -2)).masked_fill(mask, -1e9).softmax(-1)

        return Masked(), (torch.randn(2, 8, 16), torch.zeros(2, 8, 8, dtype=torch.bool))

    NOT_CALLABLE = 3
''')


@pytest.fixture
def project(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    (tmp_path / "userfactories.py").write_text(FACTORIES)
    monkeypatch.chdir(tmp_path)
    yield tmp_path
    sys.modules.pop("userfactories", None)


def run_cli(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "amprewrite", *args], cwd=cwd,
                          capture_output=True, text=True, timeout=300)


# -- as a subprocess --------------------------------------------------------------------------
def test_demo(tmp_path: Path) -> None:
    proc = run_cli("demo", "--html", "demo.html", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    # where the page went, as an absolute path, on the last line
    assert out.rstrip().splitlines()[-1] == \
        f"wrote the HTML report: {(tmp_path / 'demo.html').resolve()}"
    sections = ["== summary ==", "== rewritten graph (gm.code; # cast marks casts) ==",
                "== decisions on floating tensors (amprewrite.explain) ==",
                "== one training step (amprewrite.audit) =="]
    assert [out.index(s) for s in sections] == sorted(out.index(s) for s in sections)
    first_screen = "\n".join(out.splitlines()[:40])
    assert first_screen.startswith("== summary ==\nmodel: LlamaLogits\nhardware: ")
    assert re.search(r"ops: 10 bf16, \d+ fp32, \d+ passthrough", first_screen)
    assert re.search(r"cast kernels in one forward: \d+, torch.autocast's on the same "
                     r"input: \d+", first_screen)
    # the speed with the spread of its rounds, or no direction when they disagree, or no
    # verdict at all when a round ran several times slower than the others (a busy machine)
    assert re.search(r"^vs torch.autocast, same input: forward [\d.]+ ms vs [\d.]+ ms \(medians "
                     r"of \d+ interleaved rounds\): (([\d.]+x(, as fast as torch.autocast| "
                     r"torch.autocast's speed, (faster|slower)(; how much is too noisy to tell)?)"
                     r"|about as fast as torch.autocast; too noisy to tell) \([\d.]+x-[\d.]+x, "
                     r"middle half of \d+ rounds\)|no verdict: the machine is too busy to tell "
                     r"\(its slowest round took \d+x the median round's time, of \d+ rounds\); "
                     r"run it again on a quiet machine)$", first_screen, re.M)
    # what the memory figure is, in its own line
    assert re.search(r"^memory of one training step \(weights, gradients, saved activations\): "
                     r"[\d,]+ KiB vs [\d,]+ KiB with torch.autocast \([\d.]+x\)$",
                     first_screen, re.M)
    # fp32's time beside both where bf16 has no fast kernels (an AVX2 CPU), and what to keep
    import torch

    from amprewrite.hardware import slow_reason

    fp32 = re.search(r"^fp32 forward [\d.]+ ms, converted [\d.]+ ms, torch.autocast [\d.]+ ms: "
                     r"(cpu: .* has no fast bf16 kernels, so fp32 runs [\d.]+x faster here; keep "
                     r"the model in fp32 on this machine \(opt_level='O0'\)|bf16 is not slower "
                     r"than fp32 here, despite no fast bf16 kernels|cpu: .* has no fast bf16 "
                     r"kernels, but the machine is too busy to tell which is faster here)$",
                     first_screen, re.M)
    assert (fp32 is not None) is (slow_reason("cpu", torch.bfloat16) is not None), first_screen
    assert re.search(r"max \|logits - fp32 logits\|: [\d.e-]+ \(torch.autocast", first_screen)
    # the mask's finfo.min is masking; the RMSNorm's fp32 pow and rsqrt (whose backward is
    # huge on small rows) are no fp16 risk: the table ranks only values bf16 holds, as what
    # fp16 would meet
    assert "masking, not overflow: " in out
    table = out[out.index("fp16 headroom (bits)"):].split("\n\n")[0].splitlines()[2:]
    assert table and all(" bf16 " in row and row.endswith("(fp16 what-if)") for row in table)
    # the loss scale from the bf16 gradients, as the fp16 what-if (2^-2 when fp32 internals
    # counted; tests/test_loss_scale_truth.py holds it to the scale GradScaler settles at)
    scale = re.search(r"^max \|grad\|: [\d.e+-]+; recommended static loss scale: 2\^(-?\d+) = "
                      r"\S+ \(fp16 what-if: the bf16 gradients as fp16 would hold them\)$", out,
                      re.M)
    assert scale is not None and int(scale.group(1)) >= 10, out[-600:]
    page = (tmp_path / "demo.html").read_text()
    assert "<table class='sortable filterable'>" in page and "<svg class='ranges'" in page
    # the measurements in words, above 1 = faster
    assert re.search(r"<th>speed</th><td>((<b class='\w+'>(\d+(\.\d+)?x (faster|slower) than|"
                     r"as fast as)</b>|about as fast as) torch.autocast <span class='detail'>\("
                     r"((how much is )?too noisy to tell: )?[\d.]+x-[\d.]+x its speed, middle "
                     r"half of \d+ rounds;|no verdict against torch.autocast <span "
                     r"class='detail'>\(the machine is too busy to tell: its slowest round "
                     r"took \d+x the median round(?:'|&#x27;)s time, of \d+ rounds;)", page), \
        page[page.index("<th>speed</th>"):][:500]
    assert re.search(r"<th>memory</th><td><b class='\w+'>(\d+% (less|more) memory than|the "
                     r"same memory as)</b> torch.autocast", page)
    # a HF Llama: 7 projections and the LM head in bf16 (their weights read in one call, each
    # cast where it is used), the attention's two matmuls too; its own softmax(dtype=float32)
    # kept
    assert re.search(r"\n +\(?model_lm_head_weight, +# f32\[\d+, \d+\] or its kept bf16 copy\n",
                     out)
    assert "model_lm_head_weight_bf16 = model_lm_head_weight.bfloat16()" in out
    assert re.search(r"torch\.softmax\(\w+, -1, torch\.float32\)", out)
    assert re.search(r"linear_\d+ +linear +lower +bf16 +bf16 +default table", out)
    assert re.search(r"\d+ op nodes: 10 bf16, \d+ f32, \d+ passthrough; casts: \d+ cast nodes in "
                     r"the graph \(\d+ guarded\) after \d+ eliminated", out)
    assert "amprewrite audit:" in out and "backward" in out
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("speed, words", [
    (2.5, "2.50x torch.autocast's speed, faster"), (0.74, "0.74x torch.autocast's speed, slower"),
    (1.02, "1.02x, as fast as torch.autocast"), (0.98, "0.98x, as fast as torch.autocast")])
def test_the_speed_is_said_in_words_above_1_faster(speed: float, words: str) -> None:
    """The direction of the README's tables: autocast's time over the converted one's."""
    from amprewrite.cli.measure import speed_words

    assert speed_words(speed) == words


def test_explain_and_audit_a_factory(project: Path) -> None:
    proc = run_cli("explain", "userfactories:mlp", cwd=project)
    assert proc.returncode == 0, proc.stderr
    assert "def forward" in proc.stdout
    assert "softmax   softmax  fp32 (dtype arg)  f32    f32   default table" in proc.stdout


def test_audit_json_from_a_file_target(project: Path, capsys) -> None:
    assert main(["audit", "userfactories.py:mlp", "--policy", "autocast-cpu", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    (facts,) = result["summary"]["graphs"]
    assert facts["ops"] == {"low": 2, "fp32": 0, "passthrough": 2}
    assert set(result["summary"]["forward_casts"]) == {"converted", "autocast"}
    phases = {r["phase"] for r in result["audit"]["records"]}
    assert phases == {"forward", "backward"}


def test_bad_target_is_one_line(project: Path) -> None:
    proc = run_cli("explain", "userfactories:mpl", cwd=project)
    assert proc.returncode == 2
    assert proc.stderr == ("amprewrite: error: module 'userfactories' has no attribute 'mpl'; "
                           "did you mean 'mlp'?\n")
    assert proc.stdout == ""


def test_unconvertible_model_exits_1_with_the_fix(project: Path) -> None:
    proc = run_cli("explain", "userfactories:branchy", cwd=project)
    assert proc.returncode == 1
    # NB: after the warnings of the conversion (a CPU without native bf16 warns first)
    error = proc.stderr[proc.stderr.index("amprewrite: cannot convert"):]
    assert error.startswith("amprewrite: cannot convert Branchy: AmpRewriteError: "
                            "torch.export could not capture Branchy")
    assert all(line.startswith("amprewrite: warning:") or line.startswith(" ")
               for line in proc.stderr[:len(proc.stderr) - len(error)].splitlines())
    assert proc.stderr.rstrip().endswith("From the command line: add --capture compile.")
    assert "Traceback" not in proc.stderr and "def forward" not in proc.stderr


# -- in process (same code path, faster) ------------------------------------------------------
def test_compile_capture_converts_control_flow(project: Path, capsys) -> None:
    assert main(["explain", "userfactories:branchy", "--capture", "compile"]) == 0
    out = capsys.readouterr().out
    assert "# graph 0" in out and "== graph 0 ==" in out
    assert "lower             bf16   bf16  default table" in out


def test_dtype_and_policy_flags(project: Path, capsys) -> None:
    assert main(["explain", "userfactories:mlp", "--dtype", "fp16", "--policy",
                 "autocast-cpu"]) == 0
    out = capsys.readouterr().out
    assert "policy: autocast('cpu'), low dtype f16" in out
    assert "input_1_f16 = input_1.half()" in out
    assert "softmax   softmax  passthrough  -      f16  not listed" in out   # CPU lists


def test_explain_json(project: Path, capsys) -> None:
    assert main(["explain", "userfactories:mlp", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    (graph,) = result["explain"]
    assert [n["op"] for n in graph["nodes"]] == ["linear", "relu", "linear", "softmax"]
    assert graph["summary"]["casts_inserted"] == 5


def test_code_marks_casts_and_flags(project: Path, capsys) -> None:
    assert main(["explain", "userfactories:mlp"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("== summary ==\nmodel: Sequential\n")
    assert re.search(r"\n +input_1_bf16 = input_1\.bfloat16\(\).*  # cast\n", out)
    assert re.search(r"\n +linear = .*[^t]\n", out)  # an op line is not marked
    assert "softmax = " in out and "folded" not in out  # no plumbing in an MLP
    assert main(["explain", "userfactories:mlp", "--casts-only", "--all-nodes"]) == 0
    only = capsys.readouterr().out
    code = only[only.index("(gm.code"):only.index("== decisions")]
    assert "# cast" in code and "def forward" not in code and "    ..." in code
    assert "\nlinear " in only  # --all-nodes: the table of every node, ungrouped


def test_html_from_explain_and_audit(project: Path, capsys) -> None:
    assert main(["audit", "userfactories:mlp", "--html", "audit.html"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("== summary ==") and "amprewrite audit:" in out
    page = (project / "audit.html").read_text()
    assert "gradients: share of values" in page and "every op" in page
    assert main(["explain", "userfactories:mlp", "--html", "explain.html"]) == 0
    assert re.search(r"<span class='ln dt-\w+ cast' data-node=",
                     (project / "explain.html").read_text())


def test_html_path_in_json(project: Path, capsys) -> None:
    assert main(["explain", "userfactories:mlp", "--json", "--html", "page.html"]) == 0
    assert json.loads(capsys.readouterr().out)["html"] == str((project / "page.html").resolve())


CHECKPOINT_WARNING = "amprewrite: warning: Checkpointed calls torch.utils.checkpoint (at "


def test_audit_keeps_the_warnings_of_the_conversion(project: Path, capsys) -> None:
    assert main(["audit", "userfactories:checkpointed"]) == 0
    captured = capsys.readouterr()
    assert "== one training step (amprewrite.audit) ==" in captured.out
    (line,) = captured.err.splitlines(keepends=True)  # once
    assert line.startswith(CHECKPOINT_WARNING) and "userfactories.py:" in line
    assert line.endswith("memory is as without checkpointing. To keep checkpointing, convert "
                         "with amprewrite.compile(model), or convert the checkpointed blocks "
                         "and call checkpoint() on the converted blocks "
                         "(docs/distributed.md).\n")


def test_lint_on_cpu_gives_no_tensor_core_advice(project: Path, capsys) -> None:
    assert main(["lint", "userfactories:checkpointed", "--dtype", "fp16"]) == 0
    captured = capsys.readouterr()
    lint = captured.out.split("== fp16/bf16 pitfalls (amprewrite.lint) ==\n")[1]
    # in_channels=3 and a 10-way head: CUDA advice only
    assert lint == "nothing found (advice for cpu; tensor-core alignment is checked on CUDA " \
                   "only)\n"
    assert "tensor cores" not in captured.out and "pad to" not in captured.out
    assert captured.err.startswith(CHECKPOINT_WARNING)


def test_lint_findings_and_json(project: Path, capsys) -> None:
    assert main(["lint", "userfactories:masked", "--dtype", "fp16"]) == 0
    out = capsys.readouterr().out
    lint = out.split("== fp16/bf16 pitfalls (amprewrite.lint) ==\n")[1]
    assert lint.startswith("[fill-overflow] masked_fill: masked_fill uses the constant -1e+09 "
                           "(argument 2), which overflows fp16")
    assert lint.endswith("\n(advice for cpu; tensor-core alignment is checked on CUDA only)\n")
    assert main(["lint", "userfactories:masked", "--dtype", "fp16", "--json"]) == 0
    (finding,) = json.loads(capsys.readouterr().out)["lint"]
    assert (finding["rule"], finding["node"]) == ("fill-overflow", "masked_fill")


def test_audit_refuses_compile_capture(project: Path, capsys) -> None:
    assert main(["audit", "userfactories:mlp", "--capture", "compile"]) == 2
    assert capsys.readouterr().err.startswith(
        "amprewrite: error: audit cannot use --capture compile: torch.compile skips")


@pytest.mark.parametrize("target, message", [
    ("userfactories", "target 'userfactories' must look like 'pkg.module:factory' or "
                      "'path/to/file.py:factory'"),
    ("no_such_module:f", "cannot import 'no_such_module' (from target 'no_such_module:f'): "
                         "ModuleNotFoundError: No module named 'no_such_module'"),
    ("missing.py:f", "no such file: 'missing.py'"),
    ("userfactories:NOT_CALLABLE", "'userfactories:NOT_CALLABLE' is a int, not a function; "
                                   "expected a factory returning (model, example_inputs)"),
    ("userfactories:model_only", "factory 'userfactories:model_only' returned a Linear; "
                                 "expected a tuple (model, example_inputs) or (model, "
                                 "example_inputs, example_kwargs)"),
    ("userfactories:tensor_inputs", "factory 'userfactories:tensor_inputs' returned a Tensor "
                                    "as example_inputs; expected a tuple of positional "
                                    "inputs: return (model, (x,))"),
    ("userfactories:not_a_model", "factory 'userfactories:not_a_model' returned a str as the "
                                  "model; expected a torch.nn.Module"),
    ("userfactories:raises", "factory 'userfactories:raises' raised KeyError: "
                             "'no such checkpoint'"),
])
def test_target_errors(project: Path, capsys, target: str, message: str) -> None:
    assert main(["audit", target]) == 2
    captured = capsys.readouterr()
    assert captured.err == f"amprewrite: error: {message}\n"
    assert captured.out == ""


def test_example_factories_stay_runnable(capsys, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(Path(__file__).resolve().parents[1])
    assert main(["explain", "examples/factories.py:branchy", "--capture", "compile"]) == 0
    assert "== graph 1 ==" in capsys.readouterr().out
    assert main(["explain", "examples.factories:mlp", "--json"]) == 0
    (graph,) = json.loads(capsys.readouterr().out)["explain"]
    assert graph["summary"]["per_dtype"] == {"bf16": 2, "f32": 2, "passthrough": 1}


@pytest.mark.parametrize("command", ["demo", "explain", "audit", "lint", "compare", "search",
                                     "memory"])
def test_each_command_help_shows_an_example(command: str,
                                            capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as done:
        main([command, "--help"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    assert f"example:\n  python -m amprewrite {command} " in out, out
    if command != "demo":
        assert "def tiny():" in out  # what a factory is


def test_the_parser_imports_no_torch() -> None:
    """``--help`` is answered by argparse alone: the parser module, loaded on its own,
    imports nothing heavy."""
    import amprewrite.cli.parser as parser_module

    code = ("import importlib.util, sys\n"
            f"spec = importlib.util.spec_from_file_location('p', {parser_module.__file__!r})\n"
            "m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m)\n"
            "m.build_parser().parse_args(['explain', 'x.py:f'])\n"
            "print(sorted(n for n in sys.modules if n.split('.')[0] in "
            "('torch', 'numpy', 'amprewrite')))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
