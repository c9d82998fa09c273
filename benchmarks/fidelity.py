"""Fidelity: a tiny Llama trained in every precision, its loss against fp32's.

The model is ``LlamaForCausalLM`` built from a ``LlamaConfig`` (no download); the corpus is
generated here, deterministically: token sequences from a fixed random Markov chain, each
token followed by one of a few likely successors, so that the loss falls well below
``log(vocab)`` within a few hundred steps. Every variant starts from the same weights and
sees the same batches in the same order; the final loss is the mean training loss over the
last ``--tail`` steps (each variant's own forward).

Variants: fp32 (eager), ``torch.autocast`` bf16 (eager), O1 bf16, O1 fp16 with
``torch.amp.GradScaler``, O2 fp16 with ``amprewrite.MasterWeights`` and a GradScaler, O3 bf16,
fp8 (``Policy.fp8()``) and, if torchao is installed, torchao's float8 training
(``convert_to_float8_training(..., config=Float8LinearConfig(emulate=True))``, tensorwise
dynamic scaling, the same layers as ours). Goals: O1 and O2 within 1% of fp32's final loss,
fp8 within 2% of O1 bf16's.

With torchao installed the run also prints each fp8 layer's output error against fp32 (ours
and torchao's, on the layer inputs the fp32 model saw).

Usage::

    python benchmarks/fidelity.py                      # the table of BENCHMARKS.md
    python benchmarks/fidelity.py --steps 60 --plot benchmarks/fidelity.png

``--plot`` needs matplotlib (``pip install amprewrite[plot]``).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import sys
import time
import warnings
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import amprewrite  # noqa: E402

BF16_VARIANT = "O1 bf16"


@dataclasses.dataclass(frozen=True)
class Config:
    steps: int = 200
    batch: int = 8
    seq: int = 32
    vocab: int = 64
    hidden: int = 64
    layers: int = 2
    lr: float = 3e-3
    tail: int = 20
    seed: int = 0


@dataclasses.dataclass
class Result:
    name: str
    losses: list[float]
    final: float
    skipped: int
    seconds: float


# -- data and model ----------------------------------------------------------------------
def corpus(cfg: Config, n_tokens: int) -> torch.Tensor:
    """``n_tokens`` tokens of a fixed Markov chain: each token has 4 successors, with
    probabilities 0.55, 0.25, 0.15, 0.05."""
    g = torch.Generator().manual_seed(cfg.seed)
    successors = torch.stack([torch.randperm(cfg.vocab, generator=g)[:4]
                              for _ in range(cfg.vocab)])
    probs = torch.tensor([0.55, 0.25, 0.15, 0.05])
    choice = torch.multinomial(probs, n_tokens, replacement=True, generator=g)
    out = torch.empty(n_tokens, dtype=torch.long)
    tok = 0
    for i in range(n_tokens):
        tok = int(successors[tok, choice[i]])
        out[i] = tok
    return out


def batches(cfg: Config) -> torch.Tensor:
    """``[steps, batch, seq + 1]`` token windows: inputs and their next-token labels."""
    n = cfg.steps * cfg.batch * (cfg.seq + 1)
    return corpus(cfg, n).reshape(cfg.steps, cfg.batch, cfg.seq + 1)


def make_model(cfg: Config) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(cfg.seed)
    config = LlamaConfig(vocab_size=cfg.vocab, hidden_size=cfg.hidden,
                         intermediate_size=2 * cfg.hidden, num_hidden_layers=cfg.layers,
                         num_attention_heads=4, num_key_value_heads=4,
                         max_position_embeddings=2 * cfg.seq, tie_word_embeddings=False)
    return LlamaForCausalLM(config).float()


def logits_of(out: Any) -> torch.Tensor:
    return out.logits if hasattr(out, "logits") else out["logits"] if isinstance(out, dict) \
        else out[0]


# -- variants ----------------------------------------------------------------------------
@dataclasses.dataclass
class Setup:
    """A variant's forward, the module whose parameters train, and its step helpers."""

    forward: Callable[[torch.Tensor], torch.Tensor]
    params: Any
    scaler: torch.amp.GradScaler | None = None
    masters: Any = None
    keep: Any = None


def _convert(model: nn.Module, ids: torch.Tensor, **kw: Any) -> Setup:
    gm = amprewrite.convert(model, (ids,), **kw)
    return Setup(lambda x: logits_of(gm(x)), gm.parameters(), keep=gm)


def fp8_filter(cfg: Config) -> Callable[[nn.Module, str], bool]:
    """torchao's module filter that picks the layers ``Policy.fp8()`` picks on this model:
    all linears but the first (layer 0's q projection) and the last (the head)."""
    skip = {"model.layers.0.self_attn.q_proj", "lm_head"}
    return lambda module, fqn: fqn not in skip


def _torchao(model: nn.Module, cfg: Config) -> Setup:
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    convert_to_float8_training(model, config=Float8LinearConfig(emulate=True),
                               module_filter_fn=fp8_filter(cfg))
    return Setup(lambda x: logits_of(model(x)), model.parameters(), keep=model)


def _autocast(model: nn.Module) -> Setup:
    def forward(x: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", torch.bfloat16):
            return logits_of(model(x))
    return Setup(forward, model.parameters())


Make = Callable[[nn.Module, torch.Tensor], Setup]


def variants(cfg: Config, with_torchao: bool) -> dict[str, Make]:
    out: dict[str, Make] = {
        "fp32": lambda m, ids: Setup(lambda x: logits_of(m(x)), m.parameters()),
        "autocast bf16": lambda m, ids: _autocast(m),
        BF16_VARIANT: lambda m, ids: _convert(m, ids),
        "O1 fp16 + GradScaler": lambda m, ids: dataclasses.replace(
            _convert(m, ids, dtype=torch.float16), scaler=torch.amp.GradScaler("cpu")),
        "O2 fp16 + MasterWeights": lambda m, ids: dataclasses.replace(
            _convert(m, ids, opt_level="O2", dtype=torch.float16),
            scaler=torch.amp.GradScaler("cpu")),
        "O3 bf16": lambda m, ids: _convert(m, ids, opt_level="O3", dtype=torch.bfloat16),
        "fp8": lambda m, ids: _convert(m, ids, policy=amprewrite.Policy.fp8()),
    }
    if with_torchao:
        out["torchao fp8 (emulate)"] = lambda m, ids: _torchao(m, cfg)
    return out


def train(name: str, make: Make, cfg: Config,
          data: torch.Tensor, base: nn.Module) -> Result:
    model = copy.deepcopy(base)
    setup = make(model, data[0, :, :-1])
    opt = torch.optim.AdamW(list(setup.params), lr=cfg.lr, weight_decay=0.0)
    if name.startswith("O2"):
        setup.masters = amprewrite.MasterWeights(setup.keep, opt)
    losses, skipped = [], 0
    start = time.perf_counter()
    for step in range(cfg.steps):
        ids, labels = data[step, :, :-1], data[step, :, 1:]
        logits = setup.forward(ids)
        loss = F.cross_entropy(logits.float().reshape(-1, cfg.vocab), labels.reshape(-1))
        opt.zero_grad(set_to_none=True)
        if setup.scaler is not None:
            setup.scaler.scale(loss).backward()
            before = setup.scaler.get_scale()
            setup.scaler.step(opt)
            setup.scaler.update()
            skipped += setup.scaler.get_scale() < before
        else:
            loss.backward()
            opt.step()
        losses.append(float(loss))
    seconds = time.perf_counter() - start
    if setup.masters is not None:
        setup.masters.close()
    tail = losses[-cfg.tail:]
    return Result(name, losses, sum(tail) / len(tail), skipped, seconds)


def run(cfg: Config, only: list[str] | None = None, with_torchao: bool | None = None
        ) -> dict[str, Result]:
    if with_torchao is None:
        with_torchao = has_torchao()
    data = batches(cfg)
    base = make_model(cfg)
    results = {}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matmuls: more threads only add contention
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # bf16 emulation on this CPU; torchao's notice
            for name, make in variants(cfg, with_torchao).items():
                if only is None or name in only:
                    results[name] = train(name, make, cfg, data, base)
    finally:
        torch.set_num_threads(threads)
    return results


def has_torchao() -> bool:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            import torchao.float8  # noqa: F401
    except Exception:
        return False
    return True


# -- per-layer error (ours against torchao's) -------------------------------------------
def layer_errors(cfg: Config, model: nn.Module | None = None) -> list[tuple[str, float, float]]:
    """Each fp8 layer's output error against fp32, ``||y - y32|| / ||y32||``, for
    ``Policy.fp8()`` and for torchao's ``Float8Linear`` (emulated), on the inputs the fp32
    model gives that layer on the first batch."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    model = model if model is not None else make_model(cfg)
    ids = batches(dataclasses.replace(cfg, steps=1))[0, :, :-1]
    inputs: dict[str, torch.Tensor] = {}
    keep = fp8_filter(cfg)
    hooks = [m.register_forward_hook(lambda mod, a, out, n=n: inputs.__setitem__(n, a[0]))
             for n, m in model.named_modules() if isinstance(m, nn.Linear) and keep(m, n)]
    with torch.no_grad():
        model(ids)
    for h in hooks:
        h.remove()
    rows = []
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        for name, x in inputs.items():
            layer = model.get_submodule(name)
            ref = layer(x)
            ours = amprewrite.convert(nn.Sequential(copy.deepcopy(layer)), (x,),
                                      policy=amprewrite.Policy.fp8(skip_first_last=False))(x)
            ao = nn.Sequential(copy.deepcopy(layer))
            convert_to_float8_training(ao, config=Float8LinearConfig(emulate=True))
            theirs = ao(x)
            rel = [float((y.float() - ref).norm() / ref.norm()) for y in (ours, theirs)]
            rows.append((name, rel[0], rel[1]))
    return rows


# -- report ------------------------------------------------------------------------------
def table(results: dict[str, Result]) -> str:
    fp32 = results.get("fp32")
    bf16 = results.get(BF16_VARIANT)
    head = ("variant", "final loss", "gap to fp32", "gap to O1 bf16", "skipped steps",
            "seconds")
    rows = []
    for r in results.values():
        gap32 = f"{100 * (r.final / fp32.final - 1):+.2f}%" if fp32 else "-"
        gapbf = f"{100 * (r.final / bf16.final - 1):+.2f}%" if bf16 else "-"
        rows.append((r.name, f"{r.final:.4f}", gap32, gapbf, str(r.skipped),
                     f"{r.seconds:.1f}"))
    widths = [max(len(c) for c in col) for col in zip(head, *rows)]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(line, widths)) + " |"
             for line in [head, *rows]]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)


def plot(results: dict[str, Result], path: str, cfg: Config) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.6), dpi=90)
    k = 10  # moving average: the curves, not the batch noise
    for r in results.values():
        smooth = [sum(r.losses[max(0, i - k + 1):i + 1]) / len(r.losses[max(0, i - k + 1):i + 1])
                  for i in range(len(r.losses))]
        ax.plot(smooth, label=r.name, linewidth=1)
    ax.set_xlabel("step")
    ax.set_ylabel(f"training loss ({k}-step mean)")
    ax.set_title(f"tiny Llama ({cfg.hidden} wide, {cfg.layers} layers), {cfg.steps} steps")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=Config.steps)
    parser.add_argument("--plot", default=None, help="write the loss curves to this PNG")
    parser.add_argument("--no-torchao", action="store_true")
    args = parser.parse_args(argv)
    cfg = Config(steps=args.steps)
    print(f"torch {torch.__version__}, cpu capability "
          f"{torch.backends.cpu.get_cpu_capability()}, 1 thread")
    print(f"tiny Llama: hidden {cfg.hidden}, {cfg.layers} layers, vocab {cfg.vocab}, "
          f"seq {cfg.seq}, batch {cfg.batch}, {cfg.steps} steps, AdamW lr {cfg.lr}; final "
          f"loss = mean of the last {cfg.tail} steps")
    with_torchao = has_torchao() and not args.no_torchao
    results = run(cfg, with_torchao=with_torchao)
    print(table(results))
    if with_torchao:
        print("\nper-layer output error against fp32 (first batch, fp32 model's inputs):")
        print("| layer | Policy.fp8() | torchao Float8Linear |\n|---|---|---|")
        for name, ours, theirs in layer_errors(cfg):
            print(f"| {name} | {ours:.2e} | {theirs:.2e} |")
    if args.plot:
        try:
            plot(results, args.plot, cfg)
            print(f"loss curves: {args.plot}")
        except ImportError:
            print("--plot: matplotlib is not installed (pip install amprewrite[plot])")


if __name__ == "__main__":
    main()
