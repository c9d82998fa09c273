"""Per-block FSDP2 of a converted model, and the parameters it materialises at once.

The recipe (docs/distributed.md): convert each decoder block (and the head) on its own,
captured at its first call, put it back in the model's place, then ``fully_shard`` each block
and the root, as torchtitan compiles and shards block by block. The blocks' forwards run
under their own FSDP2 hooks, so one block's parameters are gathered at a time.

Shared by ``benchmarks/bench_fsdp2_blocks.py`` (the bytes, on a larger model) and
``tests/test_fsdp2_blocks.py`` (the numerics against the eager model under autocast). Each
run is one process of a gloo group (:func:`launch` starts them on 127.0.0.1).
"""

from __future__ import annotations

import os
import pathlib
import socket
import subprocess
import sys
import tempfile
import time
from typing import Any

import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode

import amprewrite

PRESET = amprewrite.Policy.autocast("cpu", torch.bfloat16)
LOW = torch.bfloat16


def tiny_lm(family: str, layers: int = 2, hidden: int = 32, seed: int = 0) -> nn.Module:
    """A causal LM of ``family`` ("llama" or "gpt2"), random weights, no tied head (FSDP2
    shards a tied embedding and head as one unit only)."""
    import transformers

    torch.manual_seed(seed)
    if family == "llama":
        config = transformers.LlamaConfig(
            hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
            num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
            max_position_embeddings=64, tie_word_embeddings=False)
        return transformers.LlamaForCausalLM(config)
    if family == "gpt2":
        config = transformers.GPT2Config(n_embd=hidden, n_layer=layers, n_head=4, vocab_size=128,
                                         n_positions=64, tie_word_embeddings=False)
        return transformers.GPT2LMHeadModel(config)
    raise ValueError(f"family must be 'llama' or 'gpt2', got {family!r}")


def blocks_of(model: nn.Module) -> nn.ModuleList:
    """The model's list of decoder blocks."""
    base = getattr(model, "model", None) or getattr(model, "transformer")
    return base.layers if hasattr(base, "layers") else base.h


def embeddings_of(model: nn.Module) -> list[nn.Module]:
    base = getattr(model, "model", None) or getattr(model, "transformer")
    return [base.embed_tokens] if hasattr(base, "embed_tokens") else [base.wte, base.wpe]


def convert_blocks(model: nn.Module, level: str) -> list[nn.Module]:
    """The recipe's conversion: each block and the head converted on its own, in place; the
    converted modules."""
    options = dict(capture="export", opt_level=level, dtype=LOW,
                   policy=PRESET if level == "O1" else None)
    blocks = blocks_of(model)
    for i, block in enumerate(blocks):
        blocks[i] = amprewrite.convert(block, **options)
    model.lm_head = amprewrite.convert(model.lm_head, **options)
    return [*blocks, model.lm_head]


def shard(model: nn.Module, policy: str, checkpointing: bool) -> None:
    """``fully_shard`` per block (``policy="blocks"``), or per block, embedding and head
    (``"blocks+ends"``), then the root; or the root only (``"root"``); ``checkpointing``: each block in torch's
    ``checkpoint_wrapper`` first (activation checkpointing per block, as torchtitan does)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),))
    if policy == "root":
        fully_shard(model, mesh=mesh)
        return
    blocks = blocks_of(model)
    if checkpointing:
        for i, block in enumerate(blocks):
            blocks[i] = checkpoint_wrapper(block)
    units = list(blocks)
    if policy == "blocks+ends":
        units += [*embeddings_of(model), model.lm_head]
    elif policy != "blocks":
        raise ValueError(f"policy must be 'blocks' or 'blocks+ends', got {policy!r}")
    for unit in units:
        fully_shard(unit, mesh=mesh)
    fully_shard(model, mesh=mesh)


def fsdp_params(model: nn.Module) -> list[Any]:
    """Every FSDP2 parameter of the model's sharded units (torch's FSDPParam records)."""
    from torch.distributed.fsdp import FSDPModule

    found = []
    for module in model.modules():
        if isinstance(module, FSDPModule):
            group = module._get_fsdp_state()._fsdp_param_group
            if group is not None:
                found += group.fsdp_params
    return found


def unsharded_bytes(params: list[Any]) -> int:
    """The bytes of unsharded (all-gathered) parameter storage alive now: FSDP2 frees a
    unit's storage (resizes it to 0) when it reshards."""
    storages = {}
    for p in params:
        for out in getattr(p, "all_gather_outputs", None) or []:
            storages[out.untyped_storage().data_ptr()] = out.untyped_storage().nbytes()
    return sum(storages.values())


class PeakUnsharded(TorchDispatchMode):
    """The most unsharded parameter bytes alive at any op of a forward and backward."""

    def __init__(self, params: list[Any]) -> None:
        super().__init__()
        self.params, self.peak = params, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.peak = max(self.peak, unsharded_bytes(self.params))
        return func(*args, **(kwargs or {}))


def param_bytes(module: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


def batches(step: int, rank: int, micro: int, rows: int = 2, length: int = 12
            ) -> list[torch.Tensor]:
    """Rank ``rank``'s ``micro`` micro-batches of token ids for ``step``."""
    g = torch.Generator().manual_seed(1000 + step)
    ids = torch.randint(0, 128, (micro, 2, rows, length), generator=g)
    return [ids[m, rank] for m in range(micro)]


def train(rank: int, family: str, policy: str, level: str | None, *, checkpointing: bool = False,
          steps: int = 2, micro: int = 2, layers: int = 2, hidden: int = 32,
          measure: bool = False) -> dict[str, Any]:
    """``steps`` SGD steps of ``micro`` micro-batches each (gradient accumulation: no
    reduce-scatter until the last), the eager model under autocast (``level=None``) or the
    converted blocks; the losses, the final parameters (gathered), and with ``measure`` the
    peak unsharded parameter bytes of one more forward and backward."""
    model = tiny_lm(family, layers, hidden)
    total = param_bytes(model)
    block = param_bytes(blocks_of(model)[0])
    converted: list[nn.Module] = []
    if level is not None and policy == "root":  # the whole model as one converted graph
        model = amprewrite.convert(model, capture="export", opt_level=level, dtype=LOW,
                                   policy=PRESET if level == "O1" else None)
        converted = [model]
    elif level is not None:
        converted = convert_blocks(model, level)
    shard(model, policy, checkpointing)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    # O2: one binding per converted module, after fully_shard (it then refreshes the copies
    # after each all-gather)
    masters = [amprewrite.MasterWeights(m, opt) for m in converted] if level == "O2" else []
    params = fsdp_params(model)
    out: dict[str, Any] = {"losses": [], "model_bytes": total, "block_bytes": block,
                           "masters": len(masters)}
    for step in range(steps):
        for m, ids in enumerate(batches(step, rank, micro)):
            model.set_requires_gradient_sync(m == micro - 1)
            with torch.autocast("cpu", LOW, enabled=level is None):
                loss = model(input_ids=ids, labels=ids).loss / micro
            loss.backward()
            out["losses"].append(loss.detach())
        opt.step()
        opt.zero_grad()
    out["params"] = {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}
    if measure:
        # NB: after the steps the results come from, in a forward and backward of its own:
        # a dispatch mode over eager autocast's ops can change what they compute
        mode = PeakUnsharded(params)
        ids = batches(steps, rank, 1)[0]
        with mode, torch.autocast("cpu", LOW, enabled=level is None):
            loss = model(input_ids=ids, labels=ids).loss
        with mode:
            loss.backward()
        opt.zero_grad()
        out["peak_unsharded"] = mode.peak
    if level == "O2":
        out["low_copy_bytes"] = sum(m._amp_low_copies.nbytes() for m in converted)
    return out


def launch(script: str, world: int, args: list[str], timeout_s: float) -> list[Any]:
    """Run ``python script RANK WORLD PORT OUT *args`` for each rank, one process each, under
    ``timeout_s``; what each rank saved to its ``OUT`` (``torch.save``), or RuntimeError with
    the end of both ranks' logs."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    root = pathlib.Path(__file__).resolve().parents[1]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(
        [str(root), str(root / "benchmarks"), *filter(None, [os.environ.get("PYTHONPATH")])]))
    with tempfile.TemporaryDirectory(prefix="gloo-ranks-") as tmp:
        outs = [pathlib.Path(tmp) / f"rank{r}.pt" for r in range(world)]
        logs = [open(pathlib.Path(tmp) / f"rank{r}.log", "w+") for r in range(world)]
        procs = [subprocess.Popen([sys.executable, script, str(r), str(world), str(port),
                                   str(outs[r]), *args], env=env, stdout=logs[r],
                                  stderr=subprocess.STDOUT) for r in range(world)]
        deadline = time.monotonic() + timeout_s
        try:
            for p in procs:
                p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        text = []
        for r, log in enumerate(logs):
            log.seek(0)
            text.append(f"--- rank {r} (exit {procs[r].returncode}) ---\n{log.read()[-4000:]}")
            log.close()
        if any(p.returncode != 0 for p in procs) or not all(o.exists() for o in outs):
            raise RuntimeError(f"the gloo workers failed or timed out ({timeout_s} s):\n"
                               + "\n".join(text))
        return [torch.load(o, weights_only=False) for o in outs]


def init_rank(rank: int, world: int, port: int) -> None:
    import warnings

    warnings.simplefilter("ignore")  # the slow-bf16-CPU warning, once per process
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}",
                                         rank=rank, world_size=world)
