"""The library guide's plain training loop (docs/guide.md), runnable for each of its contexts.

Run on 4 ranks with ``uv run torchrun --standalone --nproc-per-node 4 docs/examples/loop.py``;
``--context`` picks the strategy (``fsdp2_tp``, the guide's, by default; ``fsdp2``, ``hsdp``,
``ddp``), several run one after another. Rank 0 prints one line per step and, with ``--out``,
writes ``{context: [losses]}`` as JSON.
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel
from transformers import LlamaConfig, LlamaForCausalLM

from plait.mesh import (
    DDPConfig,
    FSDP2Config,
    MeshContext,
    ParallelismSizes,
    clip_grad_norm_,
    init_distributed,
    materialize,
)
from plait.sidecar import parallelize_model

CONTEXTS = {
    # mp_policy=None keeps fp32; FSDP2Config()'s default trains in bf16 (fp32 gradient reduction).
    "fsdp2_tp": lambda: MeshContext.build(
        FSDP2Config(sequence_parallel=True, mp_policy=None), ParallelismSizes(tp_size=2)
    ),
    "fsdp2": lambda: MeshContext.build(FSDP2Config(mp_policy=None), ParallelismSizes()),
    "hsdp": lambda: MeshContext.build(FSDP2Config(mp_policy=None), ParallelismSizes(dp_replicate_size=2)),
    "ddp": lambda: MeshContext.build(DDPConfig(), ParallelismSizes()),
}
CONFIG = LlamaConfig(
    vocab_size=512,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
)


def build(context: str, device: torch.device) -> tuple[torch.nn.Module, MeshContext]:
    """The guide's model under ``context``: meta, parallelized, materialised (DDP: materialised first)."""
    ctx = CONTEXTS[context]()
    if context == "ddp":  # DDP broadcasts real weights when it wraps: fill them first
        model = materialize(LlamaForCausalLM(CONFIG), seed=0, device=device)
        return parallelize_model(model, ctx), ctx
    with torch.device("meta"):  # no memory yet: only the local shards are allocated below
        model = LlamaForCausalLM(CONFIG)
    model = parallelize_model(model, ctx)
    materialize(model, seed=0, device=device)  # the same full weights whatever the mesh
    return model, ctx


def train(context: str, steps: int, save: str | None) -> list[float]:
    """The guide's loop: the same on every context; returns the losses rank 0 printed."""
    info = init_distributed()  # torchrun's environment; gloo on CPU, NCCL when every rank has a GPU
    model, ctx = build(context, info.device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    dp = ctx.dp_mesh()  # data-parallel ranks read different rows; the TP ranks of one replica share theirs
    generator = torch.Generator().manual_seed(0)
    losses = []
    for step in range(1, steps + 1):
        # The global batch: 8 rows whatever the mesh, so every context sees the same data.
        batch = torch.randint(0, CONFIG.vocab_size, (8, 65), generator=generator)
        rows = batch.chunk(dp.size())[dp.get_local_rank()].to(info.device)
        inputs, labels = rows[:, :-1], rows[:, 1:]
        logits = model(inputs).logits  # under TP a DTensor sharded on the vocabulary
        with loss_parallel():  # cross entropy over vocabulary shards (needed for backward too)
            loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten())
            loss.backward()
        grad_norm = clip_grad_norm_(model.parameters(), max_norm=1.0)  # over every mesh the gradients live on
        optimizer.step()
        optimizer.zero_grad()
        # This rank's loss: under TP a replicated DTensor, else a tensor (the mean of this rank's rows).
        local = (loss.full_tensor() if isinstance(loss, DTensor) else loss).detach()
        torch.distributed.all_reduce(local, group=dp.get_group())
        losses.append(local.item() / dp.size())
        if info.rank == 0:
            print(f"{context} step {step} loss {losses[-1]:.4f} grad_norm {grad_norm.item():.3f}")
    if save:
        model_state, optim_state = get_state_dict(model, optimizer)
        dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=f"{save}/{context}")
    return losses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", nargs="+", choices=sorted(CONTEXTS), default=["fsdp2_tp"])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--save", help="directory for a DCP checkpoint per context")
    parser.add_argument("--out", help="JSON file for rank 0's losses")
    args = parser.parse_args()
    results = {context: train(context, args.steps, args.save) for context in args.context}
    if args.out and torch.distributed.get_rank() == 0:
        with open(args.out, "w") as f:
            json.dump(results, f)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
