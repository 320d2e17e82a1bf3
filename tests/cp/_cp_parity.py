"""Rank-side context-parallel parity: a cp-parallelized model vs its unsharded reference, fp32.

Every rank builds the same seeded model and keeps an unsharded copy. The reference trains on the
whole global batch; each rank trains on its data-parallel rows, split along the sequence by
`plait.cp.shard_sequence`. Loss and every gradient are compared at step 0 (relative to the
parameter's largest reference gradient), parameters after two SGD steps.
"""

from __future__ import annotations

import contextlib
import copy
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from plait.cp import shard_sequence
from plait.mesh import FSDP2Config, MeshContext, ParallelismSizes
from plait.testing.parity import clean_fqn, full_tensor

VOCAB = 96
SEQ = 16
ROWS_PER_DP_RANK = 2
SGD_LR = 0.5


def build_model(kind: str) -> nn.Module:
    """A tiny seeded causal LM: ``llama`` / ``qwen3`` (Hugging Face) or ``dense`` (plait reference)."""
    torch.manual_seed(0)
    if kind == "dense":
        from plait.models import DecoderConfig, DenseDecoder

        return DenseDecoder(DecoderConfig(vocab_size=VOCAB))
    sizes = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        use_cache=False,
        attn_implementation="sdpa",
    )
    if kind == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM

        return LlamaForCausalLM(LlamaConfig(**sizes, tie_word_embeddings=False))
    from transformers import Qwen3Config, Qwen3ForCausalLM

    return Qwen3ForCausalLM(Qwen3Config(**sizes, head_dim=8, tie_word_embeddings=True))


def _logits(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    kwargs = {"position_ids": batch["position_ids"]} if "position_ids" in batch else {}
    out = model(input_ids=batch["input_ids"], **kwargs)
    return out if isinstance(out, torch.Tensor) else out.logits


def _loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    logits = _logits(model, batch)
    sharded = isinstance(logits, DTensor)
    with loss_parallel() if sharded else contextlib.nullcontext():
        loss = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten())
        loss.backward()
    return full_tensor(loss) if sharded else loss.detach()


def _global_batch(rows: int, step: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    ids = torch.randint(0, VOCAB, (rows, SEQ + 1), generator=gen)
    return {"input_ids": ids[:, :-1].contiguous(), "labels": ids[:, 1:].contiguous()}


def _grad_rel_diff(ref: nn.Module, par: nn.Module) -> tuple[float, str, int]:
    """Largest per-parameter ``max|g - g_ref| / max|g_ref|``, its name, and how many were compared."""
    par_params = {clean_fqn(n): p for n, p in par.named_parameters()}
    worst, worst_name, compared = 0.0, "", 0
    for name, p_ref in sorted(ref.named_parameters()):
        p = par_params[clean_fqn(name)]
        assert p_ref.grad is not None and p.grad is not None, f"{name}: missing gradient"
        g_ref, g = p_ref.grad, full_tensor(p.grad)
        rel = float((g - g_ref).abs().max() / g_ref.abs().max().clamp_min(1e-12))
        compared += 1
        if rel > worst or not worst_name:
            worst, worst_name = rel, name
    return worst, worst_name, compared


def _param_diff(ref: nn.Module, par: nn.Module) -> float:
    par_params = {clean_fqn(n): p for n, p in par.named_parameters()}
    return max(
        float((full_tensor(par_params[clean_fqn(n)]) - p.detach()).abs().max())
        for n, p in ref.named_parameters()
    )


def cp_parity(
    kind: str, sizes: dict[str, int], options: dict[str, Any], ac: str | bool = False
) -> dict[str, Any]:
    """One configuration on this rank: returns loss / gradient / parameter differences and what was used."""
    from plait.sidecar import compile_parallelized_model, parallelize_model  # not plait-cp dependencies

    ctx = MeshContext.build(
        FSDP2Config(mp_policy=None, **options), ParallelismSizes(**sizes), activation_checkpointing=ac
    )
    model = build_model(kind)
    ref = copy.deepcopy(model)
    par = parallelize_model(model, ctx)
    compile_parallelized_model(par, ctx)  # a no-op unless options hold enable_compile=True
    dp = ctx.dp_mesh()
    dp_rank, dp_size = dp.get_local_rank(), dp.size()
    reduce = ctx.dp_cp_mesh().get_group()
    opt_ref = torch.optim.SGD(ref.parameters(), lr=SGD_LR)
    opt_par = torch.optim.SGD(par.parameters(), lr=SGD_LR)
    result: dict[str, Any] = {}
    for step in range(2):
        batch = _global_batch(dp_size * ROWS_PER_DP_RANK, step)
        rows = slice(dp_rank * ROWS_PER_DP_RANK, (dp_rank + 1) * ROWS_PER_DP_RANK)
        local = shard_sequence({k: v[rows] for k, v in batch.items()}, ctx)
        ref_loss = _loss(ref, batch)
        par_loss = _loss(par, local)
        dist.all_reduce(par_loss, group=reduce)
        par_loss /= dist.get_world_size(reduce)
        if step == 0:
            result["loss_diff"] = abs(float(par_loss - ref_loss))
            result["grad_rel"], result["worst_grad"], result["compared"] = _grad_rel_diff(ref, par)
        opt_ref.step()
        opt_par.step()
        opt_ref.zero_grad()
        opt_par.zero_grad()
    result["param_diff"] = _param_diff(ref, par)
    result["local_seq"] = int(local["input_ids"].shape[1])
    return result
