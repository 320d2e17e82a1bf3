"""Rank-side parity of tiny Hugging Face decoders under dp_shard x TP (torch FSDP2 + plait.tp), fp32.

Each rank builds the same seeded model from a tiny config and plait.testing's driver compares it with
its parallelized copy: ``resolve_tp_plan`` + ``apply_tp`` over the ``tp`` mesh, then torch's
``fully_shard`` per decoder layer and on the root over ``dp_shard``.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard

from plait.testing import FP32, TP_FAMILY_HF_SIZES, Parity, paired, run_parity, tiny_hf_model, token_batches
from plait.tp import apply_tp, layer_containers, resolve_tp_plan, validate_tp_mesh

VOCAB = TP_FAMILY_HF_SIZES["vocab_size"]

Family = tuple[str, dict[str, Any]]  # (model_type, config overrides)

# Column-wise projections gathering their outputs, as Qwen3-Next's linear attention: under SP the
# block returns a whole tensor and must run on the gathered sequence.
GATHERED_MLP = {
    "layers.*.self_attn.q_proj": "colwise",
    "layers.*.self_attn.k_proj": "colwise",
    "layers.*.self_attn.v_proj": "colwise",
    "layers.*.self_attn.o_proj": "rowwise",
    "layers.*.mlp.gate_proj": "colwise_gather_output",
    "layers.*.mlp.up_proj": "colwise_gather_output",
    "layers.*.mlp.down_proj": "colwise_gather_output",
}


def build(model_type: str, overrides: dict[str, Any]) -> nn.Module:
    """A seeded tiny causal LM: hidden 64, 2 layers, vocab 96, eager attention, fp32, noisy norm weights."""
    return tiny_hf_model(model_type, vector_noise=0.1, **(TP_FAMILY_HF_SIZES | overrides))


def _parallelize(model: nn.Module, mesh: DeviceMesh, sp: bool) -> nn.Module:
    validate_tp_mesh(model, mesh["tp"])
    plan = resolve_tp_plan(model, sequence_parallel=sp, tp_size=mesh["tp"].size())
    apply_tp(model, mesh["tp"], plan)
    if mesh["dp_shard"].size() > 1:
        stacks = layer_containers(model, plan)
        assert stacks, sorted(plan)
        for stack in stacks:
            for layer in model.get_submodule(stack):
                fully_shard(layer, mesh=mesh["dp_shard"])
        fully_shard(model, mesh=mesh["dp_shard"])
    return model


def _family(mesh: DeviceMesh, sp: bool, model_type: str, overrides: dict[str, Any]) -> Parity:
    return run_parity(
        paired(lambda: build(model_type, overrides), lambda model: _parallelize(model, mesh, sp)),
        token_batches(VOCAB, mesh["dp_shard"].size()),
        dp_rank=mesh["dp_shard"].get_local_rank(),
        case=model_type,
    )


def family_parity(families: list[Family], tp: int, sp: bool) -> dict[str, dict[str, Any]]:
    """On every rank: the driver per family; its loss / gradient / parameter differences by family.

    Every measurement is also checked here against the driver's fp32 tolerances (AdamW included).
    """
    mesh = init_device_mesh("cpu", (dist.get_world_size() // tp, tp), mesh_dim_names=("dp_shard", "tp"))
    out: dict[str, dict[str, Any]] = {}
    for model_type, overrides in families:
        parity = _family(mesh, sp, model_type, overrides)
        parity.check(FP32)
        out[model_type] = {
            "loss": parity.loss_diff,
            "grad": parity.grad_diff,
            "worst_grad": parity.worst_grad,
            "param": parity.param_diff,
            "worst_param": parity.worst_param,
            "adamw_loss": max(parity.adamw_loss_diffs),
        }
    return out
