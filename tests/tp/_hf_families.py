"""Rank-side parity of tiny Hugging Face decoders under dp_shard x TP (torch FSDP2 + plait.tp), fp32.

Each rank builds the same seeded model from a tiny config, keeps an unsharded copy as the reference
(trained on the whole global batch) and parallelizes the other: ``resolve_tp_plan`` + ``apply_tp``
over the ``tp`` mesh, then torch's ``fully_shard`` per decoder layer and on the root over
``dp_shard``. Every parameter's gradient at step 0 and every parameter after 2 SGD steps is compared
relative to the reference's largest magnitude for that parameter.
"""

from __future__ import annotations

import copy
from contextlib import nullcontext
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
import transformers
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from plait.testing.parity import full_tensor
from plait.tp import apply_tp, find_decoder, resolve_tp_plan, validate_tp_mesh

SEQ = 8
ROWS_PER_DP_RANK = 2
LR = 0.5

Family = tuple[str, dict[str, Any]]  # (model_type, config overrides)


def build(model_type: str, overrides: dict[str, Any]) -> nn.Module:
    """A seeded tiny causal LM: hidden 64, 2 layers, vocab 96, eager attention, fp32."""
    fields: dict[str, Any] = {
        "vocab_size": 96,
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "max_position_embeddings": 64,
        "use_cache": False,
        "tie_word_embeddings": False,
        "pad_token_id": 0,
        "bos_token_id": 1,
        "eos_token_id": 2,
        **overrides,
    }
    config = transformers.AutoConfig.for_model(model_type, **fields)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).float()
    with torch.no_grad():  # zero-initialised norm weights (Gemma's 1 + w) would hide their gradients' errors
        for param in model.parameters():
            if param.ndim == 1:
                param.add_(0.1 * torch.randn_like(param))
    return model


def _parallelize(model: nn.Module, dp: int, tp: int, sp: bool) -> nn.Module:
    mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp_shard", "tp"))
    validate_tp_mesh(model, mesh["tp"])
    apply_tp(model, mesh["tp"], resolve_tp_plan(model, sequence_parallel=sp, tp_size=tp))
    if dp > 1:
        decoder = find_decoder(model)
        assert decoder is not None
        for layer in decoder[1].layers:
            fully_shard(layer, mesh=mesh["dp_shard"])
        fully_shard(model, mesh=mesh["dp_shard"])
    return model


def _loss(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=ids[:, :-1]).logits
    sharded = isinstance(logits, DTensor)
    with loss_parallel() if sharded else nullcontext():
        loss = F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())
        loss.backward()
    return (loss.full_tensor() if sharded else loss).detach()


def _relative(ref: nn.Module, par: nn.Module, grads: bool) -> tuple[float, str]:
    """Largest per-parameter ``max|x - x_ref| / max|x_ref|`` over all parameters (collective)."""
    par_params = dict(par.named_parameters())
    worst, worst_name = 0.0, ""
    for name, r in sorted(ref.named_parameters()):
        p = par_params[name]
        a, b = (r.grad, p.grad) if grads else (r, p)
        if a is None and b is None:
            continue
        assert a is not None and b is not None, f"{name}: a gradient is missing on one side only"
        got = full_tensor(b)
        scale = a.abs().max().item()
        diff = (got - a).abs().max().item() / (scale if scale > 0 else 1.0)
        if diff > worst or not worst_name:
            worst, worst_name = diff, name
    return worst, worst_name


def family_parity(families: list[Family], tp: int, sp: bool) -> dict[str, dict[str, Any]]:
    """On every rank: for each family, loss / gradient / 2-SGD-step parameter differences."""
    world = dist.get_world_size()
    dp = world // tp
    dp_rank = dist.get_rank() // tp
    out: dict[str, dict[str, Any]] = {}
    for model_type, overrides in families:
        ref = build(model_type, overrides)
        par = _parallelize(copy.deepcopy(ref), dp, tp, sp)
        opts = [torch.optim.SGD(m.parameters(), lr=LR) for m in (ref, par)]
        result: dict[str, Any] = {}
        for step in range(2):
            gen = torch.Generator().manual_seed(100 + step)
            ids = torch.randint(3, 96, (dp * ROWS_PER_DP_RANK, SEQ + 1), generator=gen)
            local = ids[dp_rank * ROWS_PER_DP_RANK : (dp_rank + 1) * ROWS_PER_DP_RANK]
            ref_loss, par_loss = _loss(ref, ids), _loss(par, local)
            if step == 0:
                dist.all_reduce(par_loss)  # the mean over dp (and identical tp) ranks
                result["loss"] = abs(ref_loss.item() - par_loss.item() / world)
                result["grad"], result["worst_grad"] = _relative(ref, par, grads=True)
            for opt in opts:
                opt.step()
                opt.zero_grad()
        result["param"], result["worst_param"] = _relative(ref, par, grads=False)
        out[model_type] = result
    return out
